//! Dense non-causal attention inside each span of a packed batch (block-diagonal, FlashAttention's
//! `varlen` with `causal=False`): the vision tower's attention, where every patch of an image (or
//! of a clip's frames) sees every other patch of the same item and nothing of the other items.
//!
//! Per span and head the scores are a matrix product (`Q · Kᵀ`, the keys as an f32 weight) and
//! the context another (`P · V`, over `Vᵀ`), in blocks of query rows so the score block stays
//! small whatever the span: the products run at the matrix kernels' speed instead of one dot per
//! (query, key) pair (measured 9× faster at 1,444 patches × 12 heads of 128).

use rayon::prelude::*;

use super::gemm::matmul;
use crate::backend::SeqSpan;
use crate::{F32Matrix, Matrix};

/// Query rows per block: the score block is `[ROWS, span]`.
const ROWS: usize = 256;

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
    out.fill(0.0);
    for span in spans.iter().filter(|s| s.len > 0) {
        let len = span.len;
        // Each head's context rows `[len, dim]`, computed side by side, then scattered.
        let per_head: Vec<Vec<f32>> = (0..heads)
            .into_par_iter()
            .map(|h| {
                let gather = |src: &[f32]| -> Vec<f32> {
                    span.rows().flat_map(|t| src[t * width + h * dim..][..dim].iter().copied()).collect()
                };
                let kh = gather(k);
                let vh = gather(v);
                let mut vt = vec![0f32; dim * len];
                for (j, row) in vh.chunks_exact(dim).enumerate() {
                    for (c, &x) in row.iter().enumerate() {
                        vt[c * len + j] = x;
                    }
                }
                let keys = Matrix::F32(F32Matrix { data: &kh, rows: len, cols: dim });
                let values_t = Matrix::F32(F32Matrix { data: &vt, rows: dim, cols: len });
                let mut ctx = vec![0f32; len * dim];
                let mut qb = Vec::with_capacity(ROWS * dim);
                let mut scores = vec![0f32; ROWS * len];
                for first in (0..len).step_by(ROWS) {
                    let b = ROWS.min(len - first);
                    qb.clear();
                    for t in first..first + b {
                        let at = (span.start + t) * width + h * dim;
                        qb.extend(q[at..at + dim].iter().map(|x| x * scale));
                    }
                    let s = &mut scores[..b * len];
                    matmul(&keys, &qb, b, s);
                    for row in s.chunks_exact_mut(len) {
                        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut z = 0f32;
                        row.iter_mut().for_each(|x| {
                            *x = (*x - m).exp();
                            z += *x;
                        });
                        let inv = 1.0 / z;
                        row.iter_mut().for_each(|x| *x *= inv);
                    }
                    matmul(&values_t, s, b, &mut ctx[first * dim..(first + b) * dim]);
                }
                ctx
            })
            .collect();
        for (h, ctx) in per_head.iter().enumerate() {
            for (i, row) in ctx.chunks_exact(dim).enumerate() {
                out[(span.start + i) * width + h * dim..][..dim].copy_from_slice(row);
            }
        }
    }
}
