//! How the engine writes sizes for people: one unit, GB (10^9 bytes), everywhere it prints
//! them.

/// Bytes in GB, with three significant digits down to a MB.
pub(crate) fn gb(bytes: u64) -> String {
    let gb = bytes as f64 / 1e9;
    match gb {
        0.0 => "0 GB".into(),
        g if g >= 10.0 => format!("{g:.1} GB"),
        g if g >= 1.0 => format!("{g:.2} GB"),
        g if g >= 0.1 => format!("{g:.3} GB"),
        g => format!("{g:.4} GB"),
    }
}
