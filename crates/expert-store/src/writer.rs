//! Writing safetensors files the way the release does: tensors in lexicographic name order,
//! contiguous, the header padded to 8 bytes; data streamed tensor by tensor so a shard never
//! has to fit in memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::Dtype;

use crate::checkpoint::CheckpointError;

/// One tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorOut {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorOut {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes `tensors` (sorted by name here) to `path`; `fill` appends each tensor's bytes to the
/// buffer it is given, in that order. Returns the bytes of tensor data written.
pub fn write_safetensors(
    path: &Path,
    mut tensors: Vec<TensorOut>,
    mut fill: impl FnMut(&TensorOut, &mut Vec<u8>),
) -> Result<usize, CheckpointError> {
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    for t in &tensors {
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
    for t in &tensors {
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
pub fn dtype_name(dtype: Dtype) -> serde_json::Value {
    serde_json::to_value(dtype).expect("a Dtype serialises to its name")
}
