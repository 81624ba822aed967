//! Frozen MXFP4 oracle: every tier's `dequant_mxfp4` must reproduce, bit for bit, the decode
//! that `cargo xtask oracle-mxfp4` froze from independent references (compressed-tensors packs
//! and quantises, ml_dtypes decodes), including -0.0, f32 subnormals and overflow to ±inf.

use mxfp4_kernels::{GROUP, Kernels, MxFp4Matrix, Tier};
use sha2::{Digest, Sha256};

const ORACLE_FILE: &str = "mxfp4_oracle.json";
const ORACLE_JSON: &str = include_str!("../data/mxfp4_oracle.json");
/// `sha256sum` line for the JSON, written by the xtask: a hand-edited vector fails here.
const ORACLE_SHA256: &str = include_str!("../data/mxfp4_oracle.json.sha256");
/// Every E8M0 byte but 0xFF (NaN, rejected by `MxFp4Matrix::new`).
const VALID_SCALE_BYTES: usize = 255;
/// Never produced by a decode of a valid scale (it is a NaN), so a slot a kernel forgot to
/// write cannot match the oracle by luck.
const UNWRITTEN: u32 = 0xFFFF_FFFF;

#[derive(Debug)]
struct OracleTensor {
    name: String,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    /// Expected f32 bit patterns, row-major `[rows, cols]`.
    bits: Vec<u32>,
}

#[test]
fn oracle_json_matches_committed_sha256() {
    check_sha256();
}

#[test]
fn oracle_dequant_is_bit_exact_in_every_tier() {
    let tensors = load_oracle();
    let tiers = Kernels::available();
    assert!(
        tiers.iter().any(|k| k.tier() == Tier::Scalar),
        "the scalar tier is always available"
    );

    // Count what the vector exercises, so the test cannot pass on a truncated or trivial file.
    let mut seen = [[false; 16]; 256];
    for t in &tensors {
        for (i, &byte) in t.packed.iter().enumerate() {
            let (row, col) = (i / (t.cols / 2), 2 * (i % (t.cols / 2)));
            let scale = t.scales[row * (t.cols / GROUP) + col / GROUP] as usize;
            seen[scale][(byte & 0xF) as usize] = true;
            seen[scale][(byte >> 4) as usize] = true;
        }
    }
    let scales_seen = seen.iter().filter(|codes| codes.iter().any(|&s| s)).count();
    let pairs_seen = seen.iter().flatten().filter(|&&s| s).count();
    assert_eq!(
        scales_seen, VALID_SCALE_BYTES,
        "oracle must cover every valid e8m0 byte"
    );
    assert_eq!(
        pairs_seen,
        VALID_SCALE_BYTES * 16,
        "oracle must cover every (scale, code) pair"
    );

    let mut compared = 0usize;
    for kernels in &tiers {
        for t in &tensors {
            let matrix = MxFp4Matrix::new(&t.packed, &t.scales, t.rows, t.cols)
                .unwrap_or_else(|e| panic!("oracle tensor {} rejected: {e}", t.name));

            let mut out = vec![f32::from_bits(UNWRITTEN); t.rows * t.cols];
            kernels.dequant_mxfp4(&matrix, 0..t.rows, &mut out).unwrap();
            compare(t, kernels, 0, &out);
            compared += out.len();

            // One row at a time too: row offsets into packed, scales and out must line up.
            for row in 0..t.rows {
                let mut out = vec![f32::from_bits(UNWRITTEN); t.cols];
                kernels
                    .dequant_mxfp4(&matrix, row..row + 1, &mut out)
                    .unwrap();
                compare(t, kernels, row, &out);
            }
        }
    }
    let per_tier: usize = tensors.iter().map(|t| t.rows * t.cols).sum();
    assert_eq!(compared, per_tier * tiers.len());
}

/// Panics naming the tensor, tier, row and column of the first element of `out` (which holds
/// rows from `first_row` on) whose bits differ from the oracle, and how many differ.
fn compare(t: &OracleTensor, kernels: &Kernels, first_row: usize, out: &[f32]) {
    let want = &t.bits[first_row * t.cols..first_row * t.cols + out.len()];
    let mut mismatches = out
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != **w);
    if let Some((i, (got, &want_bits))) = mismatches.next() {
        let (row, col) = (first_row + i / t.cols, i % t.cols);
        let scale = t.scales[row * (t.cols / GROUP) + col / GROUP];
        let byte = t.packed[(row * t.cols + col) / 2];
        let code = if col % 2 == 0 { byte & 0xF } else { byte >> 4 };
        panic!(
            "tensor {} tier {} row {row} col {col} (code {code}, scale byte {scale}): \
             got {:#010x} ({got:e}), oracle {want_bits:#010x} ({:e}); {} differing elements in this call",
            t.name,
            kernels.tier(),
            got.to_bits(),
            f32::from_bits(want_bits),
            1 + mismatches.count(),
        );
    }
}

fn check_sha256() {
    let mut fields = ORACLE_SHA256.split_whitespace();
    let (Some(want), Some(file), None) = (fields.next(), fields.next(), fields.next()) else {
        panic!("sha256 sidecar is not one `<hex>  {ORACLE_FILE}` line: {ORACLE_SHA256:?}");
    };
    assert_eq!(file, ORACLE_FILE, "sha256 sidecar names another file");
    let got: String = Sha256::digest(ORACLE_JSON.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        got, want,
        "{ORACLE_FILE} differs from its committed sha256: regenerate it with `cargo xtask oracle-mxfp4`, never edit it"
    );
}

/// Parses the oracle after checking its hash, so no test reads an edited vector.
fn load_oracle() -> Vec<OracleTensor> {
    check_sha256();
    let json: serde_json::Value = serde_json::from_str(ORACLE_JSON).expect("oracle is valid json");
    let tensors = json["tensors"]
        .as_array()
        .expect("oracle has a tensors list");
    assert!(!tensors.is_empty(), "oracle has no tensors");
    tensors.iter().map(parse_tensor).collect()
}

fn parse_tensor(tensor: &serde_json::Value) -> OracleTensor {
    let name = tensor["name"]
        .as_str()
        .expect("oracle tensor has a name")
        .to_owned();
    let dim = |field: &str| -> usize {
        let value = tensor[field].as_u64();
        let value = value.unwrap_or_else(|| panic!("oracle tensor {name}: no {field}"));
        usize::try_from(value).unwrap()
    };
    let (rows, cols) = (dim("rows"), dim("cols"));
    let bytes = |field: &str, expected: usize| -> Vec<u8> {
        let hex = tensor[field]
            .as_str()
            .unwrap_or_else(|| panic!("oracle tensor {name}: no {field}"));
        let bytes =
            decode_hex(hex).unwrap_or_else(|| panic!("oracle tensor {name}: {field} is not hex"));
        assert_eq!(
            bytes.len(),
            expected,
            "oracle tensor {name}: {field} length for {rows}x{cols}"
        );
        bytes
    };
    let packed = bytes("weight_packed", rows * cols / 2);
    let scales = bytes("weight_scale", rows * cols / GROUP);
    let bits = bytes("dequant_f32_bits", rows * cols * 4)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    OracleTensor {
        name,
        rows,
        cols,
        packed,
        scales,
        bits,
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.as_bytes()
        .chunks_exact(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}
