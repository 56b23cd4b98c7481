//! The SiTU GLU activation (spec §2.6) over rows of gate and up values, in place:
//! `gate ← [β·tanh(a/β)·σ(a)] · [β_lin·tanh(u/β_lin)]` (no up-branch cap when `β_lin` is None);
//! σ sees the uncapped gate.

use super::simd::{SimdLevel, simd_level};

/// One value, with libm (the reference and the fallback).
pub fn situ(a: f32, u: f32, beta: f32, linear_beta: Option<f32>) -> f32 {
    let g = beta * (a / beta).tanh() * (1.0 / (1.0 + (-a).exp()));
    let up = match linear_beta {
        Some(bl) => bl * (u / bl).tanh(),
        None => u,
    };
    g * up
}

/// In place over `gate` with `up` (same length).
pub fn situ_rows(gate: &mut [f32], up: &[f32], beta: f32, linear_beta: Option<f32>) {
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; both slices hold n values.
        SimdLevel::Avx512 => unsafe { x86::situ_avx512(gate, up, beta, linear_beta) },
        _ => {
            for (a, u) in gate.iter_mut().zip(up) {
                *a = situ(*a, *u, beta, linear_beta);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::cpu::simd::x86::exp_avx512;

    /// tanh(y) = sign(y)·(1 − e^{−2|y|}) / (1 + e^{−2|y|}): e^{−2|y|} ≤ 1, so nothing overflows;
    /// the absolute error stays near one ulp of 1.
    #[target_feature(enable = "avx512f")]
    fn tanh(y: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let ay = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
        let e = exp_avx512(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0)));
        let one = _mm512_set1_ps(1.0);
        let t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        let s = _mm512_and_si512(sign, _mm512_castps_si512(y));
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), s))
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn situ_avx512(gate: &mut [f32], up: &[f32], beta: f32, linear_beta: Option<f32>) {
        let n = gate.len();
        let b = _mm512_set1_ps(beta);
        let inv_b = _mm512_set1_ps(1.0 / beta);
        let one = _mm512_set1_ps(1.0);
        let mut c = 0;
        while c < n {
            let m: __mmask16 = if n - c >= 16 { 0xffff } else { ((1u32 << (n - c)) - 1) as __mmask16 };
            // SAFETY: the masked loads and store touch lanes c..min(c+16, n) of n-value slices.
            let (a, u) = unsafe {
                (_mm512_maskz_loadu_ps(m, gate.as_ptr().add(c)), _mm512_maskz_loadu_ps(m, up.as_ptr().add(c)))
            };
            let sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
            let g = _mm512_mul_ps(_mm512_mul_ps(b, tanh(_mm512_mul_ps(a, inv_b))), sig);
            let upv = match linear_beta {
                Some(bl) => _mm512_mul_ps(_mm512_set1_ps(bl), tanh(_mm512_mul_ps(u, _mm512_set1_ps(1.0 / bl)))),
                None => u,
            };
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(gate.as_mut_ptr().add(c), m, _mm512_mul_ps(g, upv)) };
            c += 16;
        }
    }
}
