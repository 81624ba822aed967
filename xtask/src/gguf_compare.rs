//! `cargo xtask gguf-compare --ours FILE --peer FILE`: checks that every Q8_0 tensor of our
//! GGUF has the same ne, type and bytes in another GGUF (llama.cpp's `llama-quantize` output of
//! the same checkpoint): the independent check of `gguf --outtype q8_0`'s blocks. Reads any
//! GGUF v3 header (every metadata value type, `general.alignment`), then the tensors' bytes in
//! bounded chunks, and names the first block that differs.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

use crate::{Options, from_root};

/// `GGML_TYPE_Q8_0` and its block.
const Q8_0: u32 = 8;
const Q8_0_BLOCK_BYTES: u64 = 34;

/// One tensor as a GGUF header declares it.
#[derive(Debug, Clone)]
pub(crate) struct Info {
    pub(crate) name: String,
    pub(crate) ne: Vec<u64>,
    pub(crate) ty: u32,
    /// From the start of the file.
    pub(crate) offset: u64,
}

/// A GGUF header: its tensors and the file they are in.
pub(crate) struct Header {
    pub(crate) tensors: Vec<Info>,
    pub(crate) file_type: Option<u32>,
    pub(crate) path: PathBuf,
}

struct Reader<R> {
    inner: R,
    at: u64,
}

impl<R: Read> Reader<R> {
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut b = vec![0; n];
        self.inner.read_exact(&mut b)?;
        self.at += n as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        ensure!(len < 1 << 24, "a gguf string of {len} bytes");
        Ok(String::from_utf8_lossy(&self.bytes(len as usize)?).into_owned())
    }
    /// A value of `GGUFValueType` `ty`; integers up to 32 bits are returned, others skipped.
    fn value(&mut self, ty: u32) -> Result<Option<u64>> {
        let fixed = |ty| match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match ty {
            8 => {
                self.string()?;
                Ok(None)
            }
            9 => {
                let (sub, count) = (self.u32()?, self.u64()?);
                for _ in 0..count {
                    self.value(sub)?;
                }
                Ok(None)
            }
            _ => {
                let n = fixed(ty).with_context(|| format!("gguf value type {ty}"))?;
                let b = self.bytes(n)?;
                Ok(match ty {
                    4 | 5 => Some(u64::from(u32::from_le_bytes(b.try_into().unwrap()))),
                    _ => None,
                })
            }
        }
    }
}

/// Reads the header of the GGUF at `path`.
pub(crate) fn read_header(path: &Path) -> Result<Header> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut r = Reader {
        inner: BufReader::new(file),
        at: 0,
    };
    ensure!(
        r.bytes(4)? == b"GGUF",
        "{} is not a gguf file",
        path.display()
    );
    let version = r.u32()?;
    ensure!(
        version == 3,
        "{} is gguf version {version}, not 3",
        path.display()
    );
    let (n_tensors, n_kv) = (r.u64()?, r.u64()?);
    let (mut alignment, mut file_type) = (32, None);
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty)?;
        match key.as_str() {
            "general.alignment" => alignment = value.context("general.alignment")?,
            "general.file_type" => file_type = value.map(|v| v as u32),
            _ => {}
        }
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string()?;
        let dims = r.u32()?;
        ensure!((1..=4).contains(&dims), "{name} has {dims} dimensions");
        let ne = (0..dims).map(|_| r.u64()).collect::<Result<_>>()?;
        let (ty, offset) = (r.u32()?, r.u64()?);
        tensors.push(Info {
            name,
            ne,
            ty,
            offset,
        });
    }
    let data = r.at.div_ceil(alignment) * alignment;
    tensors.iter_mut().for_each(|t| t.offset += data);
    Ok(Header {
        tensors,
        file_type,
        path: path.to_owned(),
    })
}

/// What comparing one tensor found.
enum Outcome {
    Same,
    /// The first differing block: its index and both files' 34 bytes.
    Differs(u64, Vec<u8>, Vec<u8>),
}

/// Compares `len` bytes at two offsets, 32 MiB at a time (a whole number of blocks).
fn compare(a: &mut File, at_a: u64, b: &mut File, at_b: u64, len: u64) -> Result<Outcome> {
    const CHUNK: u64 = Q8_0_BLOCK_BYTES << 20;
    a.seek(SeekFrom::Start(at_a))?;
    b.seek(SeekFrom::Start(at_b))?;
    let (mut buf_a, mut buf_b) = (Vec::new(), Vec::new());
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK) as usize;
        buf_a.resize(n, 0);
        buf_b.resize(n, 0);
        a.read_exact(&mut buf_a)?;
        b.read_exact(&mut buf_b)?;
        if buf_a != buf_b {
            let i = (0..n).find(|&i| buf_a[i] != buf_b[i]).unwrap();
            let block = i / Q8_0_BLOCK_BYTES as usize * Q8_0_BLOCK_BYTES as usize;
            let end = block + Q8_0_BLOCK_BYTES as usize;
            return Ok(Outcome::Differs(
                (done + block as u64) / Q8_0_BLOCK_BYTES,
                buf_a[block..end].to_vec(),
                buf_b[block..end].to_vec(),
            ));
        }
        done += n as u64;
    }
    Ok(Outcome::Same)
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = Options::parse(args, &["ours", "peer"])?;
    let ours = read_header(&from_root(
        o.get("ours").context("--ours FILE is required")?,
    ))?;
    let peer = read_header(&from_root(
        o.get("peer").context("--peer FILE is required")?,
    ))?;
    println!(
        "{}: {} tensors, file type {:?}; {}: {} tensors, file type {:?}",
        ours.path.display(),
        ours.tensors.len(),
        ours.file_type,
        peer.path.display(),
        peer.tensors.len(),
        peer.file_type
    );
    let (mut file_a, mut file_b) = (File::open(&ours.path)?, File::open(&peer.path)?);
    let (mut same, mut bytes, mut problems) = (0usize, 0u64, Vec::new());
    for t in ours.tensors.iter().filter(|t| t.ty == Q8_0) {
        let Some(p) = peer.tensors.iter().find(|p| p.name == t.name) else {
            problems.push(format!("{}: not in the peer file", t.name));
            continue;
        };
        if (p.ty, &p.ne) != (Q8_0, &t.ne) {
            problems.push(format!(
                "{}: ours q8_0 {:?}, the peer's type {} {:?}",
                t.name, t.ne, p.ty, p.ne
            ));
            continue;
        }
        let len = t.ne.iter().product::<u64>() / 32 * Q8_0_BLOCK_BYTES;
        match compare(&mut file_a, t.offset, &mut file_b, p.offset, len)? {
            Outcome::Same => {
                same += 1;
                bytes += len;
            }
            Outcome::Differs(block, a, b) => problems.push(format!(
                "{}: block {block} (row {}) differs: ours {a:02x?}, the peer's {b:02x?}",
                t.name,
                block * 32 / t.ne[0]
            )),
        }
    }
    let q8_in_peer_only: Vec<&str> = peer
        .tensors
        .iter()
        .filter(|p| {
            p.ty == Q8_0
                && !ours
                    .tensors
                    .iter()
                    .any(|t| t.name == p.name && t.ty == Q8_0)
        })
        .map(|p| p.name.as_str())
        .collect();
    println!(
        "{same} q8_0 tensors byte-identical ({:.3} MB); the peer also has {} q8_0 tensors ours keeps in another type{}",
        bytes as f64 / 1e6,
        q8_in_peer_only.len(),
        if q8_in_peer_only.is_empty() {
            String::new()
        } else {
            format!(
                " ({}{})",
                q8_in_peer_only[..q8_in_peer_only.len().min(8)].join(", "),
                if q8_in_peer_only.len() > 8 {
                    ", ..."
                } else {
                    ""
                }
            )
        }
    );
    for p in &problems {
        println!("  {p}");
    }
    if !problems.is_empty() {
        bail!(
            "{} of our q8_0 tensors differ from the peer's",
            problems.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgmlType, TensorInfo, Value, Writer};

    #[test]
    fn the_header_reads_back_what_the_writer_wrote() {
        let dir = std::env::temp_dir().join(format!("k3-gguf-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.gguf");
        let kv = vec![
            ("general.file_type".to_string(), Value::U32(7)),
            ("a.tokens".to_string(), Value::Strs(vec!["x".into()])),
            ("a.eps".to_string(), Value::F32(1e-5)),
        ];
        let infos = vec![
            TensorInfo {
                name: "v".into(),
                ne: vec![3],
                ty: GgmlType::F32,
            },
            TensorInfo {
                name: "q".into(),
                ne: vec![32, 2],
                ty: GgmlType::Q8_0,
            },
        ];
        let mut w = Writer::create(&path, &kv, infos).unwrap();
        w.tensor(|o| Ok(o.write_all(&[1u8; 12])?)).unwrap();
        w.tensor(|o| Ok(o.write_all(&[2u8; 68])?)).unwrap();
        w.finish().unwrap();
        let h = read_header(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(h.file_type, Some(7));
        let q = &h.tensors[1];
        assert_eq!(
            (q.name.as_str(), &q.ne[..], q.ty),
            ("q", &[32u64, 2][..], Q8_0)
        );
        assert_eq!(q.offset - h.tensors[0].offset, 32);
        assert_eq!(&bytes[q.offset as usize..][..68], &[2u8; 68]);
    }
}
