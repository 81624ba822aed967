//! What a snapshot file is valid for ([`Identity`]): the engine, the numerics it computed
//! with ([`numerics`]) and the checkpoint ([`checkpoint_identity`]).

use std::path::Path;

use expert_store::Checkpoint;

use super::format::ENGINE_VERSION;
use crate::config::K3Config;
use crate::io::checksum::Checksum;
use crate::plan::TrunkFormat;

/// What a snapshot is valid for: the engine that computed it and the checkpoint it ran.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The engine version that computed the state ([`ENGINE_VERSION`]).
    pub engine: String,
    /// The checkpoint it ran ([`checkpoint_identity`]).
    pub checkpoint: u64,
}

impl Identity {
    /// This engine over `ckpt` with `config` (see [`checkpoint_identity`]), in the default
    /// numerics (exact kernels, the trunk as stored).
    pub fn of(ckpt: &Checkpoint, config: &K3Config) -> Self {
        Self {
            engine: ENGINE_VERSION.to_owned(),
            checkpoint: checkpoint_identity(ckpt, config),
        }
    }
    /// The same, computed with kernels of `tier` over a trunk in `trunk` ([`numerics`]):
    /// a state computed with other numerics is another model's state (a resumed session would
    /// not be the cold run's bits), so files of the two refuse each other, naming both.
    pub fn with_numerics(mut self, tier: mxfp4_kernels::Tier, trunk: TrunkFormat) -> Self {
        if let Some(numerics) = numerics(tier, trunk) {
            self.engine = format!("{} ({numerics})", self.engine);
        }
        self
    }
}

/// Bytes sampled from the middle of each matrix outside the routed experts: one page.
const MATRIX_SAMPLE: usize = 4096;

/// A hash naming a checkpoint: the config, every tensor's name, dtype, shape and place, the
/// values of the 1-D tensors (norms, biases, decays: small), and `MATRIX_SAMPLE` (4096) bytes from
/// the middle of every other tensor but the routed experts' (a merged adapter or a fine-tune
/// may change matrices and leave every vector alone; a dense change shows in any page of the
/// matrix). The routed experts, most of the tensors and bytes, are not read: a few thousand
/// pages are.
pub fn checkpoint_identity(ckpt: &Checkpoint, config: &K3Config) -> u64 {
    let experts = crate::inventory::expert_layout(config);
    let mut names: Vec<&str> = ckpt.tensor_names().collect();
    names.sort_unstable();
    // The matrices' samples, read first (all of a file's in one pass).
    let mut samples: Vec<(&str, &Path, std::ops::Range<usize>, &[u8])> = Vec::new();
    for &name in &names {
        let Some(t) = ckpt.tensor(name) else { continue };
        // Expert names as the layout spells them: without the release's `language_model.`
        // prefix.
        let relative = name.strip_prefix("language_model.").unwrap_or(name);
        if t.shape.len() != 1 && experts.parse(relative).is_none() {
            let start = (t.bytes.len() / 2).saturating_sub(MATRIX_SAMPLE / 2);
            let end = (start + MATRIX_SAMPLE).min(t.bytes.len());
            samples.push((
                name,
                t.path,
                t.offset + start..t.offset + end,
                &t.bytes[start..end],
            ));
        }
    }
    let (read, _) = read_samples(&samples);
    let mut sampled = samples.iter().map(|s| s.0).zip(read).peekable();
    let mut hash = Checksum::new();
    hash.update(format!("{config:?}").as_bytes());
    for name in names {
        let Some(t) = ckpt.tensor(name) else { continue };
        hash.update(name.as_bytes());
        hash.update(format!("{:?}{:?}", t.dtype, t.shape).as_bytes());
        hash.update(&(t.offset as u64).to_le_bytes());
        hash.update(&(t.bytes.len() as u64).to_le_bytes());
        if t.shape.len() == 1 {
            hash.update(&t.bytes[..t.bytes.len().min(1 << 20)]);
        } else if let Some((_, sample)) = sampled.next_if(|(n, _)| *n == name) {
            hash.update(&sample);
        }
    }
    hash.finish()
}

/// The bytes of `samples` (name, file, byte range in it, the same bytes in the mapping), each
/// file's read in one pass with `O_DIRECT` where the filesystem takes it. Not through the
/// mapping: a fault there reads a whole readahead window (8 MiB on some block devices) into
/// the page cache for one page, which for a checkpoint of a few thousand matrices is GBs read
/// at startup and held against a memory budget. Where a file cannot be read so (a checkpoint
/// held in memory), the mapping's bytes, which are the same. Also returns how many were read
/// from the files.
pub(super) fn read_samples(
    samples: &[(&str, &Path, std::ops::Range<usize>, &[u8])],
) -> (Vec<Vec<u8>>, usize) {
    let mut out: Vec<Option<Vec<u8>>> = vec![None; samples.len()];
    let mut paths: Vec<&Path> = samples.iter().map(|s| s.1).collect();
    paths.sort_unstable();
    paths.dedup();
    for path in paths {
        let Ok(reader) = expert_store::io::ShardReader::open(path, true) else {
            continue;
        };
        let mut mine: Vec<usize> = (0..samples.len())
            .filter(|&i| samples[i].1 == path)
            .collect();
        mine.sort_by_key(|&i| samples[i].2.start);
        let pieces: Vec<_> = mine
            .iter()
            .map(|&i| (&reader, samples[i].2.clone()))
            .collect();
        if let Ok((buf, starts)) = expert_store::io::read_pieces(&pieces, None, |_, _| {}) {
            for (&i, &at) in mine.iter().zip(&starts) {
                out[i] = Some(buf[at..at + samples[i].2.len()].to_vec());
            }
        }
    }
    let from_files = out.iter().filter(|o| o.is_some()).count();
    let bytes = out
        .into_iter()
        .zip(samples)
        .map(|(read, s)| read.unwrap_or_else(|| s.3.to_vec()))
        .collect();
    (bytes, from_files)
}

/// What besides the checkpoint sets a state's bits, where it is not the default: the sums'
/// order (the scalar tier's own; `avx2` and `avx512` share theirs), activations rounded by an
/// approximate tier, a requantised trunk. `None` for the exact SIMD tiers over the trunk as
/// stored, so their files keep the plain engine version.
pub fn numerics(tier: mxfp4_kernels::Tier, trunk: TrunkFormat) -> Option<String> {
    use mxfp4_kernels::Tier;
    let sums = match tier {
        Tier::Avx2 | Tier::Avx512 => None,
        Tier::Scalar => Some("scalar sums"),
        Tier::Avx512Bf16 => Some("BF16 activations, avx512-bf16"),
        Tier::Avx512Vnni => Some("int8 activations, avx512-vnni"),
    };
    let trunk = (trunk != TrunkFormat::Bf16).then(|| format!("{} trunk", trunk.name()));
    let parts: Vec<String> = sums.map(str::to_owned).into_iter().chain(trunk).collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}
