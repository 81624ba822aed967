//! Where this model's routed experts come from: the [`ExpertSource`] seam (in
//! `expert_store::source`, so a store needs only `expert-store` and `mxfp4-kernels` to plug in),
//! instantiated for K3's experts (gate, up and down, [`MxFp4Matrices<3>`]) and [`ModelError`];
//! and `MappedExperts`, the checkpoint's file mapping, what [`super::Model::new`] uses. An
//! [`ExpertStore`](expert_store::ExpertStore) is a source itself
//! ([`super::Model::with_expert_store`]).
//!
//! `Model` holds a `Box<dyn ExpertSource<..>>` rather than being generic over it: a type
//! parameter would change the `Model<'a>` every caller names, and the indirect calls are few
//! and coarse. Per MoE layer and forward pass there is one call to [`ExpertSource::experts`]
//! and one to `hooks.run` per batch of ready experts (one batch when mapped); with home
//! placement [`ExpertSource::home`] is called once per expert task to pick its domain, and
//! each such task multiplies a block of an expert's rows (tens of KiB of weights at the
//! least), next to which an indirect call is noise. Nothing per row, per token or per weight
//! goes through the trait.

use expert_store::source::{ExpertHooks, ExpertSource, MxFp4Matrices};
use mxfp4_kernels::MxFp4Matrix;

use super::error::{ModelError, Result};

/// Routed experts read through the checkpoint's file mapping: every expert is always ready.
pub(super) struct MappedExperts<'a> {
    /// By checkpoint layer (empty for dense layers), by expert id: gate, up, down.
    pub(super) layers: Vec<Vec<[MxFp4Matrix<'a>; 3]>>,
}

impl ExpertSource<MxFp4Matrices<3>, ModelError> for MappedExperts<'_> {
    /// Round-robin by id.
    fn home(&self, _layer: usize, expert: usize) -> usize {
        expert
    }

    fn experts(
        &self,
        layer: usize,
        needed: &[usize],
        hooks: ExpertHooks<'_, MxFp4Matrices<3>, ModelError>,
    ) -> Result<()> {
        let experts: Vec<(usize, [MxFp4Matrix<'_>; 3])> =
            needed.iter().map(|&e| (e, self.layers[layer][e])).collect();
        (hooks.run)(&experts)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use expert_store::source::ExpertBatch;
    use expert_store::{Checkpoint, ExpertStore, StoreConfig};
    use mxfp4_kernels::Kernels;

    use super::*;
    use crate::model::{Model, expert_layout, fingerprint};
    use crate::synth::{Preset, SynthOptions, generate};

    /// A source of its own, plugged in through [`Model::with_expert_source`]: it wraps a store
    /// and hands each expert to the model alone, in reverse order, after the overlap work, and
    /// counts what it handed out.
    struct OneByOneReversed {
        inner: Arc<ExpertStore>,
        handed: Mutex<Vec<(usize, usize)>>,
    }

    impl ExpertSource<MxFp4Matrices<3>, ModelError> for OneByOneReversed {
        fn home(&self, layer: usize, expert: usize) -> usize {
            ExpertStore::home(&self.inner, layer, expert)
        }

        fn experts(
            &self,
            layer: usize,
            needed: &[usize],
            hooks: ExpertHooks<'_, MxFp4Matrices<3>, ModelError>,
        ) -> Result<()> {
            assert!(needed.windows(2).all(|w| w[0] < w[1]), "{needed:?}");
            (hooks.overlap)()?;
            let run = hooks.run;
            let mut inner = |batch: &ExpertBatch<'_, MxFp4Matrices<3>>| -> Result<()> {
                for one in batch.iter().rev() {
                    self.handed.lock().unwrap().push((layer, one.0));
                    run(std::slice::from_ref(one))?;
                }
                Ok(())
            };
            let mut nothing = || Ok(());
            self.inner.experts(
                layer,
                needed,
                ExpertHooks {
                    overlap: &mut nothing,
                    wait: hooks.wait,
                    run: &mut inner,
                },
            )
        }
    }

    /// Any source gives the mapped model's bits, whatever its batches and their order; every
    /// routed expert the router picks is handed out once per layer and step.
    #[test]
    fn a_custom_source_gives_the_mapped_bits() {
        let dir = std::env::temp_dir().join(format!("k3-source-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = generate(&dir, &SynthOptions::new(Preset::Tiny))
            .unwrap()
            .config;
        let ckpt = Checkpoint::open(&dir).unwrap();
        let kernels = Kernels::detect();
        let tokens = [1usize, 500, 17, 42, 7];
        let run = |model: &Model<'_>| -> Vec<u64> {
            let mut session = model.session();
            tokens
                .iter()
                .map(|&t| fingerprint(&model.decode_step(&mut session, t).unwrap()))
                .collect()
        };
        let mapped = run(&Model::new(&ckpt, &config, kernels).unwrap());
        let store = ExpertStore::open(&ckpt, expert_layout(&config), StoreConfig::default());
        let source = Arc::new(OneByOneReversed {
            inner: Arc::new(store.unwrap()),
            handed: Mutex::new(Vec::new()),
        });
        struct Shared(Arc<OneByOneReversed>);
        impl ExpertSource<MxFp4Matrices<3>, ModelError> for Shared {
            fn home(&self, layer: usize, expert: usize) -> usize {
                self.0.home(layer, expert)
            }
            fn experts(
                &self,
                layer: usize,
                needed: &[usize],
                hooks: ExpertHooks<'_, MxFp4Matrices<3>, ModelError>,
            ) -> Result<()> {
                self.0.experts(layer, needed, hooks)
            }
        }
        let model =
            Model::with_expert_source(&ckpt, &config, kernels, Box::new(Shared(source.clone())))
                .unwrap();
        assert_eq!(run(&model), mapped);
        let handed = source.handed.lock().unwrap().clone();
        let moe_layers = config
            .layers
            .iter()
            .filter(|l| l.ffn == crate::config::FfnKind::Moe);
        let top_k = config.moe.router.top_k;
        // Each step hands each MoE layer between 1 and top_k distinct experts.
        assert!(
            handed.len() >= moe_layers.clone().count() * tokens.len(),
            "{}",
            handed.len()
        );
        assert!(
            handed.len() <= moe_layers.count() * tokens.len() * top_k,
            "{}",
            handed.len()
        );
        drop(model);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A source that records each request: the layer and the experts asked for.
    struct Recording {
        inner: Arc<ExpertStore>,
        asked: Arc<Mutex<Vec<(usize, Vec<usize>)>>>,
    }

    impl ExpertSource<MxFp4Matrices<3>, ModelError> for Recording {
        fn home(&self, layer: usize, expert: usize) -> usize {
            ExpertStore::home(&self.inner, layer, expert)
        }

        fn experts(
            &self,
            layer: usize,
            needed: &[usize],
            hooks: ExpertHooks<'_, MxFp4Matrices<3>, ModelError>,
        ) -> Result<()> {
            self.asked.lock().unwrap().push((layer, needed.to_vec()));
            self.inner.experts(layer, needed, hooks)
        }
    }

    /// A verify pass of several tokens reads each distinct routed expert once, whatever number
    /// of its tokens chose it: the experts asked per layer are the union of what each token
    /// asks alone (counted by a recording source), the store (cache 0: every use a read) reads
    /// exactly that many, and the mapped model's count (`Model::experts_read`) says the same.
    #[test]
    fn a_pass_reads_each_distinct_expert_once() {
        use std::collections::BTreeSet;

        let dir = std::env::temp_dir().join(format!("k3-source-once-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = generate(&dir, &SynthOptions::new(Preset::Tiny))
            .unwrap()
            .config;
        let ckpt = Checkpoint::open(&dir).unwrap();
        let kernels = Kernels::detect();
        let prefix = [1usize, 500, 17];
        // The same token four times and two others: tokens that share experts.
        let pass = [7usize, 7, 7, 7, 42, 7];
        let asked = Arc::new(Mutex::new(Vec::new()));
        let inner = Arc::new(
            ExpertStore::open(
                &ckpt,
                expert_layout(&config),
                StoreConfig {
                    capacity: expert_store::Capacity::PerLayer(0),
                    ..StoreConfig::default()
                },
            )
            .unwrap(),
        );
        let model = Model::with_expert_source(
            &ckpt,
            &config,
            kernels,
            Box::new(Recording {
                inner: Arc::clone(&inner),
                asked: Arc::clone(&asked),
            }),
        )
        .unwrap();
        let mut start = model.session();
        model.prefill(&mut start, &prefix, 8).unwrap();
        // Each token alone, from the session it would see in the pass.
        let mut alone: std::collections::BTreeMap<usize, BTreeSet<usize>> = Default::default();
        let mut each = 0;
        let mut session = start.clone();
        for &token in &pass {
            asked.lock().unwrap().clear();
            model.decode_step(&mut session, token).unwrap();
            for (layer, ids) in asked.lock().unwrap().iter() {
                each += ids.len();
                alone.entry(*layer).or_default().extend(ids);
            }
        }
        // The pass.
        asked.lock().unwrap().clear();
        let loads = inner.stats().loads;
        let mut session = start.clone();
        model
            .step_rows(&mut [(&mut session, &pass[..])], &[crate::model::Want::All])
            .unwrap();
        let in_pass = asked.lock().unwrap().clone();
        assert_eq!(in_pass.len(), alone.len(), "one request per MoE layer");
        let mut distinct = 0;
        for (layer, ids) in &in_pass {
            let union: Vec<usize> = alone[layer].iter().copied().collect();
            assert_eq!(ids, &union, "layer {layer}: each distinct expert once");
            distinct += ids.len();
        }
        assert!(
            distinct < each,
            "the tokens shared no expert: {distinct} of {each}"
        );
        assert_eq!(inner.stats().loads - loads, distinct as u64, "store reads");
        // The mapping: the model counts what it asks of its source.
        let mapped = Model::new(&ckpt, &config, kernels).unwrap();
        let mut session = mapped.session();
        mapped.prefill(&mut session, &prefix, 8).unwrap();
        let before = mapped.experts_read();
        mapped
            .step_rows(&mut [(&mut session, &pass[..])], &[crate::model::Want::All])
            .unwrap();
        assert_eq!(
            mapped.experts_read() - before,
            distinct as u64,
            "mapped reads"
        );
        drop((model, mapped));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
