//! `cargo xtask k3-plan --config FILE --machine-gb G,..`: the memory plan the engine would
//! make for a checkpoint of that config on machines of G GB, projected onto NVMe drives.
//! The sizes are the inventory's ([`WeightSizes::of_config`]: every tensor in the config's
//! dtype, one file per layer), the plan is the library's own [`Plan::new`], and the
//! time per token is the plan's predicted bytes from disk over the drives' rate, beside the
//! weight bytes read from memory over the memory's rate: a bound where reads overlap compute,
//! not a measurement.

use anyhow::{Result, ensure};
use expert_store::io::MemoryBudget;
use k3_model::config::K3Config;
use k3_model::experts::ExpertOptions;
use k3_model::inventory::BytePlan;
use k3_model::plan::{MemoryUse, RunShape};
use k3_model::plan::{Plan, TrunkFormat, WeightSizes, safety_margin};

/// What the projection is asked for.
#[derive(Debug, Clone)]
pub(crate) struct Machines {
    /// Each machine's memory in bytes.
    pub(crate) memory: Vec<u64>,
    /// Drive counts, each drive reading `drive_rate` bytes/s.
    pub(crate) drives: Vec<usize>,
    pub(crate) drive_rate: f64,
    /// The memory's read rate in bytes/s.
    pub(crate) memory_rate: f64,
    pub(crate) run: RunShape,
    /// The trunk's format: a lossy one holds its requantised matrices resident.
    pub(crate) trunk_format: TrunkFormat,
}

/// Prints the plan and the projected time per token for each machine and drive count.
pub(crate) fn run(config: &K3Config, machines: &Machines) -> Result<()> {
    // The streamed matrices read packed too, from the pack cache a first run writes.
    let sizes = WeightSizes::of_config(config)
        .with_trunk_format(machines.trunk_format)
        .with_projected_pack_cache();
    let (stored, held) = sizes.requantised_bytes();
    let bytes_per_token = (BytePlan::new(config).bytes_per_token as u64 - stored + held) as f64;
    ensure!(
        sizes.expert_total > 0,
        "the config has no routed experts to plan"
    );
    println!(
        "\nprojection: ctx {}, max batch {}; drives of {:.1} GB/s each; memory read at {:.0} GB/s; \
         {:.1} GB of weights read per token; uniform routing (no skew); trunk format {}: the \
         trunk's BF16 matrices packed (12.25 bits per weight), resident and streamed (from the \
         pack cache), as the engine keeps them, and the ones a lossy format requantises held \
         resident in it\n",
        machines.run.ctx,
        machines.run.max_batch,
        machines.drive_rate / 1e9,
        machines.memory_rate / 1e9,
        bytes_per_token / 1e9,
        machines.trunk_format,
    );
    let mut header = String::from(
        "| machine | trunk resident | trunk streamed per token | expert cache | from disk per token |",
    );
    let mut rule = String::from("|---|---|---|---|---|");
    for d in &machines.drives {
        header.push_str(&format!(
            " s/token, {d} drive{} |",
            if *d == 1 { "" } else { "s" }
        ));
        rule.push_str("---|");
    }
    println!("{header}\n{rule}");
    for &memory in &machines.memory {
        let budget = MemoryBudget {
            bytes: memory,
            source: format!("a {:.0} GB machine", memory as f64 / 1e9),
            limit: false,
        };
        let margin = safety_margin(memory);
        let flags = MemoryUse::state(config, machines.run);
        let plan_for = match sizes.requantised() {
            true => Plan::resident_trunk,
            false => Plan::new,
        };
        let plan = plan_for(
            &sizes,
            flags,
            &ExpertOptions::default(),
            machines.run,
            Some(budget),
            margin,
            // No run of the release to measure rates from: trunk-first.
            None,
        );
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                println!("| {:.0} GB | refused: {e} |", memory as f64 / 1e9);
                continue;
            }
        };
        let streamed = plan.trunk.as_ref().map_or(0, |t| t.streamed_read_bytes());
        let memory_time = bytes_per_token / machines.memory_rate;
        let mut row = format!(
            "| {:.0} GB | {:.1} GB | {:.1} GB | {:.1} GB ({:.0}% of the experts) | {:.1} GB |",
            memory as f64 / 1e9,
            plan.memory.resident_trunk as f64 / 1e9,
            streamed as f64 / 1e9,
            plan.memory.expert_cache as f64 / 1e9,
            plan.expert_fraction * 100.0,
            plan.disk_per_token as f64 / 1e9,
        );
        for &d in &machines.drives {
            let disk = plan.disk_per_token as f64 / (d as f64 * machines.drive_rate);
            row.push_str(&format!(" {:.2} |", disk.max(memory_time)));
        }
        println!("{row}");
    }
    println!(
        "\ns/token is max(disk, memory): the plan's bytes from disk over the drives' rate, and the \
         weight bytes of a token over the memory's rate (reads overlapping compute)."
    );
    let facts = Facts::of(config, machines)?;
    println!("\n{}", facts.lines(machines).join("\n"));
    Ok(())
}

/// What a person needs besides the table: the disk the release takes with its pack cache, the
/// least memory the plan accepts, and how long a start takes on one drive.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Facts {
    /// The text shards' bytes as stored (what `--model` reads from disk).
    pub(crate) checkpoint: u64,
    /// The pack cache file: the trunk's BF16 matrices packed, and its manifest.
    pub(crate) pack_cache: u64,
    /// The BF16 bytes the first start reads to write the pack cache.
    pub(crate) pack_source: u64,
    /// The least memory budget the plan accepts (before the host's safety margin).
    pub(crate) least_memory: u64,
    /// Per machine: the bytes a start reads before serving (the resident trunk share and the
    /// expert cache's preload).
    pub(crate) start_reads: Vec<(u64, u64)>,
}

impl Facts {
    pub(crate) fn of(config: &K3Config, machines: &Machines) -> Result<Self> {
        let stored = WeightSizes::of_config(config);
        let packed = stored.clone().with_projected_pack_cache();
        let packable: Vec<_> = stored.packable();
        let pack_source = packable.iter().map(|t| t.bytes).sum();
        let bodies: u64 = packable
            .iter()
            .map(|t| {
                let cols = t.pack_cols.expect("packable");
                mxfp4_kernels::packed::packed_body_bytes(t.rows, cols)
                    .next_multiple_of(expert_store::io::IO_ALIGN) as u64
            })
            .sum();
        let plan_at = |memory: u64| {
            Plan::new(
                &packed,
                MemoryUse::state(config, machines.run),
                &ExpertOptions::default(),
                machines.run,
                Some(MemoryBudget {
                    bytes: memory,
                    source: "a machine".into(),
                    limit: false,
                }),
                safety_margin(memory),
                None,
            )
        };
        // The least accepted budget, to 0.1 GB: the plan is monotone in the budget.
        let (mut low, mut high) = (0u64, 1u64 << 44);
        ensure!(plan_at(high).is_ok(), "no budget fits the config");
        while high - low > 100_000_000 {
            let mid = low + (high - low) / 2;
            if plan_at(mid).is_ok() {
                high = mid;
            } else {
                low = mid;
            }
        }
        let start_reads = machines
            .memory
            .iter()
            .filter_map(|&memory| {
                let plan = plan_at(memory).ok()?;
                // Where everything fits as stored the engine maps it and reads it all in at
                // start (but the embedding table); else the resident share and the cache.
                let reads = match &plan.trunk {
                    None => stored.trunk_stored_bytes() + stored.expert_total,
                    Some(_) => plan.memory.resident_trunk + plan.memory.expert_cache,
                };
                Some((memory, reads))
            })
            .collect();
        Ok(Self {
            checkpoint: BytePlan::new(config).text_bytes as u64,
            pack_cache: bodies + packed.packed_side,
            pack_source,
            least_memory: high,
            start_reads,
        })
    }

    /// The facts as the lines `k3-plan` prints (the docs quote them; a test checks the quote).
    pub(crate) fn lines(&self, machines: &Machines) -> Vec<String> {
        let gb = |b: u64| b as f64 / 1e9;
        let rate = machines.drive_rate;
        let mut lines = vec![
            format!(
                "disk: the text shards {:.1} GB, the pack cache {:.1} GB (written beside the checkpoint by the first start: it reads {:.1} GB of BF16 matrices and writes the packed file, about {:.0} s on one drive)",
                gb(self.checkpoint),
                gb(self.pack_cache),
                gb(self.pack_source),
                (self.pack_source + self.pack_cache) as f64 / rate
            ),
            format!(
                "least memory the plan accepts (ctx {}, max batch {}): {:.1} GB",
                machines.run.ctx,
                machines.run.max_batch,
                gb(self.least_memory)
            ),
        ];
        for &(memory, reads) in &self.start_reads {
            lines.push(format!(
                "start on a {:.0} GB machine: reads {:.1} GB before it serves (the resident trunk and expert cache, or everything where it all fits), about {:.0} s on one drive",
                gb(memory),
                gb(reads),
                reads as f64 / rate
            ));
        }
        lines
    }
}

/// `G,..` in decimal GB as bytes.
pub(crate) fn gb_list(text: &str, flag: &str) -> Result<Vec<u64>> {
    Ok(crate::bench_memory::positive_list(text, flag)?
        .into_iter()
        .map(|g| (g * 1e9) as u64)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELEASE: &str = include_str!("../../crates/k3-model/configs/Kimi-K3.config.json");

    #[test]
    fn the_release_sizes_add_up_to_the_byte_plan() {
        let config = K3Config::from_json(RELEASE).unwrap();
        let s = WeightSizes::of_config(&config);
        let plan = BytePlan::new(&config);
        let trunk: u64 = s
            .head
            .iter()
            .chain(s.layers.iter().flatten())
            .map(|t| t.bytes)
            .sum();
        assert_eq!(
            (trunk + s.embed + s.expert_total) as usize,
            plan.text_bytes,
            "every text tensor counted once"
        );
        assert_eq!(s.experts_per_layer.len(), plan.moe_layers);
        assert!(
            s.experts_per_layer
                .iter()
                .all(|&n| n == config.moe.num_experts)
        );
    }

    #[test]
    fn a_machine_with_room_for_the_trunk_streams_only_experts() {
        let config = K3Config::from_json(RELEASE).unwrap();
        let s = WeightSizes::of_config(&config);
        let run = RunShape {
            resident_trunk: false,
            max_batch: 1,
            ctx: 4096,
        };
        let budget = |gb: u64| MemoryBudget {
            bytes: gb * 1_000_000_000,
            source: "test".into(),
            limit: false,
        };
        let plan = |gb| {
            Plan::new(
                &s,
                MemoryUse::state(&config, run),
                &ExpertOptions::default(),
                run,
                Some(budget(gb)),
                0,
                None,
            )
            .unwrap()
        };
        let small = plan(256);
        let large = plan(1000);
        // 256 GB holds the ~111 GB trunk: nothing of it is read from disk per token.
        assert_eq!(
            small.trunk.as_ref().map_or(0, |t| t.streamed_read_bytes()),
            0,
            "{}",
            small.describe()
        );
        // More memory caches more experts and reads less per token.
        assert!(large.expert_fraction > small.expert_fraction);
        assert!(large.disk_per_token < small.disk_per_token);
    }

    /// On a machine that streams the trunk, reading the streamed matrices packed from the
    /// pack cache reads at most 0.8x the bytes (packed: 49 bytes for 64, plus the rows the
    /// resident room gains), and the exception allowance is held in memory.
    #[test]
    fn the_projected_pack_cache_streams_fewer_bytes() {
        let config = K3Config::from_json(RELEASE).unwrap();
        let stored = WeightSizes::of_config(&config);
        let packed = stored.clone().with_projected_pack_cache();
        assert!(packed.packed_side > 0);
        let run = RunShape {
            resident_trunk: false,
            max_batch: 1,
            ctx: 4096,
        };
        let streamed = |s: &WeightSizes| {
            let plan = Plan::new(
                s,
                MemoryUse::state(&config, run),
                &ExpertOptions::default(),
                run,
                Some(MemoryBudget {
                    bytes: 64_000_000_000,
                    source: "test".into(),
                    limit: false,
                }),
                0,
                None,
            )
            .unwrap();
            plan.trunk.as_ref().unwrap().streamed_read_bytes()
        };
        let (stored, packed) = (streamed(&stored), streamed(&packed));
        assert!(
            stored > 0 && packed * 10 <= stored * 8,
            "{packed} of {stored}"
        );
    }
}
