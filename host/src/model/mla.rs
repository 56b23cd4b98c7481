//! Gated NoPE MLA (spec §2.5) in the absorbed-latent form: queries are mapped into the
//! 512-wide latent space per head (W_UKᵀ q_nope), attend over the cached 576-wide rows
//! [c | k_pe] as one shared KV head, and the latent context is lifted with W_UV. Prefill and
//! decode run the same code; only the number of new rows differs. No rotation anywhere.

use kimi_kernels::{Backend, Communicator, PagedRows, Selection};

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
    ///
    /// With `cp` (context parallelism over the tensor-parallel group) each rank's caches hold
    /// every n-th page: the indexer's candidates and the attention partials of every rank are
    /// gathered and merged exactly (top-k of the union; log-sum-exp-weighted contexts).
    pub fn forward<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        x: &[f32],
        layout: &BatchLayout,
        caches: &mut [&mut LatentCache],
        cp: Option<&ContextParallel<'_>>,
    ) -> Result<(Buf<'s>, Option<Vec<Selection>>), ModelError> {
        let (h, dn, dr, dv, r) = (self.heads, self.nope, self.rope, self.v_dim, self.rank);
        let width = r + dr;
        let tokens = layout.len();

        // Every projection of x in one op.
        let (q_a, kv, gate) = match &self.g_proj {
            Some(g) => {
                let [q_a, kv, gate] = Weight::matmul_many([&self.q_a, &self.kv_a, g], be, sc, x, tokens);
                (q_a, kv, Some(gate))
            }
            None => {
                let [q_a, kv] = Weight::matmul_many([&self.q_a, &self.kv_a], be, sc, x, tokens);
                (q_a, kv, None)
            }
        };
        let c_q = rms_norm(be, sc, &q_a, &self.q_a_norm, LORA_NORM_EPS);
        let q = self.q_b.matmul(be, sc, &c_q, tokens);
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
            match cp {
                None => ix.select(be, sc, x, &c_q, &layout.tokens, &keys, ix.topk()),
                Some(cp) => {
                    // Each rank's top k + 1 of the keys it holds: the union holds the global
                    // top k + 1 (the margin needs the first one left out).
                    let local = ix.select(be, sc, x, &c_q, &layout.tokens, &keys, ix.topk() + 1);
                    cp.merge_selections(local, ix.topk(), &layout.tokens)
                }
            }
        });

        let w_kv = self.kv_b.m();
        let mut q_abs = sc.zeroed(tokens * h * width);
        be.mla_absorb(&w_kv, h, dn, dv, tokens, &q, &mut q_abs);
        let mut ctx = sc.zeroed(tokens * h * r);
        let scale = 1.0 / ((dn + dr) as f32).sqrt();
        match cp {
            None => be.mla_attention(&q_abs, h, r, scale, &layout.tokens, &rows, selections.as_deref(), &mut ctx, None),
            Some(cp) => {
                cp.attention(be, sc, &q_abs, h, r, scale, &layout.tokens, &rows, selections.as_deref(), &mut ctx)
            }
        }
        let mut o = sc.zeroed(tokens * h * dv);
        be.mla_lift(&w_kv, h, dn, dv, tokens, &ctx, &mut o);
        if let Some(gate) = &gate {
            be.sigmoid_mul(&mut o, gate);
        }
        Ok((self.o_proj.matmul(be, sc, &o, tokens), selections))
    }
}

/// Context parallelism over a tensor-parallel group: every rank holds every n-th page of each
/// sequence's latent cache (see [`LatentCache`]).
pub struct ContextParallel<'c> {
    pub comm: &'c dyn Communicator,
    /// Gather every rank's indexer scores too (a trace records them); otherwise only the top
    /// candidates travel.
    pub want_scores: bool,
}

impl ContextParallel<'_> {
    /// Top `topk` of the union of every rank's candidates (`local[t]`: its top k + 1 of the
    /// positions it holds), ties to the lower position, as one rank would select over all keys.
    fn merge_selections(&self, local: Vec<Selection>, topk: usize, rows: &[(usize, usize)]) -> Vec<Selection> {
        let (tokens, k1, n) = (local.len(), topk + 1, self.comm.size());
        // (position bits, score) pairs; a NaN score marks an empty slot.
        let mut mine = vec![f32::NAN; tokens * k1 * 2];
        for (t, sel) in local.iter().enumerate() {
            for (j, &s) in sel.tokens.iter().take(k1).enumerate() {
                mine[(t * k1 + j) * 2] = f32::from_bits(s as u32);
                mine[(t * k1 + j) * 2 + 1] = sel.scores[s];
            }
        }
        let mut all = vec![0f32; n * mine.len()];
        self.comm.all_gather(&mine, &mut all);
        let scores = self.want_scores.then(|| {
            let mine: Vec<f32> = local.iter().flat_map(|s| s.scores.iter().copied()).collect();
            let mut all = vec![0f32; n * mine.len()];
            self.comm.all_gather(&mine, &mut all);
            // Every position is held by exactly one rank: take its score.
            let len = mine.len();
            (0..len).map(|i| (0..n).map(|r| all[r * len + i]).find(|v| !v.is_nan()).unwrap_or(f32::NAN)).collect()
        });
        let mut out = Vec::with_capacity(tokens);
        let mut at = 0;
        for (t, &(_, pos)) in rows.iter().enumerate() {
            let mut cands: Vec<(usize, f32)> = (0..n)
                .flat_map(|r| {
                    let base = r * mine.len() + t * k1 * 2;
                    (0..k1).map(move |j| (base + 2 * j, base + 2 * j + 1))
                })
                .filter(|&(_, sc)| !all[sc].is_nan())
                .map(|(p, sc)| (all[p].to_bits() as usize, all[sc]))
                .collect();
            cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let k = topk.min(pos + 1);
            let margin = if k < pos + 1 && cands.len() > k { cands[k - 1].1 - cands[k].1 } else { f32::NAN };
            let mut chosen: Vec<usize> = cands.iter().take(k).map(|c| c.0).collect();
            chosen.sort_unstable();
            let row_scores = match &scores {
                Some(s) => {
                    let v: &Vec<f32> = s;
                    v[at..at + pos + 1].to_vec()
                }
                None => Vec::new(),
            };
            at += pos + 1;
            out.push(Selection { tokens: chosen, scores: row_scores, margin });
        }
        out
    }

    /// Attention of this rank's `heads` query heads over every rank's cache pages: queries of
    /// all heads are gathered, each rank attends with all of them over the pages it holds, and
    /// each rank merges every rank's partials of its own heads.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        be: &dyn Backend,
        sc: &Scratch,
        q_abs: &[f32],
        heads: usize,
        rank: usize,
        scale: f32,
        rows: &[(usize, usize)],
        caches: &[PagedRows<'_>],
        selected: Option<&[Selection]>,
        ctx: &mut [f32],
    ) {
        let (n, me, tokens) = (self.comm.size(), self.comm.rank(), rows.len());
        let width = q_abs.len() / (tokens * heads).max(1);
        let all_heads = n * heads;
        let mut gathered = sc.for_overwrite(n * q_abs.len());
        self.comm.all_gather(q_abs, &mut gathered);
        let mut q_all = sc.for_overwrite(tokens * all_heads * width);
        let block = heads * width;
        for r in 0..n {
            for t in 0..tokens {
                let src = &gathered[r * q_abs.len() + t * block..r * q_abs.len() + (t + 1) * block];
                q_all[(t * all_heads + r * heads) * width..(t * all_heads + (r + 1) * heads) * width]
                    .copy_from_slice(src);
            }
        }
        let mut part = sc.zeroed(tokens * all_heads * rank);
        let mut lse = sc.for_overwrite(tokens * all_heads);
        be.mla_attention(&q_all, all_heads, rank, scale, rows, caches, selected, &mut part, Some(&mut lse));
        let mut parts_all = sc.for_overwrite(n * part.len());
        self.comm.all_gather(&part, &mut parts_all);
        let mut lse_all = sc.for_overwrite(n * lse.len());
        self.comm.all_gather(&lse, &mut lse_all);
        // Every rank's partials of this rank's heads, `[tokens, heads, rank]` each.
        let mut mine: Vec<Buf<'_>> = Vec::with_capacity(n);
        let mut mine_lse: Vec<Buf<'_>> = Vec::with_capacity(n);
        for r in 0..n {
            let mut p = sc.for_overwrite(tokens * heads * rank);
            let mut l = sc.for_overwrite(tokens * heads);
            for t in 0..tokens {
                let src = r * part.len() + (t * all_heads + me * heads) * rank;
                p[t * heads * rank..(t + 1) * heads * rank].copy_from_slice(&parts_all[src..src + heads * rank]);
                let src = r * lse.len() + t * all_heads + me * heads;
                l[t * heads..(t + 1) * heads].copy_from_slice(&lse_all[src..src + heads]);
            }
            mine.push(p);
            mine_lse.push(l);
        }
        let parts: Vec<&[f32]> = mine.iter().map(|b| &b[..]).collect();
        let lses: Vec<&[f32]> = mine_lse.iter().map(|b| &b[..]).collect();
        be.attention_merge(&parts, &lses, rank, ctx);
    }
}
