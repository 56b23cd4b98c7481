//! MXFP4 (OCP MX v1.0, compressed-tensors `mxfp4-pack-quantized`) read in place.
//!
//! `packed[r, j]` holds columns 2j (low nibble) and 2j+1 (high nibble) as E2M1 codes; `scales[r, g]`
//! is an E8M0 exponent for columns 32g..32g+31: value = E2M1(code) · 2^(scale − 127).

/// Columns per E8M0 scale.
pub const GROUP: usize = 32;

/// E2M1 code → value (bit 3 sign, bits 0–2 magnitude index).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// E8M0 byte → 2^(b − 127). b = 0 is the subnormal 2^−127 (not 0); b = 255 is NaN (OCP).
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// Both values of one packed byte (low nibble first), unscaled.
const fn byte_pairs() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1[b & 15], E2M1[b >> 4]];
        b += 1;
    }
    t
}
static PAIRS: [[f32; 2]; 256] = byte_pairs();

/// A row-major `[rows, cols]` MXFP4 matrix borrowed from its storage.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Mxfp4Matrix<'a> {
    /// `cols` must be a multiple of 32; `packed` is `[rows, cols/2]`, `scales` `[rows, cols/32]`.
    pub fn new(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Self {
        assert!(cols.is_multiple_of(GROUP), "Mxfp4Matrix: cols {cols} not a multiple of 32");
        assert_eq!(packed.len(), rows * cols / 2, "Mxfp4Matrix: packed length");
        assert_eq!(scales.len(), rows * cols / GROUP, "Mxfp4Matrix: scale length");
        Mxfp4Matrix { packed, scales, rows, cols }
    }

    pub fn row_range(&self, start: usize, len: usize) -> Mxfp4Matrix<'a> {
        let pb = self.cols / 2;
        let sb = self.cols / GROUP;
        Mxfp4Matrix::new(
            &self.packed[start * pb..(start + len) * pb],
            &self.scales[start * sb..(start + len) * sb],
            len,
            self.cols,
        )
    }

    /// Exact dequantisation of row `r` into `out` (`cols` values).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let pb = self.cols / 2;
        let sb = self.cols / GROUP;
        let packed = &self.packed[r * pb..(r + 1) * pb];
        let scales = &self.scales[r * sb..(r + 1) * sb];
        for (g, (&s, bytes)) in scales.iter().zip(packed.chunks_exact(GROUP / 2)).enumerate() {
            let scale = e8m0_to_f32(s);
            let dst = &mut out[g * GROUP..(g + 1) * GROUP];
            for (pair, &b) in dst.chunks_exact_mut(2).zip(bytes) {
                let v = PAIRS[b as usize];
                pair[0] = v[0] * scale;
                pair[1] = v[1] * scale;
            }
        }
    }

    /// The whole matrix dequantised (tests and tools only; the engine never calls this).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            self.row_to_f32(r, &mut out[r * self.cols..(r + 1) * self.cols]);
        }
        out
    }
}

/// Quantises one row of f32 values to MXFP4 the way compressed-tensors does for a symmetric
/// float-4 group: shared exponent from the group max (scale = 2^(floor(log2(max)) − 2)), codes
/// rounded to the nearest E2M1 value. Used by `make-tiny` to write MXFP4 checkpoints.
pub fn quantize_row(row: &[f32], packed: &mut [u8], scales: &mut [u8]) {
    for (g, group) in row.chunks_exact(GROUP).enumerate() {
        let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let exp = if amax > 0.0 { amax.log2().floor() as i32 - 2 } else { -127 };
        let b = (exp + 127).clamp(1, 254) as u8;
        scales[g] = b;
        let scale = e8m0_to_f32(b);
        for (j, pair) in group.chunks_exact(2).enumerate() {
            let lo = nearest_code(pair[0] / scale);
            let hi = nearest_code(pair[1] / scale);
            packed[g * GROUP / 2 + j] = lo | (hi << 4);
        }
    }
}

fn nearest_code(v: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for (c, &e) in E2M1.iter().enumerate().take(8) {
        let err = (v.abs() - e).abs();
        if err < best_err {
            best_err = err;
            best = c as u8;
        }
    }
    if v < 0.0 && best != 0 { best | 8 } else { best }
}
