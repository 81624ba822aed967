//! The options of an engine a person turns to make a run fit, or to turn a behaviour off. The
//! library's messages name them in words ([`Knob`]'s `Display`) and list them
//! ([`Knob`]s on errors and build events); the binaries, which own the command line, name each
//! by its flag (`k3_cli::flag_of`). No text in this crate names a flag.

use std::fmt;

/// An option of the engine, as a person turns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Knob {
    /// The memory the run may use (`EngineOptions::memory_bytes`).
    MemoryLimit,
    /// Sequences decoded together (`EngineOptions::max_batch`).
    MaxBatch,
    /// Tokens a sequence may hold (`EngineOptions::ctx`).
    Ctx,
    /// The expert store's reads in flight (`ExpertOptions::io_threads`).
    IoThreads,
    /// The expert cache's size (`ExpertOptions::cache_experts` or `cache_bytes`).
    ExpertCache,
    /// The copy of the whole trunk made resident (`EngineOptions::resident_trunk`).
    ResidentTrunk,
    /// BF16 trunk matrices held and streamed packed (`EngineOptions::pack_trunk`).
    PackTrunk,
    /// Where the pack cache is kept, or none (`EngineOptions::pack_cache`).
    PackCache,
    /// The read of every weight before the run (`EngineOptions::scan`).
    Scan,
    /// The expert store (an expert cache or a preload, `EngineOptions::experts`).
    ExpertStore,
}

impl fmt::Display for Knob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Knob::MemoryLimit => "the memory limit",
            Knob::MaxBatch => "the batch size",
            Knob::Ctx => "the context length",
            Knob::IoThreads => "the expert reads in flight",
            Knob::ExpertCache => "the expert cache",
            Knob::ResidentTrunk => "the resident trunk copy",
            Knob::PackTrunk => "the packed trunk",
            Knob::PackCache => "the pack cache",
            Knob::Scan => "the weight scan",
            Knob::ExpertStore => "the expert store",
        })
    }
}
