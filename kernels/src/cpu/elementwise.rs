//! Element-wise ops: the residual add, the sigmoid gate, and the activations other CPU ops
//! share (scalar, and in place over a row: on AVX-512 with its vector exponential, since a
//! libm call per value costs more than a decode step's whole convolution).

use super::simd::{SimdLevel, simd_level};

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `v[i] ← σ(v[i])` over a row.
pub fn sigmoid_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time.
        return unsafe { x86::activate_avx512::<false>(v) };
    }
    v.iter_mut().for_each(|x| *x = sigmoid(*x));
}

/// `v[i] ← SiLU(v[i])` over a row.
pub fn silu_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time.
        return unsafe { x86::activate_avx512::<true>(v) };
    }
    v.iter_mut().for_each(|x| *x = silu(*x));
}

/// `v[i] ← e^{v[i]}` over a row (a softmax's weights, KDA's decays).
pub fn exp_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time.
        return unsafe { x86::exp_avx512_rows(v) };
    }
    v.iter_mut().for_each(|x| *x = x.exp());
}

/// `acc += x`.
pub fn add(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add: lengths differ");
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// `gate ← SiLU(gate) · up` (SwiGLU).
pub fn silu_glu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_glu: lengths differ");
    silu_in_place(gate);
    gate.iter_mut().zip(up).for_each(|(g, u)| *g *= u);
}

/// Values of a row activated at once by [`sigmoid_mul`] (on the stack).
const ROW_CHUNK: usize = 256;

/// `x *= σ(gate)`.
pub fn sigmoid_mul(x: &mut [f32], gate: &[f32]) {
    assert_eq!(x.len(), gate.len(), "sigmoid_mul: lengths differ");
    let mut s = [0f32; ROW_CHUNK];
    for (xs, gs) in x.chunks_mut(ROW_CHUNK).zip(gate.chunks(ROW_CHUNK)) {
        let s = &mut s[..gs.len()];
        s.copy_from_slice(gs);
        sigmoid_in_place(s);
        xs.iter_mut().zip(s.iter()).for_each(|(v, g)| *v *= g);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::cpu::simd::x86::exp_avx512;

    /// e^v per lane; a NaN stays NaN (the vector exponential clamps its input).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_avx512_rows(v: &mut [f32]) {
        let n = v.len();
        let mut c = 0;
        while c < n {
            let m: __mmask16 = if n - c >= 16 { 0xffff } else { ((1u32 << (n - c)) - 1) as __mmask16 };
            // SAFETY: the masked load and store touch lanes c..min(c+16, n) of v.
            let x = unsafe { _mm512_maskz_loadu_ps(m, v.as_ptr().add(c)) };
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            let e = _mm512_mask_mov_ps(exp_avx512(x), nan, x);
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(v.as_mut_ptr().add(c), m, e) };
            c += 16;
        }
    }

    /// σ(v) (or v·σ(v) for SiLU) per lane, as `1 / (1 + e^{−v})`; a NaN stays NaN (the vector
    /// exponential clamps its input, which would otherwise turn it into a number).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn activate_avx512<const SILU: bool>(v: &mut [f32]) {
        let n = v.len();
        let one = _mm512_set1_ps(1.0);
        let mut c = 0;
        while c < n {
            let m: __mmask16 = if n - c >= 16 { 0xffff } else { ((1u32 << (n - c)) - 1) as __mmask16 };
            // SAFETY: the masked load and store touch lanes c..min(c+16, n) of v.
            let x = unsafe { _mm512_maskz_loadu_ps(m, v.as_ptr().add(c)) };
            let s = _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            let s = if SILU { _mm512_mul_ps(x, s) } else { s };
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(v.as_mut_ptr().add(c), m, _mm512_mask_mov_ps(s, nan, x)) };
            c += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row activations (vector exponential on AVX-512) against f64: a few ulp over every
    /// range a model produces, rows whose length leaves a partial vector, and NaN kept NaN.
    #[test]
    fn row_activations_match_f64_and_keep_nan() {
        let xs: Vec<f32> =
            (0..1003).map(|i| (i as f32 - 501.0) * 0.173).chain([0.0, -0.0, 1e-30, -1e-30, 87.0]).collect();
        let mut sig = xs.clone();
        sigmoid_in_place(&mut sig);
        let mut si = xs.clone();
        silu_in_place(&mut si);
        for ((&x, &s), &l) in xs.iter().zip(&sig).zip(&si) {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!((s as f64 - want).abs() <= 4e-7 * want.abs().max(1e-30), "σ({x}) = {s}, want {want}");
            let want = x as f64 * want;
            assert!((l as f64 - want).abs() <= 4e-7 * want.abs().max(1e-30), "SiLU({x}) = {l}, want {want}");
        }
        let mut e: Vec<f32> = xs.iter().map(|x| x.min(80.0)).collect();
        exp_in_place(&mut e);
        for (&x, &v) in xs.iter().zip(&e) {
            let want = (x.min(80.0) as f64).exp();
            assert!((v as f64 - want).abs() <= 4e-7 * want, "exp({x}) = {v}, want {want}");
        }
        let mut v = vec![0.0, f32::NAN, f32::NEG_INFINITY];
        exp_in_place(&mut v);
        assert!(v[0] == 1.0 && v[1].is_nan() && v[2] == 0.0, "{v:?}");
        let mut v = vec![1.0, f32::NAN, -2.0];
        sigmoid_in_place(&mut v);
        assert!(v[1].is_nan() && !v[0].is_nan() && !v[2].is_nan());
        let mut v = vec![f32::NAN; 17];
        silu_in_place(&mut v);
        assert!(v.iter().all(|x| x.is_nan()));
    }
}
