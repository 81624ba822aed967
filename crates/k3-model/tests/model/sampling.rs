//! Stop strings matched incrementally against a plain search of the whole text: however the
//! text is cut into pieces, the same stop is found at the same place, and the held-back tail
//! is exactly the longest one that could still become a stop.

use k3_model::sampling::StopStrings;
use k3_testkit::Rng;

/// `len` characters of a small alphabet with a two-byte letter, so stops overlap often and
/// some pieces end inside a stop.
fn text(rng: &mut Rng, len: usize) -> String {
    (0..len)
        .map(|_| ['a', 'b', 'c', 'é'][rng.below(4)])
        .collect()
}

/// The first stop to end in `text` (the longest of those ending there): `(end, len)`.
fn first_stop(text: &str, stops: &[String]) -> Option<(usize, usize)> {
    (1..=text.len()).find_map(|end| {
        stops
            .iter()
            .filter(|s| !s.is_empty() && text.as_bytes()[..end].ends_with(s.as_bytes()))
            .map(String::len)
            .max()
            .map(|len| (end, len))
    })
}

/// The longest tail of `text` that is a proper prefix of a stop (in bytes; such a tail is
/// whole characters, since it starts with a stop's first byte and ends where `text` does).
fn pending(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|s| (1..s.len()).filter(|&i| text.as_bytes().ends_with(&s.as_bytes()[..i])))
        .max()
        .unwrap_or(0)
}

#[test]
fn pieces_find_what_a_whole_search_finds() {
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut found = 0;
    for case in 0..2000 {
        let stops: Vec<String> = (0..1 + rng.below(4))
            .map(|_| {
                let len = rng.below(5);
                text(&mut rng, len)
            })
            .collect();
        let len = rng.below(40);
        let text = text(&mut rng, len);
        let mut matcher = StopStrings::new(stops.clone());
        let mut scanned = 0;
        let mut got = None;
        let boundaries: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        while scanned < text.len() {
            // A piece of 1-4 characters.
            let at = boundaries.iter().position(|&b| b == scanned).unwrap();
            let next = boundaries[(at + 1 + rng.below(4)).min(boundaries.len() - 1)];
            if let Some((end, len)) = matcher.scan(&text[scanned..next]) {
                got = Some((scanned + end, len));
                break;
            }
            scanned = next;
            assert_eq!(
                matcher.pending(),
                pending(&text[..scanned], &stops),
                "case {case}: {text:?} up to {scanned}, stops {stops:?}"
            );
        }
        let want = first_stop(&text, &stops);
        assert_eq!(got, want, "case {case}: {text:?}, stops {stops:?}");
        found += usize::from(want.is_some());
    }
    assert!(found > 200, "only {found} cases had a stop");
}

/// The cost of a piece does not grow with the stops' lengths: 4 stops of 800 kB (each a
/// prefix-rich "abab…") and 100,000 pieces that keep a partial match alive finish in a moment.
#[test]
fn long_stops_cost_nothing_per_piece() {
    let stops = vec!["ab".repeat(400_000); 4];
    let mut matcher = StopStrings::new(stops);
    let start = std::time::Instant::now();
    for _ in 0..100_000 {
        assert_eq!(matcher.scan("ab"), None);
    }
    assert_eq!(matcher.pending(), 200_000);
    // A plain search per piece would scan 3.2 MB of stops 100,000 times.
    assert!(start.elapsed() < std::time::Duration::from_secs(2));
}
