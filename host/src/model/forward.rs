//! The whole text model: embedding → 2-site AttnRes decoder layers (KDA or MLA mixer; dense MLP or
//! latent MoE) → output mix → final norm → `lm_head` (spec §2).

use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;

use kimi_kernels::{Backend, CpuBackend, SituParams};

use super::attn_res::ResMix;
use super::batch::{BatchLayout, SeqInput};
use super::checkpoint::Checkpoint;
use super::config::{MixerKind, ModelConfig, TextConfig, load_config};
use super::error::ModelError;
use super::kda::KdaLayer;
use super::mla::MlaLayer;
use super::mlp::{Mlp, situ_params};
use super::moe::MoeLayer;
use super::norm::rms_norm;
use super::profile::{Laps, OpKind, OpTimes};
use super::scratch::{Buf, Scratch};
use super::state::{KdaStateMut, LatentCache, LayerState, SequenceState, StateArenas};
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
    situ: SituParams,
    /// Where every op runs; model code reaches kernels only through it.
    backend: Arc<dyn Backend>,
    /// KDA slots and latent pages for states made by `new_state` (the engine brings its own
    /// fixed arenas).
    arenas: StateArenas,
    /// The steps' activation buffers, reused from step to step.
    scratch: Scratch,
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
        let situ = situ_params(c);
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend);
        let arenas = StateArenas::growable(c);
        let mut model = Model {
            config,
            embed,
            layers,
            output_res,
            norm,
            lm_head,
            situ,
            backend,
            arenas,
            scratch: Scratch::new(),
            _checkpoint: None,
        };
        model.prepare_weights();
        Ok(model)
    }

    /// Runs every op on `backend` from now on (the default is [`CpuBackend`]), its weight layouts
    /// made again for it.
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Model {
        self.backend = backend;
        self.prepare_weights();
        self
    }

    /// Lets the backend lay out every weight it multiplies by (the embedding table is gathered by
    /// rows, not multiplied, and stays stored), in parallel.
    fn prepare_weights(&mut self) {
        let be = Arc::clone(&self.backend);
        let mut weights: Vec<&mut Weight> = vec![&mut self.lm_head];
        for layer in &mut self.layers {
            match &mut layer.mixer {
                Mixer::Kda(k) => weights.extend(k.matmul_weights()),
                Mixer::Mla(m) => weights.extend(m.matmul_weights()),
            }
            match &mut layer.ffn {
                Ffn::Dense(mlp) => weights.extend(mlp.matmul_weights()),
                Ffn::Moe(moe) => weights.extend(moe.matmul_weights()),
            }
        }
        weights.into_par_iter().for_each(|w| w.prepare(&*be));
    }

    /// The step buffers' pool (tests: a steady state creates no buffers).
    pub fn scratch(&self) -> &Scratch {
        &self.scratch
    }

    /// The backend the ops run on.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    pub fn text_config(&self) -> &TextConfig {
        &self.config.text
    }

    /// A fresh state with its KDA slot from the model's own growable arena (tools, tests).
    pub fn new_state(&self) -> SequenceState {
        // A growable arena adds a chunk instead of refusing, so this cannot fail.
        // A growable arena adds a chunk instead of refusing; only the machine running out of
        // memory stops it (as any allocation).
        SequenceState::new_in(&self.config.text, &self.arenas).expect("memory for a sequence state")
    }

    /// A fresh state whose KDA slot and latent pages come from `arenas` (the engine's, fixed at
    /// start-up).
    pub fn new_state_in(&self, arenas: &StateArenas) -> Result<SequenceState, ModelError> {
        SequenceState::new_in(&self.config.text, arenas)
    }

    /// Fixed arenas for this model, allocated now: `slots` KDA slots and `pages` latent pages of
    /// every MLA layer (each pool page is one page per MLA layer).
    pub fn state_arenas(&self, slots: usize, pages: usize) -> Result<StateArenas, ModelError> {
        let c = &self.config.text;
        let mla_layers = c.layer_kinds.iter().filter(|k| matches!(k, MixerKind::Mla)).count();
        StateArenas::fixed(c, slots, pages.saturating_mul(mla_layers))
    }

    /// Checks that `ids` can follow the `held` tokens of a sequence: ids inside the vocabulary,
    /// the total inside the context window. The engine calls it per sequence before batching, so
    /// a bad sequence fails alone.
    pub fn check(&self, ids: &[u32], held: usize) -> Result<(), ModelError> {
        let c = &self.config.text;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(ModelError::TokenOutOfRange { id, vocab: c.vocab_size });
        }
        if held + ids.len() > c.max_position_embeddings {
            return Err(ModelError::TooLong { len: held + ids.len(), max: c.max_position_embeddings });
        }
        Ok(())
    }

    /// Checks that `state` has this model's layer kinds (before any layer writes to a state).
    fn check_state(&self, state: &SequenceState) -> Result<(), ModelError> {
        let kinds = &self.config.text.layer_kinds;
        let bad = (0..kinds.len().max(state.layers.len())).find(|&i| {
            !matches!(
                (kinds.get(i), state.layers.get(i)),
                (Some(MixerKind::Kda), Some(LayerState::Kda(_))) | (Some(MixerKind::Mla), Some(LayerState::Mla(_)))
            )
        });
        match bad {
            Some(layer) => Err(ModelError::StateMismatch { layer }),
            None => Ok(()),
        }
    }

    /// One sequence as a batch of one: runs `ids` as its next tokens (a prefill when the state is
    /// fresh, a decode step for one id) and returns logits, `[tokens or 1, V]`.
    pub fn forward(
        &self,
        ids: &[u32],
        state: &mut SequenceState,
        logits_for: LogitsFor,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut batch = [SeqInput { ids, state, logits: logits_for }];
        Ok(self.forward_batch(&mut batch, trace)?.pop().unwrap_or_default())
    }

    /// One forward step over many sequences (spec: DESIGN §3): their tokens form one flat batch,
    /// so every weight is read once per step whatever the number of sequences; the mixer cores
    /// read each sequence's own state. Returns each sequence's logits (`[tokens or 1, V]`, empty for
    /// a sequence with no tokens). A trace records the batch's rows and needs exactly one sequence.
    pub fn forward_batch(
        &self,
        seqs: &mut [SeqInput<'_>],
        trace: Option<&mut Trace>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.run_batch(seqs, trace, None)
    }

    /// [`Model::forward_batch`], adding each kind of op's wall time to `times`.
    pub fn forward_batch_profiled(
        &self,
        seqs: &mut [SeqInput<'_>],
        times: &mut OpTimes,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.run_batch(seqs, None, Some(times))
    }

    fn run_batch(
        &self,
        seqs: &mut [SeqInput<'_>],
        trace: Option<&mut Trace>,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        // The whole step runs on one of the pool's threads: every op's parallel split then starts
        // inside the pool instead of handing work to it and sleeping until it is done, op by op
        // (hundreds of wake-ups a step, measured as a sixth of a small model's serving time).
        rayon::scope(|_| self.run_batch_in_pool(seqs, trace, times))
    }

    fn run_batch_in_pool(
        &self,
        seqs: &mut [SeqInput<'_>],
        mut trace: Option<&mut Trace>,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config.text;
        let (d, v) = (c.hidden_size, c.vocab_size);
        for s in seqs.iter() {
            self.check(s.ids, s.state.len)?;
            self.check_state(s.state)?;
        }
        if trace.is_some() && seqs.len() != 1 {
            return Err(ModelError::TraceNeedsOneSequence { sequences: seqs.len() });
        }
        let mut laps = Laps::new(times);
        let layout = BatchLayout::new(seqs.iter().map(|s| (s.ids.len(), s.state.len)));
        let tokens = layout.len();
        if tokens == 0 {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let be = &*self.backend;
        let sc = &self.scratch;
        let shape = [tokens, d];
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.ids.iter().copied()).collect();
        let mut h0 = sc.for_overwrite(tokens * d);
        be.embedding(&self.embed.m(), &ids, &mut h0);
        laps.lap(OpKind::Embedding);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("embedding", &shape, &h0);
        }

        let mut blocks: Vec<Buf<'_>> = Vec::new();
        let mut partial: Option<Buf<'_>> = Some(h0);
        for (i, layer) in self.layers.iter().enumerate() {
            let mut tr = trace.as_deref_mut();
            // Attention site: mix banked blocks with the running partial sum (layer 0: embedding).
            let a = match (&partial, blocks.is_empty()) {
                (Some(p), true) => sc.copy_of(p),
                (p, _) => layer.attn_res.mix(be, sc, &candidates(&blocks, p.as_ref()), tokens),
            };
            if i % c.attn_res_block_size == 0
                && let Some(p) = partial.take()
            {
                blocks.push(p);
            }
            laps.lap(OpKind::AttnRes);
            let x = rms_norm(be, sc, &a, &layer.input_norm, c.rms_norm_eps);
            laps.lap(OpKind::Norm);
            let u = match &layer.mixer {
                Mixer::Kda(k) => {
                    let mut states: Vec<KdaStateMut<'_>> = seqs
                        .iter_mut()
                        .map(|s| s.state.kda_mut(i).ok_or(ModelError::StateMismatch { layer: i }))
                        .collect::<Result<_, _>>()?;
                    k.forward(be, sc, &x, &layout.spans, &mut states)
                }
                Mixer::Mla(m) => {
                    let mut caches: Vec<&mut LatentCache> = seqs
                        .iter_mut()
                        .map(|s| match s.state.layers.get_mut(i) {
                            Some(LayerState::Mla(cache)) => Ok(cache),
                            _ => Err(ModelError::StateMismatch { layer: i }),
                        })
                        .collect::<Result<_, _>>()?;
                    let (u, sel) = m.forward(be, sc, &x, &layout, &mut caches)?;
                    if let (Some(tr), Some(sel), Some(ix)) = (tr.as_deref_mut(), sel, &m.indexer) {
                        record_selection(tr, i, &sel, ix.topk(), layout.spans[0].pos);
                    }
                    u
                }
            };
            laps.lap(if matches!(layer.mixer, Mixer::Kda(_)) { OpKind::Kda } else { OpKind::Mla });
            let p = match partial.take() {
                None => sc.copy_of(&u),
                Some(mut p) => {
                    be.add(&mut p, &u);
                    p
                }
            };
            laps.lap(OpKind::Other);
            let m = layer.mlp_res.mix(be, sc, &candidates(&blocks, Some(&p)), tokens);
            laps.lap(OpKind::AttnRes);
            let f_in = rms_norm(be, sc, &m, &layer.post_norm, c.rms_norm_eps);
            laps.lap(OpKind::Norm);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(be, sc, &f_in, tokens, self.situ),
                Ffn::Moe(moe) => {
                    let (y, r) = moe.forward(be, sc, &f_in, tokens, self.situ);
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
            laps.lap(if matches!(layer.ffn, Ffn::Dense(_)) { OpKind::DenseMlp } else { OpKind::Moe });
            let mut p = p;
            be.add(&mut p, &f);
            laps.lap(OpKind::Other);
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
        for (s, span) in seqs.iter_mut().zip(&layout.spans) {
            s.state.len += span.len;
        }

        let final_mix = self.output_res.mix(be, sc, &candidates(&blocks, partial.as_ref()), tokens);
        laps.lap(OpKind::AttnRes);
        let hidden = rms_norm(be, sc, &final_mix, &self.norm, c.rms_norm_eps);
        laps.lap(OpKind::Norm);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("final_mix", &shape, &final_mix);
            tr.f32("final_hidden", &shape, &hidden);
        }
        // The LM head reads its weight once for the whole step, over the rows that want logits.
        let wanted: Vec<std::ops::Range<usize>> = seqs
            .iter()
            .zip(&layout.spans)
            .map(|(s, span)| match (s.logits, span.len) {
                (_, 0) => span.start..span.start,
                (LogitsFor::AllTokens, _) => span.rows(),
                (LogitsFor::LastToken, _) => span.start + span.len - 1..span.start + span.len,
            })
            .collect();
        let rows: usize = wanted.iter().map(|r| r.len()).sum();
        let mut picked = sc.for_overwrite(rows * d);
        let mut at = 0;
        for r in &wanted {
            picked[at..at + r.len() * d].copy_from_slice(&hidden[r.start * d..r.end * d]);
            at += r.len() * d;
        }
        laps.lap(OpKind::Other);
        let logits = self.lm_head.matmul(be, sc, &picked, rows);
        laps.lap(OpKind::LmHead);
        if let (Some(tr), [SeqInput { logits: LogitsFor::AllTokens, .. }]) = (trace, &*seqs) {
            tr.f32("logits", &[tokens, v], &logits);
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for r in &wanted {
            out.push(logits[at * v..(at + r.len()) * v].to_vec());
            at += r.len();
        }
        Ok(out)
    }
}

fn candidates<'a>(blocks: &'a [Buf<'_>], partial: Option<&'a Buf<'_>>) -> Vec<&'a [f32]> {
    blocks.iter().map(|b| &b[..]).chain(partial.map(|p| &p[..])).collect()
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
