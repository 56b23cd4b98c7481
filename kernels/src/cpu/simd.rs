//! Runtime-dispatched f32 inner loops: AVX-512F, AVX2+FMA, or portable scalar code.
//!
//! The level is detected once; `KIMI_SIMD=scalar|avx2|avx512` forces a lower level (tests use it
//! to check every path against the scalar one).

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    Avx2,
    Avx512,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2+fma",
            SimdLevel::Avx512 => "avx512f",
        }
    }
}

static LEVEL: OnceLock<SimdLevel> = OnceLock::new();

/// The best level this CPU supports, capped by `KIMI_SIMD` when set.
pub fn simd_level() -> SimdLevel {
    *LEVEL.get_or_init(|| {
        let detected = detect();
        let cap = match std::env::var("KIMI_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2") => SimdLevel::Avx2,
            _ => SimdLevel::Avx512,
        };
        detected.min(cap)
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    if is_x86_feature_detected!("avx512f") {
        SimdLevel::Avx512
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// Σ a[i]·b[i] over `min(a.len(), b.len())` values, f32 accumulation.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { x86::dot_avx2(a, b) },
        _ => dot_scalar(a, b),
    }
}

/// y[i] += alpha · x[i].
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { x86::axpy_avx2(alpha, x, y) },
        _ => {
            for (yi, xi) in y.iter_mut().zip(x) {
                *yi += alpha * xi;
            }
        }
    }
}

/// Scalar dot with 8 independent partial sums (same association shape as the SIMD paths, and
/// fast enough to be a fair fallback).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        unsafe {
            while i + 32 <= n {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(i + 16)),
                    _mm512_loadu_ps(b.as_ptr().add(i + 16)),
                    acc1,
                );
                i += 32;
            }
            if i + 16 <= n {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), acc0);
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                acc1 = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(m, a.as_ptr().add(i)),
                    _mm512_maskz_loadu_ps(m, b.as_ptr().add(i)),
                    acc1,
                );
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    acc1,
                );
                i += 16;
            }
            let mut s = hsum256(_mm256_add_ps(acc0, acc1));
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let va = _mm512_set1_ps(alpha);
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                let yv = _mm512_loadu_ps(y.as_ptr().add(i));
                let r = _mm512_fmadd_ps(va, _mm512_loadu_ps(x.as_ptr().add(i)), yv);
                _mm512_storeu_ps(y.as_mut_ptr().add(i), r);
                i += 16;
            }
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                let yv = _mm256_loadu_ps(y.as_ptr().add(i));
                let r = _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
                _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
                i += 8;
            }
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }
}
