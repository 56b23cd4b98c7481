//! Runtime-dispatched f32 inner loops: AVX-512F, AVX2+FMA, or portable scalar code.
//!
//! The level is detected once; `KIMI_SIMD=scalar|avx2|avx512` forces a lower level (`avx512` also
//! turns off the AMX tiles of `packed_amx`; `amx`, the default, allows everything; tests use it
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
/// Asks for the cache lines of `data` into L1 ahead of their reads (a no-op off x86): for loops
/// over stored rows that read a few KB a call, where the hardware prefetcher alone keeps too few
/// lines in flight (MLA's per-head maps read at 0.36-0.40 of the roof without it).
#[inline]
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(data);
        let p = data.as_ptr() as *const i8;
        for at in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults, and `at` lies inside `data`.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

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

/// [`dot`] of `a` with each of four rows, each result the bits of its own `dot` (the AVX-512
/// kernel runs the four chains side by side, so each load of `a` feeds four products).
pub fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; every row holds at least a.len() values.
        SimdLevel::Avx512 if b.iter().all(|r| r.len() >= a.len()) => unsafe { x86::dot4_avx512(a, b) },
        _ => b.map(|r| dot(a, r)),
    }
}

/// `y += alphas[i] · row(i)` for every i in turn, each row at least `y.len()` long: the bits of
/// one [`axpy`] per row in that order (the AVX-512 kernel keeps up to 64 lanes of `y` in
/// registers across all the rows instead of loading and storing them once per row).
pub fn axpy_rows_by<'r>(alphas: &[f32], row: impl Fn(usize) -> &'r [f32], y: &mut [f32]) {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; the kernel checks each row's length.
        SimdLevel::Avx512 => unsafe { x86::axpy_rows_by_avx512(alphas, &row, y) },
        _ => {
            for (i, &a) in alphas.iter().enumerate() {
                axpy(a, row(i), y);
            }
        }
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

/// y += Σ_r alpha[r] · m[r, :] for `m` of `alpha.len()` rows of `y.len()` values: a run of
/// axpys in one call (each output block stays in registers over all rows).
pub fn axpy_rows(alpha: &[f32], m: &[f32], y: &mut [f32]) {
    let cols = y.len();
    assert_eq!(m.len(), alpha.len() * cols, "axpy_rows: m has {} values, want {}×{cols}", m.len(), alpha.len());
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; `m` holds alpha.len() × cols values.
        SimdLevel::Avx512 => unsafe { x86::axpy_rows_avx512(alpha, m, y) },
        _ => {
            for (r, &a) in alpha.iter().enumerate() {
                axpy(a, &m[r * cols..(r + 1) * cols], y);
            }
        }
    }
}

/// `y[i, :] += Σ_r a[i, r] · m[r, :]` for every row `i` of `a` (`[n, k]`), `m` `[k, cols]`, `y`
/// `[n, cols]`: [`axpy_rows`] for many rows at once, with the same chain per output (so the same
/// bits), reading `m` once per eight rows of `y` instead of once per row.
pub fn gemm_rows(a: &[f32], k: usize, m: &[f32], y: &mut [f32]) {
    let cols = m.len().checked_div(k).unwrap_or(0);
    assert_eq!(m.len(), k * cols, "gemm_rows: m has {} values, not a multiple of {k}", m.len());
    let n = a.len().checked_div(k).unwrap_or(0);
    assert_eq!(a.len(), n * k, "gemm_rows: a has {} values, not {n}×{k}", a.len());
    assert_eq!(y.len(), n * cols, "gemm_rows: y has {} values, want {n}×{cols}", y.len());
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; the shapes were checked above.
        SimdLevel::Avx512 => unsafe { x86::gemm_rows_avx512(a, k, m, y, cols) },
        _ => {
            for (ai, yi) in a.chunks_exact(k.max(1)).zip(y.chunks_exact_mut(cols.max(1))) {
                axpy_rows(ai, m, yi);
            }
        }
    }
}

/// Decay exponents below this are taken as a factor of exactly 0 in the KDA chunk form.
///
/// Why: a strongly decaying channel (gates down to −5 a token) drives e^{Γ} far below 1 within a
/// chunk, into f32's subnormal range, and every product touching a subnormal takes a microcode
/// assist of about a hundred cycles: measured, a 128-token prefill's chunk work ran ten times
/// slower with the release's gate range than with weak gates. A dropped factor is below
/// e^−27 ≈ 2⁻³⁹ of its operand, fifteen bits under f32's rounding of the terms it would have
/// been summed with, so no result moves by more than that. The floor is high enough that the
/// products of two kept factors (e^−54) with unit-scale q and k stay normal.
pub const DECAY_FLOOR: f32 = -27.0;

/// `x · e^d`, or exactly 0 when `d` is below [`DECAY_FLOOR`] (NaN propagates).
#[inline]
pub fn decayed(x: f32, d: f32) -> f32 {
    if d < DECAY_FLOOR { 0.0 } else { x * d.exp() }
}

/// The two decayed dot products of the KDA chunk form: with w = k_j ⊙ e^{Γ_i − Γ_j} (factors
/// below [`DECAY_FLOOR`] dropped), returns (q_i · w, k_i · w). All slices have the same length.
pub fn decayed_dots(qi: &[f32], ki: &[f32], kj: &[f32], gi: &[f32], gj: &[f32]) -> (f32, f32) {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; the x86 kernel reads `qi.len()` values of each.
        SimdLevel::Avx512 if [ki.len(), kj.len(), gi.len(), gj.len()].iter().all(|&n| n == qi.len()) => unsafe {
            x86::decayed_dots_avx512(qi, ki, kj, gi, gj)
        },
        _ => {
            let (mut sq, mut sk) = (0f32, 0f32);
            for c in 0..qi.len() {
                let kw = decayed(kj[c], gi[c] - gj[c]);
                sq += qi[c] * kw;
                sk += ki[c] * kw;
            }
            (sq, sk)
        }
    }
}

/// `out = x ⊙ e^{a − b}` (`b` absent: `e^a`), the KDA chunk form's decay factors, with factors
/// below [`DECAY_FLOOR`] dropped.
pub fn mul_exp_diff(x: &[f32], a: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
    let n = out.len();
    assert!(x.len() >= n && a.len() >= n && b.is_none_or(|b| b.len() >= n), "mul_exp_diff: short input");
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; every input holds at least out.len() values.
        SimdLevel::Avx512 => unsafe { x86::mul_exp_diff_avx512(x, a, b, out) },
        _ => {
            for c in 0..n {
                let d = match b {
                    Some(b) => a[c] - b[c],
                    None => a[c],
                };
                out[c] = decayed(x[c], d);
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

    /// e^x per lane: x = n ln2 + r (ln2 in two parts), a degree-6 polynomial for e^r on
    /// |r| ≤ ln2/2 (Cephes' expf coefficients, about 1 ulp), scaled by 2^n with `vscalefps`
    /// (which underflows to 0 and overflows to ∞ like the libm call it replaces).
    #[target_feature(enable = "avx512f")]
    pub fn exp_avx512(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72)), _mm512_set1_ps(-104.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let e = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        _mm512_scalef_ps(e, n)
    }

    /// e^d, or 0 where d is below [`super::DECAY_FLOOR`]; the exponent is clamped first so that
    /// the dropped lanes never compute a subnormal either (NaN propagates).
    #[target_feature(enable = "avx512f")]
    fn floored_exp(d: __m512) -> __m512 {
        let floor = _mm512_set1_ps(super::DECAY_FLOOR);
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, floor);
        _mm512_maskz_mov_ps(keep, exp_avx512(_mm512_mask_mov_ps(floor, keep, d)))
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_rows_avx512(alpha: &[f32], m: &[f32], y: &mut [f32]) {
        let cols = y.len();
        let mut c = 0;
        while c < cols {
            let mask: __mmask16 = if cols - c >= 16 { 0xffff } else { ((1u32 << (cols - c)) - 1) as __mmask16 };
            // SAFETY: masked lanes c..min(c+16, cols) of y and of each of m's rows.
            unsafe {
                let mut acc = _mm512_maskz_loadu_ps(mask, y.as_ptr().add(c));
                for (r, &a) in alpha.iter().enumerate() {
                    let row = _mm512_maskz_loadu_ps(mask, m.as_ptr().add(r * cols + c));
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(a), row, acc);
                }
                _mm512_mask_storeu_ps(y.as_mut_ptr().add(c), mask, acc);
            }
            c += 16;
        }
    }

    /// [`super::gemm_rows`]: blocks of 4 rows × 64 columns in registers (each loaded row of `m`
    /// and each broadcast of `a` feeds four products).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemm_rows_avx512(a: &[f32], k: usize, m: &[f32], y: &mut [f32], cols: usize) {
        let n = y.len() / cols.max(1);
        let mut c = 0;
        while c < cols {
            let nv = (cols - c).div_ceil(16).min(4);
            let mut i0 = 0;
            while i0 < n {
                let nr = (n - i0).min(4);
                // SAFETY: forwarded; the block lies inside y, m and a.
                unsafe {
                    match (nr, nv) {
                        (1, 1) => gemm_block::<1, 1>(a, k, m, y, cols, i0, c),
                        (1, 2) => gemm_block::<1, 2>(a, k, m, y, cols, i0, c),
                        (1, 3) => gemm_block::<1, 3>(a, k, m, y, cols, i0, c),
                        (1, 4) => gemm_block::<1, 4>(a, k, m, y, cols, i0, c),
                        (2, 1) => gemm_block::<2, 1>(a, k, m, y, cols, i0, c),
                        (2, 2) => gemm_block::<2, 2>(a, k, m, y, cols, i0, c),
                        (2, 3) => gemm_block::<2, 3>(a, k, m, y, cols, i0, c),
                        (2, 4) => gemm_block::<2, 4>(a, k, m, y, cols, i0, c),
                        (3, 1) => gemm_block::<3, 1>(a, k, m, y, cols, i0, c),
                        (3, 2) => gemm_block::<3, 2>(a, k, m, y, cols, i0, c),
                        (3, 3) => gemm_block::<3, 3>(a, k, m, y, cols, i0, c),
                        (3, 4) => gemm_block::<3, 4>(a, k, m, y, cols, i0, c),
                        (4, 1) => gemm_block::<4, 1>(a, k, m, y, cols, i0, c),
                        (4, 2) => gemm_block::<4, 2>(a, k, m, y, cols, i0, c),
                        (4, 3) => gemm_block::<4, 3>(a, k, m, y, cols, i0, c),
                        (4, 4) => gemm_block::<4, 4>(a, k, m, y, cols, i0, c),
                        _ => unreachable!("row and vector counts are 1 to 4"),
                    }
                }
                i0 += nr;
            }
            c += 16 * nv;
        }
    }

    /// Rows `i0..i0+NR` × `NV` 16-column vectors from column `c` (the last one masked at `cols`).
    ///
    /// SAFETY (caller): AVX-512F; `a` is `[n, k]`, `m` `[k, cols]`, `y` `[n, cols]` with
    /// `i0 + NR <= n` and `c + 16 (NV − 1) < cols`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // constant ranges unroll into named registers
    unsafe fn gemm_block<const NR: usize, const NV: usize>(
        a: &[f32],
        k: usize,
        m: &[f32],
        y: &mut [f32],
        cols: usize,
        i0: usize,
        c: usize,
    ) {
        let mask = |v: usize| -> __mmask16 {
            let left = cols - (c + 16 * v);
            if left >= 16 { 0xffff } else { ((1u32 << left) - 1) as __mmask16 }
        };
        // SAFETY (all accesses): masked lanes inside rows of y and m; a's rows i0..i0+NR.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; NR];
            for i in 0..NR {
                for v in 0..NV {
                    acc[i][v] = _mm512_maskz_loadu_ps(mask(v), y.as_ptr().add((i0 + i) * cols + c + 16 * v));
                }
            }
            for r in 0..k {
                let mut row = [_mm512_setzero_ps(); NV];
                for v in 0..NV {
                    row[v] = _mm512_maskz_loadu_ps(mask(v), m.as_ptr().add(r * cols + c + 16 * v));
                }
                for i in 0..NR {
                    let s = _mm512_set1_ps(*a.get_unchecked((i0 + i) * k + r));
                    for v in 0..NV {
                        acc[i][v] = _mm512_fmadd_ps(s, row[v], acc[i][v]);
                    }
                }
            }
            for i in 0..NR {
                for v in 0..NV {
                    _mm512_mask_storeu_ps(y.as_mut_ptr().add((i0 + i) * cols + c + 16 * v), mask(v), acc[i][v]);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn mul_exp_diff_avx512(x: &[f32], a: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
        let n = out.len();
        let mut c = 0;
        while c < n {
            let m: __mmask16 = if n - c >= 16 { 0xffff } else { ((1u32 << (n - c)) - 1) as __mmask16 };
            // SAFETY: masked lanes c..min(c+16, n); the caller checked every slice holds n values.
            unsafe {
                let mut d = _mm512_maskz_loadu_ps(m, a.as_ptr().add(c));
                if let Some(b) = b {
                    d = _mm512_sub_ps(d, _mm512_maskz_loadu_ps(m, b.as_ptr().add(c)));
                }
                let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x.as_ptr().add(c)), floored_exp(d));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, v);
            }
            c += 16;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn decayed_dots_avx512(qi: &[f32], ki: &[f32], kj: &[f32], gi: &[f32], gj: &[f32]) -> (f32, f32) {
        let n = qi.len();
        let (mut sq, mut sk) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut c = 0;
        while c < n {
            let m: __mmask16 = if n - c >= 16 { 0xffff } else { ((1u32 << (n - c)) - 1) as __mmask16 };
            // SAFETY: the masked loads read lanes c..min(c+16, n) of slices holding n values.
            let (q, k, kk, a, b) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m, qi.as_ptr().add(c)),
                    _mm512_maskz_loadu_ps(m, ki.as_ptr().add(c)),
                    _mm512_maskz_loadu_ps(m, kj.as_ptr().add(c)),
                    _mm512_maskz_loadu_ps(m, gi.as_ptr().add(c)),
                    _mm512_maskz_loadu_ps(m, gj.as_ptr().add(c)),
                )
            };
            let kw = _mm512_mul_ps(kk, floored_exp(_mm512_sub_ps(a, b)));
            sq = _mm512_fmadd_ps(q, kw, sq);
            sk = _mm512_fmadd_ps(k, kw, sk);
            c += 16;
        }
        (_mm512_reduce_add_ps(sq), _mm512_reduce_add_ps(sk))
    }

    /// Four [`dot_avx512`] chains side by side: the same operations per row, in the same order.
    ///
    /// SAFETY (caller): AVX-512F; every row of `b` holds at least `a.len()` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_avx512(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        let n = a.len();
        let mut acc0 = [_mm512_setzero_ps(); 4];
        let mut acc1 = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): lanes below n of a and of each row (n ≤ its length).
        unsafe {
            while i + 32 <= n {
                let (a0, a1) = (_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(a.as_ptr().add(i + 16)));
                for j in 0..4 {
                    acc0[j] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(b[j].as_ptr().add(i)), acc0[j]);
                    acc1[j] = _mm512_fmadd_ps(a1, _mm512_loadu_ps(b[j].as_ptr().add(i + 16)), acc1[j]);
                }
                i += 32;
            }
            if i + 16 <= n {
                let a0 = _mm512_loadu_ps(a.as_ptr().add(i));
                for j in 0..4 {
                    acc0[j] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(b[j].as_ptr().add(i)), acc0[j]);
                }
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                let a1 = _mm512_maskz_loadu_ps(m, a.as_ptr().add(i));
                for j in 0..4 {
                    acc1[j] = _mm512_fmadd_ps(a1, _mm512_maskz_loadu_ps(m, b[j].as_ptr().add(i)), acc1[j]);
                }
            }
        }
        [0, 1, 2, 3].map(|j| _mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])))
    }

    /// [`super::axpy_rows_by`]: 64 lanes of `y` at a time in registers across every row, each
    /// lane updated as [`axpy_avx512`] would (FMA on whole vectors; the last `y.len() % 16` lanes
    /// multiply and add, as its scalar tail does).
    ///
    /// SAFETY (caller): AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_rows_by_avx512<'r>(alphas: &[f32], row: &dyn Fn(usize) -> &'r [f32], y: &mut [f32]) {
        let n = y.len();
        for i in 0..alphas.len() {
            assert!(row(i).len() >= n, "axpy_rows_by: row {i} has {} values, y {n}", row(i).len());
        }
        let body = n - n % 16;
        let mut c = 0;
        while c < body {
            let nv = ((body - c) / 16).min(4);
            // SAFETY: lanes c..c + 16 nv lie inside y and (checked above) every row.
            unsafe {
                match nv {
                    1 => axpy_rows_block::<1>(alphas, row, y, c),
                    2 => axpy_rows_block::<2>(alphas, row, y, c),
                    3 => axpy_rows_block::<3>(alphas, row, y, c),
                    _ => axpy_rows_block::<4>(alphas, row, y, c),
                }
            }
            c += 16 * nv;
        }
        for (i, &a) in alphas.iter().enumerate() {
            for (yj, xj) in y[body..].iter_mut().zip(&row(i)[body..n]) {
                *yj += a * xj;
            }
        }
    }

    /// Lanes `c..c + 16 NV` of [`axpy_rows_by_avx512`].
    ///
    /// SAFETY (caller): AVX-512F; those lanes lie inside `y` and every row.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // constant ranges unroll into named registers
    unsafe fn axpy_rows_block<'r, const NV: usize>(
        alphas: &[f32],
        row: &dyn Fn(usize) -> &'r [f32],
        y: &mut [f32],
        c: usize,
    ) {
        // SAFETY (all accesses): lanes c..c + 16 NV of y and of each row (caller).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); NV];
            for v in 0..NV {
                acc[v] = _mm512_loadu_ps(y.as_ptr().add(c + 16 * v));
            }
            for (i, &a) in alphas.iter().enumerate() {
                let (va, r) = (_mm512_set1_ps(a), row(i).as_ptr().add(c));
                for v in 0..NV {
                    acc[v] = _mm512_fmadd_ps(va, _mm512_loadu_ps(r.add(16 * v)), acc[v]);
                }
            }
            for v in 0..NV {
                _mm512_storeu_ps(y.as_mut_ptr().add(c + 16 * v), acc[v]);
            }
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    /// `gemm_rows` is `axpy_rows` row by row, bit for bit, over shapes with partial row blocks and
    /// partial (masked) column vectors.
    #[test]
    fn gemm_rows_equals_axpy_rows_bit_for_bit() {
        let mut s = 0x9e37_79b9u32;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32 - 0.5) * 3.0
        };
        for (n, k, cols) in [(1, 1, 1), (5, 7, 17), (9, 3, 70), (64, 128, 128), (13, 64, 50), (6, 16, 129)] {
            let a: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let m: Vec<f32> = (0..k * cols).map(|_| next()).collect();
            let y0: Vec<f32> = (0..n * cols).map(|_| next()).collect();
            let mut got = y0.clone();
            gemm_rows(&a, k, &m, &mut got);
            let mut want = y0;
            for (ai, yi) in a.chunks_exact(k).zip(want.chunks_exact_mut(cols)) {
                axpy_rows(ai, &m, yi);
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{n}×{k}·{k}×{cols}: value {i}: {g} vs {w}");
            }
        }
    }
}
