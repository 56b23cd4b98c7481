//! The DSpark speculative draft (spec `k3-dspark-vision.md` A.1), in the
//! `Inferact/Kimi-K3-DSpark` checkpoint layout: a few MLA decoder layers with YaRN RoPE and SwiGLU
//! that read the target's tapped hidden states as context rows and propose a block of T tokens
//! in one pass, then a rank-r Markov bias that walks the block left to right.
//!
//! One drafting round: the committed rows' target aux states become the draft's context rows
//! (`context_proj` → `context_norm` → each layer's `kv_a_proj_with_mqa` → `[kv_a_layernorm(c) |
//! RoPE(k_pe, p)]`, no `input_layernorm`); the block `[x0, mask × (T − 1)]` at positions
//! P..P+T−1 runs pre-norm MLA layers whose queries see every context row and every block row
//! (non-causal inside the block); `final_norm`; the target's LM head gives the base logits U,
//! and `U[k−1] + W1[x_(k−1)] · W2ᵀ` scores draft k. The context rows live in pages of the
//! target's latent page arena; the block's own rows are dropped after the pass.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use kimi_kernels::Backend;

use super::checkpoint::Checkpoint;
use super::config::TextConfig;
use super::error::ModelError;
use super::forward::Model;
use super::norm::rms_norm;
use super::scratch::Scratch;
use super::slots::SlotArena;
use super::state::LatentCache;
use super::trace::Trace;
use super::weights::{CheckpointSource, TensorSource, Weight};

/// `config.json` of a DSpark draft: the keys we read (the file has more).
#[derive(Clone, Debug, Deserialize)]
pub struct DsparkConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub mla_use_nope: bool,
    pub mla_use_output_gate: bool,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub num_target_layers: usize,
    pub target_hidden_size: usize,
    pub target_num_hidden_layers: usize,
    pub target_layer_ids: Vec<usize>,
    pub mask_token_id: u32,
    pub markov_rank: usize,
    pub markov_head_type: String,
    #[serde(default)]
    pub enable_confidence_head: bool,
    pub rope_parameters: RopeParameters,
}

impl DsparkConfig {
    /// `<dir>/config.json`.
    pub fn load(dir: &Path) -> Result<DsparkConfig, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ModelError::Io { path: path.display().to_string(), source: e })?;
        DsparkConfig::parse(&text)
    }

    pub fn parse(text: &str) -> Result<DsparkConfig, ModelError> {
        let mut de = serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(&mut de)
            .map_err(|e| ModelError::config(&format!("draft {}", e.path()), e.inner().to_string()))
    }

    /// Checks that this draft was made for `t` (hidden size, layer count, vocabulary, tapped
    /// layers) and is the architecture implemented here.
    pub fn check_target(&self, t: &TextConfig) -> Result<(), ModelError> {
        let c = self;
        let check = |ok: bool, key: &str, msg: String| if ok { Ok(()) } else { Err(ModelError::config(key, msg)) };
        check(
            c.model_type == "k3_dspark",
            "model_type",
            format!("a DSpark draft is `k3_dspark`, not `{}`", c.model_type),
        )?;
        check(!c.mla_use_output_gate, "mla_use_output_gate", "the draft's MLA has no output gate here".into())?;
        check(!c.mla_use_nope, "mla_use_nope", "the K3 DSpark draft's MLA uses RoPE".into())?;
        check(
            c.markov_head_type == "vanilla",
            "markov_head_type",
            format!("`{}` is not implemented", c.markov_head_type),
        )?;
        check(
            c.rope_parameters.rope_type == "yarn",
            "rope_parameters.rope_type",
            format!("`{}` is not implemented (yarn is)", c.rope_parameters.rope_type),
        )?;
        check(
            c.qk_rope_head_dim.is_multiple_of(2) && c.qk_rope_head_dim > 0,
            "qk_rope_head_dim",
            "must be even".into(),
        )?;
        check(
            c.target_hidden_size == t.hidden_size,
            "target_hidden_size",
            format!("{} but the target's hidden size is {}", c.target_hidden_size, t.hidden_size),
        )?;
        check(
            c.target_num_hidden_layers == t.num_layers,
            "target_num_hidden_layers",
            format!("{} but the target has {} layers", c.target_num_hidden_layers, t.num_layers),
        )?;
        check(
            c.vocab_size == t.vocab_size && (c.mask_token_id as usize) < t.vocab_size,
            "vocab_size",
            format!("{} (mask {}) but the target's vocabulary is {}", c.vocab_size, c.mask_token_id, t.vocab_size),
        )?;
        check(
            c.hidden_size == t.hidden_size,
            "hidden_size",
            format!("{}: the draft shares the target's embedding, whose width is {}", c.hidden_size, t.hidden_size),
        )?;
        check(
            c.target_layer_ids.len() == c.num_target_layers
                && !c.target_layer_ids.is_empty()
                && c.target_layer_ids.iter().all(|&l| l + 1 < t.num_layers),
            "target_layer_ids",
            format!(
                "{:?}: {} layers below the target's last ({}) expected",
                c.target_layer_ids,
                c.num_target_layers,
                t.num_layers.saturating_sub(1)
            ),
        )
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    pub rope_type: String,
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub rope_theta: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    #[serde(default = "one")]
    pub mscale: f64,
    #[serde(default = "one")]
    pub mscale_all_dim: f64,
}

fn one() -> f64 {
    1.0
}

/// DeepSeek-YaRN's attention-scale factor: `0.1 · m · ln(s) + 1` for a stretch `s > 1`.
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 }
}

/// The rotation of a draft's MLA: YaRN frequencies (DeepSeek's variant, as vLLM's
/// `DeepseekScalingRotaryEmbedding` and ATOM's `deepseek_yarn` build them), the cos/sin
/// magnitude and the softmax scale `(dn + dr)^−½ · mscale²`.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub inv_freq: Vec<f32>,
    pub magnitude: f32,
    pub softmax_scale: f32,
}

impl Yarn {
    pub fn new(r: &RopeParameters, rope_dim: usize, nope_dim: usize) -> Yarn {
        let dim = rope_dim as f64;
        let base = r.rope_theta;
        // The dimension whose wavelength fits `turns` rotations in the original context.
        let correction = |turns: f64| {
            dim * (r.original_max_position_embeddings / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let low = correction(r.beta_fast).floor().max(0.0);
        let high = correction(r.beta_slow).ceil().min(dim - 1.0);
        let high = if low == high { high + 0.001 } else { high };
        let inv_freq = (0..rope_dim / 2)
            .map(|i| {
                let extrapolated = 1.0 / base.powf(2.0 * i as f64 / dim);
                let interpolated = extrapolated / r.factor;
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                (interpolated * (1.0 - keep) + extrapolated * keep) as f32
            })
            .collect();
        let m = yarn_mscale(r.factor, r.mscale_all_dim);
        Yarn {
            inv_freq,
            magnitude: (yarn_mscale(r.factor, r.mscale) / m) as f32,
            softmax_scale: ((nope_dim + rope_dim) as f64).powf(-0.5) as f32 * (m * m) as f32,
        }
    }
}

struct DraftLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q_a: Weight,
    q_a_norm: Vec<f32>,
    q_b: Weight,
    kv_a: Weight,
    kv_a_norm: Vec<f32>,
    kv_b: Weight,
    o_proj: Weight,
    gate: Weight,
    up: Weight,
    down: Weight,
}

/// A loaded DSpark draft. The target's embedding table and LM head are shared, not copied.
pub struct DsparkDraft {
    pub config: DsparkConfig,
    pub yarn: Yarn,
    context_proj: Weight,
    context_norm: Vec<f32>,
    layers: Vec<DraftLayer>,
    final_norm: Vec<f32>,
    markov_w1: Weight,
    markov_w2: Weight,
    confidence: Option<(Weight, f32)>,
    scratch: Scratch,
    /// Keeps the memory map alive (None for a recorded draft).
    _checkpoint: Option<Checkpoint>,
}

/// The draft's per-sequence state: each layer's context rows (positions 0..P−1 of the committed
/// tokens) in pages of the target's latent arena. A clone (a fork, `n > 1`) shares the pages by
/// reference count, as the target's latent caches do.
#[derive(Clone, Debug)]
pub struct DraftCache {
    layers: Vec<LatentCache>,
}

impl DraftCache {
    /// Context rows held (the committed positions the draft has seen).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layer `i`'s rows, `[len, kv_lora_rank + qk_rope_head_dim]` (tools and tests).
    pub fn rows(&self, layer: usize) -> Vec<f32> {
        self.layers.get(layer).map(|l| l.rows()).unwrap_or_default()
    }

    /// Latent pages held over every layer.
    pub fn pages(&self) -> usize {
        self.layers.iter().map(|l| l.pages()).sum()
    }

    /// Forgets every row from `len` on (context rows of tokens a verify rejected).
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|l| l.truncate(len));
    }
}

/// One block pass: the post-`final_norm` hidden `z` `[T, d]` and the base logits `U` `[T, V]`.
#[derive(Clone, Debug)]
pub struct Block {
    pub anchor: u32,
    pub position: usize,
    pub hidden: Vec<f32>,
    pub base_logits: Vec<f32>,
}

/// A Markov walk over a block: the drafts, their biased logits and draft probabilities (at the
/// walk's temperature; one-hot rows for a greedy walk are implied, not stored).
#[derive(Clone, Debug, Default)]
pub struct Walk {
    pub tokens: Vec<u32>,
    pub logits: Vec<f32>,
    pub probs: Vec<f32>,
}

/// How a walk picks each draft token.
#[derive(Clone, Copy, Debug)]
pub enum Pick<'a> {
    /// argmax, lowest index on ties (ATOM's default).
    Greedy,
    /// Inverse-CDF draws from `softmax(logits / temperature)`, one stored uniform per position.
    Sample { temperature: f32, uniforms: &'a [f32] },
}

impl DsparkDraft {
    /// Loads a draft from `dir` (`config.json` and its safetensors) for `target`, checking that it
    /// was made for this target (hidden size, layer count, vocabulary, tapped layers) and that it
    /// is the architecture implemented here.
    pub fn load(dir: &Path, target: &Model) -> Result<DsparkDraft, ModelError> {
        let config = DsparkConfig::load(dir)?;
        config.check_target(target.text_config())?;
        let ck = Checkpoint::open(dir)?;
        let mut draft = DsparkDraft::build(config, &mut CheckpointSource::new(&ck))?;
        draft._checkpoint = Some(ck);
        // The draft's products run through the target's backend, in its layout.
        let be = target.backend();
        for l in &mut draft.layers {
            for w in [&mut l.q_a, &mut l.q_b, &mut l.kv_a, &mut l.o_proj, &mut l.gate, &mut l.up, &mut l.down] {
                w.prepare(be);
            }
        }
        draft.context_proj.prepare(be);
        draft.markov_w2.prepare(be);
        if target.default_arenas().pages.slot_floats() < super::state::PAGE_TOKENS * draft.row_width() {
            return Err(ModelError::config(
                "kv_lora_rank",
                format!("draft rows of {} values do not fit the target's latent pages", draft.row_width()),
            ));
        }
        Ok(draft)
    }

    /// Builds the draft from any tensor source (a checkpoint, or a name recorder: what a draft of
    /// this config holds, for `make-draft`).
    pub fn build(config: DsparkConfig, src: &mut dyn TensorSource) -> Result<DsparkDraft, ModelError> {
        let c = &config;
        let (d, h) = (c.hidden_size, c.num_attention_heads);
        let (dn, dr, dv, r) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            layers.push(DraftLayer {
                input_norm: src.vector(&n("input_layernorm.weight"), &[d])?,
                post_norm: src.vector(&n("post_attention_layernorm.weight"), &[d])?,
                q_a: src.matrix(&n("self_attn.q_a_proj.weight"), c.q_lora_rank, d)?,
                q_a_norm: src.vector(&n("self_attn.q_a_layernorm.weight"), &[c.q_lora_rank])?,
                q_b: src.matrix(&n("self_attn.q_b_proj.weight"), h * (dn + dr), c.q_lora_rank)?,
                kv_a: src.matrix(&n("self_attn.kv_a_proj_with_mqa.weight"), r + dr, d)?,
                kv_a_norm: src.vector(&n("self_attn.kv_a_layernorm.weight"), &[r])?,
                kv_b: src.matrix(&n("self_attn.kv_b_proj.weight"), h * (dn + dv), r)?,
                o_proj: src.matrix(&n("self_attn.o_proj.weight"), d, h * dv)?,
                gate: src.matrix(&n("mlp.gate_proj.weight"), c.intermediate_size, d)?,
                up: src.matrix(&n("mlp.up_proj.weight"), c.intermediate_size, d)?,
                down: src.matrix(&n("mlp.down_proj.weight"), d, c.intermediate_size)?,
            });
        }
        let confidence = if c.enable_confidence_head {
            let w = src.matrix("confidence_head.proj.weight", 1, d + c.markov_rank)?;
            let b = src.vector("confidence_head.proj.bias", &[1])?;
            Some((w, b.first().copied().unwrap_or(0.0)))
        } else {
            None
        };
        Ok(DsparkDraft {
            yarn: Yarn::new(&c.rope_parameters, dr, dn),
            context_proj: src.matrix("context_proj.weight", d, c.num_target_layers * c.target_hidden_size)?,
            context_norm: src.vector("context_norm.weight", &[d])?,
            layers,
            final_norm: src.vector("final_norm.weight", &[d])?,
            markov_w1: src.matrix("markov_head.markov_w1.weight", c.vocab_size, c.markov_rank)?,
            markov_w2: src.matrix("markov_head.markov_w2.weight", c.vocab_size, c.markov_rank)?,
            confidence,
            scratch: Scratch::new(),
            config,
            _checkpoint: None,
        })
    }

    /// Decoder layers (each keeps one latent row per committed token).
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Values of one context row: `[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]`.
    pub fn row_width(&self) -> usize {
        self.config.kv_lora_rank + self.config.qk_rope_head_dim
    }

    /// Target layers whose outputs the draft reads.
    pub fn taps(&self) -> &[usize] {
        &self.config.target_layer_ids
    }

    /// A fresh cache whose pages come from `arena` (the target's latent page arena: the engine's,
    /// or `target.default_arenas().pages` for tools).
    pub fn new_cache(&self, arena: &Arc<SlotArena>) -> Result<DraftCache, ModelError> {
        let layers = (0..self.layers.len())
            .map(|_| LatentCache::in_pages(arena, self.row_width()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ModelError::config("kv_lora_rank", "draft rows do not fit the target's latent pages"))?;
        Ok(DraftCache { layers })
    }

    /// `[c | k_pe]` of `x` (`[n, d]`) through layer `l`'s `kv_a_proj_with_mqa`, normed and turned
    /// to `positions`.
    fn latent_rows(&self, be: &dyn Backend, l: &DraftLayer, x: &[f32], positions: &[usize]) -> Vec<f32> {
        let (r, dr) = (self.config.kv_lora_rank, self.config.qk_rope_head_dim);
        let n = positions.len();
        let sc = &self.scratch;
        let mut kv = l.kv_a.matmul(be, sc, x, n).to_vec();
        let mut c = vec![0f32; n * r];
        for (dst, row) in c.chunks_exact_mut(r).zip(kv.chunks_exact(r + dr)) {
            dst.copy_from_slice(&row[..r]);
        }
        let c = rms_norm(be, sc, &c, &l.kv_a_norm, self.config.rms_norm_eps);
        be.rope_interleaved(&mut kv, positions, 1, r + dr, r, &self.yarn.inv_freq, self.yarn.magnitude);
        for (row, c) in kv.chunks_exact_mut(r + dr).zip(c.chunks_exact(r)) {
            row[..r].copy_from_slice(c);
        }
        kv
    }

    /// Appends context rows for the next committed positions from their target aux states
    /// (`[n, taps · d_target]`, in tap order). Returns `context_norm(context_proj(aux))`.
    pub fn extend_context(
        &self,
        target: &Model,
        cache: &mut DraftCache,
        aux: &[f32],
        trace: Option<&mut Trace>,
        prefix: &str,
    ) -> Result<Vec<f32>, ModelError> {
        let ctx = self.extend_contexts(target, &mut [cache], &[aux])?;
        if let Some(tr) = trace {
            tr.f32(
                format!("{prefix}context_hidden"),
                &[ctx.len() / self.config.hidden_size, self.config.hidden_size],
                &ctx,
            );
        }
        Ok(ctx)
    }

    /// [`DsparkDraft::extend_context`] for many sequences in one pass (one product per weight):
    /// `aux[s]` holds sequence s's new rows. All-or-nothing: on an error no cache gains a row.
    pub fn extend_contexts(
        &self,
        target: &Model,
        caches: &mut [&mut DraftCache],
        aux: &[&[f32]],
    ) -> Result<Vec<f32>, ModelError> {
        let be = target.backend();
        let sc = &self.scratch;
        let width = self.config.num_target_layers * self.config.target_hidden_size;
        let mut counts = Vec::with_capacity(aux.len());
        let mut positions = Vec::new();
        for (cache, rows) in caches.iter().zip(aux) {
            if width == 0 || !rows.len().is_multiple_of(width) {
                return Err(ModelError::config(
                    "target_layer_ids",
                    format!("aux rows of {} values are not [n, {width}]", rows.len()),
                ));
            }
            let n = rows.len() / width;
            positions.extend(cache.len()..cache.len() + n);
            counts.push(n);
        }
        let total = positions.len();
        if total == 0 {
            return Ok(Vec::new());
        }
        let all: Vec<f32> = aux.iter().flat_map(|a| a.iter().copied()).collect();
        let eps = self.config.rms_norm_eps;
        let ctx = rms_norm(be, sc, &self.context_proj.matmul(be, sc, &all, total), &self.context_norm, eps).to_vec();
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let (r, w) = (self.config.kv_lora_rank, self.row_width());
        let pushed = (|| {
            for (i, l) in self.layers.iter().enumerate() {
                let rows = self.latent_rows(be, l, &ctx, &positions);
                let mut at = 0;
                for (cache, &n) in caches.iter_mut().zip(&counts) {
                    for row in rows[at * w..(at + n) * w].chunks_exact(w) {
                        cache.layers[i].push(&row[..r], &row[r..], &[])?;
                    }
                    at += n;
                }
            }
            Ok(())
        })();
        if let Err(e) = pushed {
            for (cache, &start) in caches.iter_mut().zip(&starts) {
                cache.truncate(start);
            }
            return Err(e);
        }
        Ok(ctx)
    }

    /// The block pass for anchor `x0` at position P = `cache.len()`: `[x0, mask × (t − 1)]` at
    /// P..P+t−1 through every layer (queries see all context rows and all block rows), then
    /// `final_norm` and the target's LM head. The block's rows are not kept.
    pub fn block(
        &self,
        target: &Model,
        cache: &mut DraftCache,
        anchor: u32,
        t: usize,
        trace: Option<&mut Trace>,
        prefix: &str,
    ) -> Result<Block, ModelError> {
        if t == 0 {
            return Err(ModelError::config("num_speculative_tokens", "a block needs at least one token"));
        }
        let mut blocks = self.blocks(target, &mut [cache], &[anchor], &[t], trace.map(|tr| (tr, prefix)))?;
        blocks.pop().ok_or_else(|| ModelError::config("num_speculative_tokens", "no block"))
    }

    /// Block passes for many sequences in one forward (one product per weight; each block's
    /// queries attend over their own sequence's context through its page table). Sequence s
    /// drafts `t[s]` tokens after `anchors[s]` (none when 0). A trace needs one sequence.
    pub fn blocks(
        &self,
        target: &Model,
        caches: &mut [&mut DraftCache],
        anchors: &[u32],
        t: &[usize],
        mut trace: Option<(&mut Trace, &str)>,
    ) -> Result<Vec<Block>, ModelError> {
        let c = &self.config;
        let be = target.backend();
        let sc = &self.scratch;
        let (d, h, eps) = (c.hidden_size, c.num_attention_heads, c.rms_norm_eps);
        let (dn, dr, dv, r) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        if trace.is_some() && caches.len() != 1 {
            return Err(ModelError::TraceNeedsOneSequence { sequences: caches.len() });
        }
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        // Every block query sees its whole block: the block's last position bounds them all.
        let mut seen = Vec::new();
        for (s, ((&p, &anchor), &ts)) in starts.iter().zip(anchors).zip(t).enumerate() {
            let block: Vec<u32> = std::iter::once(anchor)
                .chain(std::iter::repeat_n(c.mask_token_id, ts.saturating_sub(1)))
                .take(ts)
                .collect();
            target.check(&block, p)?;
            ids.extend(block);
            positions.extend(p..p + ts);
            seen.extend(std::iter::repeat_n((s, p + ts.saturating_sub(1)), ts));
        }
        let total = ids.len();
        if total == 0 {
            return Ok(starts
                .iter()
                .zip(anchors)
                .map(|(&p, &a)| Block { anchor: a, position: p, hidden: Vec::new(), base_logits: Vec::new() })
                .collect());
        }
        let mut hidden = target.embed(&ids)?;
        if let Some((tr, prefix)) = trace.as_mut() {
            tr.i64(format!("{prefix}block_input_ids"), &[total], ids.iter().map(|&x| x as i64).collect());
            tr.i64(format!("{prefix}block_positions"), &[total], positions.iter().map(|&x| x as i64).collect());
        }
        let w = self.row_width();
        let result = (|| {
            for (i, l) in self.layers.iter().enumerate() {
                let a = rms_norm(be, sc, &hidden, &l.input_norm, eps);
                let c_q = rms_norm(be, sc, &l.q_a.matmul(be, sc, &a, total), &l.q_a_norm, eps);
                let mut q = l.q_b.matmul(be, sc, &c_q, total).to_vec();
                be.rope_interleaved(&mut q, &positions, h, dn + dr, dn, &self.yarn.inv_freq, self.yarn.magnitude);
                let rows = self.latent_rows(be, l, &a, &positions);
                let mut at = 0;
                for (cache, &ts) in caches.iter_mut().zip(t) {
                    for row in rows[at * w..(at + ts) * w].chunks_exact(w) {
                        cache.layers[i].push(&row[..r], &row[r..], &[])?;
                    }
                    at += ts;
                }
                let mut q_abs = sc.for_overwrite(total * h * w);
                be.mla_absorb(&l.kv_b.m(), h, dn, dv, total, &q, &mut q_abs);
                let views: Vec<_> = caches.iter().map(|c| c.layers[i].rows_view()).collect();
                let mut ctx = sc.zeroed(total * h * r);
                be.mla_attention(&q_abs, h, r, self.yarn.softmax_scale, &seen, &views, None, &mut ctx, None);
                let mut o = sc.for_overwrite(total * h * dv);
                be.mla_lift(&l.kv_b.m(), h, dn, dv, total, &ctx, &mut o);
                let attn = l.o_proj.matmul(be, sc, &o, total);
                be.add(&mut hidden, &attn);
                let x = rms_norm(be, sc, &hidden, &l.post_norm, eps);
                let mut g = l.gate.matmul(be, sc, &x, total);
                be.silu_glu(&mut g, &l.up.matmul(be, sc, &x, total));
                be.add(&mut hidden, &l.down.matmul(be, sc, &g, total));
                for (cache, &p) in caches.iter_mut().zip(&starts) {
                    cache.layers[i].truncate(p);
                }
                if let Some((tr, prefix)) = trace.as_mut() {
                    tr.f32(format!("{prefix}layer{i}.block_rows"), &[total, w], &rows);
                    tr.f32(format!("{prefix}layer{i}.attn_output"), &[total, d], &attn);
                    tr.f32(format!("{prefix}layer{i}.hidden_out"), &[total, d], &hidden);
                }
            }
            Ok(())
        })();
        // A failure part-way must not leave block rows behind.
        for (cache, &p) in caches.iter_mut().zip(&starts) {
            cache.truncate(p);
        }
        result?;
        let z = rms_norm(be, sc, &hidden, &self.final_norm, eps).to_vec();
        let base = target.lm_head(&z, total)?;
        if let Some((tr, prefix)) = trace {
            tr.f32(format!("{prefix}final_hidden"), &[total, d], &z);
            tr.f32(format!("{prefix}base_logits"), &[total, c.vocab_size], &base);
        }
        let v = c.vocab_size;
        let mut at = 0;
        let mut out = Vec::with_capacity(t.len());
        for ((&p, &anchor), &ts) in starts.iter().zip(anchors).zip(t) {
            out.push(Block {
                anchor,
                position: p,
                hidden: z[at * d..(at + ts) * d].to_vec(),
                base_logits: base[at * v..(at + ts) * v].to_vec(),
            });
            at += ts;
        }
        Ok(out)
    }

    /// Greedy Markov walks over many blocks at once: step k's biases for every block still
    /// walking come from one product (`[blocks, r] × W2ᵀ`). Returns each block's drafts.
    pub fn walk_greedy(&self, be: &dyn Backend, blocks: &[Block]) -> Vec<Vec<u32>> {
        self.walk_with(be, blocks, |_, _, logits| Some(crate::engine::speculative::argmax(logits) as u32))
    }

    /// Markov walks over many blocks at once, each token chosen by `pick(block, drafts so far,
    /// biased logits)` (it may change the logits, e.g. mask them); `None` ends that block's walk.
    /// Step k's biases for every block still walking come from one product.
    pub fn walk_with(
        &self,
        be: &dyn Backend,
        blocks: &[Block],
        mut pick: impl FnMut(usize, &[u32], &mut [f32]) -> Option<u32>,
    ) -> Vec<Vec<u32>> {
        let v = self.config.vocab_size;
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); blocks.len()];
        let mut prev: Vec<u32> = blocks.iter().map(|b| b.anchor).collect();
        let mut walking = vec![true; blocks.len()];
        for k in 0.. {
            let active: Vec<usize> =
                (0..blocks.len()).filter(|&b| walking[b] && blocks[b].base_logits.len() > k * v).collect();
            if active.is_empty() {
                break;
            }
            let prevs: Vec<u32> = active.iter().map(|&b| prev[b]).collect();
            let bias = self.markov_biases(be, &prevs);
            for (j, &b) in active.iter().enumerate() {
                let mut logits = blocks[b].base_logits[k * v..(k + 1) * v].to_vec();
                be.add(&mut logits, &bias[j * v..(j + 1) * v]);
                match pick(b, &drafts[b], &mut logits) {
                    Some(next) => {
                        drafts[b].push(next);
                        prev[b] = next;
                    }
                    None => walking[b] = false,
                }
            }
        }
        drafts
    }

    /// Reads each sequence's committed aux rows into its context, then drafts `t[s]` tokens
    /// after `anchors[s]` with a greedy walk (the likeliest block, so the most of it matches):
    /// the whole batch's context rows, block passes and walks in single passes.
    pub fn propose(
        &self,
        target: &Model,
        caches: &mut [&mut DraftCache],
        pending: &[&[f32]],
        anchors: &[u32],
        t: &[usize],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let blocks = self.draft_blocks(target, caches, pending, anchors, t)?;
        Ok(self.walk_greedy(target.backend(), &blocks))
    }

    /// `propose` up to the walk: context rows read, then one block pass for the whole batch.
    pub fn draft_blocks(
        &self,
        target: &Model,
        caches: &mut [&mut DraftCache],
        pending: &[&[f32]],
        anchors: &[u32],
        t: &[usize],
    ) -> Result<Vec<Block>, ModelError> {
        self.extend_contexts(target, caches, pending)?;
        self.blocks(target, caches, anchors, t, None)
    }

    /// `W1[prev]` (`[markov_rank]`).
    fn markov_row(&self, be: &dyn Backend, prev: u32) -> Vec<f32> {
        let mut row = vec![0f32; self.config.markov_rank];
        be.embedding(&self.markov_w1.m(), &[prev], &mut row);
        row
    }

    /// The Markov bias after `prev`: `W1[prev] · W2ᵀ` (`[V]`).
    pub fn markov_bias(&self, be: &dyn Backend, prev: u32) -> Vec<f32> {
        self.markov_biases(be, &[prev])
    }

    /// The Markov biases after each of `prevs`, `[prevs, V]`, in one product.
    fn markov_biases(&self, be: &dyn Backend, prevs: &[u32]) -> Vec<f32> {
        let mut rows = vec![0f32; prevs.len() * self.config.markov_rank];
        be.embedding(&self.markov_w1.m(), prevs, &mut rows);
        self.markov_w2.matmul(be, &self.scratch, &rows, prevs.len()).to_vec()
    }

    /// Walks the block: for k = 1..T, logits `U[k−1] + bias(x_(k−1))` and x_k picked by `pick`.
    pub fn walk(&self, be: &dyn Backend, block: &Block, pick: Pick<'_>) -> Result<Walk, ModelError> {
        let v = self.config.vocab_size;
        let t = block.base_logits.len() / v;
        let mut walk = Walk::default();
        let mut prev = block.anchor;
        for k in 0..t {
            let mut logits = block.base_logits[k * v..(k + 1) * v].to_vec();
            be.add(&mut logits, &self.markov_bias(be, prev));
            let (probs, next) = match pick {
                Pick::Greedy => {
                    (crate::engine::speculative::softmax(&logits, 1.0), crate::engine::speculative::argmax(&logits))
                }
                Pick::Sample { temperature, uniforms } => {
                    let u = *uniforms.get(k).ok_or_else(|| {
                        ModelError::config("uniforms", format!("{} uniforms for a block of {t}", uniforms.len()))
                    })?;
                    let probs = crate::engine::speculative::softmax(&logits, temperature);
                    let next = crate::engine::speculative::sample_with_uniform(&probs, u);
                    (probs, next)
                }
            };
            walk.logits.extend_from_slice(&logits);
            walk.probs.extend_from_slice(&probs);
            walk.tokens.push(next as u32);
            prev = next as u32;
        }
        Ok(walk)
    }

    /// Confidence logits `c_k = w · [z_k ; W1[x_(k−1)]] + b` along a walk (DeepSpec's input
    /// convention; informational: ATOM and vLLM skip this head), or `None` without the head.
    pub fn confidence(&self, be: &dyn Backend, block: &Block, walk: &Walk) -> Option<Vec<f32>> {
        let (w, b) = self.confidence.as_ref()?;
        let d = self.config.hidden_size;
        let mut prev = block.anchor;
        let mut out = Vec::with_capacity(walk.tokens.len());
        for (k, &x) in walk.tokens.iter().enumerate() {
            let mut input = block.hidden[k * d..(k + 1) * d].to_vec();
            input.extend(self.markov_row(be, prev));
            out.push(w.matmul(be, &self.scratch, &input, 1)[0] + b);
            prev = x;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_matches_the_deepseek_formula_on_the_release_parameters() {
        let r = RopeParameters {
            rope_type: "yarn".into(),
            factor: 32.0,
            original_max_position_embeddings: 32768.0,
            rope_theta: 50000.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        };
        // Values the dspark-tiny case records (rotary dim 8), and its softmax scale.
        let y = Yarn::new(&r, 8, 16);
        let want = [1.0f32, 0.066_874_03, 0.003_028_008_6, 0.000_105_920_54];
        for (g, w) in y.inv_freq.iter().zip(want) {
            assert!((g - w).abs() <= w * 1e-6, "{g} vs {w}");
        }
        assert_eq!(y.magnitude, 1.0);
        assert!((y.softmax_scale - 0.370_130_23).abs() < 1e-7, "{}", y.softmax_scale);
    }
}
