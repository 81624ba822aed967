//! Where the engine's build reports to: stderr, with the expert preload as a progress bar.

use expert_store::store::PreloadProgress;
use k3_model::builder::BuildSink;

/// The build's lines on stderr, and the expert preload's progress as a bar (GB/s, ETA),
/// cleared by the next line.
#[derive(Debug, Default)]
pub(crate) struct Stderr {
    bar: Option<indicatif::ProgressBar>,
}

impl BuildSink for Stderr {
    fn line(&mut self, line: &str) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        eprintln!("{line}");
    }

    fn preload_progress(&mut self, progress: PreloadProgress) {
        let bar = self.bar.get_or_insert_with(|| {
            indicatif::ProgressBar::new(0).with_style(
                indicatif::ProgressStyle::with_template(
                    "preloading experts {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
                )
                .expect("a valid template"),
            )
        });
        bar.set_length(progress.bytes_total);
        bar.set_position(progress.bytes_done);
    }
}
