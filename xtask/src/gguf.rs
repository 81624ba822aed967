//! A streaming GGUF (version 3) writer: metadata key/values, tensor infos, then each tensor's
//! bytes in order, every tensor aligned to 32 bytes, as llama.cpp's `gguf-py` lays files out.
//! The header is written first from the declared tensor infos; each tensor's bytes are then
//! produced one at a time and checked against the size its info declared, so a checkpoint far
//! larger than memory converts in one pass.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;
/// `GGUF_DEFAULT_ALIGNMENT`: tensor data starts, and every tensor's bytes are padded, to this.
pub(crate) const ALIGNMENT: u64 = 32;

/// The ggml tensor types this writer emits (`ggml_type` / `GGMLQuantizationType` numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GgmlType {
    F32,
    Bf16,
    /// `block_q8_0`: 32 elements in 34 bytes (an F16 step and 32 int8 codes).
    Q8_0,
    /// `block_mxfp4`: 32 elements in 17 bytes (an E8M0 scale and 16 bytes of codes).
    Mxfp4,
}

impl GgmlType {
    pub(crate) fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::Q8_0 => 8,
            GgmlType::Bf16 => 30,
            GgmlType::Mxfp4 => 39,
        }
    }

    /// Bytes of a tensor whose innermost dimension is `ne[0]`.
    pub(crate) fn nbytes(self, ne: &[u64]) -> Result<u64> {
        let count: u64 = ne.iter().product();
        Ok(match self {
            GgmlType::F32 => count * 4,
            GgmlType::Bf16 => count * 2,
            GgmlType::Q8_0 | GgmlType::Mxfp4 => {
                ensure!(
                    ne.first().is_some_and(|n| n % 32 == 0),
                    "a {self:?} tensor's rows must hold a multiple of 32 values, not {ne:?}"
                );
                let block_bytes = if self == GgmlType::Q8_0 { 34 } else { 17 };
                count / 32 * block_bytes
            }
        })
    }
}

/// A metadata value (`GGUFValueType`), with the types gguf-py picks for Python values: ints in
/// lists are INT32, floats FLOAT32.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    I32s(Vec<i32>),
    Strs(Vec<String>),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U32(_) => 4,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::I32s(_) | Value::Strs(_) => 9,
        }
    }
}

/// One tensor as the header declares it: `ne` in ggml order (innermost first, the reverse of
/// a row-major shape).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TensorInfo {
    pub(crate) name: String,
    pub(crate) ne: Vec<u64>,
    pub(crate) ty: GgmlType,
}

fn pad(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) -> Result<()> {
    match value {
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::Str(s) => put_str(out, s),
        Value::I32s(v) => {
            ensure!(!v.is_empty(), "a gguf array cannot be empty");
            out.extend_from_slice(&5u32.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            v.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        Value::Strs(v) => {
            ensure!(!v.is_empty(), "a gguf array cannot be empty");
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            v.iter().for_each(|s| put_str(out, s));
        }
    }
    Ok(())
}

/// The header: magic, version, counts, key/values, tensor infos with their data offsets, and
/// the padding up to the data section.
fn header(kv: &[(String, Value)], tensors: &[TensorInfo]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (i, (key, value)) in kv.iter().enumerate() {
        if kv[..i].iter().any(|(k, _)| k == key) {
            bail!("gguf key {key:?} given twice");
        }
        put_str(&mut out, key);
        out.extend_from_slice(&value.type_id().to_le_bytes());
        put_value(&mut out, value)?;
    }
    let mut offset = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|o| o.name == t.name) {
            bail!("gguf tensor {:?} given twice", t.name);
        }
        ensure!(
            !t.ne.is_empty() && t.ne.len() <= 4,
            "tensor {:?} has {} dimensions, gguf allows 1 to 4",
            t.name,
            t.ne.len()
        );
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        t.ne.iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes()));
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset += pad(t.ty.nbytes(&t.ne)?);
    }
    out.resize(pad(out.len() as u64) as usize, 0);
    Ok(out)
}

/// Counts what passes through, so each tensor's bytes can be checked against its info.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes a GGUF file: [`Writer::create`] writes the header, then [`Writer::tensor`] once per
/// declared tensor, in the declared order, then [`Writer::finish`].
pub(crate) struct Writer {
    out: Counting<BufWriter<File>>,
    tensors: Vec<TensorInfo>,
    next: usize,
    path: std::path::PathBuf,
}

impl Writer {
    pub(crate) fn create(
        path: &Path,
        kv: &[(String, Value)],
        tensors: Vec<TensorInfo>,
    ) -> Result<Self> {
        let head = header(kv, &tensors)?;
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = Counting {
            inner: BufWriter::with_capacity(8 << 20, file),
            written: 0,
        };
        out.write_all(&head)?;
        Ok(Self {
            out,
            tensors,
            next: 0,
            path: path.to_owned(),
        })
    }

    /// Writes the next tensor's bytes with `fill`, checks their count and pads.
    pub(crate) fn tensor(&mut self, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
        let info = self
            .tensors
            .get(self.next)
            .with_context(|| {
                format!(
                    "all {} declared tensors are already written",
                    self.tensors.len()
                )
            })?
            .clone();
        let start = self.out.written;
        fill(&mut self.out).with_context(|| format!("writing tensor {}", info.name))?;
        let wrote = self.out.written - start;
        let expected = info.ty.nbytes(&info.ne)?;
        ensure!(
            wrote == expected,
            "tensor {} got {wrote} bytes, its info declares {expected}",
            info.name
        );
        let padded = pad(wrote);
        self.out.write_all(&vec![0u8; (padded - wrote) as usize])?;
        self.next += 1;
        Ok(())
    }

    /// Flushes the file; fails if a declared tensor was not written.
    pub(crate) fn finish(mut self) -> Result<()> {
        ensure!(
            self.next == self.tensors.len(),
            "{} of {} declared tensors written to {}",
            self.next,
            self.tensors.len(),
            self.path.display()
        );
        self.out.flush()?;
        self.out.inner.get_ref().sync_all()?;
        Ok(())
    }
}

/// f32 to bf16 as gguf-py's `quants` does: round to nearest even; a NaN stays a quiet NaN.
pub(crate) fn bf16_from_f32(x: f32) -> u16 {
    let mut n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        n = (n & 0xffff_0000) | (64 << 16);
    }
    ((u64::from(n) + 0x7fff + u64::from((n >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal independent reader of what the writer produced.
    pub(crate) struct Parsed {
        /// Key, value type, and the value's bytes (an array: its element type, then elements;
        /// strings in arrays end with a 0 here).
        pub(crate) kv: Vec<(String, u32, Vec<u8>)>,
        /// Name, ne, type, offset from the data section.
        pub(crate) tensors: Vec<(String, Vec<u64>, u32, u64)>,
        pub(crate) data_start: usize,
    }

    struct Cursor<'a> {
        bytes: &'a [u8],
        at: usize,
    }

    impl<'a> Cursor<'a> {
        fn take(&mut self, n: usize) -> &'a [u8] {
            self.at += n;
            &self.bytes[self.at - n..self.at]
        }
        fn u32(&mut self) -> u32 {
            u32::from_le_bytes(self.take(4).try_into().unwrap())
        }
        fn u64(&mut self) -> u64 {
            u64::from_le_bytes(self.take(8).try_into().unwrap())
        }
        fn string(&mut self) -> &'a [u8] {
            let len = self.u64() as usize;
            self.take(len)
        }
    }

    pub(crate) fn parse(bytes: &[u8]) -> Parsed {
        let mut c = Cursor { bytes, at: 0 };
        assert_eq!(c.take(4), b"GGUF");
        assert_eq!(c.u32(), 3);
        let n_tensors = c.u64();
        let n_kv = c.u64();
        let mut kv = Vec::new();
        for _ in 0..n_kv {
            let key = String::from_utf8(c.string().to_vec()).unwrap();
            let ty = c.u32();
            let raw = match ty {
                4 | 6 => c.take(4).to_vec(),
                7 => c.take(1).to_vec(),
                8 => c.string().to_vec(),
                9 => {
                    let sub = c.u32();
                    let count = c.u64();
                    let mut raw = sub.to_le_bytes().to_vec();
                    for _ in 0..count {
                        match sub {
                            5 => raw.extend_from_slice(c.take(4)),
                            8 => {
                                raw.extend_from_slice(c.string());
                                raw.push(0);
                            }
                            other => panic!("array of type {other}"),
                        }
                    }
                    raw
                }
                other => panic!("value type {other}"),
            };
            kv.push((key, ty, raw));
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let name = String::from_utf8(c.string().to_vec()).unwrap();
            let dims = c.u32() as usize;
            let ne = (0..dims).map(|_| c.u64()).collect();
            let ty = c.u32();
            let offset = c.u64();
            tensors.push((name, ne, ty, offset));
        }
        Parsed {
            kv,
            tensors,
            data_start: c.at.div_ceil(32) * 32,
        }
    }

    #[test]
    fn a_written_file_reads_back_with_aligned_tensors() {
        let dir = std::env::temp_dir().join(format!("k3-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.gguf");
        let kv = vec![
            (
                "general.architecture".to_string(),
                Value::Str("kimi-k3".into()),
            ),
            ("a.count".to_string(), Value::U32(7)),
            ("a.eps".to_string(), Value::F32(1e-5)),
            ("a.flag".to_string(), Value::Bool(true)),
            ("a.kv".to_string(), Value::I32s(vec![0, 1])),
            (
                "a.tokens".to_string(),
                Value::Strs(vec!["x".into(), "yz".into()]),
            ),
        ];
        let tensors = vec![
            TensorInfo {
                name: "v".into(),
                ne: vec![3],
                ty: GgmlType::F32,
            },
            TensorInfo {
                name: "m".into(),
                ne: vec![2, 2],
                ty: GgmlType::Bf16,
            },
            TensorInfo {
                name: "q".into(),
                ne: vec![32, 1, 2],
                ty: GgmlType::Mxfp4,
            },
        ];
        let mut w = Writer::create(&path, &kv, tensors).unwrap();
        w.tensor(|o| Ok(o.write_all(&[1u8; 12])?)).unwrap();
        w.tensor(|o| Ok(o.write_all(&[2u8; 8])?)).unwrap();
        // A wrong byte count is refused with both numbers.
        let mut bad = Writer::create(
            &dir.join("bad.gguf"),
            &kv,
            vec![TensorInfo {
                name: "v".into(),
                ne: vec![3],
                ty: GgmlType::F32,
            }],
        )
        .unwrap();
        let e = bad
            .tensor(|o| Ok(o.write_all(&[0u8; 8])?))
            .unwrap_err()
            .to_string();
        assert!(e.contains("8 bytes") && e.contains("12"), "{e}");
        w.tensor(|o| Ok(o.write_all(&[3u8; 34])?)).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let p = parse(&bytes);
        let keys: Vec<_> = p.kv.iter().map(|(k, t, _)| (k.as_str(), *t)).collect();
        assert_eq!(
            keys,
            [
                ("general.architecture", 8),
                ("a.count", 4),
                ("a.eps", 6),
                ("a.flag", 7),
                ("a.kv", 9),
                ("a.tokens", 9)
            ]
        );
        assert_eq!(p.kv[0].2, b"kimi-k3");
        assert_eq!(p.kv[1].2, 7u32.to_le_bytes());
        assert_eq!(p.kv[2].2, 1e-5f32.to_le_bytes());
        assert_eq!(p.kv[3].2, [1]);
        assert_eq!(p.kv[4].2, [5, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(p.kv[5].2, [8, 0, 0, 0, b'x', 0, b'y', b'z', 0]);
        assert_eq!(p.tensors[0], ("v".into(), vec![3], 0, 0));
        assert_eq!(p.tensors[1], ("m".into(), vec![2, 2], 30, 32));
        assert_eq!(p.tensors[2], ("q".into(), vec![32, 1, 2], 39, 64));
        assert_eq!(p.data_start % 32, 0);
        let d = p.data_start;
        assert_eq!(&bytes[d..d + 12], &[1u8; 12]);
        assert_eq!(&bytes[d + 12..d + 32], &[0u8; 20]);
        assert_eq!(&bytes[d + 32..d + 40], &[2u8; 8]);
        assert_eq!(&bytes[d + 64..d + 98], &[3u8; 34]);
        assert_eq!(bytes.len(), d + 128);
    }

    #[test]
    fn block_types_take_whole_blocks_per_row() {
        assert_eq!(GgmlType::Q8_0.nbytes(&[64, 3]).unwrap(), 2 * 3 * 34);
        assert_eq!(GgmlType::Mxfp4.nbytes(&[64, 3]).unwrap(), 2 * 3 * 17);
        let e = GgmlType::Q8_0.nbytes(&[48, 2]).unwrap_err().to_string();
        assert!(e.contains("Q8_0") && e.contains("48"), "{e}");
    }

    #[test]
    fn duplicate_keys_and_tensors_are_refused() {
        let kv = vec![
            ("k".to_string(), Value::U32(1)),
            ("k".to_string(), Value::U32(2)),
        ];
        assert!(header(&kv, &[]).unwrap_err().to_string().contains("\"k\""));
        let t = TensorInfo {
            name: "t".into(),
            ne: vec![1],
            ty: GgmlType::F32,
        };
        assert!(header(&[], &[t.clone(), t]).is_err());
    }

    #[test]
    fn bf16_rounds_to_nearest_even_like_gguf_py() {
        assert_eq!(bf16_from_f32(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: to even (down); 1 + 3*2^-8: up.
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_from_f32(f32::NAN) & 0x7fc0, 0x7fc0);
        assert_eq!(bf16_from_f32(f32::INFINITY), 0x7f80);
        // Widening bf16 and rounding back is the identity.
        for b in [0x0001u16, 0x3f80, 0xbf80, 0x7f7f, 0x8000] {
            assert_eq!(bf16_from_f32(f32::from_bits(u32::from(b) << 16)), b);
        }
    }
}
