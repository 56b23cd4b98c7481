//! The whole text model: embedding → 2-site AttnRes decoder layers (KDA or MLA mixer; dense MLP or
//! latent MoE) → output mix → final norm → `lm_head` (spec §2).

use std::path::Path;

use super::attn_res::ResMix;
use super::checkpoint::Checkpoint;
use super::config::{MixerKind, ModelConfig, TextConfig, load_config};
use super::error::ModelError;
use super::kda::KdaLayer;
use super::mla::MlaLayer;
use super::mlp::{Mlp, Situ};
use super::moe::MoeLayer;
use super::norm::rms_norm;
use super::state::{LayerState, SequenceState};
use super::trace::Trace;
use super::weights::{CheckpointSource, TensorSource, Weight};

/// Every text-model tensor name starts with this.
pub const PREFIX: &str = "language_model.";

#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    Kda(KdaLayer),
    Mla(MlaLayer),
}

// One per layer, built once: the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    Dense(Mlp),
    Moe(MoeLayer),
}

pub struct DecoderLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn_res: ResMix,
    mlp_res: ResMix,
    pub mixer: Mixer,
    pub ffn: Ffn,
}

pub struct Model {
    pub config: ModelConfig,
    embed: Weight,
    pub layers: Vec<DecoderLayer>,
    output_res: ResMix,
    norm: Vec<f32>,
    lm_head: Weight,
    situ: Situ,
    /// Keeps the memory maps alive for the weights' lifetime.
    _checkpoint: Option<Checkpoint>,
}

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// `[tokens, V]`.
    AllTokens,
    /// `[1, V]` for the last token (generation).
    LastToken,
}

impl Model {
    /// Loads `<dir>/config.json` and the checkpoint beside it.
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        let config = load_config(dir)?;
        let ck = Checkpoint::open(dir)?;
        let mut model = {
            let mut src = CheckpointSource { ck: &ck };
            Model::build(config, &mut src)?
        };
        model._checkpoint = Some(ck);
        Ok(model)
    }

    /// Builds the model from any tensor source (a checkpoint, or a name recorder).
    pub fn build(config: ModelConfig, src: &mut dyn TensorSource) -> Result<Model, ModelError> {
        let c = &config.text;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let m = |s: &str| format!("{PREFIX}model.{s}");
        let embed = src.matrix(&m("embed_tokens.weight"), v, d)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = m(&format!("layers.{i}"));
            let eps = c.rms_norm_eps;
            let input_norm = src.vector(&format!("{p}.input_layernorm.weight"), &[d])?;
            let post_norm = src.vector(&format!("{p}.post_attention_layernorm.weight"), &[d])?;
            let attn_res = ResMix::load(src, &format!("{p}.self_attention_res"), d, eps)?;
            let mlp_res = ResMix::load(src, &format!("{p}.mlp_res"), d, eps)?;
            let mixer = match c.layer_kinds[i] {
                MixerKind::Kda => Mixer::Kda(KdaLayer::load(src, &format!("{p}.self_attn"), c)?),
                MixerKind::Mla => Mixer::Mla(MlaLayer::load(src, &format!("{p}.self_attn"), c)?),
            };
            let ffn = if c.is_moe_layer(i) {
                Ffn::Moe(MoeLayer::load(src, &format!("{p}.block_sparse_moe"), c)?)
            } else {
                Ffn::Dense(Mlp::load(src, &format!("{p}.mlp"), d, c.intermediate_size)?)
            };
            layers.push(DecoderLayer { input_norm, post_norm, attn_res, mlp_res, mixer, ffn });
        }
        let output_res = ResMix::load(src, &m("output_attn_res"), d, c.rms_norm_eps)?;
        let norm = src.vector(&m("norm.weight"), &[d])?;
        let lm_head = src.matrix(&format!("{PREFIX}lm_head.weight"), v, d)?;
        let situ = Situ::from_config(c);
        Ok(Model { config, embed, layers, output_res, norm, lm_head, situ, _checkpoint: None })
    }

    pub fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    pub fn new_state(&self) -> SequenceState {
        SequenceState::new(&self.config.text)
    }

    /// Runs `ids` as the next tokens of the sequence in `state` (a prefill when the state is fresh,
    /// a decode step for one id) and returns logits, `[tokens or 1, V]`.
    pub fn forward(
        &self,
        ids: &[u32],
        state: &mut SequenceState,
        logits_for: LogitsFor,
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.config.text;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let tokens = ids.len();
        if tokens == 0 {
            return Ok(Vec::new());
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= v) {
            return Err(ModelError::TokenOutOfRange { id, vocab: v });
        }
        if state.len + tokens > c.max_position_embeddings {
            return Err(ModelError::TooLong { len: state.len + tokens, max: c.max_position_embeddings });
        }
        let shape = [tokens, d];
        let emb_m = self.embed.m();
        let mut h0 = vec![0f32; tokens * d];
        for (t, &id) in ids.iter().enumerate() {
            emb_m.row_to_f32(id as usize, &mut h0[t * d..(t + 1) * d]);
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("embedding", &shape, &h0);
        }

        let mut blocks: Vec<Vec<f32>> = Vec::new();
        let mut partial: Option<Vec<f32>> = Some(h0);
        for (i, layer) in self.layers.iter().enumerate() {
            let mut tr = trace.as_deref_mut();
            // Attention site: mix banked blocks with the running partial sum (layer 0: embedding).
            let a = match (&partial, blocks.is_empty()) {
                (Some(p), true) => p.clone(),
                (p, _) => layer.attn_res.mix(&candidates(&blocks, p.as_ref()), tokens),
            };
            if i % c.attn_res_block_size == 0
                && let Some(p) = partial.take()
            {
                blocks.push(p);
            }
            let x = rms_norm(&a, &layer.input_norm, c.rms_norm_eps);
            let u = match (&layer.mixer, &mut state.layers[i]) {
                (Mixer::Kda(k), LayerState::Kda(s)) => k.forward(&x, tokens, s),
                (Mixer::Mla(m), LayerState::Mla(cache)) => {
                    let (u, sel) = m.forward(&x, tokens, cache);
                    if let (Some(tr), Some(sel), Some(ix)) = (tr.as_deref_mut(), sel, &m.indexer) {
                        record_selection(tr, i, &sel, ix.topk(), state.len);
                    }
                    u
                }
                _ => unreachable!("sequence state built from the same config"),
            };
            let p = match partial.take() {
                None => u.clone(),
                Some(mut p) => {
                    p.iter_mut().zip(&u).for_each(|(a, b)| *a += b);
                    p
                }
            };
            let m = layer.mlp_res.mix(&candidates(&blocks, Some(&p)), tokens);
            let f_in = rms_norm(&m, &layer.post_norm, c.rms_norm_eps);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&f_in, tokens, self.situ),
                Ffn::Moe(moe) => {
                    let (y, r) = moe.forward(&f_in, tokens, self.situ);
                    if let Some(tr) = tr.as_deref_mut() {
                        let e = r.scores.len() / tokens;
                        tr.i64(
                            format!("layer{i}.router.topk_ids"),
                            &[tokens, r.top_k],
                            r.ids.iter().map(|&x| x as i64).collect(),
                        );
                        tr.f32(format!("layer{i}.router.topk_weights"), &[tokens, r.top_k], &r.weights);
                        tr.f32(format!("layer{i}.router.scores"), &[tokens, e], &r.scores);
                        tr.f32(format!("layer{i}.router.selection_margin"), &[tokens], &r.margins);
                    }
                    y
                }
            };
            let mut p = p;
            p.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
            if let Some(tr) = tr {
                tr.f32(format!("layer{i}.attn_site_input"), &shape, &a);
                tr.f32(format!("layer{i}.mixer_input"), &shape, &x);
                tr.f32(format!("layer{i}.mixer_output"), &shape, &u);
                tr.f32(format!("layer{i}.mlp_site_input"), &shape, &m);
                tr.f32(format!("layer{i}.ffn_input"), &shape, &f_in);
                tr.f32(format!("layer{i}.ffn_output"), &shape, &f);
                tr.f32(format!("layer{i}.partial_sum"), &shape, &p);
            }
            partial = Some(p);
        }
        state.len += tokens;

        let final_mix = self.output_res.mix(&candidates(&blocks, partial.as_ref()), tokens);
        let hidden = rms_norm(&final_mix, &self.norm, c.rms_norm_eps);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("final_mix", &shape, &final_mix);
            tr.f32("final_hidden", &shape, &hidden);
        }
        let logits = match logits_for {
            LogitsFor::AllTokens => self.lm_head.matmul(&hidden, tokens),
            LogitsFor::LastToken => self.lm_head.matmul(&hidden[(tokens - 1) * d..], 1),
        };
        if let (Some(tr), LogitsFor::AllTokens) = (trace, logits_for) {
            tr.f32("logits", &[tokens, v], &logits);
        }
        Ok(logits)
    }
}

fn candidates<'a>(blocks: &'a [Vec<f32>], partial: Option<&'a Vec<f32>>) -> Vec<&'a [f32]> {
    blocks.iter().map(|b| b.as_slice()).chain(partial.map(|p| p.as_slice())).collect()
}

/// `index.layer{i}.selected [T, topk]` (ascending, −1 padded) and `.scores [T, start+T]`.
fn record_selection(tr: &mut Trace, layer: usize, sel: &[super::indexer::Selection], topk: usize, start: usize) {
    let tokens = sel.len();
    let total = start + tokens;
    let mut ids = vec![-1i64; tokens * topk];
    let mut scores = vec![f32::NAN; tokens * total];
    for (t, s) in sel.iter().enumerate() {
        for (j, &x) in s.tokens.iter().enumerate() {
            ids[t * topk + j] = x as i64;
        }
        scores[t * total..t * total + s.scores.len()].copy_from_slice(&s.scores);
    }
    tr.i64(format!("index.layer{layer}.selected"), &[tokens, topk], ids);
    tr.f32(format!("index.layer{layer}.scores"), &[tokens, total], &scores);
    let margins: Vec<f32> = sel.iter().map(|s| s.margin).collect();
    tr.f32(format!("index.layer{layer}.margin"), &[tokens], &margins);
}
