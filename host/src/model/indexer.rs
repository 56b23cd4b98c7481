//! K3.1 lightning indexer (spec §5, fp32, NoPE): one key per token shared by all index heads;
//! each query keeps the top-min(k, t+1) past tokens, and every MLA head attends only to those.

use kimi_kernels::{Backend, PagedRows};

pub use kimi_kernels::Selection;

use super::config::IndexerConfig;
use super::error::ModelError;
use super::norm::layer_norm;
use super::scratch::{Buf, Scratch};
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

impl Indexer {
    /// Every weight the indexer keeps.
    pub fn weights(&self) -> Vec<&Weight> {
        vec![&self.wq_b, &self.wk, &self.weights_proj]
    }

    /// Every weight the indexer multiplies by.
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        vec![&mut self.wq_b, &mut self.wk, &mut self.weights_proj]
    }

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
    pub fn keys<'s>(&self, be: &dyn Backend, sc: &'s Scratch, x: &[f32], tokens: usize) -> Buf<'s> {
        layer_norm(be, sc, &self.wk.matmul(be, sc, x, tokens), &self.k_norm_w, &self.k_norm_b, 1e-6)
    }

    /// Selections for every row of a step: row t is the query of sequence `rows[t].0` at absolute
    /// position `rows[t].1`; `keys[seq]` must cover every position of that sequence up to its
    /// last query. `c_q` is MLA's `q_a_layernorm` output. Keeps the top `topk` of each row (the
    /// layer's own, or one more for a context-parallel merge).
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        be: &dyn Backend,
        sc: &Scratch,
        x: &[f32],
        c_q: &[f32],
        rows: &[(usize, usize)],
        keys: &[PagedRows<'_>],
        topk: usize,
    ) -> Vec<Selection> {
        let (h, d) = (self.n_heads, self.head_dim);
        let tokens = rows.len();
        let q = self.wq_b.matmul(be, sc, c_q, tokens);
        let w = self.weights_proj.matmul(be, sc, x, tokens);
        let wscale = 1.0 / ((h as f32).sqrt() * (d as f32).sqrt());
        be.indexer_topk(&q, &w, h, wscale, topk, rows, keys)
    }

    pub fn topk(&self) -> usize {
        self.topk
    }
}
