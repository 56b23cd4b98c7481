//! K3.1 lightning indexer scores and per-query top-k (spec §5): one key per past token shared by
//! the index heads, `I(t, s) = Σ_j w[t, j] · scale · relu(q[t, j] · key[s])`.

use rayon::prelude::*;

use super::simd::dot;
use crate::backend::{PagedRows, Selection};

pub fn indexer_topk(
    q: &[f32],
    w: &[f32],
    heads: usize,
    scale: f32,
    topk: usize,
    rows: &[(usize, usize)],
    keys: &[PagedRows<'_>],
) -> Vec<Selection> {
    let tokens = rows.len();
    let d = q.len() / (tokens * heads).max(1);
    (0..tokens)
        .into_par_iter()
        .map(|t| {
            let (seq, pos) = rows[t];
            let qt = &q[t * heads * d..(t + 1) * heads * d];
            // Positions another context-parallel rank holds score NaN and are never candidates.
            let scores: Vec<f32> = (0..=pos)
                .map(|s| {
                    if !keys[seq].holds(s) {
                        return f32::NAN;
                    }
                    let ks = keys[seq].row(s);
                    (0..heads).map(|j| w[t * heads + j] * scale * dot(&qt[j * d..(j + 1) * d], ks).max(0.0)).sum()
                })
                .collect();
            select(scores, topk)
        })
        .collect()
}

/// A query's top `topk` of `scores` (`I(t, s)` for `s ≤ t`; NaN where another context-parallel
/// rank holds the key, never a candidate): ties to the lower position, selected positions
/// ascending, and the margin between the k-th and the (k+1)-th score (NaN when nothing is
/// pruned). Every backend selects through this, so selections agree wherever scores do.
pub fn select(scores: Vec<f32>, topk: usize) -> Selection {
    let mut order: Vec<usize> = (0..scores.len()).filter(|&s| !scores[s].is_nan()).collect();
    let k = topk.min(order.len());
    let mut margin = f32::NAN;
    if k < order.len() {
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        margin = scores[order[k - 1]] - scores[order[k]];
        order.truncate(k);
        order.sort_unstable();
    }
    Selection { tokens: order, scores, margin }
}
