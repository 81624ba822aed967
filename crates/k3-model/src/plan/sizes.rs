//! The sizes the planner works on: every trunk tensor as stored (file, offset, bytes), which
//! part of the forward pass reads it ([`Part`]), and the experts' totals.

use std::ops::Range;
use std::path::{Path, PathBuf};

use expert_store::checkpoint::LinearStorage;
use expert_store::io::aligned_span;
use expert_store::{Checkpoint, CheckpointError};

use crate::config::K3Config;
use expert_store::Dtype;

use super::format::{FloatMatrix, PackAs, QuantFormat, TrunkFormat, requantisable};
use crate::inventory::{
    DType, KdaNames, MlaNames, MlpNames, Role, TensorClass, TensorSpec, expert_layout, text_tensors,
};

/// Reads closer than this are merged into one (the gap is read and ignored): a layer's small
/// tensors (norms, biases) lie between its matrices.
pub const MERGE_GAP: usize = 1 << 20;

/// Which part of the forward pass reads a trunk tensor; the stream's units follow it, in this
/// order within a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// Widened to f32 at load (norms, biases, conv taps, MLA's `kv_b`): never read again, so
    /// neither resident nor streamed.
    Copied,
    /// A layer's attention projections (KDA or MLA): one unit.
    Attention,
    /// A dense MLP's projections: each its own unit, read in row blocks.
    Gate,
    /// A dense MLP's up projection, likewise.
    Up,
    /// A dense MLP's down projection, likewise.
    Down,
    /// A MoE layer's router, latent projections and shared experts: one unit.
    Moe,
    /// The lm_head, read in row blocks.
    Head,
}

impl Part {
    /// Whether the part's matrix may be read and multiplied in row blocks (rows of a matmul
    /// are independent: the same bits).
    pub fn splits(self) -> bool {
        matches!(self, Part::Gate | Part::Up | Part::Down | Part::Head)
    }

    /// The part as the printed plan names it.
    pub fn name(self) -> &'static str {
        match self {
            Part::Copied => "copied",
            Part::Attention => "attention",
            Part::Gate => "gate",
            Part::Up => "up",
            Part::Down => "down",
            Part::Moe => "moe",
            Part::Head => "lm_head",
        }
    }
}

/// A stored tensor (or a row block of one): its name as stored, its file, where it lies in
/// it, its size, the part that reads it and its rows (first dimension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Its name in the checkpoint, as stored (with the release's `language_model.` prefix; an MXFP4
    /// linear's `weight_packed` or `weight_scale`).
    pub name: String,
    /// The safetensors file holding it.
    pub path: PathBuf,
    /// Byte offset of its data in that file.
    pub offset: usize,
    /// Bytes of its data (a row block's alone).
    pub bytes: u64,
    /// The part of the forward pass that reads it.
    pub part: Part,
    /// Its rows, the first dimension (a row block's alone).
    pub rows: usize,
    /// Columns of a BF16 matrix kept packed where it is resident
    /// (`mxfp4_kernels::packed`): its resident bytes are the packed form's. `None`: kept as
    /// stored.
    pub pack_cols: Option<usize>,
    /// Where the pack cache (`crate::packcache`) holds its packed body: the stream reads that
    /// instead of the BF16 bytes, and its resident bytes are the body's alone (the exception
    /// blocks and row indexes of every cached matrix are counted once, in
    /// [`WeightSizes::packed_side`]). `None`: not cached.
    pub packed_at: Option<PackedAt>,
    /// A float matrix the pass reads, which a lossy `--trunk-format` may requantise. `None`:
    /// never requantised (vectors, MXFP4, copied at load, columns not whole 32-blocks).
    pub float: Option<FloatMatrix>,
    /// The lossy format it is held resident in ([`WeightSizes::with_trunk_format`]); its
    /// resident bytes are that format's. `None`: as stored (or packed, [`Self::pack_cols`]).
    pub quant: Option<QuantFormat>,
}

/// A packed body in the pack cache: the cache file, where the whole matrix's body starts in
/// it, and the first row of the tensor (or row block) this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedAt {
    /// The pack cache file.
    pub path: PathBuf,
    /// Byte offset in the file where the whole matrix's packed body starts.
    pub body: usize,
    /// The matrix row this tensor (or row block) starts at.
    pub first_row: usize,
}

/// A matrix a pack cache file holds (see [`WeightSizes::with_packed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldPacked {
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix (a multiple of 32).
    pub cols: usize,
    /// Where its body starts in the file.
    pub body: usize,
}

/// Exception blocks (`mxfp4_kernels::packed`: 32 weights whose exponents span more than 15
/// values, kept as BF16) a packed matrix is given room for, per 10,000 blocks: 200 (2%).
/// k3-wide's BF16 matrices have 16 (0.16%); a trunk with more takes the excess from the
/// plan-sized expert cache at load, or the build is refused (`builder::take_overrun`).
pub const PACKED_EXCEPTIONS_PER_10K: usize = 200;

/// The columns of `spec`'s weight where it is kept packed when resident: a linear weight read
/// as a matrix (not copied at load), stored as BF16 (`bf16`, as the caller knows the stored
/// dtype) in a `shape` of `[rows, cols]` with whole 32-blocks. `None`: kept as stored.
fn pack_cols(bf16: bool, shape: &[usize], spec: &TensorSpec, part: Part) -> Option<usize> {
    match *shape {
        [_, cols]
            if bf16
                && spec.role() == Role::Linear
                && part != Part::Copied
                && cols.is_multiple_of(mxfp4_kernels::packed::PACKED_BLOCK) =>
        {
            Some(cols)
        }
        _ => None,
    }
}

/// `spec`'s weight as a requantisable float matrix: a linear weight read as a matrix (not
/// copied at load), stored as `dtype` (BF16, F16 or F32) in a `shape` of `[rows, cols]` with
/// whole 32-blocks. The router, the lm_head and KDA's small gate matrices are `kept`.
fn float_matrix(
    dtype: Dtype,
    shape: &[usize],
    spec: &TensorSpec,
    part: Part,
) -> Option<FloatMatrix> {
    let [_, cols] = *shape else { return None };
    let kda = spec.layer.map(KdaNames::new);
    let kept = part == Part::Head
        || spec.class == TensorClass::Router
        || kda.is_some_and(|n| [n.f_a, n.f_b, n.b].contains(&spec.name));
    (requantisable(dtype)
        && spec.role() == Role::Linear
        && part != Part::Copied
        && cols.is_multiple_of(mxfp4_kernels::codes::Q8_0_BLOCK))
    .then_some(FloatMatrix { cols, dtype, kept })
}

/// Bytes that `rows` rows of a `cols`-column BF16 matrix take packed: the body, room for
/// [`PACKED_EXCEPTIONS_PER_10K`] exception blocks, the row index, rounded up to 4 KiB.
pub fn packed_resident_bytes(rows: usize, cols: usize) -> u64 {
    let blocks = rows * (cols / mxfp4_kernels::packed::PACKED_BLOCK);
    let exceptions = (blocks * PACKED_EXCEPTIONS_PER_10K).div_ceil(10_000);
    let bytes = mxfp4_kernels::packed::packed_body_bytes(rows, cols)
        + exceptions * mxfp4_kernels::packed::EXCEPTION_BYTES
        + 4 * (rows + 1);
    bytes.next_multiple_of(expert_store::io::IO_ALIGN) as u64
}

impl StoredTensor {
    /// Bytes it takes in the resident copy (read alone with `O_DIRECT`: its range rounded
    /// out to 4 KiB).
    pub fn resident_bytes(&self) -> u64 {
        if let (Some(format), Some(m)) = (self.quant, &self.float) {
            return (format.bytes(self.rows, m.cols) as u64)
                .next_multiple_of(expert_store::io::IO_ALIGN as u64);
        }
        match (self.pack_cols, &self.packed_at) {
            // Its exception blocks and index are in `WeightSizes::packed_side`.
            (Some(cols), Some(_)) => (mxfp4_kernels::packed::packed_body_bytes(self.rows, cols)
                as u64)
                .next_multiple_of(expert_store::io::IO_ALIGN as u64),
            (Some(cols), None) => packed_resident_bytes(self.rows, cols),
            (None, _) => self.stored_bytes(),
        }
    }

    /// How it is held where resident when not as stored: requantised, or packed.
    pub fn pack_as(&self) -> Option<PackAs> {
        match (self.quant, &self.float, self.pack_cols) {
            (Some(format), Some(m), _) => Some(PackAs::Quant {
                format,
                cols: m.cols,
                dtype: m.dtype,
            }),
            (_, _, Some(cols)) => Some(PackAs::Packed { cols }),
            _ => None,
        }
    }

    /// The file and byte range a stream reads for it: its packed body where the pack cache
    /// holds one, else its bytes as stored.
    pub fn read_range(&self) -> (&std::path::Path, Range<usize>) {
        match (self.pack_cols, &self.packed_at) {
            (Some(cols), Some(at)) => {
                let row = mxfp4_kernels::packed::packed_body_bytes(1, cols);
                let start = at.body + at.first_row * row;
                (&at.path, start..start + self.rows * row)
            }
            _ => (&self.path, self.offset..self.offset + self.bytes as usize),
        }
    }

    /// Bytes of its range rounded out to 4 KiB: what a copy as stored (or the page cache of
    /// the mapping) holds.
    pub fn stored_bytes(&self) -> u64 {
        aligned_span(&(self.offset..self.offset + self.bytes as usize)).1 as u64
    }

    /// Rows `rows` of it (its bytes split evenly over its rows).
    pub fn row_block(&self, rows: Range<usize>) -> Self {
        let per_row = self.bytes as usize / self.rows.max(1);
        Self {
            offset: self.offset + rows.start * per_row,
            bytes: (rows.len() * per_row) as u64,
            rows: rows.len(),
            packed_at: self.packed_at.as_ref().map(|at| PackedAt {
                first_row: at.first_row + rows.start,
                ..at.clone()
            }),
            ..self.clone()
        }
    }
}

/// The reads that fetch `tensors` (in file order; each where [`StoredTensor::read_range`]
/// says): one per run of tensors in one file whose gaps are at most [`MERGE_GAP`].
pub fn merged_reads(tensors: &[StoredTensor]) -> Vec<(PathBuf, Range<usize>)> {
    let mut reads: Vec<(PathBuf, Range<usize>)> = Vec::new();
    for t in tensors {
        let (at, range) = t.read_range();
        match reads.last_mut() {
            Some((path, r))
                if path == at && r.end <= range.start && range.start - r.end <= MERGE_GAP =>
            {
                r.end = range.end;
            }
            _ => reads.push((at.to_owned(), range)),
        }
    }
    reads
}

/// Bytes `O_DIRECT` reads of `tensors` cover (each merged read rounded out to 4 KiB).
pub fn read_bytes(tensors: &[StoredTensor]) -> u64 {
    merged_reads(tensors)
        .iter()
        .map(|(_, r)| aligned_span(r).1 as u64)
        .sum()
}

/// The sizes the planner splits a budget over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSizes {
    /// Read every token outside the layers: lm_head and the output norms.
    pub head: Vec<StoredTensor>,
    /// Each decoder layer's trunk tensors (all but the routed experts), in file order.
    pub layers: Vec<Vec<StoredTensor>>,
    /// The embedding table, and the bytes of one row of it (read per token).
    pub embed: u64,
    /// Bytes of one row of the embedding table.
    pub embed_row: u64,
    /// Every routed expert's buffer bytes summed, and the largest one.
    pub expert_total: u64,
    /// The largest routed expert's buffer bytes: what one expert read buffer holds.
    pub expert_largest: u64,
    /// Routed experts per MoE layer (one entry per MoE layer).
    pub experts_per_layer: Vec<usize>,
    /// Experts each token selects per MoE layer.
    pub top_k: usize,
    /// Bytes the pack cache's exception blocks and row indexes take, for every matrix it
    /// holds (resident or streamed, they are kept in memory): 0 without one.
    pub packed_side: u64,
}

/// The part of the forward pass that reads `name` (of `class`, `role`, in `layer`).
fn part_of(name: &str, class: TensorClass, role: Role, layer: Option<usize>) -> Part {
    if role != Role::Linear {
        return Part::Copied;
    }
    match (class, layer) {
        (TensorClass::LmHead, _) => Part::Head,
        (TensorClass::MlaAttention, Some(l)) if name == MlaNames::new(l).kv_b => Part::Copied,
        (TensorClass::KdaAttention | TensorClass::MlaAttention, _) => Part::Attention,
        (TensorClass::DenseMlp, Some(l)) => {
            let n = MlpNames::dense(l);
            if name == n.gate {
                Part::Gate
            } else if name == n.up {
                Part::Up
            } else {
                Part::Down
            }
        }
        (TensorClass::Router | TensorClass::LatentProjections | TensorClass::SharedExperts, _) => {
            Part::Moe
        }
        _ => Part::Copied,
    }
}

impl WeightSizes {
    /// No tensor yet, for `config`'s layers and routing.
    fn empty(config: &K3Config) -> Self {
        Self {
            head: Vec::new(),
            layers: vec![Vec::new(); config.num_layers()],
            embed: 0,
            embed_row: 0,
            expert_total: 0,
            expert_largest: 0,
            experts_per_layer: Vec::new(),
            top_k: config.moe.router.top_k,
            packed_side: 0,
        }
    }

    /// The sizes of `ckpt`'s tensors as stored (any dtype; an MXFP4 linear is two tensors).
    pub fn new(ckpt: &Checkpoint, config: &K3Config) -> Result<Self, CheckpointError> {
        let mut sizes = Self::empty(config);
        for spec in text_tensors(config) {
            let part = part_of(&spec.name, spec.class, spec.role(), spec.layer);
            let rows = spec.shape.first().copied().unwrap_or(1);
            let stored = |name: &str| {
                ckpt.tensor(name).map(|t| StoredTensor {
                    name: t.name.to_owned(),
                    path: t.path.to_owned(),
                    offset: t.offset,
                    bytes: t.bytes.len() as u64,
                    part,
                    rows,
                    pack_cols: pack_cols(
                        t.dtype == expert_store::Dtype::BF16 && t.shape.first() == Some(&rows),
                        t.shape,
                        &spec,
                        part,
                    ),
                    packed_at: None,
                    float: float_matrix(t.dtype, t.shape, &spec, part)
                        .filter(|_| t.shape.first() == Some(&rows)),
                    quant: None,
                })
            };
            let tensors: Vec<StoredTensor> = match ckpt.linear_format(&spec.name) {
                Ok(LinearStorage::MxFp4(base)) if spec.role() == Role::Linear => {
                    [".weight_packed", ".weight_scale"]
                        .iter()
                        .filter_map(|suffix| stored(&format!("{base}{suffix}")))
                        .collect()
                }
                _ => stored(&spec.name).into_iter().collect(),
            };
            match (spec.class, spec.layer) {
                (TensorClass::RoutedExperts, _) => {}
                (TensorClass::Embedding, _) => {
                    sizes.embed = tensors.iter().map(|t| t.bytes).sum();
                    sizes.embed_row = sizes.embed / config.vocab_size.max(1) as u64;
                }
                (_, Some(layer)) => sizes.layers[layer].extend(tensors),
                (_, None) => sizes.head.extend(tensors),
            }
        }
        for layer in sizes.layers.iter_mut().chain([&mut sizes.head]) {
            layer.sort_by(|a, b| (&a.path, a.offset).cmp(&(&b.path, b.offset)));
        }
        let table = ckpt.expert_table(&expert_layout(config))?;
        let mut per_layer = std::collections::BTreeMap::<usize, usize>::new();
        for (&(layer, _), location) in &table {
            let bytes = expert_store::store::buffer_bytes(location);
            sizes.expert_total += bytes;
            sizes.expert_largest = sizes.expert_largest.max(bytes);
            *per_layer.entry(layer).or_default() += 1;
        }
        sizes.experts_per_layer = per_layer.into_values().collect();
        Ok(sizes)
    }

    /// The sizes of a checkpoint of `config` stored as the inventory says, without one: every
    /// tensor in the config's dtype, one file per layer (the head and embedding in their
    /// own), tensors back to back in inventory order. For plans of checkpoints not at hand
    /// (`cargo xtask k3-plan --machine-gb`).
    pub fn of_config(config: &K3Config) -> Self {
        let mut sizes = Self::empty(config);
        let mut offsets = vec![0usize; config.num_layers() + 1];
        let mut experts = std::collections::BTreeMap::<usize, u64>::new();
        for spec in text_tensors(config) {
            let bytes = spec.bytes();
            match (spec.class, spec.layer) {
                (TensorClass::RoutedExperts, layer) => {
                    *experts.entry(layer.unwrap_or(0)).or_default() += bytes as u64;
                }
                (TensorClass::Embedding, _) => {
                    sizes.embed = bytes as u64;
                    sizes.embed_row = bytes as u64 / config.vocab_size.max(1) as u64;
                }
                (_, layer) => {
                    let file = layer.unwrap_or(config.num_layers());
                    let part = part_of(&spec.name, spec.class, spec.role(), spec.layer);
                    let tensor = StoredTensor {
                        name: spec.name.clone(),
                        path: PathBuf::from(format!("part-{file:03}.safetensors")),
                        offset: offsets[file],
                        bytes: bytes as u64,
                        part,
                        rows: spec.shape.first().copied().unwrap_or(1),
                        // Packed where resident, as `WeightSizes::new` marks a real checkpoint's.
                        pack_cols: pack_cols(spec.dtype == DType::Bf16, &spec.shape, &spec, part),
                        packed_at: None,
                        float: float_matrix(
                            match spec.dtype {
                                DType::Bf16 => Dtype::BF16,
                                DType::F32 => Dtype::F32,
                                DType::U8 => Dtype::U8,
                            },
                            &spec.shape,
                            &spec,
                            part,
                        ),
                        quant: None,
                    };
                    offsets[file] += bytes;
                    match layer {
                        Some(l) => sizes.layers[l].push(tensor),
                        None => sizes.head.push(tensor),
                    }
                }
            }
        }
        let one = expert_layout(config).expert_bytes() as u64;
        sizes.expert_largest = one;
        sizes.expert_total = experts.values().sum();
        sizes.experts_per_layer = experts
            .values()
            .map(|&b| (b / one.max(1)) as usize)
            .collect();
        sizes
    }

    /// Every trunk tensor a decode reads after load (the head's and every layer's, not the
    /// ones widened to f32 at load), with its layer (the layer count for the head).
    pub fn read_tensors(&self) -> impl Iterator<Item = (usize, &StoredTensor)> {
        let head = self.layers.len();
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.iter().map(move |t| (i, t)))
            .chain(self.head.iter().map(move |t| (head, t)))
            .filter(|(_, t)| t.part != Part::Copied)
    }

    /// The same sizes with every matrix kept resident as stored (`--no-pack-trunk`).
    pub fn unpacked(mut self) -> Self {
        for layer in self.layers.iter_mut().chain([&mut self.head]) {
            for t in layer {
                t.pack_cols = None;
                t.packed_at = None;
            }
        }
        self.packed_side = 0;
        self
    }

    /// The same sizes with the matrices `format` requantises held in its format
    /// ([`StoredTensor::quant`]; none for the exact `bf16`). A requantised matrix is held
    /// resident, never streamed from the pack cache: its packed place is cleared.
    pub fn with_trunk_format(mut self, format: TrunkFormat) -> Self {
        for layer in self.layers.iter_mut().chain([&mut self.head]) {
            for t in layer {
                t.quant = t.float.as_ref().and_then(|m| format.for_matrix(m));
                if t.quant.is_some() {
                    t.pack_cols = None;
                    t.packed_at = None;
                }
            }
        }
        self
    }

    /// Whether any matrix is held requantised (a lossy `--trunk-format`).
    pub fn requantised(&self) -> bool {
        self.requantised_bytes().0 > 0
    }

    /// The bytes of the matrices held requantised as stored, and in their format.
    pub fn requantised_bytes(&self) -> (u64, u64) {
        let held = |t: &StoredTensor| match (t.quant, &t.float) {
            (Some(format), Some(m)) => (t.bytes, format.bytes(t.rows, m.cols) as u64),
            _ => (0, 0),
        };
        self.read_tensors()
            .map(|(_, t)| held(t))
            .fold((0, 0), |(s, h), (a, b)| (s + a, h + b))
    }

    /// Every matrix kept packed or requantised where resident ([`StoredTensor::pack_as`]),
    /// whole, in file order: what a pack cache holds.
    pub fn packable(&self) -> Vec<&StoredTensor> {
        let mut all: Vec<&StoredTensor> = self
            .read_tensors()
            .map(|(_, t)| t)
            .filter(|t| t.pack_as().is_some())
            .collect();
        all.sort_by(|a, b| (&a.path, a.offset).cmp(&(&b.path, b.offset)));
        all
    }

    /// The same sizes with the matrices a pack cache file at `path` holds read from it where
    /// streamed ([`StoredTensor::packed_at`]), and `side_bytes` (its exception blocks and
    /// indexes, held in memory) counted in [`Self::packed_side`]. `held` gives, by tensor
    /// name, the shape the file holds a matrix in and where its body starts; a matrix held in
    /// another shape than the plan's is read as stored.
    pub fn with_packed(
        mut self,
        path: &Path,
        side_bytes: u64,
        held: impl Fn(&str) -> Option<HeldPacked>,
    ) -> Self {
        for layer in self.layers.iter_mut().chain([&mut self.head]) {
            for t in layer {
                if let (Some(cols), Some(held)) = (t.pack_cols, held(&t.name))
                    && held.cols == cols
                    && held.rows == t.rows
                {
                    t.packed_at = Some(PackedAt {
                        path: path.to_owned(),
                        body: held.body,
                        first_row: 0,
                    });
                }
            }
        }
        self.packed_side = side_bytes;
        self
    }

    /// The same sizes as if a pack cache held every matrix kept packed (for plans of a
    /// checkpoint not at hand, as `cargo xtask k3-plan` makes them): their bodies in one file
    /// in file order, their exception blocks counted at [`PACKED_EXCEPTIONS_PER_10K`].
    pub fn with_projected_pack_cache(mut self) -> Self {
        let (mut at, mut side) = (expert_store::io::IO_ALIGN, 0u64);
        for layer in self.layers.iter_mut().chain([&mut self.head]) {
            for t in layer.iter_mut() {
                // Set only on matrices the pass reads (`pack_cols`), never on copied ones.
                let Some(cols) = t.pack_cols else { continue };
                t.packed_at = Some(PackedAt {
                    path: PathBuf::from("k3-packed.bin"),
                    body: at,
                    first_row: 0,
                });
                let body = mxfp4_kernels::packed::packed_body_bytes(t.rows, cols);
                at += body.next_multiple_of(expert_store::io::IO_ALIGN);
                side += packed_resident_bytes(t.rows, cols) - body as u64;
            }
        }
        self.packed_side = side;
        self
    }

    /// How each tensor not kept as stored is held where resident, by stored name: packed
    /// (lossless) or requantised.
    pub fn packed_cols(&self) -> std::collections::HashMap<String, PackAs> {
        self.layers
            .iter()
            .chain([&self.head])
            .flatten()
            .filter_map(|t| Some((t.name.clone(), t.pack_as()?)))
            .collect()
    }

    /// The trunk's bytes as stored: what the mapping holds of what a decode reads.
    pub fn trunk_stored_bytes(&self) -> u64 {
        self.read_tensors().map(|(_, t)| t.stored_bytes()).sum()
    }

    /// The trunk's bytes as the resident copy holds them: what a decode reads of the head
    /// and of every layer.
    pub fn trunk_resident_bytes(&self) -> u64 {
        self.read_tensors().map(|(_, t)| t.resident_bytes()).sum()
    }
}
