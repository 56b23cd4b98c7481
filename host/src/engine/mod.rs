//! The engine: continuous batching over the model on its own thread. Each step runs one decode
//! token for every running sequence plus a bounded chunk of prefill (`max_batched_tokens`), masks
//! constrained rows natively, calls each sampler plugin once for all of its sequences, and streams
//! tokens to the request's channel. State comes from a pool reserved at admission (`pool`); a
//! request that does not fit waits (bounded), then fails with `PoolTimeout` (HTTP 429). A request
//! whose receiver is dropped (client gone) is freed at the next step.
//!
//! The HTTP server and the in-process API (`Engine::submit`) share this one engine.

pub mod pool;
pub mod prefix;
pub mod sampler;
pub mod speculative;
mod step;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::grammar::ConstraintMatcher;
use crate::model::Model;
use crate::model::dspark::DsparkDraft;
use crate::model::vision::{VisionInput, VisionModel};
use pool::{StatePool, StateShape};
pub use sampler::{Sampler, SamplerError, SamplerErrorKind, SamplerRequest, SamplerSeq, SharedSampler};

/// Scheduler limits, fixed at start-up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most sequences decoding at once.
    pub max_seqs: usize,
    /// Most tokens (decode + prefill) one step runs.
    pub max_batched_tokens: usize,
    /// Bytes for sequence state (KDA slots and latent pages).
    pub state_memory: usize,
    /// How long a request may wait for state before it is refused.
    pub queue_timeout: Duration,
    /// Most requests waiting for state; more are refused at once.
    pub max_waiting: usize,
    /// Speculative decoding with a DSpark draft (`--draft`), or `None`.
    pub speculation: Option<Speculation>,
    /// Prefix caching for requests that carry a cache salt (`GenRequest::cache_salt`).
    pub prefix_cache: bool,
    /// The vision tower and projector, for requests with images (`GenRequest::media`); `None`
    /// refuses them.
    pub vision: Option<Arc<VisionModel>>,
    /// Test hook: runs before every model call and every sampling pass and may panic, to
    /// simulate a fault inside a kernel. Only code can set it (not the config file).
    pub fault_probe: Option<FaultProbe>,
}

/// A draft that proposes `tokens` tokens a step for every decoding sequence; the target verifies
/// them inside the normal batched step (see `step.rs`). Either way the output follows exactly
/// the distribution of non-speculative sampling.
#[derive(Clone)]
pub struct Speculation {
    pub draft: Arc<DsparkDraft>,
    pub tokens: usize,
    pub drafts: DraftMode,
}

impl Speculation {
    /// Speculation with sampled drafts where the sampler allows it.
    pub fn new(draft: Arc<DsparkDraft>, tokens: usize) -> Speculation {
        Speculation { draft, tokens, drafts: DraftMode::Sampled }
    }
}

/// How drafts are chosen and verified.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftMode {
    /// Drawn from the sequence's sampler's own distribution over the draft's (masked) rows and
    /// verified by standard rejection sampling — for samplers that describe their
    /// distributions (`speculation` export); others fall back to `Greedy`.
    #[default]
    Sampled,
    /// The draft's argmax walk (ATOM's default), verified by sample-and-match: each row is
    /// sampled by the sequence's sampler while the previous row emitted the draft, so the
    /// emitted tokens are the very tokens non-speculative decoding would emit for the seed.
    Greedy,
}

impl std::fmt::Debug for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculation")
            .field("draft_layers", &self.draft.layers())
            .field("tokens", &self.tokens)
            .field("drafts", &self.drafts)
            .finish()
    }
}

/// Where the engine calls its [`FaultProbe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// Before a model forward over these tokens (a decode token or a prefill chunk).
    Forward,
    /// Before the step's masking and sampling pass (the tokens are empty).
    Sample,
}

/// A function the engine calls at each [`FaultPoint`] (see `EngineConfig::fault_probe`).
#[derive(Clone)]
pub struct FaultProbe(pub Arc<FaultFn>);

/// The probe's signature: where the engine is, and the tokens it is about to run.
pub type FaultFn = dyn Fn(FaultPoint, &[u32]) + Send + Sync;

impl std::fmt::Debug for FaultProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultProbe")
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_seqs: 64,
            max_batched_tokens: 512,
            state_memory: 1 << 30,
            queue_timeout: Duration::from_secs(10),
            max_waiting: 256,
            speculation: None,
            prefix_cache: false,
            vision: None,
            fault_probe: None,
        }
    }
}

/// How a request's tokens are chosen.
pub struct SamplingSpec {
    pub sampler: SharedSampler,
    /// The request's sampling parameters as JSON (OpenAI names), for the plugin.
    pub params_json: String,
    /// Sequence `i` of the request is seeded with `seed + i`.
    pub seed: u64,
    pub info: SamplerRequest,
}

/// One generation request: `n` sequences continuing the same prompt.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub n: usize,
    /// Tokens that end a sequence (emitted, then `Finished(Stop)`).
    pub stop_tokens: Vec<u32>,
    /// The request's constraint (each sequence gets its own copy).
    pub constraint: Option<ConstraintMatcher>,
    pub sampling: SamplingSpec,
    /// Log-probabilities: None, or Some(number of alternatives per token).
    pub logprobs: Option<usize>,
    /// The prefix-cache partition this request reads and fills (its tenant's, or a shared one,
    /// plus its own `cache_salt`); `None` keeps it out of the cache.
    pub cache_salt: Option<String>,
    /// The prompt's images: the engine runs them through the vision tower (batched with other
    /// requests' images of the same step) before the prefill reaches their rows.
    pub media: Option<Arc<MediaPrompt>>,
}

/// A prompt's images: the tower's inputs, in prompt order, and the prompt positions (the
/// expanded `<|media_pad|>` rows, ascending) their projector rows fill.
#[derive(Clone, Debug, Default)]
pub struct MediaPrompt {
    pub items: Vec<VisionInput>,
    pub positions: Vec<usize>,
}

impl MediaPrompt {
    /// Checks that the items' token counts cover the positions, one row each.
    pub fn rows(&self) -> usize {
        self.items.iter().map(VisionInput::tokens).sum()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens at this position, most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

#[derive(Debug)]
pub enum SeqEvent {
    /// Sent first when the request's prompt starts from a cached prefix: its tokens.
    Cached {
        tokens: usize,
    },
    /// A generated token of sequence `index`.
    Token {
        index: usize,
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        index: usize,
        reason: FinishReason,
    },
    /// The request (index None) or one sequence failed.
    Failed {
        index: Option<usize>,
        error: EngineError,
    },
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("server busy: no sequence state became free within {0:?}; retry later")]
    PoolTimeout(Duration),
    #[error("server busy: too many requests are waiting; retry later")]
    QueueFull,
    #[error("request needs state for {tokens} tokens × {n} sequences, more than this server's state memory holds")]
    TooLarge { tokens: usize, n: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Sampler(#[from] SamplerError),
    #[error("model: {0}")]
    Model(String),
    #[error("constraint: {0}")]
    Constraint(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A panic inside the engine step (a kernel bug or a broken invariant). The sequences the
    /// step touched are stopped and their state freed; the engine keeps serving the others.
    #[error("internal error in the engine step ({0}); this request was stopped, the server keeps serving")]
    Fault(String),
}

impl EngineError {
    /// Whether the client should retry later (HTTP 429 / 503) rather than fix the request.
    pub fn is_busy(&self) -> bool {
        matches!(self, EngineError::PoolTimeout(_) | EngineError::QueueFull)
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error("cannot start the engine thread: {0}")]
    Thread(std::io::Error),
    #[error("state memory: {0}")]
    StateMemory(crate::model::ModelError),
    #[error("the start-up step that sizes the step buffers failed: {0}")]
    WarmUp(crate::model::ModelError),
}

/// Live counters, read by `/metrics` and tests.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub waiting: AtomicUsize,
    pub running_requests: AtomicUsize,
    pub running_seqs: AtomicUsize,
    pub used_slots: AtomicUsize,
    /// KDA slots actually leased from the engine's arena (`used_slots` is what the pool reserved).
    pub leased_slots: AtomicUsize,
    pub used_pages: AtomicUsize,
    /// Latent pages (one MLA layer's 16 tokens each) leased from the engine's page arena.
    pub leased_pages: AtomicUsize,
    pub used_bytes: AtomicUsize,
    pub total_slots: AtomicUsize,
    pub total_pages: AtomicUsize,
    pub steps: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// Speculative decoding: verify rounds, draft tokens proposed, and those accepted (each
    /// round also emits one token of the target's own).
    pub spec_rounds: AtomicU64,
    pub spec_proposed: AtomicU64,
    pub spec_accepted: AtomicU64,
    /// Prefix cache: requests that started from a cached prefix, the prompt tokens they skipped,
    /// entries stored and evicted, entries held and the bytes reserved for them.
    pub prefix_hits: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub prefix_inserted: AtomicU64,
    pub prefix_evictions: AtomicU64,
    pub prefix_entries: AtomicUsize,
    pub prefix_bytes: AtomicUsize,
    /// Vision tower: calls (one per step that had images), images encoded, patches, and the
    /// tower + projector time in microseconds.
    pub vision_calls: AtomicU64,
    pub vision_items: AtomicU64,
    pub vision_patches: AtomicU64,
    pub vision_micros: AtomicU64,
    pub cancelled: AtomicU64,
    pub pool_timeouts: AtomicU64,
    /// Panics caught inside engine steps.
    pub faults: AtomicU64,
    /// When the last one happened, for `/health`.
    pub last_fault: parking_lot::Mutex<Option<Instant>>,
}

impl EngineStats {
    /// Seconds since the last caught fault, if any.
    pub fn seconds_since_fault(&self) -> Option<f64> {
        self.last_fault.lock().map(|t| t.elapsed().as_secs_f64())
    }
}

/// The caller's side of a request: events, and cancellation of single sequences (dropping the
/// handle cancels them all).
pub struct GenHandle {
    pub events: UnboundedReceiver<SeqEvent>,
    cancel: Arc<Vec<AtomicBool>>,
}

impl GenHandle {
    /// Stops sequence `index` at the next step (e.g. a stop string was found in its text).
    pub fn cancel(&self, index: usize) {
        if let Some(c) = self.cancel.get(index) {
            c.store(true, Ordering::Relaxed);
        }
    }
}

enum Command {
    Submit(Box<Pending>),
    Shutdown {
        grace: Duration,
    },
    /// Drops every cached prefix (their state goes back to the pool).
    ClearPrefixCache,
}

struct Pending {
    req: GenRequest,
    tx: UnboundedSender<SeqEvent>,
    cancel: Arc<Vec<AtomicBool>>,
    enqueued: Instant,
}

/// Handle to the engine thread.
pub struct Engine {
    tx: Mutex<mpsc::Sender<Command>>,
    pub stats: Arc<EngineStats>,
    pub config: EngineConfig,
    pub max_context: usize,
    /// What the model's ops run on (`Backend::describe`), for logs.
    pub backend: String,
    thread: Mutex<Option<JoinHandle<()>>>,
    accepting: AtomicBool,
    /// An empty pool, to refuse at once what could never fit.
    empty_pool: StatePool,
}

impl Engine {
    /// Sizes the pool and starts the engine thread.
    pub fn start(model: Arc<Model>, config: EngineConfig) -> Result<Arc<Engine>, EngineStartError> {
        let mut shape = StateShape::of(model.rank_config(), model.ranks().len(), model.cache_replicas());
        // A draft's context rows take pages of the same arena, one per draft layer per pool page.
        let (draft_pages, spec_tokens) = match &config.speculation {
            Some(s) => (s.draft.layers(), s.tokens),
            None => (0, 0),
        };
        shape.page_bytes += draft_pages * 4 * crate::model::state::latent_page_floats(model.rank_config());
        let pool = StatePool::speculative(shape, config.state_memory, config.max_seqs.max(1), 64, spec_tokens)?;
        let stats = Arc::new(EngineStats::default());
        stats.total_slots.store(pool.total_slots, Ordering::Relaxed);
        stats.total_pages.store(pool.total_pages, Ordering::Relaxed);
        let empty_pool = StatePool::speculative(shape, config.state_memory, config.max_seqs.max(1), 64, spec_tokens)?;
        let max_context = model.text_config().max_position_embeddings;
        let backend = match model.ranks().len() {
            1 => model.backend().describe(),
            n => format!(
                "{} · tensor parallel {n} (threads per rank: {})",
                model.backend().describe(),
                model.rank_threads()
            ),
        };
        let (tx, rx) = mpsc::channel();
        // The state arenas: as many KDA slots and latent pages as the pool can grant, set aside now.
        let arenas = model
            .state_arenas_with(pool.total_slots, pool.total_pages, draft_pages)
            .map_err(EngineStartError::StateMemory)?;
        // The step buffers, sized now for the largest step the budget allows.
        model.warm_up(config.max_batched_tokens, config.max_seqs).map_err(EngineStartError::WarmUp)?;
        let worker = step::Worker::new(model, config.clone(), pool, stats.clone(), arenas);
        let thread = std::thread::Builder::new()
            .name("kimi-engine".into())
            .spawn(move || worker.run(rx))
            .map_err(EngineStartError::Thread)?;
        Ok(Arc::new(Engine {
            tx: Mutex::new(tx),
            stats,
            config,
            max_context,
            backend,
            thread: Mutex::new(Some(thread)),
            accepting: AtomicBool::new(true),
            empty_pool,
        }))
    }

    /// Queues a request. Refuses at once when the queue is full, when the request could never
    /// fit the pool, or during shutdown.
    pub fn submit(&self, req: GenRequest) -> Result<GenHandle, EngineError> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(EngineError::ShuttingDown);
        }
        if req.n == 0 || req.prompt.is_empty() {
            return Err(EngineError::Invalid("a request needs a prompt and n ≥ 1".into()));
        }
        let tokens = req.prompt.len().saturating_add(req.max_tokens);
        if !self.empty_pool.could_fit(self.empty_pool.reservation(req.n, req.prompt.len(), req.max_tokens)) {
            return Err(EngineError::TooLarge { tokens, n: req.n });
        }
        if self.stats.waiting.load(Ordering::Relaxed) >= self.config.max_waiting {
            return Err(EngineError::QueueFull);
        }
        let (tx, rx) = unbounded_channel();
        let cancel: Arc<Vec<AtomicBool>> = Arc::new((0..req.n).map(|_| AtomicBool::new(false)).collect());
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let pending = Pending { req, tx, cancel: cancel.clone(), enqueued: Instant::now() };
        let sent = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Submit(Box::new(pending)));
        if sent.is_err() {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::ShuttingDown);
        }
        Ok(GenHandle { events: rx, cancel })
    }

    /// Whether the engine thread is up and admitting work.
    pub fn is_running(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
            && self.thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Drops every cached prefix; their slots and pages go back to the pool (asynchronously:
    /// the engine thread does it before its next step).
    pub fn clear_prefix_cache(&self) {
        let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::ClearPrefixCache);
    }

    /// Stops admitting, lets running sequences finish for up to `grace`, ends the rest with
    /// `ShuttingDown`, and joins the engine thread. Blocking.
    pub fn shutdown(&self, grace: Duration) {
        self.accepting.store(false, Ordering::Relaxed);
        let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Shutdown { grace });
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.accepting.store(false, Ordering::Relaxed);
        let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Shutdown { grace: Duration::ZERO });
    }
}
