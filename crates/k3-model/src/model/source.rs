//! Where routed experts come from: the [`ExpertSource`] seam between the forward pass and
//! expert storage, and its two implementations, `MappedExperts` (the checkpoint's file
//! mapping, what [`super::Model::new`] uses) and [`StoreExperts`] (an [`ExpertStore`]).
//!
//! `Model` holds a `Box<dyn ExpertSource>` rather than being generic over it: a type
//! parameter would change the `Model<'a>` every caller names, and the indirect calls are few
//! and coarse. Per MoE layer and forward pass there is one call to [`ExpertSource::experts`]
//! and one to [`ExpertHooks::run`] per batch of ready experts (one batch when mapped); with
//! home placement [`ExpertSource::home`] is called once per expert task to pick its domain,
//! and each such task multiplies a block of an expert's rows (tens of KiB of weights at the
//! least), next to which an indirect call is noise. Nothing per row, per token or per weight
//! goes through the trait.

use std::sync::Arc;

use expert_store::ExpertStore;
use mxfp4_kernels::MxFp4Matrix;

use super::error::Result;

/// Ready experts: id and its gate, up and down matrices.
pub type ExpertBatch<'m> = [(usize, [MxFp4Matrix<'m>; 3])];

/// The callbacks through which an [`ExpertSource`] hands a layer's routed experts to the
/// forward pass.
pub struct ExpertHooks<'h> {
    /// Work to overlap with loads (the shared experts): called at most once, before the first
    /// wait, and only when some expert is not ready.
    pub overlap: &'h mut dyn FnMut() -> Result<()>,
    /// Wraps each wait for experts to land (the model charges it to its load-wait bucket).
    pub wait: &'h dyn Fn(&mut dyn FnMut()),
    /// Computes a batch of ready experts.
    pub run: &'h mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
}

impl std::fmt::Debug for ExpertHooks<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertHooks").finish_non_exhaustive()
    }
}

/// A supplier of routed experts' MXFP4 matrices. Where the matrices come from cannot change
/// a bit of the logits: outputs go to fixed slots, whatever the batches and their order.
pub trait ExpertSource: Send + Sync {
    /// The domain expert `expert` of checkpoint layer `layer` calls home (the caller takes it
    /// modulo its pool's domains); used with [`super::ExpertPlacement::Home`].
    fn home(&self, layer: usize, expert: usize) -> usize;

    /// Hands every expert of `needed` (distinct ids of checkpoint layer `layer`, ascending) to
    /// `hooks.run` exactly once, in batches of experts ready to compute. An expert that cannot
    /// be read fails the call (this step; the model carries on).
    fn experts(&self, layer: usize, needed: &[usize], hooks: ExpertHooks<'_>) -> Result<()>;
}

/// Routed experts read through the checkpoint's file mapping: every expert is always ready.
pub(super) struct MappedExperts<'a> {
    /// By checkpoint layer (empty for dense layers), by expert id: gate, up, down.
    pub(super) layers: Vec<Vec<[MxFp4Matrix<'a>; 3]>>,
}

impl ExpertSource for MappedExperts<'_> {
    /// Round-robin by id.
    fn home(&self, _layer: usize, expert: usize) -> usize {
        expert
    }

    fn experts(&self, layer: usize, needed: &[usize], hooks: ExpertHooks<'_>) -> Result<()> {
        let experts: Vec<(usize, [MxFp4Matrix<'_>; 3])> =
            needed.iter().map(|&e| (e, self.layers[layer][e])).collect();
        (hooks.run)(&experts)
    }
}

/// Routed experts served by an [`ExpertStore`] (opened with [`super::expert_layout`]).
pub struct StoreExperts(pub Arc<ExpertStore>);

impl std::fmt::Debug for StoreExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreExperts")
            .field("layout", &self.0.layout())
            .finish_non_exhaustive()
    }
}

impl StoreExperts {
    /// The error for a store whose experts are not K3's three matrices.
    fn not_k3(&self) -> super::error::ModelError {
        super::error::ModelError::StoreLayout {
            store: self.0.layout().to_string(),
            config: "K3's 3 MXFP4 matrices (gate, up, down)".to_owned(),
        }
    }
}

impl ExpertSource for StoreExperts {
    /// The expert's home in the store ([`ExpertStore::place`]).
    fn home(&self, layer: usize, expert: usize) -> usize {
        self.0.home(layer, expert)
    }

    fn experts(&self, layer: usize, needed: &[usize], hooks: ExpertHooks<'_>) -> Result<()> {
        // All of the layer's experts at once: misses load in file order while the shared
        // experts and then the resident experts compute; each missing one runs as it lands.
        // Outputs go to fixed slots, so arrival order is invisible.
        let mut request = self.0.request(layer, needed);
        if request.pending() > 0 {
            (hooks.overlap)()?;
        }
        loop {
            let mut batch = Vec::new();
            (hooks.wait)(&mut || batch = request.next_batch());
            if batch.is_empty() {
                break;
            }
            let guards = batch
                .into_iter()
                .map(|(i, expert)| Ok((needed[i], expert?)))
                .collect::<Result<Vec<_>>>()?;
            let experts = guards
                .iter()
                .map(|(e, g)| {
                    let matrices = <[MxFp4Matrix<'_>; 3]>::try_from(g.matrices());
                    Ok((*e, matrices.map_err(|_| self.not_k3())?))
                })
                .collect::<Result<Vec<_>>>()?;
            (hooks.run)(&experts)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use expert_store::{Checkpoint, StoreConfig};
    use mxfp4_kernels::Kernels;

    use super::*;
    use crate::model::{Model, expert_layout, fingerprint};
    use crate::synth::{Preset, SynthOptions, generate};

    /// A source of its own, plugged in through [`Model::with_expert_source`]: it wraps a store
    /// and hands each expert to the model alone, in reverse order, after the overlap work, and
    /// counts what it handed out.
    struct OneByOneReversed {
        inner: StoreExperts,
        handed: Mutex<Vec<(usize, usize)>>,
    }

    impl ExpertSource for OneByOneReversed {
        fn home(&self, layer: usize, expert: usize) -> usize {
            self.inner.home(layer, expert)
        }

        fn experts(&self, layer: usize, needed: &[usize], hooks: ExpertHooks<'_>) -> Result<()> {
            assert!(needed.windows(2).all(|w| w[0] < w[1]), "{needed:?}");
            (hooks.overlap)()?;
            let run = hooks.run;
            let mut inner = |batch: &ExpertBatch<'_>| -> Result<()> {
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
            inner: StoreExperts(Arc::new(store.unwrap())),
            handed: Mutex::new(Vec::new()),
        });
        struct Shared(Arc<OneByOneReversed>);
        impl ExpertSource for Shared {
            fn home(&self, layer: usize, expert: usize) -> usize {
                self.0.home(layer, expert)
            }
            fn experts(
                &self,
                layer: usize,
                needed: &[usize],
                hooks: ExpertHooks<'_>,
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
}
