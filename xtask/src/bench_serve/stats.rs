//! Percentiles of latencies, in milliseconds.

use std::time::Duration;

/// The nearest-rank `p`-th percentile (0 < p <= 100) of `values` in ms, `None` when empty:
/// the smallest value with at least p% of the values at or below it, so p99 of fewer than 100
/// values is their maximum.
pub(super) fn percentile_ms(values: &[Duration], p: f64) -> Option<f64> {
    let mut sorted: Vec<Duration> = values.to_vec();
    sorted.sort();
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    let at = rank.clamp(1, sorted.len().max(1)) - 1;
    sorted.get(at).map(|d| ms(*d))
}

/// The largest of `values` in ms, `None` when empty.
pub(super) fn max_ms(values: &[Duration]) -> Option<f64> {
    values.iter().max().map(|d| ms(*d))
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A table cell: the value with `decimals`, or `-` when there is none.
pub(super) fn cell(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

/// `a / b` when both exist and `b` is not 0.
pub(super) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).filter(|(_, b)| *b != 0.0).map(|(a, b)| a / b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|&v| Duration::from_millis(v)).collect()
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values = millis(&[40, 10, 30, 20]);
        assert_eq!(percentile_ms(&values, 50.0), Some(20.0));
        assert_eq!(percentile_ms(&values, 75.0), Some(30.0));
        assert_eq!(percentile_ms(&values, 99.0), Some(40.0));
        assert_eq!(percentile_ms(&values, 100.0), Some(40.0));
        assert_eq!(percentile_ms(&millis(&[7]), 1.0), Some(7.0));
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile_ms(&millis(&hundred), 99.0), Some(99.0));
        assert_eq!(percentile_ms(&millis(&hundred), 50.0), Some(50.0));
        assert_eq!(percentile_ms(&[], 50.0), None);
        assert_eq!(max_ms(&values), Some(40.0));
    }

    #[test]
    fn missing_values_print_as_a_dash() {
        assert_eq!(cell(None, 1), "-");
        assert_eq!(cell(Some(2.345), 1), "2.3");
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
    }
}
