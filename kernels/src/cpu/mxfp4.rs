//! MXFP4 (OCP MX v1.0, compressed-tensors `mxfp4-pack-quantized`) read in place.
//!
//! `packed[r, j]` holds columns 2j (low nibble) and 2j+1 (high nibble) as E2M1 codes; `scales[r, g]`
//! is an E8M0 exponent for columns 32g..32g+31: value = E2M1(code) · 2^(scale − 127).

use super::simd::{SimdLevel, simd_level};

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
        let out = &mut out[..self.cols];
        #[cfg(target_arch = "x86_64")]
        if simd_level() == SimdLevel::Avx512 {
            // SAFETY: the level was detected at run time; `packed` holds cols/2 bytes, `scales`
            // cols/32 and `out` cols values.
            unsafe { x86::row_avx512(packed, scales, out) };
            return;
        }
        row_scalar(packed, scales, out);
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

/// The table path: every packed byte gives two values.
pub fn row_scalar(packed: &[u8], scales: &[u8], out: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{E2M1, GROUP, e8m0_to_f32};

    /// One 32-column group per iteration: the 16 bytes widen to 16 lanes, their nibbles are
    /// interleaved back into column order and looked up in the 16-entry E2M1 table held in a
    /// register, then scaled. Same products as the table path, so the same bits.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn row_avx512(packed: &[u8], scales: &[u8], out: &mut [f32]) {
        unsafe {
            let lut = _mm512_loadu_ps(E2M1.as_ptr());
            let lo_first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let hi_first = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            let nibble = _mm512_set1_epi32(15);
            for (g, &s) in scales.iter().enumerate() {
                let scale = _mm512_set1_ps(e8m0_to_f32(s));
                let bytes = _mm_loadu_si128(packed.as_ptr().add(g * GROUP / 2) as *const __m128i);
                let v = _mm512_cvtepu8_epi32(bytes);
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_srli_epi32::<4>(v);
                let c0 = _mm512_permutex2var_epi32(lo, lo_first, hi);
                let c1 = _mm512_permutex2var_epi32(lo, hi_first, hi);
                let dst = out.as_mut_ptr().add(g * GROUP);
                _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_permutexvar_ps(c0, lut), scale));
                _mm512_storeu_ps(dst.add(16), _mm512_mul_ps(_mm512_permutexvar_ps(c1, lut), scale));
            }
        }
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

/// [`quantize_row`] over every row of `[rows, cols]` values (`cols` a multiple of 32): the packed
/// codes `[rows, cols / 2]` and the scales `[rows, cols / 32]`.
pub fn quantize_rows(values: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / GROUP];
    for r in 0..rows {
        quantize_row(
            &values[r * cols..(r + 1) * cols],
            &mut packed[r * cols / 2..(r + 1) * cols / 2],
            &mut scales[r * cols / GROUP..(r + 1) * cols / GROUP],
        );
    }
    (packed, scales)
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
