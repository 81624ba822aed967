//! The few statistics the report takes of its samples.

/// The median of `values` (the mean of the middle two of an even count); 0 for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let half = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[half - 1] + sorted[half]) / 2.0
    } else {
        sorted[half]
    }
}

/// The least and the greatest of `values` (`(0, 0)` for none).
pub(crate) fn range(values: &[f64]) -> (f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.is_empty() {
        (0.0, 0.0)
    } else {
        (min, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_range() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[1.176, 1.478]), (1.176 + 1.478) / 2.0);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(range(&[3.0, 1.0, 2.0]), (1.0, 3.0));
        assert_eq!(range(&[]), (0.0, 0.0));
    }
}
