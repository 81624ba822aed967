//! The build's last phase: where the plan found that everything fits and reads it through the
//! mapping, the decode's weights read in and mapped now.

use std::time::Instant;

use expert_store::ExpertStore;

use super::options::{BuildSink, EngineOptions};
use super::plan::Planned;
use crate::config::K3Config;

/// Reads in (or advises) the mapping of every weight but the embedding table (of which a token
/// reads one row), so the first steps do not fault them in from disk one expert at a time
/// (llama.cpp's loader likewise advises its whole mapping).
pub(super) fn warm_mapping(
    planned: &Planned,
    config: &K3Config,
    options: &EngineOptions,
    store: Option<&ExpertStore>,
    sink: &mut dyn BuildSink,
) {
    let Planned {
        checkpoint, plan, ..
    } = planned;
    // Where the plan found that everything fits and reads it all through the mapping,
    // the decode's weights (all but the embedding table, of which a token reads one row)
    // are read in and mapped now, so the first steps do not fault them in from disk one
    // expert at a time (llama.cpp's loader likewise advises its whole mapping).
    if plan.budget.is_some() && plan.trunk.is_none() && !options.resident_trunk && store.is_none() {
        let embedding: std::collections::HashSet<String> = crate::inventory::text_tensors(config)
            .into_iter()
            .filter(|spec| spec.class == crate::inventory::TensorClass::Embedding)
            .filter_map(|spec| checkpoint.tensor(&spec.name).map(|t| t.name.to_owned()))
            .collect();
        let started = Instant::now();
        let warmed = checkpoint.warm(|stored| !embedding.contains(stored));
        sink.line(&format!(
            "warmed the mapping: {} of weights {} in {:.1} s",
            crate::units::gb(warmed.bytes),
            if warmed.populated {
                "read in and mapped"
            } else {
                "advised for read-ahead"
            },
            started.elapsed().as_secs_f64()
        ));
    }
}
