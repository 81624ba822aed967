//! Writing safetensors files the way the release does: tensors in lexicographic name order,
//! contiguous, the header padded to 8 bytes; data streamed tensor by tensor so a shard never
//! has to fit in memory. [`reshard`] rewrites a checkpoint's tensors into other shards (a
//! user's re-sharded copy: an expert's tensors may then straddle files).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::Dtype;

use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::open::Checkpoint;

/// One tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorOut {
    /// Its name in the header.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl TensorOut {
    /// Bytes of its data.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes `tensors` (sorted by name here) to `path`; `fill` appends each tensor's bytes to the
/// buffer it is given, in that order. Returns the bytes of tensor data written.
pub fn write_safetensors(
    path: &Path,
    mut tensors: Vec<TensorOut>,
    fill: impl FnMut(&TensorOut, &mut Vec<u8>),
) -> Result<usize, CheckpointError> {
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    write_safetensors_in_order(path, &tensors, fill)
}

/// [`write_safetensors`] with the data in the order of `tensors` (not sorted by name).
pub(crate) fn write_safetensors_in_order(
    path: &Path,
    tensors: &[TensorOut],
    mut fill: impl FnMut(&TensorOut, &mut Vec<u8>),
) -> Result<usize, CheckpointError> {
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.bytes();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": dtype_name(t.dtype), "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let io = |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    };
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(text.as_bytes()).map_err(io)?;
    let mut buf = Vec::new();
    for t in tensors {
        buf.clear();
        fill(t, &mut buf);
        if buf.len() != t.bytes() {
            return Err(CheckpointError::Mismatch {
                path: path.to_owned(),
                tensor: t.name.clone(),
                expected: format!("{} bytes", t.bytes()),
                found: format!("{} bytes from the generator", buf.len()),
            });
        }
        out.write_all(&buf).map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(offset)
}

/// The dtype's name in a safetensors header (`"BF16"`, `"F32"`, `"U8"`, ...).
pub(crate) fn dtype_name(dtype: Dtype) -> serde_json::Value {
    serde_json::to_value(dtype).expect("a Dtype serialises to its name")
}

/// How [`reshard`] lays a checkpoint's tensors out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReshardLayout {
    /// Tensor bytes per shard at most (a larger tensor gets a shard of its own).
    pub max_shard_bytes: usize,
    /// Shuffle the tensors with this seed before cutting them into shards (`None`: name
    /// order, the release's). A shuffle splits experts' tensors over shards and, within a
    /// shard, apart.
    pub shuffle_seed: Option<u64>,
}

/// What [`reshard`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardReport {
    /// Shard files written.
    pub shards: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: usize,
}

/// Writes every tensor of the checkpoint in `src` into `dst` (created if needed) as shards of
/// `layout` with an index, and copies the directory's other files (config, tokenizer) as
/// they are. The tensors' names, dtypes, shapes and bytes are unchanged.
pub fn reshard(
    src: &Path,
    dst: &Path,
    layout: ReshardLayout,
) -> Result<ReshardReport, CheckpointError> {
    let ckpt = Checkpoint::open(src)?;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| CheckpointError::Io { path, source }
    };
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let mut names: Vec<&str> = ckpt.tensor_names().collect();
    names.sort_unstable();
    if let Some(seed) = layout.shuffle_seed {
        let mut state = seed;
        for i in (1..names.len()).rev() {
            let j = (splitmix64(&mut state) % (i as u64 + 1)) as usize;
            names.swap(i, j);
        }
    }
    let mut shards: Vec<Vec<TensorOut>> = Vec::new();
    let mut filled = usize::MAX;
    for name in names {
        let t = ckpt.tensor(name).ok_or_else(|| CheckpointError::Missing {
            tensor: name.to_owned(),
        })?;
        let out = TensorOut {
            name: t.name.to_owned(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
        };
        if filled.saturating_add(t.bytes.len()) > layout.max_shard_bytes || shards.is_empty() {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += t.bytes.len();
        shards.last_mut().expect("pushed above").push(out);
    }
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    let (mut bytes, mut tensors) = (0, 0);
    for (k, outs) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{count:05}.safetensors", k + 1);
        for out in outs {
            weight_map.insert(out.name.clone(), file.clone().into());
        }
        tensors += outs.len();
        bytes += write_safetensors_in_order(&dst.join(&file), outs, |t, buf| {
            if let Some(source) = ckpt.tensor(&t.name) {
                buf.extend_from_slice(source.bytes);
            }
        })?;
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": bytes }, "weight_map": weight_map });
    let index_path = dst.join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).map_err(io(&index_path))?;
    for entry in std::fs::read_dir(src).map_err(io(src))? {
        let entry = entry.map_err(io(src))?;
        let name = entry.file_name();
        let text = name.to_string_lossy();
        let weights = text.ends_with(".safetensors") || text == "model.safetensors.index.json";
        if !weights && entry.file_type().map_err(io(&entry.path()))?.is_file() {
            std::fs::copy(entry.path(), dst.join(&name)).map_err(io(&entry.path()))?;
        }
    }
    Ok(ReshardReport {
        shards: count,
        tensors,
        bytes,
    })
}

/// SplitMix64: a small, well-mixed sequence for the shuffle (no dependency, same on every
/// platform).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
