//! The library's options as the command line spells them: each [`Knob`] k3-model names in its
//! messages and errors gets its flag here, so the library's wording names no flag and the
//! binaries' output still tells a person what to type. [`FlagHints`] wraps a build's sink to
//! follow each line about an option with its flag; [`with_flags`] does the same for a failed
//! build.

use expert_store::store::PreloadProgress;
use k3_model::builder::{BuildError, BuildSink};
use k3_model::knob::Knob;

/// How to turn `knob` on the command line.
pub fn flag_of(knob: Knob) -> &'static str {
    match knob {
        Knob::MemoryLimit => "--memory-gb",
        Knob::MaxBatch => "--max-batch",
        Knob::Ctx => "--ctx",
        Knob::IoThreads => "--io-threads",
        Knob::ExpertCache => "--expert-cache/--expert-cache-gb",
        Knob::ResidentTrunk => "--resident-trunk",
        Knob::PackTrunk => "--no-pack-trunk",
        Knob::PackCache => "--pack-cache DIR|off",
        Knob::Scan => "--scan",
        Knob::ExpertStore => "--expert-cache, --expert-cache-gb, --preload-experts",
        _ => "(no flag)",
    }
}

/// What a line about `knob` is followed by: the flag, and where it helps, what it does.
pub fn hint_of(knob: Knob) -> &'static str {
    match knob {
        Knob::PackCache => "--pack-cache off reads them as stored",
        Knob::PackTrunk => "--no-pack-trunk keeps every matrix as stored",
        knob => flag_of(knob),
    }
}

/// `error`'s message, followed by the flags of the options it names, if any.
pub fn with_flags(error: &BuildError) -> String {
    let knobs = error.knobs();
    if knobs.is_empty() {
        return error.to_string();
    }
    let flags: Vec<&str> = knobs.into_iter().map(flag_of).collect();
    format!("{error} (flags: {})", flags.join(", "))
}

/// A build sink that follows each line about an option with the option's flag.
#[derive(Debug)]
pub struct FlagHints<S>(pub S);

impl<S: BuildSink> BuildSink for FlagHints<S> {
    fn line(&mut self, line: &str) {
        self.0.line(line);
    }

    fn line_about(&mut self, line: &str, knob: Knob) {
        self.0.line(&format!("{line} ({})", hint_of(knob)));
    }

    fn preload_progress(&mut self, progress: PreloadProgress) {
        self.0.preload_progress(progress);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::library::library_flags;

    /// Every flag a knob names is a flag of the binaries' library table, so a hint never
    /// sends a person to a flag that does not exist.
    #[test]
    fn every_knob_names_flags_that_exist() {
        let table = library_flags();
        let known: Vec<String> = table.iter().map(|f| format!("--{}", f.name)).collect();
        let serve_only = ["--memory-gb", "--max-batch", "--ctx", "--scan"];
        for knob in [
            Knob::MemoryLimit,
            Knob::MaxBatch,
            Knob::Ctx,
            Knob::IoThreads,
            Knob::ExpertCache,
            Knob::ResidentTrunk,
            Knob::PackTrunk,
            Knob::PackCache,
            Knob::Scan,
            Knob::ExpertStore,
        ] {
            for flag in flag_of(knob)
                .split([',', '/', ' '])
                .filter(|w| w.starts_with("--"))
            {
                assert!(
                    known.contains(&flag.to_owned()) || serve_only.contains(&flag),
                    "{knob:?}: {flag}"
                );
            }
        }
    }

    #[test]
    fn lines_about_an_option_get_its_flag() {
        let mut lines = Vec::new();
        let mut sink = FlagHints(|line: &str| lines.push(line.to_owned()));
        sink.line("plain");
        sink.line_about("pack cache: not used", Knob::PackCache);
        sink.line_about("weight scan: 3 tensors read", Knob::Scan);
        sink.line_about("memory plan: budget 4 GB", Knob::MemoryLimit);
        assert_eq!(
            lines,
            [
                "plain",
                "pack cache: not used (--pack-cache off reads them as stored)",
                "weight scan: 3 tensors read (--scan)",
                "memory plan: budget 4 GB (--memory-gb)"
            ]
        );
    }
}
