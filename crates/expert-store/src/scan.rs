//! Reading every weight of a checkpoint once: NaN and infinity counts per floating-point
//! tensor (F32, BF16, F16) and, for every MXFP4 scale tensor (`*.weight_scale`, U8 E8M0), the
//! count of 0xFF bytes (E8M0's NaN). A separate, explicit step (`k3-check` runs it by default;
//! [`require_finite`] is the server-side check, off by default): it reads the whole checkpoint,
//! 1.56 TB for the release.

use std::path::PathBuf;

use safetensors::Dtype;

use crate::checkpoint::open::Checkpoint;
use crate::checkpoint::storage::TensorRef;

/// What the scan found in one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorScan {
    /// The name as stored.
    pub name: String,
    /// Its shard.
    pub path: PathBuf,
    /// Its dtype (U8 for E8M0 scales).
    pub dtype: Dtype,
    /// Values (floats) or scale bytes (E8M0) looked at.
    pub values: u64,
    /// NaN values.
    pub nan: u64,
    /// Infinite values.
    pub inf: u64,
    /// E8M0 scale bytes equal to 0xFF (NaN).
    pub nan_scales: u64,
}

impl TensorScan {
    /// Whether anything non-finite was found.
    pub fn is_bad(&self) -> bool {
        self.nan + self.inf + self.nan_scales > 0
    }

    /// `name (n NaN, n Inf, n NaN scales)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} NaN, {} Inf, {} NaN scales)",
            self.name, self.nan, self.inf, self.nan_scales
        )
    }
}

/// The scan of a whole checkpoint: one entry per floating-point or scale tensor, in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Each scanned tensor, in file order.
    pub tensors: Vec<TensorScan>,
    /// Bytes read (every tensor's, scanned or not: the scan reads the checkpoint once).
    pub bytes: u64,
}

impl ScanReport {
    /// The tensors with a NaN, an infinity or a 0xFF scale.
    pub fn bad(&self) -> impl Iterator<Item = &TensorScan> {
        self.tensors.iter().filter(|t| t.is_bad())
    }
}

/// A scan that found NaN, Inf or 0xFF scales.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{bad} of {scanned} scanned tensors hold NaN, Inf or 0xFF (NaN) scales, first {first}")]
pub struct ScanError {
    /// Tensors with something non-finite.
    pub bad: usize,
    /// Tensors scanned.
    pub scanned: usize,
    /// The first few, with their counts.
    pub first: String,
}

/// [`scan_checkpoint`] as a startup check (the server's `--scan`): the report, or an error
/// naming the first bad tensors.
pub fn require_finite(ckpt: &Checkpoint) -> Result<ScanReport, ScanError> {
    let report = scan_checkpoint(ckpt, |_, _| {});
    let bad: Vec<&TensorScan> = report.bad().collect();
    if bad.is_empty() {
        return Ok(report);
    }
    let first: Vec<String> = bad.iter().take(3).map(|t| t.describe()).collect();
    Err(ScanError {
        bad: bad.len(),
        scanned: report.tensors.len(),
        first: first.join(", "),
    })
}

/// Scans every tensor of `ckpt` in file order (shard by shard, by offset), calling
/// `progress(bytes_done, bytes_total)` after each.
pub fn scan_checkpoint(ckpt: &Checkpoint, mut progress: impl FnMut(u64, u64)) -> ScanReport {
    let mut tensors: Vec<TensorRef<'_>> = ckpt
        .tensor_names()
        .filter_map(|name| ckpt.tensor(name))
        .collect();
    tensors.sort_by(|a, b| (a.path, a.offset).cmp(&(b.path, b.offset)));
    let total: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    let mut report = ScanReport::default();
    for t in &tensors {
        if let Some(scan) = scan_tensor(t) {
            report.tensors.push(scan);
        }
        report.bytes += t.bytes.len() as u64;
        progress(report.bytes, total);
    }
    report
}

/// Scans one tensor: F32/BF16/F16 values for NaN and infinity, a U8 `*.weight_scale` for 0xFF;
/// `None` for other tensors (packed codes, integers).
pub(crate) fn scan_tensor(t: &TensorRef<'_>) -> Option<TensorScan> {
    let mut scan = TensorScan {
        name: t.name.to_owned(),
        path: t.path.to_owned(),
        dtype: t.dtype,
        values: 0,
        nan: 0,
        inf: 0,
        nan_scales: 0,
    };
    // (exponent mask, mantissa mask) of each float format: all-ones exponent is NaN or inf.
    match t.dtype {
        Dtype::F32 => {
            for b in t.bytes.chunks_exact(4) {
                classify(
                    u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    0x7F80_0000,
                    0x007F_FFFF,
                    &mut scan,
                );
            }
        }
        Dtype::BF16 => {
            for b in t.bytes.chunks_exact(2) {
                classify(
                    u64::from(u16::from_le_bytes([b[0], b[1]])),
                    0x7F80,
                    0x007F,
                    &mut scan,
                );
            }
        }
        Dtype::F16 => {
            for b in t.bytes.chunks_exact(2) {
                classify(
                    u64::from(u16::from_le_bytes([b[0], b[1]])),
                    0x7C00,
                    0x03FF,
                    &mut scan,
                );
            }
        }
        Dtype::U8 if t.name.ends_with("weight_scale") => {
            scan.values = t.bytes.len() as u64;
            scan.nan_scales = t.bytes.iter().filter(|&&b| b == 0xFF).count() as u64;
        }
        _ => return None,
    }
    Some(scan)
}

fn classify(bits: u64, exponent: u64, mantissa: u64, scan: &mut TensorScan) {
    scan.values += 1;
    if bits & exponent == exponent {
        if bits & mantissa == 0 {
            scan.inf += 1;
        } else {
            scan.nan += 1;
        }
    }
}
