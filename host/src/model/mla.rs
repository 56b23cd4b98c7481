//! Gated NoPE MLA (spec §2.5) in the absorbed-latent form: queries are mapped into the
//! 512-wide latent space per head (W_UKᵀ q_nope), attend over the cached 576-wide rows
//! [c | k_pe] as one shared KV head, and the latent context is lifted with W_UV. Prefill and
//! decode run the same code; only the number of new rows differs. No rotation anywhere.

use rayon::prelude::*;

use kimi_kernels::cpu::simd::{axpy, dot};

use super::batch::BatchLayout;
use super::config::TextConfig;
use super::error::ModelError;
use super::indexer::{Indexer, Selection};
use super::norm::{rms_norm, sigmoid};
use super::state::LatentCache;
use super::weights::{TensorSource, Weight};

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
    pub fn load(src: &mut dyn TensorSource, prefix: &str, c: &TextConfig) -> Result<MlaLayer, ModelError> {
        let d = c.hidden_size;
        let (h, dn, dr, dv, r) = (c.mla_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let n = |s: &str| format!("{prefix}.{s}");
        let indexer = match &c.indexer {
            Some(ic) => Some(Indexer::load(src, &n("indexer"), ic, d, c.q_lora_rank)?),
            None => None,
        };
        Ok(MlaLayer {
            q_a: src.matrix(&n("q_a_proj.weight"), c.q_lora_rank, d)?,
            q_a_norm: src.vector(&n("q_a_layernorm.weight"), &[c.q_lora_rank])?,
            q_b: src.matrix(&n("q_b_proj.weight"), h * (dn + dr), c.q_lora_rank)?,
            kv_a: src.matrix(&n("kv_a_proj_with_mqa.weight"), r + dr, d)?,
            kv_a_norm: src.vector(&n("kv_a_layernorm.weight"), &[r])?,
            kv_b: src.matrix(&n("kv_b_proj.weight"), h * (dn + dv), r)?,
            g_proj: if c.mla_output_gate { Some(src.matrix(&n("g_proj.weight"), h * dv, d)?) } else { None },
            o_proj: src.matrix(&n("o_proj.weight"), d, h * dv)?,
            indexer,
            heads: h,
            nope: dn,
            rope: dr,
            v_dim: dv,
            rank: r,
        })
    }

    /// x: `[T, d]` (post `input_layernorm`) for every sequence of the step; `caches[s]` belongs to
    /// `layout.spans[s]` and gains its rows. Projections run once over all T rows; each token
    /// attends over its own sequence's cache. Returns the layer output and, for K3.1, the
    /// indexer's selection per row.
    pub fn forward(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        caches: &mut [&mut LatentCache],
    ) -> (Vec<f32>, Option<Vec<Selection>>) {
        let (h, dn, dr, dv, r) = (self.heads, self.nope, self.rope, self.v_dim, self.rank);
        let width = r + dr;
        let tokens = layout.len();

        let c_q = rms_norm(&self.q_a.matmul(x, tokens), &self.q_a_norm, LORA_NORM_EPS);
        let q = self.q_b.matmul(&c_q, tokens);
        let kv = self.kv_a.matmul(x, tokens);
        let keys = self.indexer.as_ref().map(|ix| ix.keys(x, tokens));
        for (span, cache) in layout.spans.iter().zip(caches.iter_mut()) {
            for t in span.rows() {
                let row = &kv[t * width..(t + 1) * width];
                let c = rms_norm(&row[..r], &self.kv_a_norm, LORA_NORM_EPS);
                let key = keys.as_ref().map_or(&[][..], |k| &k[t * cache.index_dim..(t + 1) * cache.index_dim]);
                cache.push(&c, &row[r..], key);
            }
        }
        let caches: Vec<&LatentCache> = caches.iter().map(|c| &**c).collect();

        let selections =
            self.indexer.as_ref().map(|ix| ix.select(x, &c_q, &layout.tokens, |seq, s| caches[seq].index_key(s)));

        let scale = 1.0 / ((dn + dr) as f32).sqrt();
        let wkv = self.kv_b.m();
        let heads: Vec<Vec<f32>> = (0..h)
            .into_par_iter()
            .map(|hh| {
                let w_uk = wkv.row_range(hh * (dn + dv), dn);
                let w_uv = wkv.row_range(hh * (dn + dv) + dn, dv);
                let mut ctx = vec![0f32; tokens * r];
                // This head's queries absorbed into the latent space for every row at once
                // (W_UKᵀ q_nope), so W_UK is read once per step.
                let head_q =
                    |t: usize| &q[t * h * (dn + dr) + hh * (dn + dr)..t * h * (dn + dr) + (hh + 1) * (dn + dr)];
                let q_nope: Vec<f32> = (0..tokens).flat_map(|t| head_q(t)[..dn].iter().copied()).collect();
                let mut q_lat = vec![0f32; tokens * r];
                w_uk.matmul_transposed(&q_nope, tokens, &mut q_lat);
                let mut qabs = vec![0f32; width];
                let mut scores = Vec::new();
                let mut all = Vec::new();
                for (t, &(seq, pos)) in layout.tokens.iter().enumerate() {
                    let cache = caches[seq];
                    qabs[..r].copy_from_slice(&q_lat[t * r..(t + 1) * r]);
                    qabs[r..].copy_from_slice(&head_q(t)[dn..]);
                    let cand: &[usize] = match &selections {
                        Some(sel) => &sel[t].tokens,
                        None => {
                            all.clear();
                            all.extend(0..=pos);
                            &all
                        }
                    };
                    scores.clear();
                    scores.extend(cand.iter().map(|&s| dot(&qabs, cache.row(s)) * scale));
                    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut z = 0f32;
                    scores.iter_mut().for_each(|s| {
                        *s = (*s - m).exp();
                        z += *s;
                    });
                    let ct = &mut ctx[t * r..(t + 1) * r];
                    for (&s, p) in cand.iter().zip(&scores) {
                        axpy(p / z, &cache.row(s)[..r], ct);
                    }
                }
                let mut o = vec![0f32; tokens * dv];
                w_uv.matmul(&ctx, tokens, &mut o);
                o
            })
            .collect();

        let mut o = vec![0f32; tokens * h * dv];
        for (hh, oh) in heads.iter().enumerate() {
            for t in 0..tokens {
                o[t * h * dv + hh * dv..t * h * dv + (hh + 1) * dv].copy_from_slice(&oh[t * dv..(t + 1) * dv]);
            }
        }
        if let Some(g) = &self.g_proj {
            let gate = g.matmul(x, tokens);
            o.iter_mut().zip(&gate).for_each(|(v, g)| *v *= sigmoid(*g));
        }
        (self.o_proj.matmul(&o, tokens), selections)
    }
}
