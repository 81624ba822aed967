//! "Did you mean": the candidate nearest a mistyped word by edit distance.

/// The candidate closest to `word` by edit distance, if close enough to be a likely typo.
pub(crate) fn nearest<S: AsRef<str>>(
    word: &str,
    candidates: impl Iterator<Item = S>,
) -> Option<String> {
    if word.len() < 4 {
        return None; // `-x` is one edit from every short alias
    }
    let limit = (word.len() / 4).clamp(1, 3);
    candidates
        .map(|c| (edit_distance(word, c.as_ref()), c.as_ref().to_owned()))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Edit distance over bytes, a swap of two neighbours counting as one edit (optimal string
/// alignment): `--modle` is one edit from `--model`.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    for i in 0..=a.len() {
        for j in 0..=b.len() {
            d[i * width + j] = if i == 0 || j == 0 {
                i + j
            } else {
                let mut best = (d[(i - 1) * width + j - 1] + usize::from(a[i - 1] != b[j - 1]))
                    .min(d[(i - 1) * width + j] + 1)
                    .min(d[i * width + j - 1] + 1);
                if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                    best = best.min(d[(i - 2) * width + j - 2] + 1);
                }
                best
            };
        }
    }
    d[a.len() * width + b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("--thread", "--threads"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("--modle", "--model"), 1);
        assert_eq!(nearest("--zzzzzz", ["--model"].into_iter()), None);
        assert_eq!(
            nearest("-x", ["-t"].into_iter()),
            None,
            "too short to guess"
        );
        assert_eq!(
            nearest("--thread", ["--model", "--threads"].into_iter()).as_deref(),
            Some("--threads")
        );
    }
}
