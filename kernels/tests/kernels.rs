//! Kernel checks against plain f64 loops written here. `.ci/run` runs this file once per SIMD
//! level (`KIMI_SIMD=scalar|avx2|avx512`), so every dispatched path is covered.

mod common;

use kimi_kernels::cpu::bf16::{bf16_bits_to_f32, f32_to_bf16_bits};
use kimi_kernels::cpu::kda::{kda_prefill, kda_step};
use kimi_kernels::cpu::mxfp4::quantize_rows;
use kimi_kernels::{Bf16Matrix, F32Matrix, Matrix, Mxfp4Matrix};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], tokens: usize) -> Vec<f64> {
    let mut out = vec![0f64; tokens * rows];
    for t in 0..tokens {
        for r in 0..rows {
            out[t * rows + r] = (0..cols).map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64).sum();
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn bf16_matmul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    // Odd shapes exercise row and column tails; the large one takes the threaded path.
    for &(rows, cols) in &[(1, 1), (3, 17), (7, 33), (64, 128), (259, 515), (1024, 700)] {
        let wf = randn(&mut rng, rows * cols);
        let bits: Vec<u16> = wf.iter().map(|&v| f32_to_bf16_bits(v)).collect();
        let wq: Vec<f32> = bits.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        let m = Matrix::Bf16(Bf16Matrix::new(&bits, rows, cols));
        for tokens in [1, 2, 5, 9] {
            let x = randn(&mut rng, tokens * cols);
            let mut out = vec![0f32; tokens * rows];
            m.matmul(&x, tokens, &mut out);
            assert_close(&out, &reference(&wq, rows, cols, &x, tokens), 1e-4, "bf16");
        }
    }
}

#[test]
fn f32_matmul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    let (rows, cols) = (130, 77);
    let w = randn(&mut rng, rows * cols);
    let m = Matrix::F32(F32Matrix { data: &w, rows, cols });
    for tokens in [1, 4, 6] {
        let x = randn(&mut rng, tokens * cols);
        let mut out = vec![0f32; tokens * rows];
        m.matmul(&x, tokens, &mut out);
        assert_close(&out, &reference(&w, rows, cols, &x, tokens), 1e-4, "f32");
    }
}

#[test]
fn mxfp4_matmul_matches_its_dequantisation() {
    let mut rng = StdRng::seed_from_u64(3);
    for &(rows, cols) in &[(5, 32), (67, 96), (600, 256)] {
        let wf = randn(&mut rng, rows * cols);
        let (packed, scales) = quantize_rows(&wf, rows, cols);
        let mx = Mxfp4Matrix::new(&packed, &scales, rows, cols);
        let deq = mx.to_f32();
        // Quantisation keeps every value within a quarter of its group's scale of the original.
        for (a, b) in deq.iter().zip(&wf) {
            assert!((a - b).abs() <= 0.5 * b.abs().max(0.0625) + 1e-6, "quantised {a} vs {b}");
        }
        let m = Matrix::Mxfp4(mx);
        for tokens in [1, 3, 8] {
            let x = randn(&mut rng, tokens * cols);
            let mut out = vec![0f32; tokens * rows];
            m.matmul(&x, tokens, &mut out);
            assert_close(&out, &reference(&deq, rows, cols, &x, tokens), 1e-4, "mxfp4");
        }
    }
}

#[test]
fn transposed_matvec_matches_reference() {
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols) = (19, 45);
    let w = randn(&mut rng, rows * cols);
    let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
    let wq: Vec<f32> = bits.iter().map(|&b| bf16_bits_to_f32(b)).collect();
    let x = randn(&mut rng, rows);
    let mut out = vec![0f32; cols];
    Matrix::Bf16(Bf16Matrix::new(&bits, rows, cols)).matvec_transposed(&x, &mut out);
    let want: Vec<f64> = (0..cols).map(|c| (0..rows).map(|r| wq[r * cols + c] as f64 * x[r] as f64).sum()).collect();
    assert_close(&out, &want, 1e-5, "wt x");
}

/// The dispatched MXFP4 row decode gives the table path's bits for every byte and every scale
/// (including the subnormal 0 and the NaN 255).
#[test]
fn mxfp4_row_decode_is_bit_exact_on_every_path() {
    let cols = 256 * 32;
    let packed: Vec<u8> = (0..cols / 2).map(|i| (i % 256) as u8).collect();
    let scales: Vec<u8> = (0..cols / 32).map(|g| g as u8).collect();
    let m = Mxfp4Matrix::new(&packed, &scales, 1, cols);
    let mut got = vec![0f32; cols];
    m.row_to_f32(0, &mut got);
    let mut want = vec![0f32; cols];
    kimi_kernels::cpu::mxfp4::row_scalar(&packed, &scales, &mut want);
    for (c, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "column {c}: {a} vs {b}");
    }
}

/// Wᵀ x over several tokens equals the single-token product of each token, bit for bit (the
/// batched MLA absorption must not depend on the batch).
#[test]
fn transposed_matmul_is_batch_invariant() {
    let mut rng = StdRng::seed_from_u64(6);
    let (rows, cols, tokens) = (33, 70, 5);
    let bits: Vec<u16> = randn(&mut rng, rows * cols).iter().map(|&v| f32_to_bf16_bits(v)).collect();
    let m = Matrix::Bf16(Bf16Matrix::new(&bits, rows, cols));
    let x = randn(&mut rng, tokens * rows);
    let mut batched = vec![0f32; tokens * cols];
    m.matmul_transposed(&x, tokens, &mut batched);
    for t in 0..tokens {
        let mut one = vec![0f32; cols];
        m.matvec_transposed(&x[t * rows..(t + 1) * rows], &mut one);
        assert_eq!(one, batched[t * cols..(t + 1) * cols], "token {t}");
    }
}

/// The KDA chunk's decayed dot products (a vector e^x on AVX-512) against f64, for decay
/// differences from 0 down to −120 (past the floor, and where e^x underflows) and lengths that
/// leave a masked tail. Factors below `DECAY_FLOOR` are dropped; the exact sum differs from the
/// result by at most what the floor allows.
#[test]
fn decayed_dots_match_f64() {
    use kimi_kernels::cpu::simd::DECAY_FLOOR;
    let mut rng = StdRng::seed_from_u64(7);
    for n in [1, 15, 16, 33, 128] {
        for spread in [0.1f32, 5.0, 40.0, 120.0] {
            let q = randn(&mut rng, n);
            let k = randn(&mut rng, n);
            let kj = randn(&mut rng, n);
            let gj: Vec<f32> = (0..n).map(|_| rng.random_range(-10.0f32..0.0)).collect();
            let gi: Vec<f32> = gj.iter().map(|g| g - spread * rng.random_range(0.0f32..1.0)).collect();
            let (sq, sk) = kimi_kernels::cpu::simd::decayed_dots(&q, &k, &kj, &gi, &gj);
            let d = |c: usize| gi[c] - gj[c];
            let exact: Vec<f64> = (0..n).map(|c| kj[c] as f64 * (d(c) as f64).exp()).collect();
            let w: Vec<f64> = (0..n).map(|c| if d(c) < DECAY_FLOOR { 0.0 } else { exact[c] }).collect();
            let wq: f64 = (0..n).map(|c| q[c] as f64 * w[c]).sum();
            let wk: f64 = (0..n).map(|c| k[c] as f64 * w[c]).sum();
            let scale: f64 = w.iter().map(|x| x.abs()).sum::<f64>().max(1e-30);
            assert!(((sq as f64) - wq).abs() <= 1e-6 * scale, "n {n} spread {spread}: q·w {sq} vs {wq}");
            assert!(((sk as f64) - wk).abs() <= 1e-6 * scale, "n {n} spread {spread}: k·w {sk} vs {wk}");
            // Against the exact sum: off by at most the dropped terms, each under e^floor.
            let dropped: f64 = (0..n).map(|c| (q[c] as f64 * (exact[c] - w[c])).abs()).sum();
            let bound = (DECAY_FLOOR as f64).exp() * (0..n).map(|c| (q[c] * kj[c]).abs() as f64).sum::<f64>();
            assert!(dropped <= bound, "n {n} spread {spread}: dropped {dropped} over {bound}");
            let exact_q: f64 = (0..n).map(|c| q[c] as f64 * exact[c]).sum();
            assert!(((sq as f64) - exact_q).abs() <= 1e-6 * scale + bound, "n {n} spread {spread}");
        }
    }
}

/// `dot4` and `axpy_rows_by` (the MLA attention's blocked scores and context) give the bits of
/// `dot` per row and of one `axpy` per row in turn, for lengths with and without vector tails.
#[test]
fn blocked_dots_and_axpys_match_one_at_a_time() {
    use kimi_kernels::cpu::simd::{axpy, axpy_rows_by, dot, dot4};
    let mut rng = StdRng::seed_from_u64(12);
    for n in [1usize, 15, 16, 17, 31, 32, 33, 64, 255, 320] {
        let a = randn(&mut rng, n);
        let rows: Vec<Vec<f32>> = (0..9).map(|_| randn(&mut rng, n + 3)).collect();
        let got = dot4(&a, [&rows[0], &rows[1], &rows[2], &rows[3]]);
        for j in 0..4 {
            assert_eq!(got[j].to_bits(), dot(&a, &rows[j]).to_bits(), "n {n}: dot4 row {j}");
        }
        let alphas = randn(&mut rng, rows.len());
        let mut want = randn(&mut rng, n);
        let mut blocked = want.clone();
        for (r, &al) in rows.iter().zip(&alphas) {
            axpy(al, &r[..n], &mut want);
        }
        axpy_rows_by(&alphas, |i| &rows[i][..], &mut blocked);
        let same = want.iter().zip(&blocked).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "n {n}: axpy_rows_by differs from axpy row by row");
    }
}

/// The chunk form's decay factors: e^d within f32 rounding down to the floor, exactly 0 below it
/// (never a subnormal, which would cost a microcode assist in every product it meets), NaN kept.
#[test]
fn decay_factors_stop_at_the_floor() {
    use kimi_kernels::cpu::simd::{DECAY_FLOOR, mul_exp_diff};
    let n = 1000 + 5;
    let a: Vec<f32> = (0..n).map(|i| -(i as f32) * 0.13).collect();
    let mut x: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
    x[3] = f32::NAN;
    let mut out = vec![0f32; n];
    mul_exp_diff(&x, &a, None, &mut out);
    for i in 0..n {
        let want = if a[i] < DECAY_FLOOR { 0.0 } else { x[i] as f64 * (a[i] as f64).exp() };
        if i == 3 {
            assert!(out[i].is_nan());
            continue;
        }
        assert!(((out[i] as f64) - want).abs() <= 2e-7 * want.abs(), "d {}: {} vs {want}", a[i], out[i]);
        assert!(out[i] == 0.0 || out[i].is_normal(), "d {}: subnormal {}", a[i], out[i]);
    }
}

/// SiTU over rows (a vector tanh and σ on AVX-512) against f64, with and without the up cap,
/// from tiny to saturating inputs and a masked tail.
#[test]
fn situ_rows_match_f64() {
    let mut rng = StdRng::seed_from_u64(8);
    for linear_beta in [None, Some(3.0f32)] {
        let n = 1000 + 7;
        let gate: Vec<f32> = (0..n).map(|i| rng.random_range(-1.0f32..1.0) * [1e-4, 1.0, 30.0, 200.0][i % 4]).collect();
        let up: Vec<f32> = (0..n).map(|i| rng.random_range(-1.0f32..1.0) * [1e-3, 2.0, 50.0][i % 3]).collect();
        let mut got = gate.clone();
        kimi_kernels::cpu::situ::situ_rows(&mut got, &up, 10.0, linear_beta);
        for i in 0..n {
            let (a, u) = (gate[i] as f64, up[i] as f64);
            let g = 10.0 * (a / 10.0).tanh() / (1.0 + (-a).exp());
            let want = g * linear_beta.map_or(u, |bl| bl as f64 * (u / bl as f64).tanh());
            let tol = 1e-6 * want.abs() + 1e-7 * (g.abs() + u.abs());
            assert!(((got[i] as f64) - want).abs() <= tol, "a {a} u {u}: {} vs {want}", got[i]);
        }
    }
}

/// A run of axpys in one call equals the axpys one by one (within rounding of the tail lanes).
#[test]
fn axpy_rows_equals_axpys() {
    let mut rng = StdRng::seed_from_u64(9);
    for (rows, cols) in [(0, 5), (1, 16), (7, 33), (64, 128)] {
        let alpha = randn(&mut rng, rows);
        let m = randn(&mut rng, rows * cols);
        let y0 = randn(&mut rng, cols);
        let mut got = y0.clone();
        kimi_kernels::cpu::simd::axpy_rows(&alpha, &m, &mut got);
        let want: Vec<f64> = (0..cols)
            .map(|c| y0[c] as f64 + (0..rows).map(|r| alpha[r] as f64 * m[r * cols + c] as f64).sum::<f64>())
            .collect();
        assert_close(&got, &want, 1e-5, "axpy_rows");
    }
}

fn l2norm(v: &mut [f32]) {
    let n = (v.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
    v.iter_mut().for_each(|x| *x /= n);
}

/// The chunked (WY) prefill must equal the token recurrence, including partial last chunks,
/// strong decay (g near −5) and a non-zero incoming state.
#[test]
fn kda_chunked_prefill_equals_recurrence() {
    let mut rng = StdRng::seed_from_u64(5);
    for &(tokens, dk, dv) in &[(1, 8, 8), (37, 16, 8), (64, 16, 16), (65, 8, 24), (150, 32, 16), (200, 128, 128)] {
        let mut q = randn(&mut rng, tokens * dk);
        let mut k = randn(&mut rng, tokens * dk);
        for t in 0..tokens {
            l2norm(&mut q[t * dk..(t + 1) * dk]);
            l2norm(&mut k[t * dk..(t + 1) * dk]);
        }
        let v = randn(&mut rng, tokens * dv);
        let g: Vec<f32> = (0..tokens * dk).map(|_| -5.0 * rng.random_range(0.0f32..1.0)).collect();
        let beta: Vec<f32> = (0..tokens).map(|_| rng.random_range(0.0f32..1.0)).collect();
        let s0 = randn(&mut rng, dk * dv);

        let mut s_rec = s0.clone();
        let mut o_rec = vec![0f32; tokens * dv];
        for t in 0..tokens {
            kda_step(
                &mut s_rec,
                &q[t * dk..(t + 1) * dk],
                &k[t * dk..(t + 1) * dk],
                &v[t * dv..(t + 1) * dv],
                &g[t * dk..(t + 1) * dk],
                beta[t],
                &mut o_rec[t * dv..(t + 1) * dv],
            );
        }
        let mut s_chunk = s0.clone();
        let mut o_chunk = vec![0f32; tokens * dv];
        kda_prefill(&mut s_chunk, &q, &k, &v, &g, &beta, &mut o_chunk, dk, dv);
        let max_o = o_rec.iter().zip(&o_chunk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let max_s = s_rec.iter().zip(&s_chunk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(max_o < 1e-4 && max_s < 1e-4, "T={tokens} K={dk} V={dv}: |ΔO|={max_o} |ΔS|={max_s}");
        assert!(o_rec.iter().all(|x| x.is_finite()));
    }
}

/// Re-runs this test binary with each lower SIMD level forced (`KIMI_SIMD`), so the AVX2 and
/// scalar paths are checked on a machine that would otherwise always take AVX-512.
#[test]
fn every_simd_level_passes() {
    common::rerun_at_every_simd_level("every_simd_level_passes");
}

#[test]
fn forced_simd_level_is_respected() {
    use kimi_kernels::{SimdLevel, simd_level};
    match std::env::var("KIMI_SIMD").as_deref() {
        Ok("scalar") => assert_eq!(simd_level(), SimdLevel::Scalar),
        Ok("avx2") => assert!(simd_level() <= SimdLevel::Avx2),
        _ => {}
    }
}

#[test]
fn row_reductions_match_plain_loops() {
    use kimi_kernels::cpu::reduce::{log_sum_exp, top_k};
    let mut rng = StdRng::seed_from_u64(11);
    for n in [1usize, 15, 16, 17, 300, 163_840] {
        let mut v: Vec<f32> = (0..n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
        if n > 20 {
            v[7] = f32::NAN;
            v[9] = v[10]; // a tie
        }
        for t in [1.0f32, 0.7, 2.5] {
            let m = v.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
            let want = m / t as f64
                + v.iter().filter(|x| !x.is_nan()).map(|&x| ((x as f64 - m) / t as f64).exp()).sum::<f64>().ln();
            let got = log_sum_exp(&v, t) as f64;
            assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "n={n} t={t}: {got} vs {want}");
        }
        let mut all: Vec<(u32, f32)> =
            v.iter().enumerate().filter(|(_, x)| !x.is_nan()).map(|(i, &x)| (i as u32, x)).collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for k in [1, 5, 256, n + 3] {
            assert_eq!(top_k(&v, k), all[..k.min(all.len())].to_vec(), "n={n} k={k}");
        }
    }
}
