//! MLA's head-wise maps between the query / value space and the shared latent space (spec §2.5,
//! absorbed form), from `kv_b_proj` (`[heads · (nope + v_dim), rank]`): queries are absorbed with
//! W_UKᵀ, latent contexts lifted with W_UV. One rayon job per head; each head's weights are read
//! once per step for all tokens.

use std::cell::RefCell;

use rayon::prelude::*;

use super::disjoint::DisjointOut;
use crate::Matrix;

thread_local! {
    /// A head job's gathered input and its product, kept per thread.
    static HEAD_BUFS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with this thread's head buffers, taken out of their slot rather than borrowed: a
/// nested product may run another head's job on this thread while `f` waits.
fn with_head_bufs(f: impl FnOnce(&mut Vec<f32>, &mut Vec<f32>)) {
    let (mut a, mut b) = HEAD_BUFS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    f(&mut a, &mut b);
    HEAD_BUFS.with(|s| *s.borrow_mut() = (a, b));
}

/// `q`: `[tokens, heads, nope + rope]` → `out`: `[tokens, heads, rank + rope]` = `[W_UKᵀ q_nope | q_pe]`.
pub fn mla_absorb(
    w_kv: &Matrix<'_>,
    heads: usize,
    nope: usize,
    v_dim: usize,
    tokens: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let rank = w_kv.cols();
    let qw = q.len() / (tokens * heads).max(1);
    let ow = rank + qw - nope;
    assert_eq!(out.len(), tokens * heads * ow, "mla_absorb: out has {} values", out.len());
    // Each head's job writes its own (token, head) rows of out.
    let dst = DisjointOut::new(out);
    (0..heads).into_par_iter().for_each(|hh| {
        with_head_bufs(|q_nope, q_lat| {
            let w_uk = w_kv.row_range(hh * (nope + v_dim), nope);
            q_nope.clear();
            for t in 0..tokens {
                q_nope.extend_from_slice(&q[(t * heads + hh) * qw..(t * heads + hh) * qw + nope]);
            }
            q_lat.resize(tokens * rank, 0.0);
            super::gemm::matmul_transposed(&w_uk, q_nope, tokens, &mut q_lat[..tokens * rank]);
            for t in 0..tokens {
                // SAFETY: row (t, hh) of out (ow values) belongs to this head's job; out holds
                // tokens × heads × ow values (asserted).
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at((t * heads + hh) * ow), ow) };
                o[..rank].copy_from_slice(&q_lat[t * rank..(t + 1) * rank]);
                o[rank..].copy_from_slice(&q[(t * heads + hh) * qw + nope..(t * heads + hh + 1) * qw]);
            }
        })
    });
}

/// `ctx`: `[tokens, heads, rank]` → `out`: `[tokens, heads · v_dim]` = W_UV ctx per head.
pub fn mla_lift(
    w_kv: &Matrix<'_>,
    heads: usize,
    nope: usize,
    v_dim: usize,
    tokens: usize,
    ctx: &[f32],
    out: &mut [f32],
) {
    let rank = w_kv.cols();
    assert_eq!(ctx.len(), tokens * heads * rank, "mla_lift: ctx has {} values", ctx.len());
    assert_eq!(out.len(), tokens * heads * v_dim, "mla_lift: out has {} values", out.len());
    // Each head's job writes its own (token, head) rows of out.
    let dst = DisjointOut::new(out);
    (0..heads).into_par_iter().for_each(|hh| {
        with_head_bufs(|c, o| {
            let w_uv = w_kv.row_range(hh * (nope + v_dim) + nope, v_dim);
            c.clear();
            for t in 0..tokens {
                c.extend_from_slice(&ctx[(t * heads + hh) * rank..(t * heads + hh + 1) * rank]);
            }
            o.resize(tokens * v_dim, 0.0);
            super::gemm::matmul(&w_uv, c, tokens, &mut o[..tokens * v_dim]);
            for t in 0..tokens {
                // SAFETY: row (t, hh) of out (v_dim values) belongs to this head's job; out holds
                // tokens × heads × v_dim values (asserted).
                let row = unsafe { std::slice::from_raw_parts_mut(dst.at((t * heads + hh) * v_dim), v_dim) };
                row.copy_from_slice(&o[t * v_dim..(t + 1) * v_dim]);
            }
        })
    });
}
