//! Per-(layer, expert) use counts kept across runs: a small JSON file that lets the next start
//! preload the hottest experts first and seeds the usage-weighted eviction policy. It also
//! keeps the last run's decode rates ([`DecodeRates`]), which a memory plan sizes the streamed
//! part of the trunk by.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::file::{ReadFileError, read_regular_text};

/// The file's `format` field; a file with another is refused.
pub(crate) const USAGE_FORMAT: &str = "k3-expert-usage/1";

/// The default file name, placed in the checkpoint directory.
pub const USAGE_FILE: &str = "k3-expert-usage.json";

/// The most bytes a usage file may hold. One count per (layer, expert) at up to 21 bytes
/// each: the release's 61 x 384 take under 0.5 MB, so this is generous for any model, and a
/// file that is no usage file is not read whole.
pub const MAX_USAGE_BYTES: u64 = 64 << 20;

/// Errors reading or writing a usage file.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The file is not a regular file (a FIFO, a device, ...), is over [`MAX_USAGE_BYTES`],
    /// or cannot be read.
    #[error("usage file {0}")]
    Read(#[from] ReadFileError),
    /// The file could not be read, parsed or written.
    #[error("{path}: {reason}")]
    File {
        /// The usage file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Use counts per layer (the checkpoint's 0-based layer index) and expert id, and the decode
/// rates a run measured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageHistory {
    counts: BTreeMap<usize, Vec<u64>>,
    rates: Option<DecodeRates>,
}

/// What a run measured of its decode steps (one token per step): how fast the disk gave
/// weights while it read them, and the compute a step took besides waiting for reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRates {
    /// Bytes read per second of read-busy time, in MB/s.
    pub read_mbps: u64,
    /// A step's wall time less its waits for reads, in microseconds.
    pub compute_us: u64,
}

impl DecodeRates {
    /// The bytes the disk reads while one step computes: what a read ahead of compute can
    /// bring in without the step waiting for it.
    pub fn hidden_bytes(&self) -> u64 {
        self.read_mbps * self.compute_us
    }

    /// The mean of these rates and `earlier` ones: what a run saves, so one run on a noisy
    /// host moves the next plan half as far.
    pub fn blended(self, earlier: DecodeRates) -> Self {
        Self {
            read_mbps: (self.read_mbps + earlier.read_mbps).div_ceil(2),
            compute_us: (self.compute_us + earlier.compute_us).div_ceil(2),
        }
    }
}

impl UsageHistory {
    /// The count of `(layer, expert)`; 0 for one never seen.
    pub fn count(&self, layer: usize, expert: usize) -> u64 {
        self.counts
            .get(&layer)
            .and_then(|c| c.get(expert))
            .copied()
            .unwrap_or(0)
    }

    /// Adds `n` uses of `(layer, expert)`.
    pub fn add(&mut self, layer: usize, expert: usize, n: u64) {
        let row = self.counts.entry(layer).or_default();
        if row.len() <= expert {
            row.resize(expert + 1, 0);
        }
        // Saturating: the file's counts are read as they are (a damaged or hand-made file may
        // hold u64::MAX), and a count only orders experts.
        row[expert] = row[expert].saturating_add(n);
    }

    /// The decode rates of the run that wrote the file, if it measured them.
    pub fn rates(&self) -> Option<DecodeRates> {
        self.rates
    }

    /// Replaces the decode rates (saved with the counts).
    pub fn set_rates(&mut self, rates: DecodeRates) {
        self.rates = Some(rates);
    }

    /// All uses counted.
    pub fn total(&self) -> u64 {
        self.counts.values().flatten().sum()
    }

    /// Reads `path`; `Ok(None)` when there is no such file (a first run). Anything but a
    /// regular file (a FIFO, `/dev/zero`) is an error like a corrupt file, found without
    /// blocking and without reading it.
    pub fn load(path: &Path) -> Result<Option<Self>, UsageError> {
        let fail = |reason: String| UsageError::File {
            path: path.to_owned(),
            reason,
        };
        let text = match read_regular_text(path, MAX_USAGE_BYTES) {
            Ok(text) => text,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
        if json["format"] != USAGE_FORMAT {
            return Err(fail(format!(
                "format is {}, expected {USAGE_FORMAT:?}",
                json["format"]
            )));
        }
        let layers = json["layers"]
            .as_object()
            .ok_or_else(|| fail("no \"layers\" object".into()))?;
        let mut history = Self::default();
        for (layer, counts) in layers {
            let layer: usize = layer
                .parse()
                .map_err(|_| fail(format!("layer key {layer:?} is not an index")))?;
            let counts = counts
                .as_array()
                .ok_or_else(|| fail(format!("layer {layer}: counts are not an array")))?;
            let row = counts
                .iter()
                .map(|c| c.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| fail(format!("layer {layer}: a count is not a whole number")))?;
            history.counts.insert(layer, row);
        }
        // Optional: files from before the rates, or from runs that measured none.
        if !json["rates"].is_null() {
            let field = |name: &str| {
                json["rates"][name]
                    .as_u64()
                    .ok_or_else(|| fail(format!("rates: {name} is not a whole number")))
            };
            history.rates = Some(DecodeRates {
                read_mbps: field("read_mbps")?,
                compute_us: field("compute_us")?,
            });
        }
        Ok(Some(history))
    }

    /// Writes the counts to `path` (through a temporary file renamed into place).
    pub fn save(&self, path: &Path) -> Result<(), UsageError> {
        let layers: serde_json::Map<String, serde_json::Value> = self
            .counts
            .iter()
            .map(|(layer, counts)| (layer.to_string(), serde_json::json!(counts)))
            .collect();
        let mut json = serde_json::json!({ "format": USAGE_FORMAT, "layers": layers });
        if let Some(r) = self.rates {
            json["rates"] =
                serde_json::json!({ "read_mbps": r.read_mbps, "compute_us": r.compute_us });
        }
        let text = json.to_string();
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| UsageError::File {
                path: path.to_owned(),
                reason: e.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_and_bad_files_are_named() {
        let dir = std::env::temp_dir().join(format!("k3-usage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(USAGE_FILE);
        assert_eq!(UsageHistory::load(&path).unwrap(), None);
        let mut history = UsageHistory::default();
        history.add(3, 7, 5);
        history.add(3, 1, 2);
        history.add(1, 0, 1);
        history.save(&path).unwrap();
        let back = UsageHistory::load(&path).unwrap().unwrap();
        assert_eq!(back, history);
        assert_eq!(
            (back.count(3, 7), back.count(3, 2), back.count(9, 9)),
            (5, 0, 0)
        );
        assert_eq!(back.total(), 8);
        assert_eq!(back.rates(), None);
        // With the rates: they come back; a file without them (an older one) has none.
        history.set_rates(DecodeRates {
            read_mbps: 1100,
            compute_us: 600_000,
        });
        history.save(&path).unwrap();
        let back = UsageHistory::load(&path).unwrap().unwrap();
        assert_eq!(back, history);
        assert_eq!(back.rates().unwrap().hidden_bytes(), 660_000_000);
        let later = DecodeRates {
            read_mbps: 900,
            compute_us: 500_001,
        };
        assert_eq!(
            later.blended(back.rates().unwrap()),
            DecodeRates {
                read_mbps: 1000,
                compute_us: 550_001
            }
        );
        std::fs::write(
            &path,
            r#"{"format": "k3-expert-usage/1", "layers": {"2": [4]}}"#,
        )
        .unwrap();
        let old = UsageHistory::load(&path).unwrap().unwrap();
        assert_eq!((old.count(2, 0), old.rates()), (4, None));
        // A count at u64::MAX (a damaged or hand-made file) saturates instead of overflowing.
        std::fs::write(
            &path,
            format!(
                r#"{{"format": "k3-expert-usage/1", "layers": {{"0": [{}]}}}}"#,
                u64::MAX
            ),
        )
        .unwrap();
        let mut full = UsageHistory::load(&path).unwrap().unwrap();
        full.add(0, 0, 5);
        assert_eq!(full.count(0, 0), u64::MAX);
        std::fs::write(
            &path,
            r#"{"format": "k3-expert-usage/1", "layers": {}, "rates": {"read_mbps": -1}}"#,
        )
        .unwrap();
        let err = UsageHistory::load(&path).unwrap_err().to_string();
        assert!(err.contains("read_mbps"), "{err}");
        std::fs::write(&path, r#"{"format": "other", "layers": {}}"#).unwrap();
        let err = UsageHistory::load(&path).unwrap_err().to_string();
        assert!(err.contains("format") && err.contains(USAGE_FILE), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A FIFO or a link to `/dev/zero` in the usage file's place is an error at once, like a
    /// corrupt file, naming the path and what it is.
    #[test]
    fn a_fifo_or_a_device_is_refused_at_once() {
        let dir = k3_testkit::Scratch::new("usage-specials");
        for special in ["fifo", "/dev/zero"] {
            let path = dir.path().join("usage.json");
            let kind = k3_testkit::replace_with_special(&path, special);
            let shown = path.display().to_string();
            let loaded = k3_testkit::promptly(&shown, std::time::Duration::from_secs(5), {
                let path = path.clone();
                move || UsageHistory::load(&path).map(|_| ())
            });
            let err = loaded.expect_err(&shown).to_string();
            assert_eq!(
                err,
                format!("usage file {shown} is {kind}, not a regular file")
            );
        }
    }
}
