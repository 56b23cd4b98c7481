//! Row reductions for sampling over a full vocabulary row (163,840 logits): max, log-sum-exp
//! at a temperature, and top-k — vectorised so that they cost microseconds, not milliseconds.

use super::simd::{SimdLevel, simd_level};

/// e^x for x ≤ 0 (inputs are max-shifted), scalar version of the vector polynomial.
#[inline]
pub fn exp_nonpos(x: f32) -> f32 {
    if x < -87.0 {
        return 0.0;
    }
    // e^x = 2^(x·log2 e) = 2^n · 2^f, f ∈ [-0.5, 0.5]
    let t = x * std::f32::consts::LOG2_E;
    let n = t.round();
    let f = t - n;
    // Minimax polynomial for 2^f on [-0.5, 0.5] (rel. error < 2e-7).
    let p = 1.535_336_2e-4f32;
    let p = p.mul_add(f, 1.339_887_4e-3);
    let p = p.mul_add(f, 9.618_437e-3);
    let p = p.mul_add(f, 5.550_332_5e-2);
    let p = p.mul_add(f, 2.402_264_8e-1);
    let p = p.mul_add(f, 6.931_472e-1);
    let p = p.mul_add(f, 1.0);
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Largest non-NaN value (−∞ for an empty or all-NaN row).
pub fn max(row: &[f32]) -> f32 {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::max_avx512(row) },
        _ => row.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max),
    }
}

/// (index, value) of the largest non-NaN value, lowest index on ties; (0, −∞) if none.
pub fn argmax(row: &[f32]) -> (u32, f32) {
    let m = max(row);
    let found = match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::find_avx512(row, m) },
        _ => row.iter().position(|&x| x == m),
    };
    match found {
        Some(i) => (i as u32, m),
        None => (0, f32::NEG_INFINITY),
    }
}

/// log Σ exp(x / t) over the row (NaNs ignored), accurate to ~1e-6 relative.
pub fn log_sum_exp(row: &[f32], t: f32) -> f32 {
    log_sum_exp_with_max(row, max(row), t)
}

/// [`log_sum_exp`] when the row's max is already known.
pub fn log_sum_exp_with_max(row: &[f32], m: f32, t: f32) -> f32 {
    if !m.is_finite() {
        return m;
    }
    let inv_t = 1.0 / t;
    let s = match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::sum_exp_avx512(row, m, inv_t) },
        _ => sum_exp_scalar(row, m, inv_t),
    };
    m * inv_t + s.ln() as f32
}

fn sum_exp_scalar(row: &[f32], m: f32, inv_t: f32) -> f64 {
    let mut total = 0f64;
    for chunk in row.chunks(256) {
        let mut acc = [0f32; 8];
        for (i, &x) in chunk.iter().enumerate() {
            if !x.is_nan() {
                acc[i & 7] += exp_nonpos((x - m) * inv_t);
            }
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
    }
    total
}

/// A running top-k: a buffer of values above the current floor, compacted to the best k (by
/// value, then lower index) whenever it fills up. Values not above the floor are skipped, so
/// after the first compaction almost nothing is copied.
pub struct TopK {
    buf: Vec<(f32, u32)>,
    k: usize,
    floor: f32,
}

/// Descending by value, then ascending by index.
fn better(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

impl TopK {
    fn new(k: usize) -> TopK {
        TopK { buf: Vec::with_capacity(Self::cap(k) + 16), k, floor: f32::NEG_INFINITY }
    }

    fn cap(k: usize) -> usize {
        (4 * k).max(1024)
    }

    #[inline]
    fn push(&mut self, i: usize, x: f32) {
        // NaN and values not above the floor never make it (ties keep the earlier index).
        if x > self.floor {
            self.buf.push((x, i as u32));
            if self.buf.len() >= Self::cap(self.k) {
                self.compact();
            }
        }
    }

    fn compact(&mut self) {
        if self.buf.len() > self.k {
            self.buf.select_nth_unstable_by(self.k - 1, better);
            self.buf.truncate(self.k);
            self.floor = self.buf.iter().map(|e| e.0).fold(f32::INFINITY, f32::min);
        }
    }

    fn into_sorted(mut self) -> Vec<(u32, f32)> {
        self.compact();
        self.buf.sort_by(better);
        self.buf.into_iter().map(|(x, i)| (i, x)).collect()
    }
}

/// The `k` largest values with their indices, descending (ties: lower index first; NaN never
/// chosen). Blocks of 16 that cannot beat the current floor are skipped with one compare.
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let mut tk = TopK::new(k);
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::top_k_avx512(row, &mut tk) },
        _ => {
            for (i, &x) in row.iter().enumerate() {
                tk.push(i, x);
            }
        }
    }
    tk.into_sorted()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::TopK;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn top_k_avx512(row: &[f32], tk: &mut TopK) {
        let n = row.len();
        let mut i = 0;
        let mut floor = _mm512_set1_ps(tk.floor);
        unsafe {
            while i + 16 <= n {
                let v = _mm512_loadu_ps(row.as_ptr().add(i));
                let mut m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, floor);
                if m != 0 {
                    while m != 0 {
                        let j = m.trailing_zeros() as usize;
                        tk.push(i + j, row[i + j]);
                        m &= m - 1;
                    }
                    floor = _mm512_set1_ps(tk.floor);
                }
                i += 16;
            }
        }
        while i < n {
            tk.push(i, row[i]);
            i += 1;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn find_avx512(row: &[f32], value: f32) -> Option<usize> {
        let v = _mm512_set1_ps(value);
        let mut i = 0;
        unsafe {
            while i + 16 <= row.len() {
                let m = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_loadu_ps(row.as_ptr().add(i)), v);
                if m != 0 {
                    return Some(i + m.trailing_zeros() as usize);
                }
                i += 16;
            }
        }
        row[i..].iter().position(|&x| x == value).map(|p| i + p)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn max_avx512(row: &[f32]) -> f32 {
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        unsafe {
            while i < row.len() {
                let n = (row.len() - i).min(16);
                let lanes: __mmask16 = ((1u32 << n) - 1) as __mmask16;
                let v = _mm512_maskz_loadu_ps(lanes, row.as_ptr().add(i));
                let valid = lanes & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v);
                acc = _mm512_mask_max_ps(acc, valid, acc, v);
                i += n;
            }
        }
        _mm512_reduce_max_ps(acc)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp_nonpos(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let mut p = _mm512_set1_ps(1.535_336_2e-4);
        for c in [1.339_887_4e-3f32, 9.618_437e-3, 5.550_332_5e-2, 2.402_264_8e-1, 6.931_472e-1, 1.0] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_exp_avx512(row: &[f32], m: f32, inv_t: f32) -> f64 {
        let vm = _mm512_set1_ps(m);
        let vt = _mm512_set1_ps(inv_t);
        let mut total = 0f64;
        let mut i = 0;
        unsafe {
            while i < row.len() {
                let end = (i + 256).min(row.len());
                let mut acc = _mm512_setzero_ps();
                while i < end {
                    let n = (end - i).min(16);
                    let mask: __mmask16 = ((1u32 << n) - 1) as __mmask16;
                    let x = _mm512_maskz_loadu_ps(mask, row.as_ptr().add(i));
                    // NaN lanes and tail lanes contribute 0.
                    let valid = mask & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x);
                    let e = exp_nonpos(_mm512_mul_ps(_mm512_sub_ps(x, vm), vt));
                    acc = _mm512_mask_add_ps(acc, valid, acc, e);
                    i += n;
                }
                total += _mm512_reduce_add_ps(acc) as f64;
            }
        }
        total
    }
}
