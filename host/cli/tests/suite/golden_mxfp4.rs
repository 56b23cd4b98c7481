//! MXFP4 dequantisation against `../shared/golden/mxfp4-vectors`: bit-exact, including the E8M0
//! edge scales (0 → 2^−127 subnormal, 254 → overflow to ±inf, 255 → NaN per OCP), and the same
//! values through the matrix product kernel.

use crate::common;

use kimi_host::model::checkpoint::{Checkpoint, Dtype};
use kimi_kernels::{Matrix, Mxfp4Matrix};

fn u8s(ck: &Checkpoint, name: &str) -> Vec<u8> {
    let info = ck.info(name).expect(name);
    assert_eq!(info.dtype, Dtype::U8);
    ck.bytes(info).bytes().to_vec()
}

#[test]
fn mxfp4_vectors_dequantise_exactly() {
    let dir = common::golden_dir().join("mxfp4-vectors");
    let ck = Checkpoint::open_file(&dir.join("vectors.safetensors")).expect("vectors.safetensors");
    let packed = u8s(&ck, "packed");
    let scale = u8s(&ck, "scale");
    let want = ck.read_f32(ck.info("dequant").expect("dequant"));
    let (rows, cols) = (16, 128);
    let m = Mxfp4Matrix::new(&packed, &scale, rows, cols);
    let got = m.to_f32();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        let same = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(
            same,
            "row {} col {}: got {a:e} ({:#x}), want {b:e} ({:#x})",
            i / cols,
            i % cols,
            a.to_bits(),
            b.to_bits()
        );
    }
    // The edge rows really are the edge cases.
    assert_eq!(scale[10 * 4], 0);
    assert!(want[10 * cols..11 * cols].iter().any(|v| *v != 0.0 && v.is_subnormal()));
    assert!(want[13 * cols..14 * cols].iter().any(|v| v.is_infinite()));
    assert!(want[14 * cols..15 * cols].iter().all(|v| v.is_nan()));
    // Spec §3.2 real-checkpoint row: low nibble first.
    assert_eq!(&packed[15 * 64..15 * 64 + 8], &[0x16, 0xB9, 0xCE, 0x23, 0x85, 0xAB, 0x9B, 0xA2]);
    assert_eq!(got[15 * cols], 0.0625);
    assert_eq!(got[15 * cols + 1], 0.0078125);

    // The product kernel reads the same values: one-hot inputs pick single columns (finite rows).
    let mat = Matrix::Mxfp4(m);
    for c in [0, 1, 31, 32, 77, 127] {
        let mut x = vec![0f32; cols];
        x[c] = 1.0;
        let mut out = vec![0f32; rows];
        mat.matmul(&x, 1, &mut out);
        for r in (0..rows).filter(|&r| r != 13 && r != 14) {
            assert_eq!(out[r].to_bits(), (got[r * cols + c] + 0.0).to_bits(), "row {r} col {c}");
        }
    }
}
