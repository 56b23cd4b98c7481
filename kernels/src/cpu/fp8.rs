//! FP8 E4M3 (`float8_e4m3fn`: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
//! infinities, 0x7F / 0xFF NaN, largest finite 448) weights with one f32 scale per output row, as
//! ATOM's `ptpc_fp8` requantises dense linears at load: `W[r, c] ≈ E4M3(q[r, c]) · scale[r]`.
//! Products quantise each token's activations the same way (one scale per token), so
//! `y[t, r] = s_t · s_r · Σ_c E4M3(x_q[t, c]) · E4M3(q[r, c])`, accumulated in f32.

use std::sync::OnceLock;

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Unit roundoff of round-to-nearest E4M3 for normal values: half of 2^−3.
pub const E4M3_UNIT_ROUNDOFF: f32 = 1.0 / 16.0;

/// Value of an E4M3 code.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0x0F, b & 0x07);
    if e == 0x0F && m == 0x07 {
        return f32::NAN;
    }
    let mag = if e == 0 { m as f32 / 8.0 * 2f32.powi(-6) } else { (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7) };
    sign * mag
}

/// 2^120: from an f32 exponent field holding an E4M3 exponent (bias 7) to its value.
const REBIAS: f32 = f32::from_bits((127 + 120) << 23);

/// A code's value by bit arithmetic (see [`Fp8Matrix::row_to_f32`]).
#[inline(always)]
fn decode(b: u8) -> f32 {
    let b = b as u32;
    f32::from_bits(((b & 0x80) << 24) | ((b & 0x7F) << 20)) * REBIAS
}

/// Every code's value.
fn table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// The nearest E4M3 code to `x` (ties to the even code), saturating at ±448; NaN stays NaN.
/// Arithmetic on the exponent: the value's quantum (2^(e − 3) for a normal, 2⁻⁹ below 2⁻⁶) is a
/// power of two, so `a / quantum` is exact and rounding it half-to-even is the E4M3 rounding.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    if a < 2f32.powi(-6) {
        // Subnormal codes 0..=7 (8 rounds up to the smallest normal, code 8).
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    let e = ((a.to_bits() >> 23) as i32) - 127;
    let quantum = f32::from_bits(((e - 3 + 127) as u32) << 23);
    let r = (a / quantum).round_ties_even() * quantum;
    // A mantissa that rounds up to 2.0 moves to the next binade: read the exponent again.
    let (re, rm) = (((r.to_bits() >> 23) as i32) - 127, (r.to_bits() >> 20) & 7);
    let code = (((re + 7) as u32) << 3 | rm).min(0x7E);
    sign | code as u8
}

/// [`f32_to_e4m3`] by a binary search of the code table (the tests' reference).
pub fn f32_to_e4m3_search(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let t = table();
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Positive codes 0x00..=0x7E are increasing in value: binary search the first ≥ a.
    let (mut lo, mut hi) = (0usize, 0x7Eusize);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if t[mid] < a {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let code = if lo == 0 {
        0
    } else {
        let (below, above) = (t[lo - 1], t[lo]);
        let (db, da) = (a - below, above - a);
        if db < da || (db == da && (lo - 1) % 2 == 0) { lo - 1 } else { lo }
    };
    sign | code as u8
}

/// A row-major `[rows, cols]` E4M3 matrix with one scale per row, borrowed from its storage.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Matrix<'a> {
    pub data: &'a [u8],
    pub scales: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Fp8Matrix<'a> {
    pub fn new(data: &'a [u8], scales: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(data.len() == rows * cols && scales.len() == rows, "Fp8Matrix: storage does not match {rows}×{cols}");
        Fp8Matrix { data, scales, rows, cols }
    }

    pub fn row_range(&self, start: usize, len: usize) -> Fp8Matrix<'a> {
        Fp8Matrix::new(
            &self.data[start * self.cols..(start + len) * self.cols],
            &self.scales[start..start + len],
            len,
            self.cols,
        )
    }

    /// Row `r` dequantised. Bit arithmetic, not a table, so the loop vectorises: an E4M3 code's
    /// magnitude bits shifted left by 20 land in an f32's exponent and mantissa fields, and
    /// scaling by 2^120 rebiases the exponent (7 → 127) — subnormal codes included. (The NaN
    /// codes 0x7F / 0xFF decode as ±480; the encoder saturates at 448 and never writes them.)
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let s = self.scales[r];
        for (o, &b) in out.iter_mut().zip(&self.data[r * self.cols..(r + 1) * self.cols]) {
            *o = decode(b) * s;
        }
    }
}

/// Requantises `[rows, cols]` f32 values to E4M3 with one scale per row, `max|row| / 448` (an
/// all-zero row gets scale 1): the codes and the scales.
pub fn quantize_rows(values: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![1f32; rows];
    for ((row, out), s) in values.chunks_exact(cols.max(1)).zip(codes.chunks_exact_mut(cols.max(1))).zip(&mut scales) {
        let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        if m > 0.0 && m.is_finite() {
            *s = m / E4M3_MAX;
        }
        for (o, v) in out.iter_mut().zip(row) {
            *o = f32_to_e4m3(v / *s);
        }
    }
    (codes, scales)
}

/// Each token's activations as the FP8 product sees them: scaled by `max|x_t| / 448`, rounded
/// to E4M3 and scaled back (values the E4M3 grid times the token's scale represent exactly).
pub fn quantize_activations(x: &[f32], cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks_exact(cols.max(1)).zip(out.chunks_exact_mut(cols.max(1))) {
        let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if m > 0.0 && m.is_finite() { m / E4M3_MAX } else { 1.0 };
        for (o, v) in o.iter_mut().zip(row) {
            *o = decode(f32_to_e4m3(v / s)) * s;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_round_trip_and_round_to_nearest_even() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7F == 0x7F);
                continue;
            }
            // -0 encodes as 0x80, +0 as 0x00.
            assert_eq!(f32_to_e4m3(v), b, "code {b:#x} ({v})");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f32_to_e4m3(1000.0), 0x7E, "saturates");
        // 1.0 = 0x38 and 1.125 = 0x39: the midpoint goes to the even code.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A, "1.125 (odd) and 1.25 (even): the even one");
        assert_eq!(f32_to_e4m3(1.06), 0x38);
        assert_eq!(f32_to_e4m3(-1.07), 0xB9);
    }

    #[test]
    fn the_arithmetic_encoder_equals_the_table_search() {
        // Every code, every midpoint between neighbours, and values around them.
        let mut xs: Vec<f32> = vec![0.0, -0.0, 1e-9, 448.0, 449.0, 464.0, 500.0, 1e9, -1e9, 2f32.powi(-10)];
        for b in 0u8..0x7E {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            for v in [lo, hi, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                xs.extend([v, -v]);
            }
        }
        xs.extend((0..20000).map(|i| ((i as f32) * 0.7371).sin() * 500.0 / (1.0 + (i % 97) as f32)));
        for x in xs {
            assert_eq!(f32_to_e4m3(x), f32_to_e4m3_search(x), "{x:e}");
        }
    }

    #[test]
    fn the_bit_decode_equals_the_code_table() {
        let codes: Vec<u8> = (0u8..=255).filter(|b| b & 0x7F != 0x7F).collect();
        let scales = vec![1.0f32];
        let m = Fp8Matrix::new(&codes, &scales, 1, codes.len());
        let mut row = vec![0f32; codes.len()];
        m.row_to_f32(0, &mut row);
        for (&b, v) in codes.iter().zip(&row) {
            assert_eq!(v.to_bits(), e4m3_to_f32(b).to_bits(), "code {b:#x}");
        }
    }

    #[test]
    fn quantised_rows_stay_within_the_unit_roundoff() {
        let vals: Vec<f32> = (0..64).map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.173).collect();
        let (codes, scales) = quantize_rows(&vals, 2, 32);
        let m = Fp8Matrix::new(&codes, &scales, 2, 32);
        let mut row = vec![0f32; 32];
        for r in 0..2 {
            m.row_to_f32(r, &mut row);
            for (a, b) in row.iter().zip(&vals[r * 32..(r + 1) * 32]) {
                // Normal range: relative error ≤ u; near zero the subnormal step bounds it.
                let tol = E4M3_UNIT_ROUNDOFF * b.abs() + scales[r] * 2f32.powi(-10);
                assert!((a - b).abs() <= tol, "{a} vs {b}");
            }
        }
    }
}
