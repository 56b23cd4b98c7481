//! Absorbed MLA attention (spec §2.5) over paged latent rows `[c | k_pe]`: every (token, head)
//! attends over its own sequence's rows — the indexer's selection, or every position up to its
//! own, skipping positions another context-parallel rank holds — and writes its latent context
//! (and, for a context-parallel partial, the scores' log-sum-exp). One rayon job per head.

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
    lse: Option<&mut [f32]>,
) {
    let tokens = rows.len();
    let width = q.len() / (tokens * heads).max(1);
    assert_eq!(ctx.len(), tokens * heads * rank, "mla_attention: ctx has {} values", ctx.len());
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..heads)
        .into_par_iter()
        .map(|hh| {
            let mut out = vec![0f32; tokens * rank];
            let mut lses = vec![f32::NEG_INFINITY; tokens];
            let mut scores = Vec::new();
            let mut cand = Vec::new();
            for (t, &(seq, pos)) in rows.iter().enumerate() {
                let cache = &caches[seq];
                let qt = &q[(t * heads + hh) * width..(t * heads + hh + 1) * width];
                cand.clear();
                match selected {
                    Some(sel) => cand.extend(sel[t].tokens.iter().copied().filter(|&s| cache.holds(s))),
                    None => cand.extend((0..=pos).filter(|&s| cache.holds(s))),
                }
                if cand.is_empty() {
                    continue;
                }
                scores.clear();
                scores.extend(cand.iter().map(|&s| dot(qt, cache.row(s)) * scale));
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0f32;
                scores.iter_mut().for_each(|s| {
                    *s = (*s - m).exp();
                    z += *s;
                });
                lses[t] = m + z.ln();
                let ct = &mut out[t * rank..(t + 1) * rank];
                for (&s, p) in cand.iter().zip(&scores) {
                    axpy(p / z, &cache.row(s)[..rank], ct);
                }
            }
            (out, lses)
        })
        .collect();
    for (hh, (oh, _)) in per_head.iter().enumerate() {
        for t in 0..tokens {
            ctx[(t * heads + hh) * rank..(t * heads + hh + 1) * rank].copy_from_slice(&oh[t * rank..(t + 1) * rank]);
        }
    }
    if let Some(lse) = lse {
        assert_eq!(lse.len(), tokens * heads, "mla_attention: lse has {} values", lse.len());
        for (hh, (_, lh)) in per_head.iter().enumerate() {
            for t in 0..tokens {
                lse[t * heads + hh] = lh[t];
            }
        }
    }
}
