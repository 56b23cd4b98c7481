//! Kimi Delta Attention core for one head (spec §2.4): the token recurrence (decode) and the
//! chunked WY form (prefill). The state `S` is key-major `[K, V]`:
//! `S_t = (I − β k kᵀ) diag(e^{g_t}) S_{t−1} + β k vᵀ`, `o_t = S_tᵀ q_t`.

use super::simd::{SimdLevel, axpy, axpy_rows, decayed_dots, dot, dot4, gemm_rows, mul_exp_diff, simd_level};

/// Tokens per chunk in the chunked prefill (fla's C).
pub const CHUNK: usize = 64;

/// Tokens per sub-chunk: decay factors inside one are exact per pair, across ones factored.
const SUB_CHUNK: usize = 16;

/// One recurrent step: decay, error against the decayed state, delta-rule write, read.
/// `q` is already L2-normalised and scaled, `k` L2-normalised, `g` the per-key log decay.
pub fn kda_step(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, out: &mut [f32]) {
    let dk = k.len();
    let dv = v.len();
    debug_assert_eq!(state.len(), dk * dv);
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 && state.len() == dk * dv && q.len() == dk && g.len() == dk && out.len() == dv
    {
        return with_tmp(dk, |decay| {
            decay.copy_from_slice(g);
            super::elementwise::exp_in_place(decay);
            let kq = dot(k, q);
            // SAFETY: the level was detected at run time and every length was checked above.
            unsafe {
                match dv {
                    16 => x86::step_rows_avx512::<1>(state, q, k, v, decay, beta, kq, out),
                    32 => x86::step_rows_avx512::<2>(state, q, k, v, decay, beta, kq, out),
                    64 => x86::step_rows_avx512::<4>(state, q, k, v, decay, beta, kq, out),
                    128 => x86::step_rows_avx512::<8>(state, q, k, v, decay, beta, kq, out),
                    _ => x86::step_avx512(state, q, k, v, decay, beta, kq, out),
                }
            };
        });
    }
    with_tmp(dv, |pred| {
        // pred = S_decᵀ k and read = S_decᵀ q, in one pass over the decayed rows.
        out.fill(0.0);
        for j in 0..dk {
            let row = &mut state[j * dv..(j + 1) * dv];
            let d = g[j].exp();
            row.iter_mut().for_each(|s| *s *= d);
            axpy(k[j], row, pred);
            axpy(q[j], row, out);
        }
        // e = v − pred (in place); S += β k eᵀ; o = S_decᵀ q + β (k·q) e.
        let err = pred;
        err.iter_mut().zip(v).for_each(|(e, a)| *e = beta * (a - *e));
        for j in 0..dk {
            axpy(k[j], err, &mut state[j * dv..(j + 1) * dv]);
        }
        axpy(dot(k, q), err, out);
    })
}

/// Runs `f` on `n` zeroed floats: on the stack up to 256 (K3's heads are 128 wide), so a decode
/// step allocates nothing per head; on the heap beyond.
fn with_tmp<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    if n <= 256 {
        let mut a = [0f32; 256];
        f(&mut a[..n])
    } else {
        f(&mut vec![0f32; n])
    }
}

/// Scratch reused across chunks and heads by one thread.
#[derive(Default)]
pub struct ChunkScratch {
    gamma: Vec<f32>,
    akk: Vec<f32>,
    aqk: Vec<f32>,
    delta: Vec<f32>,
    tmp: Vec<f32>,
    coef: Vec<f32>,
    /// Sub-chunk factoring: q_i, k_i scaled by e^{Γ_i − Γ_R}, and k_j by e^{Γ_R − Γ_j}.
    qs: Vec<f32>,
    ks: Vec<f32>,
    kr: Vec<f32>,
    /// `[n, K]` rows multiplied into the state at once (−k_i ⊙ e^{Γ_i}, then q_i ⊙ e^{Γ_i}).
    rows: Vec<f32>,
    /// `[K, n]`: k_i ⊙ e^{Γ_C − Γ_i} transposed, for the state update.
    krt: Vec<f32>,
}

/// Processes `n ≤ CHUNK` tokens of one head in the WY/UT form and advances `state`.
/// Layouts: `q`, `k`, `g` `[n, K]`; `v`, `out` `[n, V]`; `beta` `[n]`.
/// Decay factors only ever appear as e^{Γ_i − Γ_j} with i ≥ j, or (across sub-chunks, when
/// every g ≤ 0) as two factors of that form each ≤ 1, so nothing overflows however strong the
/// decay.
#[allow(clippy::too_many_arguments)]
pub fn kda_chunk(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
    s: &mut ChunkScratch,
) {
    let n = beta.len();
    debug_assert!(n <= CHUNK);
    s.gamma.clear();
    s.gamma.resize(n * dk, 0.0);
    for i in 0..n {
        for c in 0..dk {
            let prev = if i == 0 { 0.0 } else { s.gamma[(i - 1) * dk + c] };
            s.gamma[i * dk + c] = prev + g[i * dk + c];
        }
    }
    // A_kk (strictly lower, includes β_i) and A_qk (lower incl. diagonal).
    s.akk.clear();
    s.akk.resize(n * n, 0.0);
    s.aqk.clear();
    s.aqk.resize(n * n, 0.0);
    // With every g ≤ 0 (KDA's gates are lower_bound · σ(·), lower_bound < 0), pairs across
    // sub-chunks factor through the cumulative decay just before i's sub-chunk, Γ_R:
    // e^{Γ_i − Γ_j} = e^{Γ_i − Γ_R} · e^{Γ_R − Γ_j}, both factors ≤ 1 (no overflow), so those
    // pairs are plain dot products of pre-scaled rows and only pairs inside a sub-chunk need
    // their own exponentials (as fla's sub-chunked kernels).
    let factor = g[..n * dk].iter().all(|&x| x <= 0.0);
    for b0 in (0..n).step_by(SUB_CHUNK) {
        let b1 = (b0 + SUB_CHUNK).min(n);
        let exact_from = if factor { b0 } else { 0 };
        let gam = &s.gamma;
        for i in b0..b1 {
            let (qi, ki, gi) = (&q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk], &gam[i * dk..(i + 1) * dk]);
            for j in exact_from..=i {
                let (kj, gj) = (&k[j * dk..(j + 1) * dk], &gam[j * dk..(j + 1) * dk]);
                let (sq, sk) = decayed_dots(qi, ki, kj, gi, gj);
                s.aqk[i * n + j] = sq;
                if j < i {
                    s.akk[i * n + j] = beta[i] * sk;
                }
            }
        }
        if exact_from == 0 {
            continue;
        }
        let gr = &gam[(b0 - 1) * dk..b0 * dk];
        s.kr.clear();
        s.kr.resize(b0 * dk, 0.0);
        for j in 0..b0 {
            let (kj, gj) = (&k[j * dk..(j + 1) * dk], &gam[j * dk..(j + 1) * dk]);
            mul_exp_diff(kj, gr, Some(gj), &mut s.kr[j * dk..(j + 1) * dk]);
        }
        // Two rows i at a time: four dot products per kr_j, each the bits of its own `dot`.
        s.qs.resize(2 * dk, 0.0);
        s.ks.resize(2 * dk, 0.0);
        let mut i = b0;
        while i < b1 {
            let pair = (b1 - i).min(2);
            for r in 0..pair {
                let gi = &gam[(i + r) * dk..(i + r + 1) * dk];
                mul_exp_diff(&q[(i + r) * dk..(i + r + 1) * dk], gi, Some(gr), &mut s.qs[r * dk..(r + 1) * dk]);
                mul_exp_diff(&k[(i + r) * dk..(i + r + 1) * dk], gi, Some(gr), &mut s.ks[r * dk..(r + 1) * dk]);
            }
            for j in 0..b0 {
                let kr = &s.kr[j * dk..(j + 1) * dk];
                if pair == 2 {
                    let (qs, ks) = (&s.qs, &s.ks);
                    let [q0, k0, q1, k1] = dot4(kr, [&qs[..dk], &ks[..dk], &qs[dk..], &ks[dk..]]);
                    s.aqk[i * n + j] = q0;
                    s.akk[i * n + j] = beta[i] * k0;
                    s.aqk[(i + 1) * n + j] = q1;
                    s.akk[(i + 1) * n + j] = beta[i + 1] * k1;
                } else {
                    s.aqk[i * n + j] = dot(&s.qs[..dk], kr);
                    s.akk[i * n + j] = beta[i] * dot(&s.ks[..dk], kr);
                }
            }
            i += pair;
        }
    }
    let gam = &s.gamma;
    // Δ = (I + A_kk)⁻¹ diag(β) (v − (e^Γ ⊙ k) S₀) by forward substitution, row by row; the
    // products with S₀ of every row at once first (each row's chain as one row at a time).
    s.delta.clear();
    s.delta.extend_from_slice(&v[..n * dv]);
    s.rows.clear();
    s.rows.resize(n * dk, 0.0);
    for i in 0..n {
        let r = &mut s.rows[i * dk..(i + 1) * dk];
        mul_exp_diff(&k[i * dk..(i + 1) * dk], &gam[i * dk..(i + 1) * dk], None, r);
        r.iter_mut().for_each(|t| *t = -*t);
    }
    gemm_rows(&s.rows, dk, &state[..dk * dv], &mut s.delta);
    for i in 0..n {
        let (done, rest) = s.delta.split_at_mut(i * dv);
        let di = &mut rest[..dv];
        di.iter_mut().for_each(|x| *x *= beta[i]);
        s.coef.clear();
        s.coef.extend(s.akk[i * n..i * n + i].iter().map(|a| -a));
        axpy_rows(&s.coef, &done[..i * dv], di);
    }
    // O_i = (q_i ⊙ e^{Γ_i}) S₀ + Σ_{j≤i} A_qk[i,j] Δ_j (A_qk is zero above the diagonal).
    for i in 0..n {
        mul_exp_diff(&q[i * dk..(i + 1) * dk], &gam[i * dk..(i + 1) * dk], None, &mut s.rows[i * dk..(i + 1) * dk]);
    }
    let out = &mut out[..n * dv];
    out.fill(0.0);
    gemm_rows(&s.rows, dk, &state[..dk * dv], out);
    gemm_rows(&s.aqk, n, &s.delta, out);
    // S_C = diag(e^{Γ_C}) S₀ + Σ_i (k_i ⊙ e^{Γ_C − Γ_i}) Δ_iᵀ.
    let last = &gam[(n - 1) * dk..n * dk];
    s.kr.clear();
    s.kr.resize(dk, 0.0);
    s.krt.clear();
    s.krt.resize(dk * n, 0.0);
    for i in 0..n {
        mul_exp_diff(&k[i * dk..(i + 1) * dk], last, Some(&gam[i * dk..(i + 1) * dk]), &mut s.kr);
        for (c, v) in s.kr.iter().enumerate() {
            s.krt[c * n + i] = *v;
        }
    }
    s.tmp.clear();
    s.tmp.resize(dk, 1.0);
    s.qs.resize(dk, 0.0);
    mul_exp_diff(&s.tmp, last, None, &mut s.qs);
    for c in 0..dk {
        let d = s.qs[c];
        state[c * dv..(c + 1) * dv].iter_mut().for_each(|x| *x *= d);
    }
    gemm_rows(&s.krt, n, &s.delta, &mut state[..dk * dv]);
}

/// Runs `tokens` tokens of one head through the chunked form (chunks of `CHUNK`, last one partial).
#[allow(clippy::too_many_arguments)]
pub fn kda_prefill(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
) {
    let mut scratch = ChunkScratch::default();
    let tokens = beta.len();
    let mut t0 = 0;
    while t0 < tokens {
        let t1 = (t0 + CHUNK).min(tokens);
        kda_chunk(
            state,
            &q[t0 * dk..t1 * dk],
            &k[t0 * dk..t1 * dk],
            &v[t0 * dv..t1 * dv],
            &g[t0 * dk..t1 * dk],
            &beta[t0..t1],
            &mut out[t0 * dv..t1 * dv],
            dk,
            dv,
            &mut scratch,
        );
        t0 = t1;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The recurrent step over whole rows of `16 N` values: a first pass streams the rows in
    /// memory order, decaying each in registers into `pred` and the read; a second pass decays
    /// them again (the same product, so the same bits) and writes the delta-rule update. The
    /// state is read from memory once (the second pass finds it in the caches) and written
    /// once, in memory order — faster from cold memory than column blocks, whose rows lie a
    /// row's length apart. Every value is the same chain of operations as in [`step_avx512`].
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn step_rows_avx512<const N: usize>(
        state: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        decay: &[f32],
        beta: f32,
        kq: f32,
        out: &mut [f32],
    ) {
        let dv = 16 * N;
        debug_assert!(v.len() == dv && out.len() == dv && state.len() == k.len() * dv);
        // SAFETY: rows j < k.len() of `dv` values lie inside `state`; v and out hold dv values.
        unsafe {
            let mut pred = [_mm512_setzero_ps(); N];
            let mut read = [_mm512_setzero_ps(); N];
            for j in 0..k.len() {
                let p = state.as_ptr().add(j * dv);
                let (d, kj, qj) = (_mm512_set1_ps(decay[j]), _mm512_set1_ps(k[j]), _mm512_set1_ps(q[j]));
                for n in 0..N {
                    let row = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * n)), d);
                    pred[n] = _mm512_fmadd_ps(kj, row, pred[n]);
                    read[n] = _mm512_fmadd_ps(qj, row, read[n]);
                }
            }
            let b = _mm512_set1_ps(beta);
            let mut err = [_mm512_setzero_ps(); N];
            for (n, (e, p)) in err.iter_mut().zip(pred).enumerate() {
                *e = _mm512_mul_ps(b, _mm512_sub_ps(_mm512_loadu_ps(v.as_ptr().add(16 * n)), p));
            }
            for j in 0..k.len() {
                let p = state.as_mut_ptr().add(j * dv);
                let (d, kj) = (_mm512_set1_ps(decay[j]), _mm512_set1_ps(k[j]));
                for (n, &e) in err.iter().enumerate() {
                    let row = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * n)), d);
                    _mm512_storeu_ps(p.add(16 * n), _mm512_fmadd_ps(kj, e, row));
                }
            }
            let kq = _mm512_set1_ps(kq);
            for (n, (e, r)) in err.into_iter().zip(read).enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * n), _mm512_fmadd_ps(kq, e, r));
            }
        }
    }

    /// The recurrent step one 16-column block of the state at a time: decay the block's rows and
    /// gather `pred` and the read in registers, then write the delta-rule update into the same
    /// rows while they are still in L1 — the state is read once and written once.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn step_avx512(
        state: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        decay: &[f32],
        beta: f32,
        kq: f32,
        out: &mut [f32],
    ) {
        let (dk, dv) = (k.len(), v.len());
        let mut c = 0;
        while c < dv {
            let m: __mmask16 = if dv - c >= 16 { 0xffff } else { ((1u32 << (dv - c)) - 1) as __mmask16 };
            // SAFETY: masked lanes c..min(c+16, dv) of rows of `dv` values (state is dk × dv).
            unsafe {
                let mut pred = _mm512_setzero_ps();
                let mut read = _mm512_setzero_ps();
                for j in 0..dk {
                    let p = state.as_mut_ptr().add(j * dv + c);
                    let row = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p), _mm512_set1_ps(decay[j]));
                    _mm512_mask_storeu_ps(p, m, row);
                    pred = _mm512_fmadd_ps(_mm512_set1_ps(k[j]), row, pred);
                    read = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), row, read);
                }
                let err = _mm512_mul_ps(
                    _mm512_set1_ps(beta),
                    _mm512_sub_ps(_mm512_maskz_loadu_ps(m, v.as_ptr().add(c)), pred),
                );
                for (j, &kj) in k.iter().enumerate() {
                    let p = state.as_mut_ptr().add(j * dv + c);
                    _mm512_mask_storeu_ps(p, m, _mm512_fmadd_ps(_mm512_set1_ps(kj), err, _mm512_maskz_loadu_ps(m, p)));
                }
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, _mm512_fmadd_ps(_mm512_set1_ps(kq), err, read));
            }
            c += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-order step (heads 16 to 128 wide; K3's are 128, the goldens' 16) and the
    /// column-block step (other widths) are the same chain of operations per value: the same
    /// state and output bits from the same inputs, over several steps of a decaying, updating
    /// state.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn row_order_step_gives_the_column_block_steps_bits() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut next = crate::cpu::uniform_stream(0x9e37_79b9);
        for (dk, dv) in [(128usize, 128usize), (16, 16), (48, 32), (64, 64)] {
            let mut rows: Vec<f32> = (0..dk * dv).map(|_| next()).collect();
            let mut blocks = rows.clone();
            for step in 0..4 {
                let q: Vec<f32> = (0..dk).map(|_| next()).collect();
                let k: Vec<f32> = (0..dk).map(|_| next()).collect();
                let v: Vec<f32> = (0..dv).map(|_| next()).collect();
                let decay: Vec<f32> = (0..dk).map(|_| (next() - 0.5).exp()).collect();
                let (beta, kq) = (next() + 0.5, next());
                let (mut o_rows, mut o_blocks) = (vec![0f32; dv], vec![0f32; dv]);
                // SAFETY: AVX-512 was detected; every length is dk × dv, dk or dv as both require.
                unsafe {
                    match dv {
                        16 => x86::step_rows_avx512::<1>(&mut rows, &q, &k, &v, &decay, beta, kq, &mut o_rows),
                        32 => x86::step_rows_avx512::<2>(&mut rows, &q, &k, &v, &decay, beta, kq, &mut o_rows),
                        64 => x86::step_rows_avx512::<4>(&mut rows, &q, &k, &v, &decay, beta, kq, &mut o_rows),
                        _ => x86::step_rows_avx512::<8>(&mut rows, &q, &k, &v, &decay, beta, kq, &mut o_rows),
                    }
                    x86::step_avx512(&mut blocks, &q, &k, &v, &decay, beta, kq, &mut o_blocks);
                }
                let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(&o_rows, &o_blocks), "{dk}x{dv}, step {step}: outputs differ");
                assert!(same(&rows, &blocks), "{dk}x{dv}, step {step}: states differ");
            }
        }
    }
}
