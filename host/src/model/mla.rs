//! Gated NoPE MLA (spec §2.5) in the absorbed-latent form: queries are mapped into the
//! 512-wide latent space per head (W_UKᵀ q_nope), attend over the cached 576-wide rows
//! [c | k_pe] as one shared KV head, and the latent context is lifted with W_UV. Prefill and
//! decode run the same code; only the number of new rows differs. No rotation anywhere.

use kimi_kernels::{Backend, PagedRows, Selection};

use super::batch::BatchLayout;
use super::config::TextConfig;
use super::error::ModelError;
use super::indexer::Indexer;
use super::norm::rms_norm;
use super::scratch::{Buf, Scratch};
use super::shard::Shard;
use super::state::LatentCache;
use super::weights::{Part, TensorSource, Weight};

/// ε of `q_a_layernorm` / `kv_a_layernorm`: the release builds them with the class default.
const LORA_NORM_EPS: f32 = 1e-6;

pub struct MlaLayer {
    q_a: Weight,
    q_a_norm: Vec<f32>,
    q_b: Weight,
    kv_a: Weight,
    kv_a_norm: Vec<f32>,
    kv_b: Weight,
    g_proj: Option<Weight>,
    o_proj: Weight,
    pub indexer: Option<Indexer>,
    heads: usize,
    nope: usize,
    rope: usize,
    v_dim: usize,
    rank: usize,
}

impl MlaLayer {
    /// Every weight the layer keeps.
    pub fn weights(&self) -> Vec<&Weight> {
        let mut v = vec![&self.q_a, &self.q_b, &self.kv_a, &self.kv_b, &self.o_proj];
        v.extend(self.g_proj.as_ref());
        if let Some(ix) = &self.indexer {
            v.extend(ix.weights());
        }
        v
    }

    /// Every weight the layer multiplies by (`kv_b` is read by head slices in the absorbed maps,
    /// so it stays in its stored format).
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        let mut v = vec![&mut self.q_a, &mut self.q_b, &mut self.kv_a, &mut self.o_proj];
        v.extend(self.g_proj.as_mut());
        if let Some(ix) = &mut self.indexer {
            v.extend(ix.matmul_weights());
        }
        v
    }

    /// Loads the layer, or rank `sh`'s part of it (ATOM's scheme): its heads of `q_b`, `kv_b` and
    /// the output gate, and the matching input columns of `o_proj` (whose partial output the
    /// caller all-reduces); `q_a`, `kv_a` (so the latent cache is the same on every rank) and the
    /// indexer are replicated.
    pub fn load(src: &mut dyn TensorSource, prefix: &str, c: &TextConfig, sh: Shard) -> Result<MlaLayer, ModelError> {
        let d = c.hidden_size;
        let (h, dn, dr, dv, r) = (c.mla_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let heads = sh.heads(h);
        let per_head = |w: usize| {
            if heads.len() == h { Part::Whole } else { Part::Rows(heads.start * w..heads.end * w) }
        };
        let o_cols = if heads.len() == h { Part::Whole } else { Part::Cols(heads.start * dv..heads.end * dv) };
        let n = |s: &str| format!("{prefix}.{s}");
        let indexer = match &c.indexer {
            Some(ic) => Some(Indexer::load(src, &n("indexer"), ic, d, c.q_lora_rank)?),
            None => None,
        };
        Ok(MlaLayer {
            q_a: src.matrix(&n("q_a_proj.weight"), c.q_lora_rank, d)?,
            q_a_norm: src.vector(&n("q_a_layernorm.weight"), &[c.q_lora_rank])?,
            q_b: src.matrix_part(&n("q_b_proj.weight"), h * (dn + dr), c.q_lora_rank, per_head(dn + dr))?,
            kv_a: src.matrix(&n("kv_a_proj_with_mqa.weight"), r + dr, d)?,
            kv_a_norm: src.vector(&n("kv_a_layernorm.weight"), &[r])?,
            kv_b: src.matrix_part(&n("kv_b_proj.weight"), h * (dn + dv), r, per_head(dn + dv))?,
            g_proj: if c.mla_output_gate {
                Some(src.matrix_part(&n("g_proj.weight"), h * dv, d, per_head(dv))?)
            } else {
                None
            },
            o_proj: src.matrix_part(&n("o_proj.weight"), d, h * dv, o_cols)?,
            indexer,
            heads: heads.len(),
            nope: dn,
            rope: dr,
            v_dim: dv,
            rank: r,
        })
    }

    /// x: `[T, d]` (post `input_layernorm`) for every sequence of the step; `caches[s]` belongs to
    /// `layout.spans[s]` and gains its rows. Projections run once over all T rows; each token
    /// attends over its own sequence's cache through its page table. Returns the layer output
    /// and, for K3.1, the indexer's selection per row; a full page arena is an error.
    pub fn forward<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        x: &[f32],
        layout: &BatchLayout,
        caches: &mut [&mut LatentCache],
    ) -> Result<(Buf<'s>, Option<Vec<Selection>>), ModelError> {
        let (h, dn, dr, dv, r) = (self.heads, self.nope, self.rope, self.v_dim, self.rank);
        let width = r + dr;
        let tokens = layout.len();

        let c_q = rms_norm(be, sc, &self.q_a.matmul(be, sc, x, tokens), &self.q_a_norm, LORA_NORM_EPS);
        let q = self.q_b.matmul(be, sc, &c_q, tokens);
        let kv = self.kv_a.matmul(be, sc, x, tokens);
        let mut latent = sc.for_overwrite(tokens * r);
        for (dst, row) in latent.chunks_exact_mut(r).zip(kv.chunks_exact(width)) {
            dst.copy_from_slice(&row[..r]);
        }
        let latent = rms_norm(be, sc, &latent, &self.kv_a_norm, LORA_NORM_EPS);
        let keys = self.indexer.as_ref().map(|ix| ix.keys(be, sc, x, tokens));
        for (span, cache) in layout.spans.iter().zip(caches.iter_mut()) {
            for t in span.rows() {
                let key = keys.as_ref().map_or(&[][..], |k| &k[t * cache.index_dim..(t + 1) * cache.index_dim]);
                cache.push(&latent[t * r..(t + 1) * r], &kv[t * width + r..(t + 1) * width], key)?;
            }
        }
        let rows: Vec<PagedRows<'_>> = caches.iter().map(|c| c.rows_view()).collect();
        let selections = self.indexer.as_ref().map(|ix| {
            let keys: Vec<PagedRows<'_>> = caches.iter().map(|c| c.keys_view()).collect();
            ix.select(be, sc, x, &c_q, &layout.tokens, &keys)
        });

        let w_kv = self.kv_b.m();
        let mut q_abs = sc.zeroed(tokens * h * width);
        be.mla_absorb(&w_kv, h, dn, dv, tokens, &q, &mut q_abs);
        let mut ctx = sc.zeroed(tokens * h * r);
        let scale = 1.0 / ((dn + dr) as f32).sqrt();
        be.mla_attention(&q_abs, h, r, scale, &layout.tokens, &rows, selections.as_deref(), &mut ctx);
        let mut o = sc.zeroed(tokens * h * dv);
        be.mla_lift(&w_kv, h, dn, dv, tokens, &ctx, &mut o);
        if let Some(g) = &self.g_proj {
            let gate = g.matmul(be, sc, x, tokens);
            be.sigmoid_mul(&mut o, &gate);
        }
        Ok((self.o_proj.matmul(be, sc, &o, tokens), selections))
    }
}
