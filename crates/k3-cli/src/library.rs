//! The flags every binary takes for the libraries' options ([`library_flags`]: threads, kernel
//! tier, memory budget, resident trunk, the expert store's flags, NUMA placement) and the one place their
//! values reach [`EngineOptions`] ([`apply_library_flags`]). The libraries themselves parse
//! no flags.

use std::path::PathBuf;

use expert_store::Policy;
use k3_model::builder::EngineOptions;
use k3_model::builder::{PackCachePlace, PackRule};
use k3_model::plan::TrunkFormat;

use crate::error::UsageError;
use crate::flag::{Flag, Group, Kind};
use crate::parse::Parsed;

/// The kernel tiers `--kernel-tier` accepts (the names `Tier` parses).
pub const KERNEL_TIERS: &[&str] = &["scalar", "avx2", "avx512", "avx512-bf16", "avx512-vnni"];

/// The expert cache's eviction policies `--expert-policy` accepts.
pub const EXPERT_POLICIES: &[&str] = &["lru", "usage"];

/// `--model DIR` (`-m`), required: for tools that have no default checkpoint to fall back on.
pub fn model_flag(group: Group) -> Flag {
    Flag::value(
        "model",
        "DIR",
        Kind::Text,
        "",
        group,
        "checkpoint directory: config.json, the tokenizer files and *.safetensors",
    )
    .aliases(&["-m"])
    .required()
}

/// [`library_flags`] with `--threads` defaulting to `threads` (a tool with a fixed default
/// rather than every core, for reproducible runs).
pub fn library_flags_with_threads(threads: &'static str) -> Vec<Flag> {
    library_flags()
        .into_iter()
        .map(|flag| match flag.name {
            "threads" => flag.with_default(threads),
            _ => flag,
        })
        .collect()
}

/// The library flags, grouped Performance, Experts, NUMA. `--threads` defaults to every
/// physical core here; a binary with another default says so with [`Flag::with_default`].
pub fn library_flags() -> Vec<Flag> {
    use Kind::*;
    let (performance, experts, numa) = (Group::PERFORMANCE, Group::EXPERTS, Group::NUMA);
    let non_negative = Number {
        min: 0.0,
        max: f64::INFINITY,
    };
    vec![
        // Performance.
        Flag::value(
            "threads",
            "N",
            Count,
            "the physical cores this process may use",
            performance,
            "compute threads in all (hyperthread siblings are not counted)",
        )
        .aliases(&["-t"]),
        Flag::value(
            "kernel-tier",
            "TIER",
            Choice(KERNEL_TIERS),
            "the best this CPU supports",
            performance,
            "kernel tier for MXFP4: scalar, avx2, avx512, avx512-bf16 or avx512-vnni",
        ),
        Flag::value(
            "memory-gb",
            "G",
            non_negative,
            "the smaller of MemAvailable and the cgroup's headroom, less a safety margin (printed)",
            performance,
            "gigabytes this run may use; a model larger than that streams what the plan does not keep resident",
        ),
        Flag::switch(
            "resident-trunk",
            performance,
            "copy every weight but the routed experts into huge-page memory at startup, each NUMA domain's rows on its node",
        ),
        Flag::switch(
            "no-pack-trunk",
            performance,
            "keep the BF16 matrices a memory plan holds resident or streams as stored, and where everything fits read them through the mapping (default: packed losslessly in 12.25 bits per weight, so 1.3x as many fit and 0.77x the bytes stream; where everything fits, a measurement at startup of both GEMVs per core and of the read rate with every worker busy decides whether the whole trunk is held packed, and says why; the same logits)",
        ),
        Flag::switch(
            "pack-trunk",
            performance,
            "where everything fits, hold the whole trunk packed losslessly (12.25 bits per weight) without the startup measurement that otherwise decides it; with several MPI ranks each rank holds only its rows (the same logits)",
        ),
        Flag::value(
            "trunk-format",
            "FORMAT",
            Choice(&TrunkFormat::NAMES),
            "bf16: every matrix as stored, exact",
            performance,
            "requantise the trunk's large projections once at load and hold them resident: q8_0 (ggml's Q8_0, 8.5 bits per weight) or mxfp4 (4.25); the router, the lm_head and KDA's small gate matrices stay as stored unless -all (q8_0-all, mxfp4-all); lossy, its error is in the README",
        ),
        Flag::value(
            "pack-cache",
            "DIR|off",
            Text,
            "the model directory, else (k3-serve) $XDG_CACHE_HOME/k3 or $HOME/.cache/k3",
            performance,
            "where the packed copy of the BF16 matrices a memory plan streams is written once (k3-packed-<identity>.bin, about 0.77x their size) and read from; off: stream them as stored",
        ),
        // Experts.
        Flag::value(
            "expert-cache",
            "N",
            Whole,
            "none: experts are read through the file mapping",
            experts,
            "experts per layer kept resident (0: read on every use)",
        ),
        Flag::value(
            "expert-cache-gb",
            "G",
            non_negative,
            "none: experts are read through the file mapping",
            experts,
            "gigabytes of experts kept resident, over all layers (instead of --expert-cache)",
        ),
        Flag::switch(
            "preload-experts",
            experts,
            "fill the expert cache at startup, most used experts first",
        ),
        Flag::switch("mlock", experts, "pin resident experts in memory"),
        Flag::switch(
            "no-usage-cache",
            experts,
            "neither read nor write the expert usage file (the policy is then lru, and a memory plan keeps the trunk first)",
        ),
        Flag::value(
            "usage-file",
            "FILE",
            Text,
            "k3-expert-usage.json in the model directory",
            experts,
            "where expert usage counts, and the decode rates a memory plan sizes its stream by, are read at startup and written at exit",
        ),
        Flag::value(
            "expert-policy",
            "POLICY",
            Choice(EXPERT_POLICIES),
            "usage while the usage cache is on, else lru",
            experts,
            "expert cache eviction: lru or usage (usage-weighted)",
        ),
        Flag::value(
            "io-threads",
            "N",
            Count,
            "16",
            experts,
            "expert reads in flight at once (a memory plan that cannot keep every weight resident lowers it to 2)",
        ),
        // NUMA.
        Flag::switch(
            "numa",
            numa,
            "one worker pool per NUMA node, weights placed on the node that uses them",
        ),
        Flag::value(
            "numa-fake",
            "N",
            Count,
            "none",
            numa,
            "split the CPUs into N synthetic domains (testing NUMA code on one node)",
        ),
        Flag::value(
            "numa-threads",
            "N",
            Count,
            "none: --threads split over the domains",
            numa,
            "threads per domain",
        ),
        Flag::switch(
            "hyperthreads",
            numa,
            "count hyperthread siblings as CPUs (default: one per physical core)",
        ),
    ]
}

/// Sets the options the library flags of `parsed` give (flags absent leave the options as
/// they are; the values were checked against their kinds by the parser).
pub fn apply_library_flags(parsed: &Parsed, options: &mut EngineOptions) -> Result<(), UsageError> {
    if parsed.has("expert-cache") && parsed.has("expert-cache-gb") {
        return Err(UsageError::Other(
            "--expert-cache and --expert-cache-gb cannot both be given".into(),
        ));
    }
    let experts = &mut options.experts;
    if let Some(n) = parsed.get_usize("expert-cache")? {
        experts.cache_experts = Some(n);
    }
    if let Some(gb) = parsed.get_f64("expert-cache-gb")? {
        experts.cache_bytes = Some((gb * 1e9) as u64);
    }
    experts.preload |= parsed.switch("preload-experts");
    experts.mlock |= parsed.switch("mlock");
    experts.usage_cache &= !parsed.switch("no-usage-cache");
    if let Some(path) = parsed.get_str("usage-file") {
        experts.usage_file = Some(PathBuf::from(path));
    }
    match parsed.get_str("expert-policy") {
        Some("lru") => experts.policy = Some(Policy::Lru),
        Some("usage") => experts.policy = Some(Policy::UsageWeighted),
        Some(other) => {
            return Err(UsageError::Other(format!(
                "--expert-policy must be lru or usage, got {other:?}"
            )));
        }
        None => {}
    }
    if let Some(n) = parsed.get_usize("io-threads")? {
        experts.io_threads = n;
    }
    let pool = &mut options.pool;
    if let Some(n) = parsed.get_usize("threads")? {
        pool.threads = Some(n);
    }
    pool.numa |= parsed.switch("numa");
    if let Some(n) = parsed.get_usize("numa-fake")? {
        pool.fake_domains = Some(n);
    }
    if let Some(n) = parsed.get_usize("numa-threads")? {
        pool.threads_per_domain = Some(n);
    }
    pool.hyperthreads |= parsed.switch("hyperthreads");
    options.resident_trunk |= parsed.switch("resident-trunk");
    // The binaries decide the packed trunk by measuring this machine (the library's default
    // is the tier's name).
    options.pack_rule = PackRule::Measured;
    match (parsed.switch("pack-trunk"), parsed.switch("no-pack-trunk")) {
        (true, true) => {
            return Err(UsageError::Other(
                "--pack-trunk and --no-pack-trunk contradict each other: give one".into(),
            ));
        }
        (true, false) => options.pack_rule = PackRule::Always,
        (false, true) => options.pack_trunk = false,
        (false, false) => {}
    }
    if let Some(format) = parsed.get_str("trunk-format") {
        options.trunk_format = format.parse().map_err(UsageError::Other)?;
    }
    match parsed.get_str("pack-cache") {
        Some("off") => options.pack_cache = PackCachePlace::Off,
        Some("") => {
            return Err(UsageError::Other(
                "--pack-cache needs a directory or off".into(),
            ));
        }
        Some(dir) => options.pack_cache = PackCachePlace::Dir(dir.into()),
        None => {}
    }
    if let Some(gb) = parsed.get_f64("memory-gb")? {
        options.memory_bytes = Some((gb * 1e9) as u64);
    }
    if let Some(tier) = parsed.get_str("kernel-tier") {
        options.kernel_tier = Some(
            tier.parse()
                .map_err(|e: mxfp4_kernels::Error| UsageError::Other(e.to_string()))?,
        );
    }
    Ok(())
}
