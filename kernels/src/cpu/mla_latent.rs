//! MLA's head-wise maps between the query / value space and the shared latent space (spec §2.5,
//! absorbed form), from `kv_b_proj` (`[heads · (nope + v_dim), rank]`): queries are absorbed with
//! W_UKᵀ, latent contexts lifted with W_UV. One rayon job per head; each head's weights are read
//! once per step for all tokens.

use rayon::prelude::*;

use crate::Matrix;

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
    let lat: Vec<Vec<f32>> = (0..heads)
        .into_par_iter()
        .map(|hh| {
            let w_uk = w_kv.row_range(hh * (nope + v_dim), nope);
            let q_nope: Vec<f32> = (0..tokens)
                .flat_map(|t| q[(t * heads + hh) * qw..(t * heads + hh) * qw + nope].iter().copied())
                .collect();
            let mut q_lat = vec![0f32; tokens * rank];
            super::gemm::matmul_transposed(&w_uk, &q_nope, tokens, &mut q_lat);
            q_lat
        })
        .collect();
    for (hh, q_lat) in lat.iter().enumerate() {
        for t in 0..tokens {
            let o = &mut out[(t * heads + hh) * ow..(t * heads + hh + 1) * ow];
            o[..rank].copy_from_slice(&q_lat[t * rank..(t + 1) * rank]);
            o[rank..].copy_from_slice(&q[(t * heads + hh) * qw + nope..(t * heads + hh + 1) * qw]);
        }
    }
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
    let per_head: Vec<Vec<f32>> = (0..heads)
        .into_par_iter()
        .map(|hh| {
            let w_uv = w_kv.row_range(hh * (nope + v_dim) + nope, v_dim);
            let c: Vec<f32> = (0..tokens)
                .flat_map(|t| ctx[(t * heads + hh) * rank..(t * heads + hh + 1) * rank].iter().copied())
                .collect();
            let mut o = vec![0f32; tokens * v_dim];
            super::gemm::matmul(&w_uv, &c, tokens, &mut o);
            o
        })
        .collect();
    for (hh, o) in per_head.iter().enumerate() {
        for t in 0..tokens {
            out[(t * heads + hh) * v_dim..(t * heads + hh + 1) * v_dim].copy_from_slice(&o[t * v_dim..(t + 1) * v_dim]);
        }
    }
}
