//! K3.1 lightning indexer (spec §5, fp32, NoPE): one key per token shared by all index heads;
//! each query keeps the top-min(k, t+1) past tokens, and every MLA head attends only to those.

use super::config::IndexerConfig;
use super::error::ModelError;
use super::norm::layer_norm;
use super::weights::{TensorSource, Weight};

pub struct Indexer {
    wq_b: Weight,
    wk: Weight,
    k_norm_w: Vec<f32>,
    k_norm_b: Vec<f32>,
    weights_proj: Weight,
    n_heads: usize,
    head_dim: usize,
    topk: usize,
}

/// The indexer's decision for one query token.
pub struct Selection {
    /// Selected past positions, ascending.
    pub tokens: Vec<usize>,
    /// I(t, s) for every candidate s ≤ t.
    pub scores: Vec<f32>,
    /// I(k-th) − I((k+1)-th); NaN when nothing is pruned.
    pub margin: f32,
}

impl Indexer {
    pub fn load(
        src: &mut dyn TensorSource,
        prefix: &str,
        c: &IndexerConfig,
        hidden: usize,
        q_lora_rank: usize,
    ) -> Result<Indexer, ModelError> {
        let (h, d) = (c.n_heads, c.head_dim);
        Ok(Indexer {
            wq_b: src.matrix(&format!("{prefix}.wq_b.weight"), h * d, q_lora_rank)?,
            wk: src.matrix(&format!("{prefix}.wk.weight"), d, hidden)?,
            k_norm_w: src.vector(&format!("{prefix}.k_norm.weight"), &[d])?,
            k_norm_b: src.vector(&format!("{prefix}.k_norm.bias"), &[d])?,
            weights_proj: src.matrix(&format!("{prefix}.weights_proj.weight"), h, hidden)?,
            n_heads: h,
            head_dim: d,
            topk: c.topk,
        })
    }

    /// Keys LayerNorm(wk x) for `tokens` new rows of the MLA input `x`, `[tokens, d_I]`.
    pub fn keys(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        layer_norm(&self.wk.matmul(x, tokens), &self.k_norm_w, &self.k_norm_b, 1e-6)
    }

    /// Selections for every row of a step: row t is the query of sequence `rows[t].0` at absolute
    /// position `rows[t].1`; `key(seq, s)` must cover every position of that sequence up to its
    /// last query. `c_q` is MLA's `q_a_layernorm` output.
    pub fn select<'k>(
        &self,
        x: &[f32],
        c_q: &[f32],
        rows: &[(usize, usize)],
        key: impl Fn(usize, usize) -> &'k [f32] + Sync,
    ) -> Vec<Selection> {
        use rayon::prelude::*;
        let (h, d) = (self.n_heads, self.head_dim);
        let tokens = rows.len();
        let q = self.wq_b.matmul(c_q, tokens);
        let w = self.weights_proj.matmul(x, tokens);
        let wscale = 1.0 / ((h as f32).sqrt() * (d as f32).sqrt());
        (0..tokens)
            .into_par_iter()
            .map(|t| {
                let (seq, pos) = rows[t];
                let qt = &q[t * h * d..(t + 1) * h * d];
                let scores: Vec<f32> = (0..=pos)
                    .map(|s| {
                        let ks = key(seq, s);
                        (0..h)
                            .map(|j| {
                                let dotp = kimi_kernels::cpu::simd::dot(&qt[j * d..(j + 1) * d], ks);
                                w[t * h + j] * wscale * dotp.max(0.0)
                            })
                            .sum()
                    })
                    .collect();
                let k = self.topk.min(pos + 1);
                let mut order: Vec<usize> = (0..=pos).collect();
                let mut margin = f32::NAN;
                if k < order.len() {
                    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                    margin = scores[order[k - 1]] - scores[order[k]];
                    order.truncate(k);
                    order.sort_unstable();
                }
                Selection { tokens: order, scores, margin }
            })
            .collect()
    }

    pub fn topk(&self) -> usize {
        self.topk
    }
}
