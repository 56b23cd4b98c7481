//! Absorbed MLA attention (spec §2.5) over paged latent rows `[c | k_pe]`: every (token, head)
//! attends over its own sequence's rows — the indexer's selection, or every position up to its
//! own — and writes its latent context. One rayon job per head.

use rayon::prelude::*;

use super::simd::{axpy, dot};
use crate::backend::{PagedRows, Selection};

#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    q: &[f32],
    heads: usize,
    rank: usize,
    scale: f32,
    rows: &[(usize, usize)],
    caches: &[PagedRows<'_>],
    selected: Option<&[Selection]>,
    ctx: &mut [f32],
) {
    let tokens = rows.len();
    let width = q.len() / (tokens * heads).max(1);
    assert_eq!(ctx.len(), tokens * heads * rank, "mla_attention: ctx has {} values", ctx.len());
    let per_head: Vec<Vec<f32>> = (0..heads)
        .into_par_iter()
        .map(|hh| {
            let mut out = vec![0f32; tokens * rank];
            let mut scores = Vec::new();
            let mut all = Vec::new();
            for (t, &(seq, pos)) in rows.iter().enumerate() {
                let cache = &caches[seq];
                let qt = &q[(t * heads + hh) * width..(t * heads + hh + 1) * width];
                let cand: &[usize] = match selected {
                    Some(sel) => &sel[t].tokens,
                    None => {
                        all.clear();
                        all.extend(0..=pos);
                        &all
                    }
                };
                scores.clear();
                scores.extend(cand.iter().map(|&s| dot(qt, cache.row(s)) * scale));
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0f32;
                scores.iter_mut().for_each(|s| {
                    *s = (*s - m).exp();
                    z += *s;
                });
                let ct = &mut out[t * rank..(t + 1) * rank];
                for (&s, p) in cand.iter().zip(&scores) {
                    axpy(p / z, &cache.row(s)[..rank], ct);
                }
            }
            out
        })
        .collect();
    for (hh, oh) in per_head.iter().enumerate() {
        for t in 0..tokens {
            ctx[(t * heads + hh) * rank..(t * heads + hh + 1) * rank].copy_from_slice(&oh[t * rank..(t + 1) * rank]);
        }
    }
}
