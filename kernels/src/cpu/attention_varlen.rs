//! Dense non-causal attention inside each span of a packed batch (block-diagonal, FlashAttention's
//! `varlen` with `causal=False`): the vision tower's attention, where every patch of an image (or
//! of a clip's frames) sees every other patch of the same item and nothing of the other items.

use rayon::prelude::*;

use super::simd::{axpy, dot};
use crate::backend::SeqSpan;

/// See [`crate::Backend::attention_varlen`].
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    dim: usize,
    spans: &[SeqSpan],
    scale: f32,
    out: &mut [f32],
) {
    let width = heads * dim;
    let rows = q.len() / width.max(1);
    assert!(
        q.len() == rows * width && k.len() == q.len() && v.len() == q.len() && out.len() == q.len(),
        "attention_varlen: q, k, v and out must all be [rows, heads, dim]"
    );
    assert!(spans.iter().all(|s| s.start + s.len <= rows), "attention_varlen: a span overruns the rows");
    // One job per output row: rows of all spans are independent.
    out.par_chunks_mut(width).enumerate().for_each_init(Vec::new, |scores, (t, o)| {
        o.fill(0.0);
        let Some(span) = spans.iter().find(|s| s.rows().contains(&t)) else { return };
        for h in 0..heads {
            let qt = &q[t * width + h * dim..][..dim];
            scores.clear();
            scores.extend(span.rows().map(|j| dot(qt, &k[j * width + h * dim..][..dim]) * scale));
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f32;
            scores.iter_mut().for_each(|s| {
                *s = (*s - m).exp();
                z += *s;
            });
            let oh = &mut o[h * dim..][..dim];
            for (j, p) in span.rows().zip(scores.iter()) {
                axpy(p / z, &v[j * width + h * dim..][..dim], oh);
            }
        }
    });
}
