//! The whole text model: embedding → 2-site AttnRes decoder layers (KDA or MLA mixer; dense MLP or
//! latent MoE) → output mix → final norm → `lm_head` (spec §2).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use kimi_kernels::{Backend, CommStats, Communicator, CpuBackend, SituParams, ThreadComm};

use super::attn_res::ResMix;
use super::batch::{AuxTap, BatchLayout, SeqInput};
use super::checkpoint::Checkpoint;
use super::config::{MixerKind, ModelConfig, TextConfig, load_config};
use super::error::ModelError;
use super::kda::KdaLayer;
use super::mla::{ContextParallel, MlaLayer};
use super::mlp::{Mlp, situ_params};
use super::moe::MoeLayer;
use super::norm::rms_norm;
use super::profile::{Laps, OpKind, OpTimes};
use super::scratch::{Buf, Scratch};
use super::shard::{Shard, rank_config};
use super::state::{KdaStateMut, LatentCache, LayerState, RankStateMut, SequenceState, StateArenas};
use super::trace::Trace;
use super::weights::{CheckpointSource, LoadedTensor, Part, TensorSource, Weight};

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

/// One tensor-parallel rank: its part of every weight (the whole model at TP 1), its step
/// buffers, its communicator and, with more than one rank, its own worker threads.
pub struct Rank {
    pub shard: Shard,
    embed: Weight,
    /// The vocabulary rows of `embed` and `lm_head` this rank holds.
    vocab: Range<usize>,
    pub layers: Vec<DecoderLayer>,
    output_res: ResMix,
    norm: Vec<f32>,
    lm_head: Weight,
    scratch: Scratch,
    comm: ThreadComm,
    /// This rank's communicator within its context-parallel group (the `context` consecutive
    /// ranks that split each sequence's latent pages between them); `None` without context
    /// parallelism.
    context_comm: Option<ThreadComm>,
    /// This rank's threads (ranks run side by side; each waits in collectives on the others, so
    /// they cannot share one pool's workers). `None` at TP 1: the global pool.
    pool: Option<rayon::ThreadPool>,
    /// What the loader handed this rank (tensor, stored bytes, kept bytes).
    pub loaded: Vec<LoadedTensor>,
}

impl Rank {
    /// Bytes of every weight this rank keeps, counted from the weights themselves (matrices in
    /// their stored format, vectors as f32).
    pub fn matrix_bytes(&self) -> usize {
        let mut n = self.embed.stored_bytes() + self.lm_head.stored_bytes();
        for l in &self.layers {
            let mut ws: Vec<&Weight> = Vec::new();
            match &l.mixer {
                Mixer::Kda(k) => ws.extend(k.weights()),
                Mixer::Mla(m) => ws.extend(m.weights()),
            }
            match &l.ffn {
                Ffn::Dense(mlp) => ws.extend(mlp.weights()),
                Ffn::Moe(moe) => ws.extend(moe.weights()),
            }
            n += ws.iter().map(|w| w.stored_bytes()).sum::<usize>();
        }
        n
    }
}

pub struct Model {
    pub config: ModelConfig,
    /// The config as each rank sees it (heads divided by the rank count).
    rank_config: TextConfig,
    ranks: Vec<Rank>,
    /// Context-parallel ranks (1, or all of `ranks`).
    context: usize,
    situ: SituParams,
    /// Where every op runs; model code reaches kernels only through it.
    backend: Arc<dyn Backend>,
    /// KDA slots and latent pages for states made by `new_state` (the engine brings its own
    /// fixed arenas).
    arenas: StateArenas,
    /// Keeps the memory maps alive for the weights' lifetime.
    _checkpoint: Option<Checkpoint>,
}

/// How weights are held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightFormat {
    /// Attention, dense-MLP and shared-expert linears requantised at load to FP8 E4M3 with a
    /// scale per output row, their products quantising activations per token (ATOM's
    /// `ptpc_fp8`); routed experts stay MXFP4 (`--fp8-dense`).
    pub fp8_dense: bool,
    /// MXFP4 routed experts laid out for the CPU's AMX tiles where it has them
    /// (`--mxfp4-tiles`): faster with several tokens per expert, slower with one; a sequence's
    /// results stay independent of its batch either way.
    pub mxfp4_tiles: bool,
}

/// How a model is spread over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parallelism {
    /// Tensor-parallel ranks (`--tensor-parallel`).
    pub tensor: usize,
    /// Ranks of the tensor-parallel group that split each sequence's latent cache by pages
    /// instead of each holding all of it (`--context-parallel`): a divisor of the tensor-parallel
    /// size; groups of this many consecutive ranks each split the pages.
    pub context: usize,
    /// Routed experts placed whole on the tensor-parallel ranks (a contiguous range each)
    /// instead of split on their intermediate dimension (`--expert-parallel`).
    pub expert: bool,
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism { tensor: 1, context: 1, expert: false }
    }
}

impl Parallelism {
    pub fn tensor(n: usize) -> Parallelism {
        Parallelism { tensor: n, ..Parallelism::default() }
    }
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
        Model::load_with(dir, Parallelism::default())
    }

    /// Loads the model spread over `par.tensor` ranks: each rank maps only its shard.
    pub fn load_with(dir: &Path, par: Parallelism) -> Result<Model, ModelError> {
        Model::load_as(dir, par, WeightFormat::default())
    }

    /// [`Model::load_with`], requantising weights as `fmt` says.
    pub fn load_as(dir: &Path, par: Parallelism, fmt: WeightFormat) -> Result<Model, ModelError> {
        let config = load_config(dir)?;
        let n = par.tensor;
        let rank_config = rank_config(&config.text, n)?;
        let cp = par.context;
        if cp == 0 || !n.is_multiple_of(cp) {
            return Err(ModelError::Parallel {
                msg: format!(
                    "--context-parallel {cp} runs on the tensor-parallel ranks: it must divide --tensor-parallel {n}"
                ),
            });
        }
        let ck = Checkpoint::open(dir)?;
        if fmt.mxfp4_tiles {
            // The CPU backend reads it as it lays the weights out (in `assemble`).
            kimi_kernels::set_mxfp4_tiles(kimi_kernels::Mxfp4Tiles::Always);
        }
        let mut ranks = Vec::with_capacity(n);
        let comms = ThreadComm::group(n);
        // Ranks g·cp .. (g + 1)·cp form context-parallel group g; rank r holds the pages of
        // group rank r % cp (as `SequenceState::new_in` lays them out).
        let mut context_comms = (0..n / cp).flat_map(|_| ThreadComm::group(cp));
        for (r, comm) in comms.into_iter().enumerate() {
            let mut src = CheckpointSource::new(&ck);
            src.fp8_dense = fmt.fp8_dense;
            let mut rank = Model::build_rank(&config.text, &mut src, Shard { rank: r, size: n }, par.expert, comm)?;
            rank.loaded = src.loaded;
            rank.context_comm = if cp > 1 { context_comms.next() } else { None };
            ranks.push(rank);
        }
        let mut model = Model::assemble(config, rank_config, ranks)?;
        model.context = par.context;
        model._checkpoint = Some(ck);
        Ok(model)
    }

    /// Builds the whole model from any tensor source (a checkpoint, or a name recorder).
    pub fn build(config: ModelConfig, src: &mut dyn TensorSource) -> Result<Model, ModelError> {
        let rank = Model::build_rank(&config.text, src, Shard::WHOLE, false, ThreadComm::group(1).remove(0))?;
        let rc = config.text.clone();
        Model::assemble(config, rc, vec![rank])
    }

    fn assemble(config: ModelConfig, rank_config: TextConfig, mut ranks: Vec<Rank>) -> Result<Model, ModelError> {
        let n = ranks.len();
        if n > 1 {
            // Each rank gets its share of the machine's threads (at least one).
            let threads = (rayon::current_num_threads() / n).max(1);
            for (r, rank) in ranks.iter_mut().enumerate() {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("kimi-rank{r}-{i}"))
                    .build()
                    .map_err(|e| ModelError::Parallel { msg: format!("rank {r}'s threads: {e}") })?;
                rank.pool = Some(pool);
            }
        }
        let situ = situ_params(&config.text);
        let arenas = StateArenas::growable(&rank_config, n);
        let mut model = Model {
            config,
            rank_config,
            ranks,
            context: 1,
            situ,
            backend: Arc::new(CpuBackend),
            arenas,
            _checkpoint: None,
        };
        model.prepare_weights();
        Ok(model)
    }

    /// Runs rank `sh`'s loader against `src` (a name recorder: what that rank would map, for
    /// planning without weights), after checking that `sh.size` can split the heads.
    pub fn record_shard(c: &TextConfig, src: &mut dyn TensorSource, sh: Shard, ep: bool) -> Result<(), ModelError> {
        rank_config(c, sh.size)?;
        Model::build_rank(c, src, sh, ep, ThreadComm::group(1).remove(0)).map(drop)
    }

    /// Rank `sh`'s part of every weight: vocabulary rows of the embedding and LM head, and each
    /// layer's shard (see the layers' `load`); norms and AttnRes queries are replicated.
    fn build_rank(
        c: &TextConfig,
        src: &mut dyn TensorSource,
        sh: Shard,
        ep: bool,
        comm: ThreadComm,
    ) -> Result<Rank, ModelError> {
        let (d, v) = (c.hidden_size, c.vocab_size);
        let m = |s: &str| format!("{PREFIX}model.{s}");
        let vocab = sh.range(v, 1);
        let vocab_part = if vocab.len() == v { Part::Whole } else { Part::Rows(vocab.clone()) };
        let embed = src.matrix_part(&m("embed_tokens.weight"), v, d, vocab_part.clone())?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = m(&format!("layers.{i}"));
            let eps = c.rms_norm_eps;
            let input_norm = src.vector(&format!("{p}.input_layernorm.weight"), &[d])?;
            let post_norm = src.vector(&format!("{p}.post_attention_layernorm.weight"), &[d])?;
            let attn_res = ResMix::load(src, &format!("{p}.self_attention_res"), d, eps)?;
            let mlp_res = ResMix::load(src, &format!("{p}.mlp_res"), d, eps)?;
            let mixer = match c.layer_kinds[i] {
                MixerKind::Kda => Mixer::Kda(KdaLayer::load(src, &format!("{p}.self_attn"), c, sh)?),
                MixerKind::Mla => Mixer::Mla(MlaLayer::load(src, &format!("{p}.self_attn"), c, sh)?),
            };
            let ffn = if c.is_moe_layer(i) {
                Ffn::Moe(MoeLayer::load(src, &format!("{p}.block_sparse_moe"), c, sh, ep)?)
            } else {
                Ffn::Dense(Mlp::load(src, &format!("{p}.mlp"), d, c.intermediate_size, sh)?)
            };
            layers.push(DecoderLayer { input_norm, post_norm, attn_res, mlp_res, mixer, ffn });
        }
        let output_res = ResMix::load(src, &m("output_attn_res"), d, c.rms_norm_eps)?;
        let norm = src.vector(&m("norm.weight"), &[d])?;
        let lm_head = src.matrix_part(&format!("{PREFIX}lm_head.weight"), v, d, vocab_part)?;
        Ok(Rank {
            shard: sh,
            embed,
            vocab,
            layers,
            output_res,
            norm,
            lm_head,
            scratch: Scratch::new(),
            comm,
            context_comm: None,
            pool: None,
            loaded: Vec::new(),
        })
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
        let mut weights: Vec<&mut Weight> = Vec::new();
        for rank in &mut self.ranks {
            weights.push(&mut rank.lm_head);
            for layer in &mut rank.layers {
                match &mut layer.mixer {
                    Mixer::Kda(k) => weights.extend(k.matmul_weights()),
                    Mixer::Mla(m) => weights.extend(m.matmul_weights()),
                }
                match &mut layer.ffn {
                    Ffn::Dense(mlp) => weights.extend(mlp.matmul_weights()),
                    Ffn::Moe(moe) => weights.extend(moe.matmul_weights()),
                }
            }
        }
        weights.into_par_iter().for_each(|w| w.prepare(&*be));
    }

    /// Rank 0's step buffers (tests: a steady state creates no buffers).
    pub fn scratch(&self) -> &Scratch {
        &self.ranks[0].scratch
    }

    /// Rows of the target's embedding table, `[ids, d]` (the DSpark draft's block input). Under
    /// tensor parallelism each row comes from the rank holding that part of the vocabulary.
    pub fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.check(ids, 0)?;
        let d = self.config.text.hidden_size;
        let mut out = vec![0f32; ids.len() * d];
        for rank in &self.ranks {
            let local: Vec<(usize, u32)> = ids
                .iter()
                .enumerate()
                .filter(|(_, id)| rank.vocab.contains(&(**id as usize)))
                .map(|(t, id)| (t, *id - rank.vocab.start as u32))
                .collect();
            if local.is_empty() {
                continue;
            }
            let local_ids: Vec<u32> = local.iter().map(|(_, id)| *id).collect();
            let mut rows = vec![0f32; local_ids.len() * d];
            self.backend.embedding(&rank.embed.m(), &local_ids, &mut rows);
            for ((t, _), row) in local.iter().zip(rows.chunks_exact(d)) {
                out[t * d..(t + 1) * d].copy_from_slice(row);
            }
        }
        Ok(out)
    }

    /// The target's LM head over `x` (`[rows, d]`), `[rows, V]` (the DSpark draft's base logits):
    /// each rank's vocabulary part, side by side.
    pub fn lm_head(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        if let [rank] = &self.ranks[..] {
            return Ok(rank.lm_head.matmul(&*self.backend, &rank.scratch, x, rows).to_vec());
        }
        let v = self.config.text.vocab_size;
        let mut out = vec![0f32; rows * v];
        for rank in &self.ranks {
            let part = rank.lm_head.matmul(&*self.backend, &rank.scratch, x, rows);
            let w = rank.vocab.len();
            for (r, row) in part.chunks_exact(w.max(1)).enumerate().take(rows) {
                out[r * v + rank.vocab.start..][..w].copy_from_slice(row);
            }
        }
        Ok(out)
    }

    /// The latent-page arena of states made by [`Model::new_state`] (a DSpark draft keeps its
    /// rows in pages of the same arena).
    pub fn default_arenas(&self) -> &StateArenas {
        &self.arenas
    }

    /// Rank 0's layers (the whole model's at TP 1).
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.ranks[0].layers
    }

    /// The tensor-parallel ranks.
    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }

    /// Worker threads each rank runs on.
    pub fn rank_threads(&self) -> usize {
        self.ranks[0].pool.as_ref().map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    /// The config each rank sizes its state from (heads divided by the rank count).
    pub fn rank_config(&self) -> &TextConfig {
        &self.rank_config
    }

    /// Collectives each rank has made so far (rank 0's, over the whole group and its
    /// context-parallel group; every rank makes the same calls).
    pub fn comm_stats(&self) -> CommStats {
        let r = &self.ranks[0];
        let whole = r.comm.stats();
        r.context_comm.as_ref().map_or(whole, |c| whole.plus(&c.stats()))
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
        SequenceState::new_in(&self.rank_config, self.ranks.len(), self.context, &self.arenas)
            .expect("memory for a sequence state")
    }

    /// A fresh state whose KDA slot and latent pages come from `arenas` (the engine's, fixed at
    /// start-up).
    pub fn new_state_in(&self, arenas: &StateArenas) -> Result<SequenceState, ModelError> {
        SequenceState::new_in(&self.rank_config, self.ranks.len(), self.context, arenas)
    }

    /// Copies of each latent page the ranks hold between them: one per context-parallel group.
    pub fn cache_replicas(&self) -> usize {
        self.ranks.len() / self.context.max(1)
    }

    /// Fixed arenas for this model, allocated now: `slots` KDA slots and `pages` latent pages of
    /// every MLA layer on every rank (each pool page is one page per MLA layer and rank: the
    /// latent cache is replicated).
    pub fn state_arenas(&self, slots: usize, pages: usize) -> Result<StateArenas, ModelError> {
        self.state_arenas_with(slots, pages, 0)
    }

    /// [`Model::state_arenas`] with `extra` more arena pages per pool page (a DSpark draft's
    /// layers keep their context rows in the same page arena).
    pub fn state_arenas_with(&self, slots: usize, pages: usize, extra: usize) -> Result<StateArenas, ModelError> {
        let c = &self.rank_config;
        let mla_layers = c.layer_kinds.iter().filter(|k| matches!(k, MixerKind::Mla)).count();
        let n = self.ranks.len();
        let per_page = mla_layers.saturating_mul(self.cache_replicas()).saturating_add(extra);
        StateArenas::fixed(c, n, slots, pages.saturating_mul(per_page))
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
        if state.ranks() != self.ranks.len() {
            return Err(ModelError::StateMismatch { layer: 0 });
        }
        let kinds = &self.config.text.layer_kinds;
        let layers = state.layers();
        let bad = (0..kinds.len().max(layers.len())).find(|&i| {
            !matches!(
                (kinds.get(i), layers.get(i)),
                (Some(MixerKind::Kda), Some(LayerState::Kda(_))) | (Some(MixerKind::Mla), Some(LayerState::Mla(_)))
            )
        });
        match bad {
            Some(layer) => Err(ModelError::StateMismatch { layer }),
            None => Ok(()),
        }
    }

    /// Sizes the step buffers at start-up (as vLLM's profile run does): one step of `max_tokens`
    /// tokens over `max_seqs` throwaway sequences — one prefilling, the others decoding their
    /// first token, every one wanting logits — takes the largest buffers a step of that budget
    /// needs, so serving then allocates none of its own. Returns the buffers the pool holds.
    pub fn warm_up(&self, max_tokens: usize, max_seqs: usize) -> Result<usize, ModelError> {
        let seqs = max_seqs.clamp(1, max_tokens.max(1));
        let prefill = max_tokens.max(1) - (seqs - 1);
        let ids: Vec<u32> = (0..prefill).map(|i| (i % self.config.text.vocab_size) as u32).collect();
        let mut states: Vec<SequenceState> = (0..seqs).map(|_| self.new_state()).collect();
        let mut batch: Vec<SeqInput<'_>> = states
            .iter_mut()
            .enumerate()
            .map(|(i, state)| SeqInput::new(if i == 0 { &ids } else { &ids[..1] }, state, LogitsFor::LastToken))
            .collect();
        self.forward_batch(&mut batch, None)?;
        Ok(self.scratch().created())
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
        let mut batch = [SeqInput::new(ids, state, logits_for)];
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
        for s in seqs.iter() {
            self.check(s.ids, s.state.len)?;
            self.check_state(s.state)?;
            let snapshots = s.state.snapshot_slots();
            if snapshots > 0 && snapshots != s.ids.len() {
                return Err(ModelError::VerifyShape { snapshots, tokens: s.ids.len() });
            }
            if let Some(tap) = &s.aux
                && let Some(&bad) = tap.layers.iter().find(|&&l| l + 1 >= self.config.text.num_layers)
            {
                return Err(ModelError::config(
                    "target_layer_ids",
                    format!(
                        "layer {bad} cannot be tapped: the model has {} layers and the last is never a tap",
                        self.config.text.num_layers
                    ),
                ));
            }
        }
        if trace.is_some() && seqs.len() != 1 {
            return Err(ModelError::TraceNeedsOneSequence { sequences: seqs.len() });
        }
        let d = self.config.text.hidden_size;
        for s in seqs.iter() {
            if let Some(e) = &s.embeds
                && (e.rows.len() != e.at.len() * d || e.at.iter().any(|&i| i >= s.ids.len()))
            {
                return Err(ModelError::config(
                    "inputs_embeds",
                    format!(
                        "{} given rows of {} values for {} rows of a {}-token step (hidden size {d})",
                        e.at.len(),
                        e.rows.len(),
                        e.at.len(),
                        s.ids.len()
                    ),
                ));
            }
        }
        let layout = BatchLayout::new(seqs.iter().map(|s| (s.ids.len(), s.state.len)));
        if layout.is_empty() {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        // Every page the step writes is taken now, so no rank can fail halfway through.
        for s in seqs.iter_mut() {
            s.state.prepare_pages(s.ids.len())?;
        }
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.ids.iter().copied()).collect();
        // The rows that want logits: the LM head reads its weight once for all of them.
        let wanted: Vec<Range<usize>> = seqs
            .iter()
            .zip(&layout.spans)
            .map(|(s, span)| match (s.logits, span.len) {
                (_, 0) => span.start..span.start,
                (LogitsFor::AllTokens, _) => span.rows(),
                (LogitsFor::LastToken, _) => span.start + span.len - 1..span.start + span.len,
            })
            .collect();
        let all_tokens_trace = matches!(&*seqs, [SeqInput { logits: LogitsFor::AllTokens, .. }]);
        let n = self.ranks.len();
        let mut per_rank: Vec<Vec<RankStateMut<'_>>> = (0..n).map(|_| Vec::with_capacity(seqs.len())).collect();
        let overrides: Vec<(usize, &[f32])> = seqs
            .iter()
            .zip(&layout.spans)
            .filter_map(|(s, span)| s.embeds.map(|e| (e, span.start)))
            .flat_map(|(e, start)| e.at.iter().zip(e.rows.chunks_exact(d)).map(move |(&i, r)| (start + i, r)))
            .collect();
        let mut taps: Vec<Option<&mut AuxTap<'_>>> = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            for (r, st) in s.state.ranks_mut().into_iter().enumerate() {
                per_rank[r].push(st);
            }
            if let Some(tap) = s.aux.as_mut() {
                // This step's rows, filled layer by layer.
                tap.rows.resize(tap.rows.len() + s.ids.len() * tap.layers.len() * d, 0.0);
            }
            taps.push(s.aux.as_mut());
        }
        let step = Step {
            layout: &layout,
            ids: &ids,
            overrides: &overrides,
            wanted: &wanted,
            all_tokens_trace,
            traced: trace.is_some(),
        };
        let mut per_rank = per_rank.into_iter();
        let first = per_rank.next().unwrap_or_default();
        let logits = if n == 1 {
            // The whole step runs on one of the pool's threads: every op's parallel split then
            // starts inside the pool instead of handing work to it and sleeping until it is done,
            // op by op (hundreds of wake-ups a step, measured as a sixth of a small model's
            // serving time).
            // The pool's other threads stay in the step (taking its parallel work as it comes)
            // instead of parking whenever a serial stretch outlasts rayon's spin, which cost a
            // wake-up (~15 µs) on the next op, about a hundred times a decode step.
            let done = AtomicBool::new(false);
            rayon::scope(|sc| {
                let _inside = InStep::enter();
                for _ in 1..rayon::current_num_threads() {
                    sc.spawn(|_| stay_in_step(&done));
                }
                let _release = SetOnDrop(&done);
                self.rank_step(&self.ranks[0], &step, first, &mut taps, trace, times)
            })
        } else {
            // Ranks run in lock-step on their own threads, meeting in the collectives.
            // Every rank holds the same partial sums after the all-reduces: rank 0 records taps.
            let run = |rank: &Rank, states, taps: &mut [Option<&mut AuxTap<'_>>], trace, times| match &rank.pool {
                Some(pool) => pool.install(|| self.rank_step(rank, &step, states, taps, trace, times)),
                None => self.rank_step(rank, &step, states, taps, trace, times),
            };
            std::thread::scope(|scope| {
                let others: Vec<_> = self.ranks[1..]
                    .iter()
                    .zip(per_rank)
                    .map(|(rank, states)| scope.spawn(move || run(rank, states, &mut [], None, None)))
                    .collect();
                let logits = run(&self.ranks[0], first, &mut taps, trace, times);
                for h in others {
                    if let Err(panic) = h.join() {
                        std::panic::resume_unwind(panic);
                    }
                }
                logits
            })
        }?;
        for (s, span) in seqs.iter_mut().zip(&layout.spans) {
            s.state.len += span.len;
        }
        Ok(logits)
    }

    /// One rank's program for a step: every rank runs it side by side on the same inputs, with
    /// its own weights and state, meeting in the same collectives in the same order. Returns the
    /// wanted rows' logits, `[rows, V]` for each wanted range of rows.
    fn rank_step(
        &self,
        rank: &Rank,
        step: &Step<'_>,
        mut states: Vec<RankStateMut<'_>>,
        taps: &mut [Option<&mut AuxTap<'_>>],
        mut trace: Option<&mut Trace>,
        times: Option<&mut OpTimes>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config.text;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let layout = step.layout;
        let mut laps = Laps::new(times);
        let tokens = layout.len();
        let be = &*self.backend;
        let sc = &rank.scratch;
        let comm: &dyn Communicator = &rank.comm;
        let split = !rank.shard.is_whole();
        let shape = [tokens, d];
        let h0 = if split {
            // Vocabulary-parallel lookup: this rank's rows, zero elsewhere, summed over ranks.
            let mut h0 = sc.zeroed(tokens * d);
            let local: Vec<(usize, u32)> = step
                .ids
                .iter()
                .enumerate()
                .filter(|(_, id)| rank.vocab.contains(&(**id as usize)))
                .map(|(t, id)| (t, *id - rank.vocab.start as u32))
                .collect();
            let local_ids: Vec<u32> = local.iter().map(|(_, id)| *id).collect();
            let mut rows = sc.for_overwrite(local_ids.len() * d);
            be.embedding(&rank.embed.m(), &local_ids, &mut rows);
            for ((t, _), row) in local.iter().zip(rows.chunks_exact(d)) {
                h0[t * d..(t + 1) * d].copy_from_slice(row);
            }
            comm.all_reduce_sum(&mut h0);
            h0
        } else {
            let mut h0 = sc.for_overwrite(tokens * d);
            be.embedding(&rank.embed.m(), step.ids, &mut h0);
            h0
        };
        let mut h0 = h0;
        for &(row, e) in step.overrides {
            h0[row * d..(row + 1) * d].copy_from_slice(e);
        }
        laps.lap(OpKind::Embedding);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("embedding", &shape, &h0);
        }

        let mut blocks: Vec<Buf<'_>> = Vec::new();
        let mut partial: Option<Buf<'_>> = Some(h0);
        for (i, layer) in rank.layers.iter().enumerate() {
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
            let mut u = match &layer.mixer {
                Mixer::Kda(k) => {
                    let mut kda: Vec<KdaStateMut<'_>> = states
                        .iter_mut()
                        .map(|s| s.kda_mut(i).ok_or(ModelError::StateMismatch { layer: i }))
                        .collect::<Result<_, _>>()?;
                    k.forward(be, sc, &x, &layout.spans, &mut kda)
                }
                Mixer::Mla(m) => {
                    let mut caches: Vec<&mut LatentCache> = states
                        .iter_mut()
                        .map(|s| s.mla_mut(i).ok_or(ModelError::StateMismatch { layer: i }))
                        .collect::<Result<_, _>>()?;
                    let cp = rank
                        .context_comm
                        .as_ref()
                        .map(|c| ContextParallel { comm: c as &dyn Communicator, want_scores: step.traced });
                    let (u, sel) = m.forward(be, sc, &x, layout, &mut caches, cp.as_ref())?;
                    if let (Some(tr), Some(sel), Some(ix)) = (tr.as_deref_mut(), sel, &m.indexer) {
                        record_selection(tr, i, &sel, ix.topk(), layout.spans[0].pos);
                    }
                    u
                }
            };
            if split {
                // The mixer's o_proj is row-parallel: its partial sums meet here.
                comm.all_reduce_sum(&mut u);
            }
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
                Ffn::Dense(mlp) => {
                    let mut f = mlp.forward(be, sc, &f_in, tokens, self.situ);
                    if split {
                        comm.all_reduce_sum(&mut f);
                    }
                    f
                }
                Ffn::Moe(moe) => {
                    let (y, r) = moe.forward(be, sc, comm, &f_in, tokens, &layout.spans, self.situ);
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
            record_taps(taps, &layout.spans, i, &p, d);
            partial = Some(p);
        }

        let final_mix = rank.output_res.mix(be, sc, &candidates(&blocks, partial.as_ref()), tokens);
        laps.lap(OpKind::AttnRes);
        let hidden = rms_norm(be, sc, &final_mix, &rank.norm, c.rms_norm_eps);
        laps.lap(OpKind::Norm);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("final_mix", &shape, &final_mix);
            tr.f32("final_hidden", &shape, &hidden);
        }
        let rows: usize = step.wanted.iter().map(|r| r.len()).sum();
        let mut picked = sc.for_overwrite(rows * d);
        let mut at = 0;
        for r in step.wanted {
            picked[at..at + r.len() * d].copy_from_slice(&hidden[r.start * d..r.end * d]);
            at += r.len() * d;
        }
        laps.lap(OpKind::Other);
        let local = rank.lm_head.matmul(be, sc, &picked, rows);
        let gathered_logits;
        let logits: &[f32] = if split {
            // Vocabulary-parallel head: every rank's `[rows, its vocab]` gathered, then laid out
            // as `[rows, V]`.
            let mut gathered = vec![0f32; rows * v];
            comm.all_gather(&local, &mut gathered);
            let mut logits = vec![0f32; rows * v];
            let mut at = 0;
            for r in 0..rank.shard.size {
                let part = Shard { rank: r, size: rank.shard.size }.range(v, 1);
                let w = part.len();
                for row in 0..rows {
                    logits[row * v + part.start..row * v + part.end]
                        .copy_from_slice(&gathered[at + row * w..at + (row + 1) * w]);
                }
                at += rows * w;
            }
            gathered_logits = logits;
            &gathered_logits
        } else {
            &local
        };
        laps.lap(OpKind::LmHead);
        if let (Some(tr), true) = (trace, step.all_tokens_trace) {
            tr.f32("logits", &[tokens, v], logits);
        }
        // Each wanted range's rows, copied once out of the step's buffer.
        let mut out = Vec::with_capacity(step.wanted.len());
        let mut at = 0;
        for r in step.wanted {
            out.push(logits[at * v..(at + r.len()) * v].to_vec());
            at += r.len();
        }
        Ok(out)
    }
}

/// What every rank of a step reads: the flat batch, its ids and the rows that want logits.
struct Step<'a> {
    layout: &'a BatchLayout,
    ids: &'a [u32],
    /// `(row, embedding)`: rows whose input embedding is given (image tokens).
    overrides: &'a [(usize, &'a [f32])],
    wanted: &'a [Range<usize>],
    /// One sequence wanting every row's logits (a trace records them).
    all_tokens_trace: bool,
    /// A trace is recorded (context-parallel ranks then gather every indexer score).
    traced: bool,
}

/// Appends layer `layer`'s partial sums `p` (`[tokens, d]`) to every tap that reads it: a tap's
/// rows are `[rows, layers · d]`, so row t's slice for its k-th layer is written in place (the
/// tap's rows for this step are added, zeroed, at its first layer).
fn record_taps(taps: &mut [Option<&mut AuxTap<'_>>], spans: &[super::batch::Span], layer: usize, p: &[f32], d: usize) {
    for (tap, span) in taps.iter_mut().zip(spans) {
        let Some(tap) = tap else { continue };
        let Some(k) = tap.layers.iter().position(|&l| l == layer) else { continue };
        let width = tap.layers.len() * d;
        let base = tap.rows.len() - span.len * width;
        for (r, t) in span.rows().enumerate() {
            tap.rows[base + r * width + k * d..base + r * width + (k + 1) * d].copy_from_slice(&p[t * d..(t + 1) * d]);
        }
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

/// Sets its flag when dropped, on return or unwind alike (so a panicking step still lets the
/// threads in [`stay_in_step`] go).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

thread_local! {
    /// Whether this thread is running a step (its frames are somewhere on the stack).
    static IN_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as running a step until dropped (restoring what it was: steps of other
/// models may nest on a pool thread that picked one up while waiting).
struct InStep(bool);

impl InStep {
    fn enter() -> InStep {
        InStep(IN_STEP.with(|s| s.replace(true)))
    }
}

impl Drop for InStep {
    fn drop(&mut self) {
        IN_STEP.with(|s| s.set(self.0));
    }
}

/// Runs the pool's pending jobs on this thread until `done`: a worker of the step that would
/// otherwise park between ops. A thread inside a step returns at once: that step's own thread
/// would wait on itself, and one of another step (two models sharing the pool) could wait on a
/// step whose own thread waits on it in turn. So only threads outside every step stay, and
/// none of them holds up a step.
fn stay_in_step(done: &AtomicBool) {
    if IN_STEP.with(|s| s.get()) {
        return;
    }
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
            continue;
        }
        // A short pause between looks, so the search does not contend with the step's own
        // thread for the pool's queues; now and then the core goes to any other runnable thread
        // (the server's HTTP and plugin work), which a yield costs little when there is none.
        idle += 1;
        if idle.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
    }
}
