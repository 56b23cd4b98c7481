//! The engine thread: admission from the waiting queue, one scheduling step at a time, and the
//! per-step batched sampling.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use super::pool::{Reservation, StatePool};
use super::prefix::{BLOCK_TOKENS, PrefixCache};
use super::sampler::{SamplerError, SamplerSeq, SharedSampler};
use super::speculative::{DraftProbs, argmax, sample_with_uniform, verify_rejection};
use super::{
    Command, EngineConfig, EngineError, EngineStats, FaultPoint, FinishReason, GenRequest, Pending, SeqEvent,
    TokenLogprob,
};
use crate::grammar::ConstraintMatcher;
use crate::model::batch::{AuxTap, EmbedRows};
use crate::model::dspark::DraftCache;
use crate::model::vision::{MAX_PATCHES_PER_CALL, VisionInput};
use crate::model::{LogitsFor, Model, SeqInput, SequenceState, StateArenas};
use kimi_kernels::cpu::reduce::{log_sum_exp, top_k};
use kimi_sampling_core::Rng;
use llguidance::toktrie::SimpleVob;

/// One generated sequence of a running request.
struct Seq {
    index: usize,
    state: SequenceState,
    sampler_seq: Option<SamplerSeq>,
    matcher: Option<ConstraintMatcher>,
    generated: usize,
    /// The token to feed next (None until the first one is sampled).
    next: Option<u32>,
    done: bool,
    /// Speculative decoding: the draft's side of this sequence (None without a draft).
    spec: Option<SpecSeq>,
}

/// One sequence's speculative state.
struct SpecSeq {
    /// The draft's context rows (one per committed token it has read).
    cache: DraftCache,
    /// Target aux rows of committed tokens the draft has not read yet.
    pending: Vec<f32>,
    /// This step's input: `[next, drafts…]` (just `[next]` when nothing is proposed).
    ids: Vec<u32>,
    /// This step's aux rows, one per input token.
    aux: Vec<f32>,
    /// `generated` before this step.
    generated_before: usize,
    /// This round's drafts' distributions, `[drafts, V]`, when they were drawn from the
    /// sequence's sampler's distributions (verified by rejection sampling); `None` for greedy
    /// drafts (verified by sample-and-match).
    q: Option<Vec<f32>>,
    /// The constraint's masks at rows 0..=drafts of this round (constrained sampled rounds;
    /// `None` past a stop token).
    masks: Vec<Option<SimpleVob>>,
    /// The engine's own draws for sampled drafts and their acceptance tests.
    rng: Rng,
}

impl SpecSeq {
    fn new(cache: DraftCache, pending: Vec<f32>, seed: u64) -> SpecSeq {
        SpecSeq {
            cache,
            pending,
            ids: Vec::new(),
            aux: Vec::new(),
            generated_before: 0,
            q: None,
            masks: Vec::new(),
            // Not the sampler's stream (the sampler has its own, seeded with `seed`).
            rng: Rng::new(seed ^ 0x5eed_d4af_7000_0001),
        }
    }

    fn drafts(&self) -> &[u32] {
        self.ids.get(1..).unwrap_or(&[])
    }
}

/// A request that holds state from the pool.
struct Running {
    req: GenRequest,
    tx: UnboundedSender<SeqEvent>,
    cancel: Arc<Vec<AtomicBool>>,
    reservation: Reservation,
    /// Prompt tokens already prefilled into `seqs[0].state`.
    prefilled: usize,
    /// Prefix cache: a block boundary where prefill stops once so the state there is stored.
    split: Option<usize>,
    seqs: Vec<Seq>,
    /// The projector rows of the prompt's images (`[positions, hidden]`), once the tower ran.
    media_rows: Option<Vec<f32>>,
    /// This step's prefill chunk: indices of its image rows (scratch for `SeqInput::embeds`).
    media_at: Vec<usize>,
}

impl Running {
    fn in_prefill(&self) -> bool {
        self.prefilled < self.req.prompt.len()
    }

    fn live(&self) -> usize {
        self.seqs.iter().filter(|s| !s.done).count()
    }
}

/// A masked row: (row, request, sequence, its matcher back, the unmasked logits when logprobs
/// need them, a failure).
type Masked = (usize, usize, usize, ConstraintMatcher, Option<Vec<f32>>, Option<EngineError>);

/// One sequence's place in the step's batch: a decode token (`seq`) or a prefill chunk of
/// `tokens` prompt tokens of a request (`seq: None`, into sequence 0's state).
struct Entry {
    run: usize,
    seq: Option<usize>,
    tokens: usize,
}

/// A speculative verify's logits, `[1 + drafts, V]`, for the rounds after the first.
struct Verify {
    run: usize,
    seq: usize,
    logits: Vec<f32>,
    /// Drafts drawn from the sampler's distributions: verified by rejection sampling, row 0
    /// included (it is not sampled with the step's other rows).
    sampled: bool,
}

/// A row to sample: (request, sequence) and its logits.
struct Row {
    run: usize,
    seq: usize,
    logits: Vec<f32>,
}

pub(super) struct Worker {
    model: Arc<Model>,
    config: EngineConfig,
    pool: StatePool,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Box<Pending>>,
    running: Vec<Running>,
    draining: Option<Instant>,
    /// KDA slots and latent pages, as many as the pool can grant, allocated at start-up.
    arenas: StateArenas,
    /// Cached prompt prefixes (`EngineConfig::prefix_cache`).
    prefix: Option<PrefixCache>,
}

impl Worker {
    pub(super) fn new(
        model: Arc<Model>,
        config: EngineConfig,
        pool: StatePool,
        stats: Arc<EngineStats>,
        arenas: StateArenas,
    ) -> Worker {
        let prefix = config.prefix_cache.then(PrefixCache::default);
        Worker {
            model,
            config,
            pool,
            stats,
            waiting: VecDeque::new(),
            running: Vec::new(),
            draining: None,
            arenas,
            prefix,
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Block only when there is nothing to do.
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                None
            };
            for cmd in first.into_iter().chain(rx.try_iter()) {
                match cmd {
                    Command::Submit(p) => {
                        if self.draining.is_some() {
                            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                            let _ = p.tx.send(SeqEvent::Failed { index: None, error: EngineError::ShuttingDown });
                        } else {
                            self.waiting.push_back(p);
                        }
                    }
                    Command::ClearPrefixCache => {
                        if let Some(pc) = self.prefix.as_mut() {
                            pc.clear(&mut self.pool);
                        }
                    }
                    Command::Shutdown { grace } => {
                        self.draining = Some(Instant::now() + grace);
                        for p in self.waiting.drain(..) {
                            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                            let _ = p.tx.send(SeqEvent::Failed { index: None, error: EngineError::ShuttingDown });
                        }
                    }
                }
            }
            if let Some(deadline) = self.draining {
                if self.running.is_empty() {
                    return;
                }
                if Instant::now() >= deadline {
                    for r in std::mem::take(&mut self.running) {
                        let _ = r.tx.send(SeqEvent::Failed { index: None, error: EngineError::ShuttingDown });
                        self.free(r);
                    }
                    self.publish();
                    return;
                }
            }
            // A panic anywhere in the step fails the requests it was running and frees their
            // state; the engine goes on with the waiting ones.
            let iteration = catch_unwind(AssertUnwindSafe(|| {
                self.reap();
                self.admit();
                if !self.running.is_empty() {
                    self.step();
                }
            }));
            if let Err(payload) = iteration {
                self.recover(panic_message(payload.as_ref()));
            }
            self.publish();
        }
    }

    /// After a panic escaped the step: every running request fails with `Fault` and gives its
    /// state back (their states may be half-written, so none is kept).
    fn recover(&mut self, message: String) {
        self.note_fault(&message);
        for r in std::mem::take(&mut self.running) {
            let _ = r.tx.send(SeqEvent::Failed { index: None, error: EngineError::Fault(message.clone()) });
            let reservation = r.reservation;
            // Freeing calls the sampler plugin; if even that panics, the pool still gets its
            // reservation back.
            if catch_unwind(AssertUnwindSafe(|| self.free(r))).is_err() {
                self.pool.release(reservation);
            }
        }
    }

    fn note_fault(&self, message: &str) {
        self.stats.faults.fetch_add(1, Ordering::Relaxed);
        *self.stats.last_fault.lock() = Some(Instant::now());
        tracing::error!(fault = %message, "engine fault contained; the requests of that step were failed");
    }

    fn probe(&self, point: FaultPoint, tokens: &[u32]) {
        if let Some(p) = &self.config.fault_probe {
            (p.0)(point, tokens);
        }
    }

    fn publish(&self) {
        let s = &self.stats;
        let used = self.pool.used();
        s.used_slots.store(used.slots, Ordering::Relaxed);
        s.leased_slots.store(self.arenas.slots.in_use(), Ordering::Relaxed);
        s.leased_pages.store(self.arenas.pages.in_use(), Ordering::Relaxed);
        s.used_pages.store(used.pages, Ordering::Relaxed);
        s.used_bytes.store(self.pool.used_bytes(), Ordering::Relaxed);
        s.running_requests.store(self.running.len(), Ordering::Relaxed);
        s.running_seqs.store(self.running.iter().map(Running::live).sum(), Ordering::Relaxed);
        if let Some(pc) = &self.prefix {
            let p = pc.stats();
            s.prefix_hits.store(p.hits, Ordering::Relaxed);
            s.prefix_hit_tokens.store(p.hit_tokens, Ordering::Relaxed);
            s.prefix_inserted.store(p.inserted, Ordering::Relaxed);
            s.prefix_evictions.store(p.evictions, Ordering::Relaxed);
            s.prefix_entries.store(p.entries, Ordering::Relaxed);
            s.prefix_bytes.store(p.bytes, Ordering::Relaxed);
        }
    }

    /// Gives back a finished or abandoned request's state and sampler sequences.
    fn free(&mut self, mut r: Running) {
        let mut sampler = r.req.sampling.sampler.lock().unwrap_or_else(|e| e.into_inner());
        for s in &mut r.seqs {
            if let Some(h) = s.sampler_seq.take() {
                sampler.close(h);
            }
        }
        drop(sampler);
        self.pool.release(r.reservation);
    }

    /// Drops requests whose client is gone, and sequences cancelled by their caller.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            for s in &mut r.seqs {
                if !s.done && r.cancel.get(s.index).is_some_and(|c| c.load(Ordering::Relaxed)) {
                    s.done = true;
                }
            }
            let all_cancelled = r.cancel.iter().all(|c| c.load(Ordering::Relaxed));
            if r.tx.is_closed() || all_cancelled || (!r.in_prefill() && r.live() == 0) {
                if r.tx.is_closed() || all_cancelled {
                    self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                let r = self.running.swap_remove(i);
                self.free(r);
            } else {
                i += 1;
            }
        }
        // Waiting requests: gone clients leave, expired ones get their refusal.
        let timeout = self.config.queue_timeout;
        let before = self.waiting.len();
        let stats = self.stats.clone();
        self.waiting.retain(|p| {
            if p.tx.is_closed() {
                return false;
            }
            if p.enqueued.elapsed() > timeout {
                stats.pool_timeouts.fetch_add(1, Ordering::Relaxed);
                let _ = p.tx.send(SeqEvent::Failed { index: None, error: EngineError::PoolTimeout(timeout) });
                return false;
            }
            true
        });
        self.stats.waiting.fetch_sub(before - self.waiting.len(), Ordering::Relaxed);
    }

    /// Admits waiting requests in order while the pool and `max_seqs` allow.
    fn admit(&mut self) {
        if self.draining.is_some() {
            return;
        }
        while let Some(p) = self.waiting.front() {
            let n = p.req.n;
            let live: usize = self.running.iter().map(|r| r.seqs.len().max(r.req.n)).sum();
            let res = self.pool.reservation(n, p.req.prompt.len(), p.req.max_tokens);
            if live + n > self.config.max_seqs {
                break;
            }
            // Cached prefixes give their state back before anyone has to wait for it.
            let mut reserved = self.pool.try_reserve(res);
            while !reserved && self.prefix.as_mut().is_some_and(|pc| pc.evict_one(&mut self.pool)) {
                reserved = self.pool.try_reserve(res);
            }
            if !reserved {
                break;
            }
            let Some(p) = self.waiting.pop_front() else { break };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            match self.start(*p, res) {
                Ok(r) => self.running.push(r),
                Err((tx, e)) => {
                    self.pool.release(res);
                    let _ = tx.send(SeqEvent::Failed { index: None, error: e });
                }
            }
        }
    }

    /// Creates the request's sampler sequences (they see the prompt) and its first state.
    #[allow(clippy::result_large_err)]
    fn start(&mut self, p: Pending, res: Reservation) -> Result<Running, (UnboundedSender<SeqEvent>, EngineError)> {
        let Pending { req, tx, cancel, .. } = p;
        let mut handles = Vec::with_capacity(req.n);
        {
            let mut sampler = req.sampling.sampler.lock().unwrap_or_else(|e| e.into_inner());
            for i in 0..req.n {
                let seed = req.sampling.seed.wrapping_add(i as u64);
                match sampler.open(&req.sampling.info, &req.sampling.params_json, seed, &req.prompt) {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        for h in handles {
                            sampler.close(h);
                        }
                        return Err((tx, EngineError::Sampler(e)));
                    }
                }
            }
        }
        // Sequence 0's state (prefilled; the others fork it afterwards), from the engine's arena:
        // a fork of the deepest cached prefix when there is one.
        let hit = match (self.prefix.as_mut(), &req.cache_salt) {
            (Some(pc), Some(salt)) => pc.lookup(salt, &req.prompt),
            _ => None,
        };
        // With a draft, a hit carries its context rows too (entries are stored with them).
        let mut hit = hit.filter(|h| self.config.speculation.is_none() || h.draft.is_some());
        let hit_draft = hit.as_mut().and_then(|h| h.draft.take());
        let cached = hit.as_ref().map_or(0, |h| h.tokens);
        let split = match (self.prefix.as_mut(), &req.cache_salt) {
            (Some(pc), Some(salt)) => pc.split_point(salt, &req.prompt, cached),
            _ => None,
        };
        if cached > 0 {
            let _ = tx.send(SeqEvent::Cached { tokens: cached });
        }
        let fresh = match hit {
            Some(h) => Ok(h.state),
            None => self.model.new_state_in(&self.arenas),
        };
        let mut first = match fresh {
            Ok(mut st) => {
                st.reserve_tokens(req.prompt.len() + req.max_tokens);
                Some(st)
            }
            Err(e) => {
                let mut sampler = req.sampling.sampler.lock().unwrap_or_else(|e| e.into_inner());
                for h in handles {
                    sampler.close(h);
                }
                return Err((tx, EngineError::Fault(format!("state slot: {e}"))));
            }
        };
        // Sequence 0 reads the prompt's aux rows into its draft context; forks share its pages.
        let mut spec0 = match &self.config.speculation {
            Some(sp) => match hit_draft.map_or_else(|| sp.draft.new_cache(&self.arenas.pages), Ok) {
                Ok(cache) => Some(SpecSeq::new(cache, Vec::new(), req.sampling.seed)),
                Err(e) => {
                    let mut sampler = req.sampling.sampler.lock().unwrap_or_else(|e| e.into_inner());
                    for h in handles {
                        sampler.close(h);
                    }
                    return Err((tx, EngineError::Fault(format!("draft cache: {e}"))));
                }
            },
            None => None,
        };
        let seqs = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| Seq {
                index: i,
                // Only sequence 0 is prefilled; the others copy its state afterwards.
                state: if i == 0 { first.take().unwrap_or_else(SequenceState::empty) } else { SequenceState::empty() },
                sampler_seq: Some(h),
                matcher: req.constraint.clone(),
                generated: 0,
                next: None,
                done: false,
                spec: if i == 0 { spec0.take() } else { None },
            })
            .collect();
        Ok(Running {
            req,
            tx,
            cancel,
            reservation: res,
            prefilled: cached,
            split,
            seqs,
            media_rows: None,
            media_at: Vec::new(),
        })
    }

    /// One scheduling step.
    fn step(&mut self) {
        let started = Instant::now();
        let step = self.stats.steps.fetch_add(1, Ordering::Relaxed) + 1;
        let decoding: usize = self.running.iter().filter(|r| !r.in_prefill()).map(Running::live).sum();
        // A speculating sequence runs its token and up to `tokens` drafts.
        let per_seq = 1 + self.config.speculation.as_ref().map_or(0, |s| s.tokens);
        let mut budget = self.config.max_batched_tokens.saturating_sub(decoding * per_seq).max(1);
        // Prefill chunks, oldest request first, within the step's token budget.
        let mut prefill: Vec<(usize, usize)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if r.in_prefill() {
                let mut take = (r.req.prompt.len() - r.prefilled).min(budget);
                if self.prefix.is_some() && r.req.cache_salt.is_some() {
                    // Stop on the last block boundary within reach (short of the final token),
                    // so the state there can be cached; the rest comes in a later chunk.
                    let mut end = (r.prefilled + take).min(r.req.prompt.len() - 1);
                    if let Some(split) = r.split.filter(|&b| b > r.prefilled) {
                        end = end.min(split);
                    }
                    let boundary = end / BLOCK_TOKENS * BLOCK_TOKENS;
                    if boundary > r.prefilled {
                        take = boundary - r.prefilled;
                    }
                }
                budget -= take;
                prefill.push((i, take));
            }
        }
        let model = self.model.clone();
        let mut rows: Vec<Row> = Vec::new();
        let mut failures: Vec<(usize, Option<usize>, EngineError)> = Vec::new();
        let mut verifies: Vec<Verify> = Vec::new();
        let prefill_tokens: usize = prefill.iter().map(|p| p.1).sum();

        // One batch for the whole step: a token per decoding sequence, then the prefill chunks.
        // Each entry is checked (and passed through the fault probe) on its own first, so a bad
        // sequence fails alone; the batch then runs as one forward call.
        let mut entries: Vec<Entry> = Vec::new();
        let mut inputs: Vec<SeqInput<'_>> = Vec::new();
        let speculation = self.config.speculation.clone();
        let max_context = model.text_config().max_position_embeddings;
        if let Some(sp) = &speculation {
            self.propose(sp, max_context, &mut failures);
        }
        if prefill.iter().any(|&(i, take)| self.needs_tower(&self.running[i], take)) {
            self.encode_media(&mut prefill, &mut failures);
        }
        let probe = &self.config.fault_probe;
        let mut chunks = prefill.iter().copied().peekable();
        for (ri, r) in self.running.iter_mut().enumerate() {
            let Running { req, seqs, prefilled, media_rows, media_at, .. } = r;
            let take = match chunks.peek() {
                Some(&(i, take)) if i == ri => {
                    chunks.next();
                    Some(take)
                }
                _ => None,
            };
            let admitted = if *prefilled < req.prompt.len() {
                let Some(take) = take else { continue };
                let entry = Entry { run: ri, seq: None, tokens: take };
                let ids = &req.prompt[*prefilled..*prefilled + take];
                let Seq { state, spec, .. } = &mut seqs[0];
                let mut input = SeqInput::new(ids, state, LogitsFor::LastToken);
                if let (Some(media), Some(rows)) = (&req.media, media_rows.as_ref()) {
                    // The chunk's image rows: positions are ascending, so theirs are a run.
                    let span = *prefilled..*prefilled + take;
                    let lo = media.positions.partition_point(|&p| p < span.start);
                    let hi = media.positions.partition_point(|&p| p < span.end);
                    media_at.clear();
                    media_at.extend(media.positions[lo..hi].iter().map(|p| p - span.start));
                    let d = model.text_config().hidden_size;
                    input.embeds = Some(EmbedRows { at: media_at, rows: &rows[lo * d..hi * d] });
                }
                if let (Some(sp), Some(spec)) = (&speculation, spec.as_mut()) {
                    // The prompt's rows become the draft's first context rows.
                    input.aux = Some(AuxTap { layers: sp.draft.taps(), rows: &mut spec.pending });
                }
                vec![admit(&model, probe, entry, input)]
            } else {
                seqs.iter_mut()
                    .filter(|s| !s.done)
                    .filter_map(|s| {
                        let Seq { index, state, spec, next, .. } = s;
                        let (Some(sp), Some(spec)) = (&speculation, spec.as_mut()) else {
                            let entry = Entry { run: ri, seq: Some(*index), tokens: 1 };
                            let ids = std::slice::from_ref(next.as_ref()?);
                            return Some(admit(&model, probe, entry, SeqInput::new(ids, state, LogitsFor::LastToken)));
                        };
                        let next = (*next)?;
                        // The drafts `propose` made for this step (none when it failed).
                        if spec.ids.first() != Some(&next) {
                            return None;
                        }
                        let entry = Entry { run: ri, seq: Some(*index), tokens: spec.ids.len() };
                        let drafts = spec.drafts().len();
                        if drafts > 0
                            && let Err(e) = contain(|| state.begin_verify(1 + drafts))
                        {
                            return Some(Err((entry, e)));
                        }
                        let logits = if drafts == 0 { LogitsFor::LastToken } else { LogitsFor::AllTokens };
                        let mut input = SeqInput::new(&spec.ids, state, logits);
                        input.aux = Some(AuxTap { layers: sp.draft.taps(), rows: &mut spec.aux });
                        Some(admit(&model, probe, entry, input))
                    })
                    .collect()
            };
            for a in admitted {
                match a {
                    Ok((entry, input)) => {
                        entries.push(entry);
                        inputs.push(input);
                    }
                    Err((entry, e)) => failures.push((entry.run, entry.seq, e)),
                }
            }
        }
        let decode_tokens: usize = entries.iter().filter(|e| e.seq.is_some()).map(|e| e.tokens).sum();
        self.stats.decode_tokens.fetch_add(decode_tokens as u64, Ordering::Relaxed);
        let batch_prefill: usize = entries.iter().filter(|e| e.seq.is_none()).map(|e| e.tokens).sum();
        self.stats.prefill_tokens.fetch_add(batch_prefill as u64, Ordering::Relaxed);
        let outputs =
            if inputs.is_empty() { Ok(Vec::new()) } else { contain(|| model.forward_batch(&mut inputs, None)) };
        drop(inputs);
        match outputs {
            // A failure of the batched call itself (a panic inside a kernel) fails every sequence it
            // carried: their states may be half-written.
            Err(e) => {
                for entry in &entries {
                    failures.push((entry.run, entry.seq, e.clone()));
                }
            }
            Ok(outputs) => {
                for (entry, logits) in entries.iter().zip(outputs) {
                    match entry.seq {
                        Some(seq) if entry.tokens > 1 => {
                            // A verify of greedy drafts: row 0 is sampled with the others, the
                            // rest while they match. Sampled drafts: every row in `verify`.
                            let v = self.model.text_config().vocab_size;
                            let sampled =
                                self.running[entry.run].seqs[seq].spec.as_ref().is_some_and(|sp| sp.q.is_some());
                            if !sampled {
                                rows.push(Row { run: entry.run, seq, logits: logits[..v].to_vec() });
                            }
                            verifies.push(Verify { run: entry.run, seq, logits, sampled });
                        }
                        Some(seq) => {
                            // A speculating sequence that proposed nothing this step: its one
                            // row is committed, so its aux row waits for the draft.
                            if let Some(sp) = self.running[entry.run].seqs[seq].spec.as_mut() {
                                let aux = std::mem::take(&mut sp.aux);
                                sp.pending.extend(aux);
                            }
                            rows.push(Row { run: entry.run, seq, logits })
                        }
                        None => {
                            // A finished prompt yields the first rows of all `n` sequences.
                            let r = &mut self.running[entry.run];
                            r.prefilled += entry.tokens;
                            if let (Some(pc), Some(salt)) = (self.prefix.as_mut(), &r.req.cache_salt)
                                && r.in_prefill()
                                && r.prefilled.is_multiple_of(BLOCK_TOKENS)
                            {
                                // With a draft, its context rows catch up with the prompt first, so
                                // the entry carries both sides of the same tokens.
                                let Seq { state, spec, .. } = &mut r.seqs[0];
                                let draft = match (&speculation, spec.as_mut()) {
                                    (Some(sp), Some(spec)) => {
                                        let SpecSeq { cache, pending, .. } = spec;
                                        match contain(|| sp.draft.extend_contexts(&model, &mut [cache], &[pending])) {
                                            Ok(_) => {
                                                pending.clear();
                                                Some(&spec.cache)
                                            }
                                            Err(e) => {
                                                failures.push((entry.run, None, e));
                                                None
                                            }
                                        }
                                    }
                                    _ => None,
                                };
                                if speculation.is_none() || draft.is_some() {
                                    pc.insert(&mut self.pool, salt, &r.req.prompt, state, draft);
                                }
                            }
                            if !r.in_prefill() {
                                // Forks take a KDA slot each (the pool reserved them at admission)
                                // and share the prompt's pages — the draft's too, once it has
                                // read the prompt.
                                let total = r.req.prompt.len() + r.req.max_tokens;
                                let (first, rest) = r.seqs.split_at_mut(1);
                                if let (Some(sp), Some(spec)) = (&speculation, first[0].spec.as_mut())
                                    && !rest.is_empty()
                                {
                                    let SpecSeq { cache, pending, .. } = spec;
                                    match contain(|| sp.draft.extend_contexts(&model, &mut [cache], &[pending])) {
                                        Ok(_) => pending.clear(),
                                        Err(e) => failures.push((entry.run, None, e)),
                                    }
                                }
                                let seed = r.req.sampling.seed;
                                for s in rest {
                                    s.spec = first[0].spec.as_ref().map(|sp| {
                                        let seed = seed.wrapping_add(s.index as u64);
                                        SpecSeq::new(sp.cache.clone(), sp.pending.clone(), seed)
                                    });
                                    match first[0].state.fork() {
                                        Ok(st) => s.state = st,
                                        Err(e) => failures.push((
                                            entry.run,
                                            Some(s.index),
                                            EngineError::Fault(format!("fork: {e}")),
                                        )),
                                    }
                                    s.state.reserve_tokens(total);
                                }
                                for s in &r.seqs {
                                    rows.push(Row { run: entry.run, seq: s.index, logits: logits.clone() });
                                }
                            }
                        }
                    }
                }
            }
        }

        for (run, seq, e) in failures {
            self.fail(run, seq, e);
        }
        let forward = started.elapsed();
        let decode_rows = rows.len();
        self.sample(rows);
        if !verifies.is_empty() {
            self.verify(verifies);
        }
        tracing::debug!(
            step,
            decoding,
            prefill_tokens,
            rows = decode_rows,
            forward_ms = forward.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "engine step"
        );
    }

    /// Drafts for every decoding speculating sequence, in one batched draft pass: each reads its
    /// committed rows' aux states, then proposes up to `tokens` drafts after its next token —
    /// fewer near `max_tokens` or the context end, where they could never be emitted. Sets each
    /// sequence's step input `[next, drafts…]`; a failed pass fails those sequences.
    /// Whether a prefill chunk of `take` tokens of `r` reaches image rows the tower has not made.
    fn needs_tower(&self, r: &Running, take: usize) -> bool {
        r.media_rows.is_none()
            && r.req
                .media
                .as_ref()
                .is_some_and(|m| m.positions.iter().any(|&p| p < r.prefilled + take && p >= r.prefilled))
    }

    /// Runs the vision tower once over the images of every request whose chunk this step needs
    /// them (batched across requests, at most [`MAX_PATCHES_PER_CALL`] patches: the rest wait a
    /// step, their chunks dropped from `prefill`). A failure fails those requests only.
    fn encode_media(
        &mut self,
        prefill: &mut Vec<(usize, usize)>,
        failures: &mut Vec<(usize, Option<usize>, EngineError)>,
    ) {
        let Some(vision) = self.config.vision.clone() else {
            for &(i, take) in prefill.iter() {
                if self.needs_tower(&self.running[i], take) {
                    failures.push((i, None, EngineError::Fault("this engine has no vision tower".into())));
                }
            }
            prefill.retain(|&(i, take)| !self.needs_tower(&self.running[i], take));
            return;
        };
        let mut chosen: Vec<usize> = Vec::new();
        let mut deferred: Vec<usize> = Vec::new();
        let mut patches = 0usize;
        for &(i, take) in prefill.iter() {
            if !self.needs_tower(&self.running[i], take) {
                continue;
            }
            let media =
                self.running[i].req.media.as_ref().map_or(0, |m| m.items.iter().map(VisionInput::patches).sum());
            if chosen.is_empty() || patches + media <= MAX_PATCHES_PER_CALL {
                patches += media;
                chosen.push(i);
            } else {
                deferred.push(i);
            }
        }
        prefill.retain(|(i, _)| !deferred.contains(i));
        let items: Vec<VisionInput> = chosen
            .iter()
            .filter_map(|&i| self.running[i].req.media.as_ref())
            .flat_map(|m| m.items.iter().cloned())
            .collect();
        let started = Instant::now();
        let be = self.model.backend();
        let out = contain(|| vision.encode(be, &items, None));
        self.stats.vision_calls.fetch_add(1, Ordering::Relaxed);
        self.stats.vision_items.fetch_add(items.len() as u64, Ordering::Relaxed);
        self.stats.vision_patches.fetch_add(patches as u64, Ordering::Relaxed);
        self.stats.vision_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        let d = self.model.text_config().hidden_size;
        match out {
            Ok(rows) if rows.len() == items.iter().map(VisionInput::tokens).sum::<usize>() * d => {
                let mut at = 0;
                for &i in &chosen {
                    let r = &mut self.running[i];
                    let n = r.req.media.as_ref().map_or(0, |m| m.rows());
                    r.media_rows = Some(rows[at * d..(at + n) * d].to_vec());
                    at += n;
                }
            }
            Ok(rows) => {
                let e = EngineError::Fault(format!(
                    "the vision tower returned {} values for {} image rows of width {d} (text_hidden_size differs from the text model's hidden size?)",
                    rows.len(),
                    items.iter().map(VisionInput::tokens).sum::<usize>()
                ));
                for &i in &chosen {
                    failures.push((i, None, e.clone()));
                }
                prefill.retain(|(i, _)| !chosen.contains(i));
            }
            Err(e) => {
                for &i in &chosen {
                    failures.push((i, None, e.clone()));
                }
                prefill.retain(|(i, _)| !chosen.contains(i));
            }
        }
    }

    fn propose(
        &mut self,
        sp: &super::Speculation,
        max_context: usize,
        failures: &mut Vec<(usize, Option<usize>, EngineError)>,
    ) {
        let mut who = Vec::new();
        let mut caches: Vec<&mut DraftCache> = Vec::new();
        let mut pending: Vec<&[f32]> = Vec::new();
        let mut anchors = Vec::new();
        let mut counts = Vec::new();
        for (ri, r) in self.running.iter_mut().enumerate() {
            if r.prefilled < r.req.prompt.len() {
                continue;
            }
            let max_tokens = r.req.max_tokens;
            for s in r.seqs.iter_mut().filter(|s| !s.done) {
                let (Some(next), Some(spec)) = (s.next, s.spec.as_mut()) else { continue };
                let room = max_tokens.saturating_sub(s.generated + 1).min(max_context.saturating_sub(s.state.len + 1));
                spec.ids.clear();
                spec.aux.clear();
                spec.generated_before = s.generated;
                who.push((ri, s.index));
                caches.push(&mut spec.cache);
                pending.push(&spec.pending);
                anchors.push(next);
                counts.push(sp.tokens.min(room));
            }
        }
        if who.is_empty() {
            return;
        }
        let model = self.model.clone();
        let blocks = contain(|| sp.draft.draft_blocks(&model, &mut caches, &pending, &anchors, &counts));
        drop((caches, pending));
        let blocks = match blocks {
            Ok(b) => b,
            Err(e) => {
                for (ri, si) in who {
                    failures.push((ri, Some(si), EngineError::Fault(format!("draft: {e}"))));
                }
                return;
            }
        };
        // Each walk draws from its sequence's sampler where the sampler describes its
        // distributions; otherwise (or once it declines) it takes the draft's argmax.
        let mut walks: Vec<SampledWalk> = who
            .iter()
            .map(|&(ri, si)| {
                let r = &mut self.running[ri];
                let sampler = r.req.sampling.sampler.clone();
                let sampled = sp.drafts == super::DraftMode::Sampled
                    && sampler.lock().unwrap_or_else(|e| e.into_inner()).describes_distributions();
                let s = &mut r.seqs[si];
                SampledWalk {
                    on: sampled && s.sampler_seq.is_some(),
                    sampler,
                    seq: s.sampler_seq,
                    lookahead: if sampled { s.matcher.clone() } else { None },
                    rng: s.spec.as_mut().map_or_else(|| Rng::new(0), |sp| std::mem::replace(&mut sp.rng, Rng::new(0))),
                    q: Vec::new(),
                    masks: Vec::new(),
                    ended: false,
                }
            })
            .collect();
        let stops: Vec<&[u32]> = who.iter().map(|&(ri, _)| self.running[ri].req.stop_tokens.as_slice()).collect();
        let drafts = contain(|| {
            Ok(sp
                .draft
                .walk_with(model.backend(), &blocks, |b, before, logits| walks[b].pick(before, logits, stops[b])))
        });
        drop(stops);
        let drafts = match drafts {
            Ok(d) => d,
            Err(e) => {
                for ((ri, si), w) in who.into_iter().zip(walks) {
                    if let Some(spec) = self.running[ri].seqs[si].spec.as_mut() {
                        spec.rng = w.rng;
                    }
                    failures.push((ri, Some(si), EngineError::Fault(format!("draft: {e}"))));
                }
                return;
            }
        };
        for (((ri, si), (anchor, drafts)), mut w) in who.into_iter().zip(anchors.into_iter().zip(drafts)).zip(walks) {
            if w.on && !drafts.is_empty() && !w.ended && w.lookahead.is_some() {
                // The mask of the row after the last draft (the bonus row).
                w.masks.push(w.lookahead.as_mut().and_then(|m| m.mask().ok()));
            }
            if let Some(spec) = self.running[ri].seqs[si].spec.as_mut() {
                spec.pending.clear();
                spec.ids.push(anchor);
                spec.q = (w.on && !drafts.is_empty()).then_some(w.q);
                spec.masks = w.masks;
                spec.rng = w.rng;
                spec.ids.extend(drafts);
            }
        }
    }

    /// Sampled drafts: every row of a sampled round (0..=drafts) is verified here, by standard
    /// rejection sampling against the rows the drafts were drawn from (`SpecSeq::q`), with the
    /// target's rows masked as the drafts' were and described by the same sampler — so the
    /// emitted tokens follow the sampler's distribution over the target's rows exactly. The
    /// emitted tokens (accepted drafts, then a correction or a bonus) go out one by one, as
    /// sampled rows do. Returns false when the sampler declines to describe the rows: the caller
    /// then verifies the round by sample-and-match (exact for any drafts).
    fn verify_sampled(&mut self, ver: &Verify) -> bool {
        let v = self.model.text_config().vocab_size;
        let Some(r) = self.running.get_mut(ver.run) else { return true };
        let want_logprobs = r.req.logprobs.is_some();
        let sampler = r.req.sampling.sampler.clone();
        let s = &mut r.seqs[ver.seq];
        let (Some(sp), Some(h), false) = (s.spec.as_mut(), s.sampler_seq, s.done) else { return true };
        let Some(q) = sp.q.take() else { return false };
        let drafts = sp.drafts().to_vec();
        let t = drafts.len();
        let mut rows: Vec<Vec<f32>> = (0..=t).map(|j| ver.logits[j * v..(j + 1) * v].to_vec()).collect();
        let raw = want_logprobs.then(|| rows.clone());
        for (row, mask) in rows.iter_mut().zip(&sp.masks) {
            if let Some(mask) = mask {
                apply_mask(mask, row);
            }
        }
        let uniforms: Vec<f32> = (0..=t).map(|_| uniform(&mut sp.rng)).collect();
        let refs: Vec<(usize, &[f32])> = rows.iter().enumerate().map(|(j, r)| (j, r.as_slice())).collect();
        let p = sampler.lock().unwrap_or_else(|e| e.into_inner()).distributions(h, &drafts, &refs);
        let target = match p {
            Ok(Some(p)) if p.len() == t + 1 && p.iter().all(|row| row.len() == v) => p.concat(),
            Ok(_) => return false,
            Err(e) => {
                self.fail(ver.run, Some(ver.seq), EngineError::Sampler(e));
                return true;
            }
        };
        let verdict = verify_rejection(&drafts, DraftProbs::Rows(&q), &target, &uniforms[..t], uniforms[t], v);
        let emitted = drafts[..verdict.accepted].iter().copied().chain(std::iter::once(verdict.next));
        for (j, token) in emitted.enumerate() {
            if self.running[ver.run].seqs[ver.seq].done {
                break;
            }
            let row = Row { run: ver.run, seq: ver.seq, logits: std::mem::take(&mut rows[j]) };
            let raw_row = raw.as_ref().map(|raw| raw[j].clone());
            self.emit(&[row], vec![Some(Ok(token))], vec![raw_row]);
        }
        true
    }

    /// Verifies the step's speculative rounds: sampled rounds by rejection sampling
    /// (`verify_sampled`), greedy ones by sample-and-match. There, row j of a verify is sampled
    /// (masked, through the sequence's own sampler, as any row) only if the token emitted from
    /// row j − 1 is draft j; the first mismatch is itself the emitted token. Every emitted token
    /// is thus exactly what non-speculative decoding would emit — same rows, same sampler state,
    /// same random draws — at any temperature and with any sampler or grammar; accepted drafts
    /// only save target steps. Then each sequence keeps the verified rows of its emitted tokens: the
    /// KDA snapshot after the last one is swapped in, rejected latent rows are dropped, and the
    /// kept rows' aux states wait for the draft.
    fn verify(&mut self, verifies: Vec<Verify>) {
        let v = self.model.text_config().vocab_size;
        // Sampled rounds first; a round whose sampler declines is matched below, from row 0.
        let matched: Vec<usize> =
            (0..verifies.len()).filter(|&i| !(verifies[i].sampled && self.verify_sampled(&verifies[i]))).collect();
        for j in 0.. {
            let mut rows = Vec::new();
            for ver in matched.iter().map(|&i| &verifies[i]) {
                let Some(r) = self.running.get(ver.run) else { continue };
                let s = &r.seqs[ver.seq];
                let Some(sp) = s.spec.as_ref() else { continue };
                let drafts = sp.drafts();
                // Row 0 of a greedy round was sampled with the step's other rows already.
                let on_track = !s.done
                    && s.generated == sp.generated_before + j
                    && (j == 0 || s.next == drafts.get(j - 1).copied());
                if on_track && let Some(row) = ver.logits.get(j * v..(j + 1) * v) {
                    rows.push(Row { run: ver.run, seq: ver.seq, logits: row.to_vec() });
                }
            }
            // Row 0 is sampled here only for rounds whose sampler declined; row 1 always follows.
            if rows.is_empty() {
                if j == 0 {
                    continue;
                }
                break;
            }
            self.sample(rows);
        }
        for ver in verifies {
            let Some(r) = self.running.get_mut(ver.run) else { continue };
            let s = &mut r.seqs[ver.seq];
            let (Some(sp), false) = (s.spec.as_mut(), s.done) else { continue };
            let verified = sp.ids.len();
            let kept = s.generated - sp.generated_before;
            let proposed = verified - 1;
            let width = sp.aux.len() / verified.max(1);
            let kept_aux = sp.aux.get(..kept * width).map(<[f32]>::to_vec);
            let result = match kept_aux {
                Some(rows) if kept >= 1 => {
                    sp.pending.extend(rows);
                    s.state.accept(verified, kept).map_err(|e| EngineError::Fault(format!("rollback: {e}")))
                }
                _ => Err(EngineError::Fault(format!("verify kept {kept} of {verified} rows"))),
            };
            self.stats.spec_rounds.fetch_add(1, Ordering::Relaxed);
            self.stats.spec_proposed.fetch_add(proposed as u64, Ordering::Relaxed);
            self.stats.spec_accepted.fetch_add(kept.saturating_sub(1).min(proposed) as u64, Ordering::Relaxed);
            if let Err(e) = result {
                self.fail(ver.run, Some(ver.seq), e);
            }
        }
    }

    fn fail(&mut self, run: usize, seq: Option<usize>, error: EngineError) {
        if let EngineError::Fault(m) = &error {
            self.note_fault(m);
        }
        let r = &mut self.running[run];
        match seq {
            Some(i) => {
                if let Some(s) = r.seqs.get_mut(i) {
                    s.done = true;
                }
            }
            None => r.seqs.iter_mut().for_each(|s| s.done = true),
        }
        if seq.is_none() {
            // A request-level failure during prefill: make sure `reap` frees it.
            r.prefilled = r.req.prompt.len();
        }
        let _ = r.tx.send(SeqEvent::Failed { index: seq, error });
    }

    /// Masks, samples (one plugin call per sampler per step), checks and emits.
    fn sample(&mut self, mut rows: Vec<Row>) {
        self.probe(FaultPoint::Sample, &[]);
        rows.retain(|row| self.running.get(row.run).is_some_and(|r| !r.seqs[row.seq].done));
        let raw = self.mask(&mut rows);
        let chosen = self.choose(&rows);
        self.emit(&rows, chosen, raw);
    }

    /// Constrained rows: disallowed tokens to −∞ before the sampler sees them. Masks are
    /// computed for all constrained sequences in parallel (each owns its matcher). Returns the
    /// unmasked rows that logprobs need.
    fn mask(&mut self, rows: &mut [Row]) -> Vec<Option<Vec<f32>>> {
        let mut failures: Vec<(usize, usize, EngineError)> = Vec::new();
        let mut raw: Vec<Option<Vec<f32>>> = (0..rows.len()).map(|_| None).collect();
        let running = &mut self.running;
        let jobs: Vec<(usize, &mut Row, ConstraintMatcher, bool)> = rows
            .iter_mut()
            .enumerate()
            .filter_map(|(k, row)| {
                let r = &mut running[row.run];
                let want_logprobs = r.req.logprobs.is_some();
                r.seqs[row.seq].matcher.take().map(|m| (k, row, m, want_logprobs))
            })
            .collect();
        let masked: Vec<Masked> = jobs
            .into_par_iter()
            .map(|(k, row, mut m, want_logprobs)| match m.mask() {
                Ok(mask) => {
                    let (masked, any) = masked_row(&mask, &row.logits);
                    let original = std::mem::replace(&mut row.logits, masked);
                    let e = (!any).then(|| EngineError::Constraint("no token is allowed here".into()));
                    (k, row.run, row.seq, m, want_logprobs.then_some(original), e)
                }
                Err(e) => (k, row.run, row.seq, m, None, Some(EngineError::Constraint(e.to_string()))),
            })
            .collect();
        for (k, run, seq, m, original, e) in masked {
            self.running[run].seqs[seq].matcher = Some(m);
            raw[k] = original;
            if let Some(e) = e {
                failures.push((run, seq, e));
            }
        }
        for (run, seq, e) in failures {
            self.fail(run, Some(seq), e);
        }
        raw
    }

    /// One batched call per sampler (tenant + plugin) for its rows: a token or a failure each.
    fn choose(&self, rows: &[Row]) -> Vec<Option<Result<u32, EngineError>>> {
        let mut groups: Vec<(SharedSampler, Vec<usize>)> = Vec::new();
        for (k, row) in rows.iter().enumerate() {
            let r = &self.running[row.run];
            if r.seqs[row.seq].done {
                continue;
            }
            let sampler = &r.req.sampling.sampler;
            match groups.iter_mut().find(|g| Arc::ptr_eq(&g.0, sampler)) {
                Some(g) => g.1.push(k),
                None => groups.push((sampler.clone(), vec![k])),
            }
        }
        let mut chosen: Vec<Option<Result<u32, EngineError>>> = (0..rows.len()).map(|_| None).collect();
        for (sampler, members) in groups {
            let batch: Vec<(SamplerSeq, &[f32])> = members
                .iter()
                .filter_map(|&k| {
                    let row = &rows[k];
                    Some((self.running[row.run].seqs[row.seq].sampler_seq?, row.logits.as_slice()))
                })
                .collect();
            let results = if batch.len() == members.len() {
                sampler.lock().unwrap_or_else(|e| e.into_inner()).sample(&batch)
            } else {
                Vec::new()
            };
            let mut results = results.into_iter();
            for &k in &members {
                let r = results
                    .next()
                    .unwrap_or_else(|| Err(SamplerError::internal("the sampler gave no token for this sequence")));
                chosen[k] = Some(r.map_err(EngineError::Sampler));
            }
        }
        chosen
    }

    /// Checks each chosen token against the constraint, feeds it back to the sampler and the
    /// matcher, and sends it (with logprobs from the unmasked row) and any finish to the client.
    fn emit(&mut self, rows: &[Row], mut chosen: Vec<Option<Result<u32, EngineError>>>, raw: Vec<Option<Vec<f32>>>) {
        for (k, row) in rows.iter().enumerate() {
            let Some(result) = chosen[k].take() else { continue };
            let token = match result {
                Ok(t) => t,
                Err(e) => {
                    self.fail(row.run, Some(row.seq), e);
                    continue;
                }
            };
            if !row.logits.get(token as usize).is_some_and(|v| *v > f32::NEG_INFINITY) {
                let e =
                    EngineError::Constraint(format!("the sampler chose token {token}, which the constraint forbids"));
                self.fail(row.run, Some(row.seq), e);
                continue;
            }
            let logprob = {
                let r = &self.running[row.run];
                r.req.logprobs.map(|n| {
                    let full = raw[k].as_deref().unwrap_or(&row.logits);
                    let lse = log_sum_exp(full, 1.0);
                    TokenLogprob {
                        logprob: full[token as usize] - lse,
                        top: top_k(full, n).into_iter().map(|(t, v)| (t, v - lse)).collect(),
                    }
                })
            };
            let r = &mut self.running[row.run];
            let stop = r.req.stop_tokens.contains(&token);
            let max_tokens = r.req.max_tokens;
            let max_context = self.model.text_config().max_position_embeddings;
            let s = &mut r.seqs[row.seq];
            if let Some(m) = s.matcher.as_mut()
                && !stop
                && let Err(e) = m.consume(token)
            {
                let e = EngineError::Constraint(e.to_string());
                self.fail(row.run, Some(row.seq), e);
                continue;
            }
            let s = &mut self.running[row.run].seqs[row.seq];
            s.generated += 1;
            s.next = Some(token);
            {
                let r = &self.running[row.run];
                if let Some(h) = r.seqs[row.seq].sampler_seq {
                    r.req.sampling.sampler.lock().unwrap_or_else(|e| e.into_inner()).accept(h, token);
                }
            }
            let r = &mut self.running[row.run];
            let s = &mut r.seqs[row.seq];
            let _ = r.tx.send(SeqEvent::Token { index: s.index, id: token, logprob });
            let reason = if stop {
                Some(FinishReason::Stop)
            } else if s.generated >= max_tokens || s.state.len >= max_context {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                s.done = true;
                let _ = r.tx.send(SeqEvent::Finished { index: s.index, reason });
            }
        }
    }
}

/// One sequence's draft walk over the draft's rows when its drafts are drawn from its
/// sampler's distributions: the constraint runs ahead on a copy of the sequence's matcher (the
/// real one advances only through emitted tokens, so nothing is ever rolled back — budgeted
/// lexemes included), and every row's distribution is kept for the verify.
struct SampledWalk {
    /// Drawing from the sampler (false: the draft's argmax, as for greedy rounds).
    on: bool,
    sampler: SharedSampler,
    seq: Option<SamplerSeq>,
    lookahead: Option<ConstraintMatcher>,
    rng: Rng,
    /// The distributions drawn from, `[drafts, V]`.
    q: Vec<f32>,
    /// The mask of each row walked (`None` without a constraint).
    masks: Vec<Option<SimpleVob>>,
    /// A stop token was drawn: nothing after it can be emitted.
    ended: bool,
}

impl SampledWalk {
    /// The draft after `before` (the drafts so far) from the draft's biased `logits`.
    fn pick(&mut self, before: &[u32], logits: &mut [f32], stops: &[u32]) -> Option<u32> {
        if !self.on {
            return Some(argmax(logits) as u32);
        }
        if self.ended {
            return None;
        }
        let seq = self.seq?;
        let mask = match self.lookahead.as_mut() {
            Some(m) => match m.mask() {
                Ok(mask) => {
                    if !apply_mask(&mask, logits) {
                        return None;
                    }
                    Some(mask)
                }
                Err(_) => return None,
            },
            None => None,
        };
        let rows = [(before.len(), &*logits)];
        let q = match self.sampler.lock().unwrap_or_else(|e| e.into_inner()).distributions(seq, before, &rows) {
            Ok(Some(mut q)) if q.len() == 1 && q[0].len() == logits.len() => q.remove(0),
            Ok(_) if before.is_empty() => {
                // The sampler declines these rows: a greedy round.
                self.on = false;
                return Some(argmax(logits) as u32);
            }
            // Declined or failed part-way: the drafts so far stand (the verify asks again and
            // fails the sequence if the sampler fails there too).
            _ => return None,
        };
        let token = sample_with_uniform(&q, uniform(&mut self.rng)) as u32;
        if q[token as usize] <= 0.0 {
            return None;
        }
        if stops.contains(&token) {
            self.ended = true;
        } else if let Some(m) = self.lookahead.as_mut()
            && m.consume(token).is_err()
        {
            return None;
        }
        self.q.extend_from_slice(&q);
        self.masks.push(mask);
        Some(token)
    }
}

/// `row` with the tokens `mask` disallows at −∞, and whether it allows any token of the row.
fn masked_row(mask: &SimpleVob, row: &[f32]) -> (Vec<f32>, bool) {
    let mut masked = vec![f32::NEG_INFINITY; row.len()];
    let mut any = false;
    mask.iter_set_entries(|i| {
        if let Some(v) = row.get(i) {
            masked[i] = *v;
            any = true;
        }
    });
    (masked, any)
}

/// [`masked_row`] in place; false when the mask allows no token of the row.
fn apply_mask(mask: &SimpleVob, row: &mut [f32]) -> bool {
    let (masked, any) = masked_row(mask, row);
    row.copy_from_slice(&masked);
    any
}

/// A uniform draw in [0, 1) with 24 bits (exactly representable as f32).
fn uniform(rng: &mut Rng) -> f32 {
    (rng.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Checks one sequence's entry on its own (the fault probe, then the model's input checks), so
/// a bad sequence fails alone before the batch runs.
#[allow(clippy::result_large_err)]
fn admit<'a>(
    model: &Model,
    probe: &Option<super::FaultProbe>,
    entry: Entry,
    input: SeqInput<'a>,
) -> Result<(Entry, SeqInput<'a>), (Entry, EngineError)> {
    let checked = contain(|| {
        if let Some(p) = probe {
            (p.0)(FaultPoint::Forward, input.ids);
        }
        model.check(input.ids, input.state.len)
    });
    match checked {
        Ok(()) => Ok((entry, input)),
        Err(e) => Err((entry, e)),
    }
}

/// Runs one model call; a panic inside it (a kernel bug, a broken invariant) becomes this call's
/// error, so only the sequences it touched fail.
fn contain<T>(f: impl FnOnce() -> Result<T, crate::model::ModelError>) -> Result<T, EngineError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| EngineError::Model(e.to_string())),
        Err(payload) => Err(EngineError::Fault(panic_message(payload.as_ref()))),
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
