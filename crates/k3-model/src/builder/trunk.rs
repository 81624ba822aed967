//! The build's second phase: the trunk made resident, as the options ask (a copy of the whole
//! trunk through the mapping, each domain's rows on its node) or as the plan places it (its
//! share read with `O_DIRECT`, BF16 matrices packed).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use expert_store::Checkpoint;
use numa_sched::Ranks;

use super::options::{BuildError, BuildSink, EngineOptions};
use super::plan::Planned;
use crate::checks::validate::trunk_tensor_names;
use crate::config::K3Config;
use crate::knob::Knob;
use crate::model::{ModelError, ResidentTrunk};
use crate::plan::{StoredTensor, TrunkPlan, WeightSizes};

/// The trunk resident where the options or the plan keep it, and the bytes a packed trunk
/// holds beyond its plan (more wide blocks than it allowed for).
pub(super) fn load_trunk(
    planned: &mut Planned,
    config: &K3Config,
    options: &EngineOptions,
    nodes: &[Option<usize>],
    sink: &mut dyn BuildSink,
) -> Result<(Option<Arc<ResidentTrunk>>, u64), BuildError> {
    let Planned {
        checkpoint,
        sizes,
        plan,
        pack,
        pool,
        ..
    } = planned;
    // The flag's copy (the whole trunk, through the mapping, each domain's rows of every
    // matrix on its node on real NUMA), or the plan's share of it (read with O_DIRECT).
    let mut resident = None;
    // Bytes the packed trunk holds beyond the plan (more wide blocks than it allowed for).
    let mut overrun = 0;
    // The plan's trunk (packed where the startup measurement chose it) comes first: with
    // `--resident-trunk` a trunk held packed is resident already, in fewer bytes.
    let planned = plan
        .trunk
        .as_ref()
        .filter(|t| !t.resident.is_empty() || !t.resident_rows.is_empty());
    if options.resident_trunk && planned.is_none() {
        let keep = trunk_tensor_names(checkpoint, config);
        let started = Instant::now();
        let bytes = checkpoint.make_resident_placed(
            |stored| keep.contains(stored),
            |_, shape, bytes| {
                if let [rows, _] = shape {
                    numa_sched::memory::bind_row_split(bytes, *rows, nodes);
                }
            },
        )?;
        sink.line(&format!(
            "resident trunk: {:.2} GB copied in {:.1} s",
            bytes as f64 / 1e9,
            started.elapsed().as_secs_f64()
        ));
    } else if let Some(trunk) = planned {
        let started = Instant::now();
        let (names, rows) = rank_rows(trunk, sizes, checkpoint, &options.ranks)?;
        let loaded = ResidentTrunk::load(
            checkpoint,
            &names,
            &rows,
            &sizes.packed_cols(),
            pack.as_deref(),
            pool,
            &pool.topology().domains[0].cpus,
        )?;
        let packed = loaded.packed_summary();
        let split = rows.len() - trunk.resident_rows.len();
        let line = format!(
            "resident trunk: {} read with O_DIRECT in {:.1} s{}{}",
            crate::units::gb(loaded.bytes() as u64),
            started.elapsed().as_secs_f64(),
            match split {
                0 => String::new(),
                n => format!(
                    " (rank {} of {}: its rows of {n} row-split matrices alone)",
                    options.ranks.rank(),
                    options.ranks.size()
                ),
            },
            match packed.pieces {
                0 => String::new(),
                n if packed.requantised > 0 => format!(
                    "; {} matrices requantised to {} (lossy, --trunk-format) and {} packed{}: \
                     {:.2} GB as stored held in {:.2} GB",
                    packed.requantised,
                    options.trunk_format,
                    n - packed.requantised,
                    match packed.cached {
                        0 => String::new(),
                        c => format!(" ({c} read from the pack cache)"),
                    },
                    packed.bf16_bytes as f64 / 1e9,
                    packed.packed_bytes as f64 / 1e9,
                ),
                n => format!(
                    "; {n} BF16 matrices (or leading rows) packed{}: {:.2} GB of BF16 in {:.2} \
                     GB ({} blocks kept as BF16)",
                    match packed.cached {
                        0 => String::new(),
                        c => format!(" ({c} read from the pack cache)"),
                    },
                    packed.bf16_bytes as f64 / 1e9,
                    packed.packed_bytes as f64 / 1e9,
                    packed.exceptions,
                ),
            }
        );
        match packed.pieces {
            0 => sink.line(&line),
            _ => sink.line_about(&line, Knob::PackTrunk),
        }
        overrun = (loaded.bytes() as u64).saturating_sub(plan.memory.resident_trunk);
        if overrun > 0 {
            sink.line(&format!(
                "the packed trunk holds {} more than planned ({} wide blocks kept as BF16, \
                 over the {} per 10,000 planned for); the expert cache gives it up",
                crate::units::gb(overrun),
                packed.exceptions,
                crate::plan::PACKED_EXCEPTIONS_PER_10K,
            ));
        }
        resident = Some(Arc::new(loaded));
    }
    // The bodies the load read whole were checked as they landed. The others (a streamed
    // trunk's, whose row blocks are too small a unit to check as they are read, and a rank's
    // part of a matrix) would cost a read of them at every start: for the release under a
    // memory limit most of its ~85 GB cache, and every rank the whole file. So they are
    // checked where `--scan` asks for every weight to be read at startup, as the checkpoint's
    // own tensors are; the header, the file's length and the manifest are checked always.
    if let Some(cache) = pack.as_ref().filter(|_| options.scan) {
        let checked = resident.as_ref().map_or(&[][..], |r| &r.cache_checked[..]);
        cache
            .verify(checked, &pool.topology().domains[0].cpus)
            .map_err(ModelError::from)?;
    }
    Ok((resident, overrun))
}

/// What of `trunk`'s resident tensors this rank holds: with one rank, all of them; with
/// several, only its rows ([`Ranks::share`]) of each row-split matrix
/// ([`crate::shares::row_split`]), the only rows its GEMMs read (`Model::gemm_many` looks
/// them up alone), as row blocks (none of a matrix it owns no rows of); the rest whole. A plan
/// that streams keeps them whole: its steps read whole tensors.
fn rank_rows(
    trunk: &TrunkPlan,
    sizes: &WeightSizes,
    checkpoint: &Checkpoint,
    ranks: &Ranks,
) -> Result<(HashSet<String>, Vec<StoredTensor>), BuildError> {
    if ranks.size() == 1 || trunk.streams() {
        return Ok((trunk.resident.clone(), trunk.resident_rows.clone()));
    }
    let stored: HashMap<&str, &StoredTensor> = sizes
        .read_tensors()
        .map(|(_, t)| (t.name.as_str(), t))
        .collect();
    let mut names = HashSet::new();
    let mut rows = trunk.resident_rows.clone();
    for name in &trunk.resident {
        let shape = &checkpoint.require(name)?.shape;
        match stored.get(name.as_str()) {
            Some(t) if crate::shares::row_split(name, shape) && t.rows == shape[0] => {
                let share = ranks.share(t.rows);
                if !share.is_empty() {
                    rows.push(t.row_block(share));
                }
            }
            _ => {
                names.insert(name.clone());
            }
        }
    }
    Ok((names, rows))
}
