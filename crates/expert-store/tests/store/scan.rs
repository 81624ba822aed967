//! The full-checkpoint scan: NaN and infinity counts per F32/BF16/F16 tensor (including the
//! encodings' edge cases), 0xFF counts per E8M0 scale tensor, nothing for packed codes.

use expert_store::checkpoint::{Checkpoint, Dtype};
use expert_store::scan::{require_finite, scan_checkpoint};
use expert_store::writer::{TensorOut, write_safetensors};
use k3_testkit::Scratch;

fn t(name: &str, dtype: Dtype, n: usize) -> TensorOut {
    TensorOut {
        name: name.into(),
        dtype,
        shape: vec![n],
    }
}

#[test]
fn nan_inf_and_nan_scales_are_counted_per_tensor() {
    let dir = Scratch::new("store-scan");
    // Each float tensor: finite values (incl. max finite, -0, subnormal), then 2 NaNs
    // (quiet and signalling, one negative) and 3 infinities (+, -, +).
    let f32s: Vec<u32> = vec![
        0x3F80_0000,
        0x7F7F_FFFF,
        0x8000_0000,
        0x0000_0001, // finite
        0x7FC0_0000,
        0xFF80_0001, // NaN
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0000, // inf
    ];
    let bf16s: Vec<u16> = vec![
        0x3F80, 0x7F7F, 0x8000, 0x0001, 0x7FC0, 0xFF81, 0x7F80, 0xFF80, 0x7F80,
    ];
    let f16s: Vec<u16> = vec![
        0x3C00, 0x7BFF, 0x8000, 0x0001, 0x7E00, 0xFC01, 0x7C00, 0xFC00, 0x7C00,
    ];
    let clean: Vec<u16> = vec![0x3F80; 9];
    let tensors = vec![
        t("a.f32", Dtype::F32, 9),
        t("b.bf16", Dtype::BF16, 9),
        t("c.f16", Dtype::F16, 9),
        t("d.clean", Dtype::BF16, 9),
        t("e.w1.weight_packed", Dtype::U8, 8),
        t("e.w1.weight_scale", Dtype::U8, 6),
    ];
    write_safetensors(
        &dir.path().join("model.safetensors"),
        tensors,
        |t, buf| match t.name.as_str() {
            "a.f32" => buf.extend(f32s.iter().flat_map(|v| v.to_le_bytes())),
            "b.bf16" => buf.extend(bf16s.iter().flat_map(|v| v.to_le_bytes())),
            "c.f16" => buf.extend(f16s.iter().flat_map(|v| v.to_le_bytes())),
            "d.clean" => buf.extend(clean.iter().flat_map(|v| v.to_le_bytes())),
            // Packed codes may hold any byte, 0xFF included: not a scale, not scanned.
            "e.w1.weight_packed" => buf.extend([0xFF; 8]),
            _ => buf.extend([0x7F, 0xFF, 0x00, 0xFE, 0xFF, 0x01]),
        },
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut calls = 0;
    let report = scan_checkpoint(&ckpt, |done, total| {
        calls += 1;
        assert!(done <= total);
    });
    assert_eq!(calls, 6);
    assert_eq!(report.bytes, ckpt.data_bytes() as u64);
    let counts: Vec<(&str, u64, u64, u64, u64)> = report
        .tensors
        .iter()
        .map(|s| (s.name.as_str(), s.values, s.nan, s.inf, s.nan_scales))
        .collect();
    assert_eq!(
        counts,
        [
            ("a.f32", 9, 2, 3, 0),
            ("b.bf16", 9, 2, 3, 0),
            ("c.f16", 9, 2, 3, 0),
            ("d.clean", 9, 0, 0, 0),
            ("e.w1.weight_scale", 6, 0, 0, 2),
        ]
    );
    let bad: Vec<&str> = report.bad().map(|s| s.name.as_str()).collect();
    assert_eq!(bad, ["a.f32", "b.bf16", "c.f16", "e.w1.weight_scale"]);
    let err = require_finite(&ckpt).unwrap_err();
    assert_eq!((err.bad, err.scanned), (4, 5));
    assert!(
        err.to_string()
            .contains("first a.f32 (2 NaN, 3 Inf, 0 NaN scales), b.bf16 (2 NaN, 3 Inf"),
        "{err}"
    );
}
