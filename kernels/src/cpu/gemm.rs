//! Threaded matrix products over stored-format weights: `out[t, r] = Σ_c W[r, c] · x[t, c]`.
//!
//! Work is split by blocks of output rows, so each weight byte is read once per call whatever the
//! token count. Decode (one token, BF16) dots the stored rows directly; otherwise four rows are
//! widened to f32 once and multiplied against the tokens four at a time in registers.

use std::cell::RefCell;

use rayon::prelude::*;

use super::bf16::dot4_bf16;
use super::disjoint::DisjointOut;
use super::simd::{self, SimdLevel, simd_level};
use crate::Matrix;

/// Below this many multiply-adds a call runs on the calling thread (thread hand-off costs more).
const SERIAL_WORK: usize = 1 << 16;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub fn matmul(w: &Matrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    if let Matrix::Packed(p) = w {
        return super::packed::matmul(p, x, tokens, out);
    }
    if let Matrix::Fp8(_) = w {
        // Per-token FP8 activations (ATOM's ptpc_fp8): each product of an E4M3 weight and an
        // E4M3 activation is exact in f32, so this equals the scaled integer-grid product up to
        // the f32 accumulation.
        let xq = super::fp8::quantize_activations(x, w.cols());
        return matmul_stored(w, &xq, tokens, out);
    }
    matmul_stored(w, x, tokens, out)
}

/// [`matmul`] of each of `ws` over the same activations. The matrices the AMX tiles take run as
/// one call ([`super::packed_amx::matmul_many`]: one split of `x`, one parallel loop over all
/// their row groups), and so do the packed ones on the registers ([`super::packed::matmul_many`]);
/// any other runs alone. Each output is the bits [`matmul`] gives.
pub fn matmul_many(ws: &[Matrix], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
    matmul_many_where(ws, x, tokens, outs, |p| super::packed_amx::takes_for(p, tokens))
}

/// [`matmul_many`] over tokens that are runs of one sequence each, [`BATCHED_TILE_TOKENS`] or more
/// of a sequence's tokens (`Mxfp4Tiles::PerSequence`, see `moe_experts`): matrices packed for
/// that take the AMX tiles whatever the count; the rest run as in [`matmul_many`].
///
/// [`BATCHED_TILE_TOKENS`]: super::packed::BATCHED_TILE_TOKENS
pub fn matmul_many_runs(ws: &[Matrix], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
    matmul_many_where(ws, x, tokens, outs, |p| super::packed_amx::takes_for(p, tokens) || p.takes_sequence_runs())
}

/// [`matmul_many`] with the packed matrices `tiles` picks on the AMX tiles.
fn matmul_many_where(
    ws: &[Matrix],
    x: &[f32],
    tokens: usize,
    outs: &mut [&mut [f32]],
    tiles: impl Fn(&super::packed::PackedMatrix) -> bool,
) {
    use super::packed_amx::{MANY, matmul_many as on_tiles};
    use smallvec::SmallVec;
    assert_eq!(ws.len(), outs.len(), "matmul_many: {} matrices, {} outputs", ws.len(), outs.len());
    let cols = ws.first().map(|w| w.cols());
    use super::packed::{MANY as REGS_MANY, matmul_many as on_registers, runs_many};
    let mut mats: SmallVec<[&super::packed::PackedMatrix; MANY]> = SmallVec::new();
    let mut touts: SmallVec<[&mut [f32]; MANY]> = SmallVec::new();
    let mut regs: SmallVec<[&super::packed::PackedMatrix; REGS_MANY]> = SmallVec::new();
    let mut routs: SmallVec<[&mut [f32]; REGS_MANY]> = SmallVec::new();
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        match w {
            Matrix::Packed(p) if mats.len() < MANY && tiles(p) && Some(p.cols) == cols => {
                mats.push(p);
                touts.push(&mut **out);
            }
            Matrix::Packed(p)
                if regs.len() < REGS_MANY && !tiles(p) && runs_many(p, tokens) && Some(p.cols) == cols =>
            {
                regs.push(p);
                routs.push(&mut **out);
            }
            _ => matmul(w, x, tokens, out),
        }
    }
    if !mats.is_empty() {
        on_tiles(&mats, x, tokens, &mut touts);
    }
    if !regs.is_empty() {
        on_registers(&regs, x, tokens, &mut routs);
    }
}

/// [`matmul`] over a weight read in its stored format, row by row.
/// Rows [`matmul_transposed`] asks for ahead of the row it widens.
const PREFETCH_ROWS: usize = 2;

fn matmul_stored(w: &Matrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), tokens * cols, "matmul: x has {} values, want {tokens}×{cols}", x.len());
    assert_eq!(out.len(), tokens * rows, "matmul: out has {} values, want {tokens}×{rows}", out.len());
    if tokens == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    let work = rows * cols * tokens;
    let threads = rayon::current_num_threads().max(1);
    // Every task writes a disjoint set of output columns (its own rows of W).
    let ptr = DisjointOut::new(out);
    if work < SERIAL_WORK || threads == 1 {
        compute_rows(w, x, tokens, 0, rows, ptr);
        return;
    }
    // About 8 tasks per thread for balance, in multiples of 4 rows.
    let block = rows.div_ceil(threads * 8).next_multiple_of(4).max(4);
    let nblocks = rows.div_ceil(block);
    (0..nblocks).into_par_iter().for_each(|b| {
        let r0 = b * block;
        compute_rows(w, x, tokens, r0, (r0 + block).min(rows), ptr);
    });
}

fn compute_rows(w: &Matrix, x: &[f32], tokens: usize, r0: usize, r1: usize, out: DisjointOut) {
    let rows = w.rows();
    let cols = w.cols();
    let store = |t: usize, r: usize, v: f32| {
        // SAFETY: t < tokens and r0 <= r < r1 <= rows; rows r0..r1 belong to this task only.
        unsafe { *out.at(t * rows + r) = v };
    };
    if let (Matrix::Bf16(m), 1) = (w, tokens) {
        let mut r = r0;
        while r < r1 {
            let n = (r1 - r).min(4);
            // The next group of rows while this one is dotted (MLA's value lift per head).
            for ahead in (r + 4..r + 8).filter(|&a| a < r1) {
                simd::prefetch(m.row(ahead));
            }
            let pick = |i: usize| m.row(r + i.min(n - 1));
            let v = dot4_bf16([pick(0), pick(1), pick(2), pick(3)], x);
            for (i, val) in v.iter().take(n).enumerate() {
                store(0, r + i, *val);
            }
            r += n;
        }
        return;
    }
    SCRATCH.with(|s| {
        let mut scratch = s.borrow_mut();
        if scratch.len() < 4 * cols {
            scratch.resize(4 * cols, 0.0);
        }
        let mut r = r0;
        while r < r1 {
            let n = (r1 - r).min(4);
            for i in 0..4 {
                let src = r + i.min(n - 1);
                w.row_to_f32(src, &mut scratch[i * cols..(i + 1) * cols]);
            }
            let wt = &scratch[..4 * cols];
            let mut t = 0;
            while t < tokens {
                let nt = (tokens - t).min(4);
                let xs: [&[f32]; 4] =
                    std::array::from_fn(|j| &x[(t + j.min(nt - 1)) * cols..(t + j.min(nt - 1) + 1) * cols]);
                let tile = dot_tile(wt, cols, &xs);
                for (j, row) in tile.iter().take(nt).enumerate() {
                    for (i, val) in row.iter().take(n).enumerate() {
                        store(t + j, r + i, *val);
                    }
                }
                t += nt;
            }
            r += n;
        }
    });
}

/// `[token j][row i]` dot products of four f32 rows (`w`, `4 × cols`) with four vectors.
fn dot_tile(w: &[f32], cols: usize, xs: &[&[f32]; 4]) -> [[f32; 4]; 4] {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; all slices hold `cols` values.
        SimdLevel::Avx512 => unsafe { x86::tile_avx512(w, cols, xs) },
        _ => {
            let mut out = [[0f32; 4]; 4];
            for (j, x) in xs.iter().enumerate() {
                for (i, o) in out[j].iter_mut().enumerate() {
                    *o = simd::dot(&w[i * cols..(i + 1) * cols], x);
                }
            }
            out
        }
    }
}

/// `out[c] = Σ_r x[r] · W[r, c]` (Wᵀ x).
pub fn matvec_transposed(w: &Matrix, x: &[f32], out: &mut [f32]) {
    matmul_transposed(w, x, 1, out)
}

/// `out[t, c] = Σ_r x[t, r] · W[r, c]` (Wᵀ x per token). Each stored row is widened once per
/// call and added into every token's output in row order, so a token's result does not depend
/// on how many tokens share the call.
pub fn matmul_transposed(w: &Matrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), tokens * rows, "matmul_transposed: x has {} values, want {tokens}×{rows}", x.len());
    assert_eq!(out.len(), tokens * cols, "matmul_transposed: out has {} values, want {tokens}×{cols}", out.len());
    out.fill(0.0);
    SCRATCH.with(|s| {
        let mut scratch = s.borrow_mut();
        if scratch.len() < cols {
            scratch.resize(cols, 0.0);
        }
        let row = &mut scratch[..cols];
        for r in 0..rows {
            // Two rows ahead of the widening (stored BF16: MLA's query absorption per head).
            if let (Matrix::Bf16(m), true) = (w, r + PREFETCH_ROWS < rows) {
                simd::prefetch(m.row(r + PREFETCH_ROWS));
            }
            w.row_to_f32(r, row);
            for (t, o) in out.chunks_exact_mut(cols).enumerate() {
                simd::axpy(x[t * rows + r], row, o);
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512(w: &[f32], cols: usize, xs: &[&[f32]; 4]) -> [[f32; 4]; 4] {
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut c = 0;
        unsafe {
            let step = |c: usize, m: __mmask16, acc: &mut [[__m512; 4]; 4]| {
                let wv: [__m512; 4] = std::array::from_fn(|i| _mm512_maskz_loadu_ps(m, w.as_ptr().add(i * cols + c)));
                for j in 0..4 {
                    let xv = _mm512_maskz_loadu_ps(m, xs[j].as_ptr().add(c));
                    for i in 0..4 {
                        acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
                    }
                }
            };
            while c + 16 <= cols {
                step(c, 0xffff, &mut acc);
                c += 16;
            }
            if c < cols {
                let m = ((1u32 << (cols - c)) - 1) as __mmask16;
                step(c, m, &mut acc);
            }
        }
        let mut out = [[0f32; 4]; 4];
        for j in 0..4 {
            for i in 0..4 {
                out[j][i] = _mm512_reduce_add_ps(acc[j][i]);
            }
        }
        out
    }
}
