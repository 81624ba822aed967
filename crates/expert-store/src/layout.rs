//! A routed expert's layout, supplied by the caller: how many MXFP4 matrices an expert has,
//! each one's shape, and the names of its packed-codes and scales tensors as patterns over
//! `{layer}` and `{expert}`. The checkpoint's expert table ([`crate::Checkpoint::expert_table`])
//! finds experts by these names and the store ([`crate::ExpertStore`]) validates and hands out
//! these matrices; neither knows any model's names.
//!
//! Every matrix is MXFP4 in the compressed-tensors layout (packed codes `[rows, cols/2]` U8,
//! E8M0 scales `[rows, cols/32]` U8), the format the kernels' expert path takes
//! ([`mxfp4_kernels::MxFp4Matrix`]); an expert's tensors are numbered matrix by matrix, codes
//! then scales ([`ExpertLayout::tensor`]).

use std::fmt;

/// A layout the store cannot use, naming the pattern or matrix at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A tensor-name pattern without `{layer}` and `{expert}` exactly once each.
    #[error("tensor-name pattern {pattern:?}: {reason}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A layout of no matrix.
    #[error("an expert layout needs at least one matrix, found 0")]
    NoMatrices,
    /// Two of a layout's tensors named by one pattern.
    #[error("matrix {what}: tensor-name pattern {pattern:?} is used twice in the layout")]
    DuplicatePattern {
        /// The matrix whose tensor repeats an earlier pattern.
        what: &'static str,
        /// The pattern.
        pattern: String,
    },
}

/// A tensor name with `{layer}` and `{expert}` in it, each exactly once (in either order):
/// `model.layers.{layer}.mlp.experts.{expert}.gate.codes`. Names are relative to the text model
/// (a checkpoint's `language_model.` prefix is stripped before matching).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamePattern {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Layer,
    Expert,
}

impl NamePattern {
    /// Parses `text`. Refused: a placeholder missing or repeated, two placeholders back to
    /// back or a placeholder followed by a digit (the number's end would be ambiguous), and
    /// any other `{`/`}`.
    pub fn new(text: &str) -> Result<Self, LayoutError> {
        let bad = |reason: &str| LayoutError::Pattern {
            pattern: text.to_owned(),
            reason: reason.to_owned(),
        };
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let (part, len) = if rest.starts_with("{layer}") {
                (Part::Layer, "{layer}".len())
            } else if rest.starts_with("{expert}") {
                (Part::Expert, "{expert}".len())
            } else {
                let end = rest.find('{').unwrap_or(rest.len());
                if end == 0 || rest[..end].contains('}') {
                    return Err(bad("only {layer} and {expert} may appear in braces"));
                }
                (Part::Literal(rest[..end].to_owned()), end)
            };
            if matches!(parts.last(), Some(Part::Layer | Part::Expert)) {
                match &part {
                    Part::Layer | Part::Expert => {
                        return Err(bad("two placeholders are back to back"));
                    }
                    Part::Literal(lit) if lit.starts_with(|c: char| c.is_ascii_digit()) => {
                        return Err(bad("a placeholder is followed by a digit"));
                    }
                    Part::Literal(_) => {}
                }
            }
            parts.push(part);
            rest = &rest[len..];
        }
        for (placeholder, which) in [("{layer}", Part::Layer), ("{expert}", Part::Expert)] {
            let count = parts.iter().filter(|p| **p == which).count();
            if count != 1 {
                return Err(bad(&format!(
                    "{placeholder} must appear exactly once, found {count} times"
                )));
            }
        }
        Ok(Self {
            text: text.to_owned(),
            parts,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The name of expert `expert` of layer `layer`.
    pub fn name(&self, layer: usize, expert: usize) -> String {
        let mut out = String::with_capacity(self.text.len());
        for part in &self.parts {
            match part {
                Part::Literal(lit) => out.push_str(lit),
                Part::Layer => out.push_str(&layer.to_string()),
                Part::Expert => out.push_str(&expert.to_string()),
            }
        }
        out
    }

    /// `(layer, expert)` if `name` is this pattern's name for them. Numbers are written as
    /// [`Self::name`] writes them (no sign, no leading zero), so a match names one expert.
    pub fn parse(&self, name: &str) -> Option<(usize, usize)> {
        let (mut layer, mut expert) = (None, None);
        let mut rest = name;
        for part in &self.parts {
            match part {
                Part::Literal(lit) => rest = rest.strip_prefix(lit.as_str())?,
                Part::Layer | Part::Expert => {
                    let digits =
                        rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
                    let number = &rest[..digits];
                    if number.is_empty() || (number.len() > 1 && number.starts_with('0')) {
                        return None;
                    }
                    let value = number.parse().ok()?;
                    if *part == Part::Layer {
                        layer = Some(value);
                    } else {
                        expert = Some(value);
                    }
                    rest = &rest[digits..];
                }
            }
        }
        rest.is_empty().then_some((layer?, expert?))
    }
}

impl fmt::Display for NamePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// One MXFP4 matrix of a routed expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixLayout {
    /// Its name in errors (`"expert w1 (gate)"`).
    pub what: &'static str,
    /// Its packed codes, U8 `[rows, cols/2]`.
    pub codes: NamePattern,
    /// Its E8M0 scales, U8 `[rows, cols/32]`.
    pub scales: NamePattern,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, a multiple of 32).
    pub cols: usize,
}

impl MatrixLayout {
    /// A matrix whose codes and scales tensors are named by `codes` and `scales`.
    pub fn new(
        what: &'static str,
        codes: &str,
        scales: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self, LayoutError> {
        Ok(Self {
            what,
            codes: NamePattern::new(codes)?,
            scales: NamePattern::new(scales)?,
            rows,
            cols,
        })
    }

    /// Bytes of its two tensors (`cols` a multiple of 32, as MXFP4 needs).
    pub fn bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / 32
    }
}

/// A routed expert's matrices, in the order [`crate::Expert::matrices`] hands them out.
///
/// # Example: a model that is not K3
///
/// Experts of two matrices, `up` `[64, 32]` and `down` `[32, 64]`, stored as
/// `blk.{layer}.ffn_{up,down}.{expert}.{q,s}` (codes, scales), served by the store:
///
/// ```
/// use expert_store::writer::{TensorOut, write_safetensors};
/// use expert_store::{
///     Capacity, Checkpoint, Dtype, ExpertLayout, ExpertStore, MatrixLayout, StoreConfig,
/// };
///
/// let matrix = |what, name: &str, rows, cols| {
///     let pattern = |part: &str| format!("blk.{{layer}}.{name}.{{expert}}.{part}");
///     MatrixLayout::new(what, &pattern("q"), &pattern("s"), rows, cols)
/// };
/// let layout = ExpertLayout::new(vec![
///     matrix("up", "ffn_up", 64, 32)?,
///     matrix("down", "ffn_down", 32, 64)?,
/// ])?;
///
/// // A checkpoint of layer 0's four experts; codes from each name, scales 127 (2^0).
/// let dir = std::env::temp_dir().join(format!("expert-store-layout-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let mut tensors = Vec::new();
/// for expert in 0..4 {
///     for m in layout.matrices() {
///         let u8s = |name: String, cols| TensorOut { name, dtype: Dtype::U8, shape: vec![m.rows, cols] };
///         tensors.push(u8s(m.codes.name(0, expert), m.cols / 2));
///         tensors.push(u8s(m.scales.name(0, expert), m.cols / 32));
///     }
/// }
/// write_safetensors(&dir.join("model.safetensors"), tensors, |t, buf| {
///     let seed = t.name.bytes().fold(0u8, |h, b| h.wrapping_mul(31).wrapping_add(b));
///     let scales = t.name.ends_with(".s");
///     buf.extend((0..t.bytes()).map(|i| if scales { 127 } else { seed ^ i as u8 }));
/// })?;
///
/// let ckpt = Checkpoint::open(&dir)?;
/// assert_eq!(ckpt.expert_table(&layout)?.len(), 4);
/// let config = StoreConfig { capacity: Capacity::PerLayer(2), io_threads: 1, ..StoreConfig::default() };
/// let store = ExpertStore::open(&ckpt, layout, config)?;
/// let mut request = store.request(0, &[3]);
/// let (index, expert) = request.next_batch().pop().expect("one expert asked for");
/// let expert = expert?;
/// let [up, down] = expert.matrices() else { panic!("two matrices") };
/// assert_eq!((index, up.rows(), up.cols(), down.rows(), down.cols()), (0, 64, 32, 32, 64));
/// assert!(up.packed() == ckpt.require("blk.0.ffn_up.3.q")?.bytes);
/// assert!(down.packed() == ckpt.require("blk.0.ffn_down.3.q")?.bytes);
/// assert!(down.scales() == ckpt.require("blk.0.ffn_down.3.s")?.bytes);
/// assert_eq!(store.stats().loads, 1);
/// std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    matrices: Vec<MatrixLayout>,
}

impl ExpertLayout {
    /// A layout of `matrices` (at least one; no tensor-name pattern used twice). Shapes are
    /// checked when an expert's bytes are viewed (`cols` must be a multiple of 32).
    pub fn new(matrices: Vec<MatrixLayout>) -> Result<Self, LayoutError> {
        if matrices.is_empty() {
            return Err(LayoutError::NoMatrices);
        }
        let layout = Self { matrices };
        for (i, pattern) in layout.tensors().enumerate() {
            if layout.tensors().take(i).any(|p| p == pattern) {
                return Err(LayoutError::DuplicatePattern {
                    what: layout.matrices[i / 2].what,
                    pattern: pattern.to_string(),
                });
            }
        }
        Ok(layout)
    }

    /// The matrices, in the order a landed expert hands them out.
    pub fn matrices(&self) -> &[MatrixLayout] {
        &self.matrices
    }

    /// Tensors per expert: two per matrix.
    pub fn tensor_count(&self) -> usize {
        2 * self.matrices.len()
    }

    /// Tensor `i` of an expert: matrix `i / 2`'s codes (`i` even) or scales (`i` odd).
    pub fn tensor(&self, i: usize) -> &NamePattern {
        let matrix = &self.matrices[i / 2];
        if i.is_multiple_of(2) {
            &matrix.codes
        } else {
            &matrix.scales
        }
    }

    /// Every tensor's pattern, in [`Self::tensor`] order.
    pub fn tensors(&self) -> impl Iterator<Item = &NamePattern> {
        self.matrices.iter().flat_map(|m| [&m.codes, &m.scales])
    }

    /// `((layer, expert), tensor index)` if `name` is one of an expert's tensors (the first
    /// pattern that matches, in [`Self::tensor`] order).
    pub fn parse(&self, name: &str) -> Option<((usize, usize), usize)> {
        self.tensors()
            .enumerate()
            .find_map(|(i, pattern)| Some((pattern.parse(name)?, i)))
    }

    /// Bytes of one expert's tensors.
    pub fn expert_bytes(&self) -> usize {
        self.matrices.iter().map(MatrixLayout::bytes).sum()
    }
}

impl fmt::Display for ExpertLayout {
    /// `2 MXFP4 matrices: up [64, 32] (codes, scales), down [32, 64] (codes, scales)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} MXFP4 matrices: ", self.matrices.len())?;
        for (i, m) in self.matrices.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "{} [{}, {}] ({}, {})",
                m.what, m.rows, m.cols, m.codes, m.scales
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_names_and_parses_both_ways_round() {
        let p = NamePattern::new("blk.{layer}.ffn.{expert}.up").unwrap();
        assert_eq!(p.name(3, 17), "blk.3.ffn.17.up");
        assert_eq!(p.parse("blk.3.ffn.17.up"), Some((3, 17)));
        let swapped = NamePattern::new("e{expert}_l{layer}").unwrap();
        assert_eq!(swapped.name(2, 40), "e40_l2");
        assert_eq!(swapped.parse("e40_l2"), Some((2, 40)));
        for other in [
            "blk.3.ffn.17.up.x",
            "blk.3.ffn.17.upx",
            "blk..ffn.17.up",
            "blk.03.ffn.17.up",
            "blk.-3.ffn.17.up",
            "xblk.3.ffn.17.up",
        ] {
            assert_eq!(p.parse(other), None, "{other}");
        }
        assert_eq!(p.parse("blk.0.ffn.0.up"), Some((0, 0)));
    }

    #[test]
    fn bad_patterns_are_refused_with_the_reason() {
        for (text, why) in [
            (
                "layers.{layer}.w1",
                "{expert} must appear exactly once, found 0",
            ),
            (
                "{layer}.{expert}.{layer}",
                "{layer} must appear exactly once, found 2",
            ),
            ("{layer}{expert}", "back to back"),
            ("{layer}.{expert}7", "followed by a digit"),
            ("{layer}.{expert}.{name}", "braces"),
            ("{layer}.}{expert}", "braces"),
        ] {
            let err = NamePattern::new(text).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains(text), "{text}: {err}");
        }
    }

    #[test]
    fn a_layout_numbers_its_tensors_codes_then_scales() {
        let m = |what, w: &str| {
            MatrixLayout::new(
                what,
                &format!("{{layer}}.{{expert}}.{w}.q"),
                &format!("{{layer}}.{{expert}}.{w}.s"),
                64,
                32,
            )
            .unwrap()
        };
        let layout = ExpertLayout::new(vec![m("a", "a"), m("b", "b")]).unwrap();
        assert_eq!(layout.tensor_count(), 4);
        assert_eq!(layout.tensor(3).as_str(), "{layer}.{expert}.b.s");
        assert_eq!(layout.parse("1.2.a.s"), Some(((1, 2), 1)));
        assert_eq!(layout.parse("1.2.b.q"), Some(((1, 2), 2)));
        assert_eq!(layout.parse("1.2.c.q"), None);
        assert_eq!(layout.expert_bytes(), 2 * (64 * 16 + 64));
        assert_eq!(ExpertLayout::new(Vec::new()), Err(LayoutError::NoMatrices));
        let twice = ExpertLayout::new(vec![m("a", "a"), m("b", "a")]).unwrap_err();
        assert!(
            twice.to_string().contains("{layer}.{expert}.a.q"),
            "{twice}"
        );
    }
}
