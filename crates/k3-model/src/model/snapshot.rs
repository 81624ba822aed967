//! Snapshots of a [`Session`]: a copy of everything a later token reads (KDA states and conv
//! windows, the MLA latent cache and `k_pe` up to the position, the position), restored by a
//! copy into a session of the same model; no token is recomputed. Because prefill and decode
//! are bit-identical whatever the chunking or batching, a session restored from a snapshot at
//! position `p` then fed tokens `p..` gives the same logits bits as one fed `0..` cold.
//!
//! The AttnRes banks are not state: they live inside one forward pass, per token.
//!
//! [`file`](mod@file) writes and reads snapshot files (header, identity, checksum).

pub mod file;

use super::forward::Model;
use super::session::{KdaState, MlaCache, Session};
use crate::config::{AttentionKind, K3Config};

/// Bytes of one `f32` of state.
const F32_BYTES: usize = 4;

/// Why a snapshot cannot be restored into a session (or a file does not hold one).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    /// The snapshot comes from a model with another number of layers.
    #[error("the snapshot has {found} layers, the session {expected}")]
    Layers {
        /// The session's layers.
        expected: usize,
        /// The snapshot's layers.
        found: usize,
    },
    /// A layer's token mixer differs between the snapshot and the session.
    #[error("layer {layer}: the snapshot holds {found} state, the session {expected}")]
    LayerKind {
        /// The layer, 0-based.
        layer: usize,
        /// The session's kind: `"kda"`, `"mla"` or `"no"`.
        expected: &'static str,
        /// The snapshot's kind, spelled the same way.
        found: &'static str,
    },
    /// A layer's array has another length than this model gives it at the snapshot's
    /// position (another model's widths, or a damaged snapshot).
    #[error("layer {layer}: the snapshot's {part} has {found} values, the session's {expected}")]
    Size {
        /// The layer, 0-based.
        layer: usize,
        /// The array: `"q conv window"`, `"kda state"`, `"mla latent"`, `"mla k_pe"`, ...
        part: &'static str,
        /// `f32`s it should hold.
        expected: usize,
        /// `f32`s it holds.
        found: usize,
    },
}

/// The state of a session at one position, owned and immutable: restore it into any number
/// of sessions of the same model (share it behind an `Arc`).
#[derive(Debug, Clone)]
pub struct Snapshot {
    state: Session,
}

impl Snapshot {
    /// Tokens the snapshot covers (the position a restored session is at).
    pub fn position(&self) -> usize {
        self.state.position
    }

    /// Bytes of state held (every `f32` of KDA states, conv windows and MLA cache rows);
    /// equals [`state_bytes`] of the model's config at [`Self::position`].
    pub fn bytes(&self) -> usize {
        let kda: usize = self
            .state
            .kda
            .iter()
            .flatten()
            .map(|s| s.windows.iter().map(Vec::len).sum::<usize>() + s.state.len())
            .sum();
        let mla: usize = self
            .state
            .mla
            .iter()
            .flatten()
            .map(|c| c.latent.len() + c.k_pe.len())
            .sum();
        (kda + mla) * F32_BYTES
    }

    /// A layer's state, in layer order: what [`file`] writes.
    pub(crate) fn layers(&self) -> impl Iterator<Item = LayerState<'_>> {
        self.state
            .kda
            .iter()
            .zip(&self.state.mla)
            .map(|(kda, mla)| match (kda, mla) {
                (Some(k), _) => LayerState::Kda {
                    windows: [&k.windows[0], &k.windows[1], &k.windows[2]],
                    state: &k.state,
                },
                (None, Some(m)) => LayerState::Mla {
                    latent: &m.latent,
                    k_pe: &m.k_pe,
                },
                (None, None) => LayerState::Empty,
            })
    }

    /// A snapshot from its parts (what [`file`] read); shapes are checked at restore.
    pub(crate) fn from_layers(position: usize, layers: Vec<OwnedLayer>) -> Self {
        let mut kda = Vec::with_capacity(layers.len());
        let mut mla = Vec::with_capacity(layers.len());
        for layer in layers {
            match layer {
                OwnedLayer::Kda { windows, state } => {
                    kda.push(Some(KdaState { windows, state }));
                    mla.push(None);
                }
                OwnedLayer::Mla { latent, k_pe } => {
                    kda.push(None);
                    mla.push(Some(MlaCache {
                        latent: latent.into(),
                        k_pe: k_pe.into(),
                    }));
                }
                OwnedLayer::Empty => {
                    kda.push(None);
                    mla.push(None);
                }
            }
        }
        Self {
            state: Session {
                position,
                kda,
                mla,
                journal: None,
                spare: None,
                mirror: Default::default(),
            },
        }
    }
}

/// One layer's state, borrowed from a snapshot.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LayerState<'s> {
    Kda {
        windows: [&'s [f32]; 3],
        state: &'s [f32],
    },
    Mla {
        latent: &'s [f32],
        k_pe: &'s [f32],
    },
    Empty,
}

/// One layer's state, owned (read from a file).
#[derive(Debug)]
pub(crate) enum OwnedLayer {
    Kda {
        windows: [Vec<f32>; 3],
        state: Vec<f32>,
    },
    Mla {
        latent: Vec<f32>,
        k_pe: Vec<f32>,
    },
    Empty,
}

impl Session {
    /// A copy of this session's state at its current position.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            state: Session {
                position: self.position,
                kda: self.kda.clone(),
                mla: self.mla.clone(),
                journal: None,
                spare: None,
                mirror: Default::default(),
            },
        }
    }

    /// Makes this session the snapshot's state (a copy into its buffers, which are reused):
    /// it then continues exactly as the session the snapshot was taken from. The snapshot
    /// must come from a session of a model with this session's layer shapes; otherwise the
    /// error names the first difference and this session is left unchanged.
    pub fn restore(&mut self, snapshot: &Snapshot) -> Result<(), SnapshotError> {
        let from = &snapshot.state;
        self.check(from)?;
        self.commit();
        // Overwritten: the other ranks' mirror of the old sequence no longer matches.
        self.mirror.forget();
        for (to, from) in self.kda.iter_mut().zip(&from.kda) {
            if let (Some(to), Some(from)) = (to, from) {
                for (w, f) in to.windows.iter_mut().zip(&from.windows) {
                    w.copy_from_slice(f);
                }
                to.state.copy_from_slice(&from.state);
            }
        }
        for (to, from) in self.mla.iter_mut().zip(&from.mla) {
            if let (Some(to), Some(from)) = (to, from) {
                to.latent.clone_from(&from.latent);
                to.k_pe.clone_from(&from.k_pe);
            }
        }
        self.position = from.position;
        Ok(())
    }

    /// Whether `other`'s layers have this session's kinds and fixed sizes, and its MLA caches
    /// one row per position.
    fn check(&self, other: &Session) -> Result<(), SnapshotError> {
        if other.kda.len() != self.kda.len() || other.mla.len() != self.mla.len() {
            return Err(SnapshotError::Layers {
                expected: self.kda.len(),
                found: other.kda.len().max(other.mla.len()),
            });
        }
        let kind = |s: &Session, i: usize| match (&s.kda[i], &s.mla[i]) {
            (Some(_), _) => "kda",
            (None, Some(_)) => "mla",
            (None, None) => "no",
        };
        let size = |layer, part, expected: usize, found: usize| {
            if expected == found {
                Ok(())
            } else {
                Err(SnapshotError::Size {
                    layer,
                    part,
                    expected,
                    found,
                })
            }
        };
        for layer in 0..self.kda.len() {
            let (expected, found) = (kind(self, layer), kind(other, layer));
            if expected != found {
                return Err(SnapshotError::LayerKind {
                    layer,
                    expected,
                    found,
                });
            }
            if let (Some(a), Some(b)) = (&self.kda[layer], &other.kda[layer]) {
                for (w, (x, y)) in a.windows.iter().zip(&b.windows).enumerate() {
                    let part = ["q conv window", "k conv window", "v conv window"][w];
                    size(layer, part, x.len(), y.len())?;
                }
                size(layer, "kda state", a.state.len(), b.state.len())?;
            }
            if let Some(b) = &other.mla[layer] {
                // One row per position (the widths are checked against the config by
                // [`Model::restore`]).
                for (part, values) in [("mla latent", &b.latent), ("mla k_pe", &b.k_pe)] {
                    let rows_ok = match other.position {
                        0 => values.is_empty(),
                        p => values.len() % p == 0,
                    };
                    if !rows_ok {
                        return Err(SnapshotError::Size {
                            layer,
                            part,
                            expected: values.len().next_multiple_of(other.position.max(1)),
                            found: values.len(),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

impl Model<'_> {
    /// [`Session::restore`] after checking the snapshot's MLA rows against this model's
    /// config (`kv_lora_rank` and `qk_rope_head_dim` values per position): a snapshot of
    /// another model with the same layer kinds is refused here.
    pub fn restore(&self, session: &mut Session, snapshot: &Snapshot) -> Result<(), SnapshotError> {
        let m = &self.config.mla;
        let position = snapshot.position();
        for (layer, cache) in snapshot.state.mla.iter().enumerate() {
            if let Some(c) = cache {
                let parts = [
                    ("mla latent", c.latent.len(), position * m.kv_lora_rank),
                    ("mla k_pe", c.k_pe.len(), position * m.qk_rope_head_dim),
                ];
                for (part, found, expected) in parts {
                    if found != expected {
                        return Err(SnapshotError::Size {
                            layer,
                            part,
                            expected,
                            found,
                        });
                    }
                }
            }
        }
        session.restore(snapshot)
    }
}

/// Bytes of a session's state after `tokens` tokens under `config`: per KDA layer three conv
/// windows of `(conv_kernel - 1) × heads × head_dim` and a `heads × head_dim × head_dim`
/// state; per MLA layer `tokens × (kv_lora_rank + qk_rope_head_dim)` cache values; all `f32`.
pub fn state_bytes(config: &K3Config, tokens: usize) -> usize {
    let kda_layers = config
        .layers
        .iter()
        .filter(|l| l.attention == AttentionKind::Kda)
        .count();
    let mla_layers = config.layers.len() - kda_layers;
    let k = &config.kda;
    let kda = 3 * (k.conv_kernel - 1) * config.kda_width() + k.num_heads * k.head_dim * k.head_dim;
    let mla = tokens * (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim);
    (kda_layers * kda + mla_layers * mla) * F32_BYTES
}

#[cfg(test)]
mod tests;
