//! The host side of every plugin import: per-store state and the implementations of `log`,
//! `metrics`, `tokenizer`, `logits`, `grammar-engine`, `kv`, `rate-limit` and `clock`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use wasmtime::component::{Resource, ResourceTable};
use wasmtime::{ResourceLimiter, StoreLimits};

use super::bindings::host::kimi::host::{
    clock, grammar_engine, kv, log, logits, metrics, rate_limit, tokenizer, types,
};
use super::plugin_metrics::PluginMetricStore;
use super::quota::{LocalQuotas, QuotaStore};
use crate::grammar::GrammarEngine;
use crate::tokenizer::Tokenizer;

/// What the served model offers plugins: logits width, stop tokens, tokenizer.
pub struct PluginEnv {
    pub vocab_size: u32,
    pub eos_tokens: Vec<u32>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The native grammar engine over this tokenizer (when one is loaded).
    pub grammar: Option<Arc<GrammarEngine>>,
}

impl PluginEnv {
    /// An environment with no tokenizer (tests, benches): only the vocabulary width and EOS.
    pub fn bare(vocab_size: u32, eos_tokens: Vec<u32>) -> PluginEnv {
        PluginEnv { vocab_size, eos_tokens, tokenizer: None, grammar: None }
    }

    /// An environment from a tokenizer: vocab = its size, stop token `<|end_of_msg|>`.
    pub fn from_tokenizer(tok: Arc<Tokenizer>, vocab_size: u32) -> PluginEnv {
        let eos = tok.special_id("<|end_of_msg|>").into_iter().collect();
        PluginEnv { vocab_size, eos_tokens: eos, tokenizer: Some(tok), grammar: None }
    }
}

/// Host services scoped to one tenant (plugins of other tenants never reach them).
pub struct TenantServices {
    kv: Mutex<HashMap<String, KvEntry>>,
    /// Rate-limit buckets: this process's, or shared with other replicas (Redis).
    quotas: Arc<dyn QuotaStore>,
    /// The tenant's name: its buckets' scope in the store.
    scope: String,
    on_store_failure: QuotaFailure,
    /// Store failures by outcome, for `/metrics`.
    pub store_failures_allowed: AtomicU64,
    pub store_failures_refused: AtomicU64,
    /// Plugin-defined counters and histograms (capped per tenant).
    pub metrics: PluginMetricStore,
    /// `log.emit` budget per plugin, shared by all its instances (a flood across many requests
    /// is limited as much as one inside a request).
    log_buckets: Mutex<HashMap<String, LogBucket>>,
    /// Plugin log lines dropped by that budget, for `/metrics`.
    pub log_dropped: AtomicU64,
}

struct LogBucket {
    tokens: f64,
    last: Instant,
    dropped: u64,
}

/// Plugin log lines: a burst, then a steady rate, per (tenant, plugin).
pub const LOG_BURST: f64 = 100.0;
pub const LOG_PER_SECOND: f64 = 20.0;

/// Whether a plugin's log line is written.
#[derive(Debug, PartialEq, Eq)]
pub enum LogAdmit {
    /// Write it; `dropped` lines were suppressed since the last one written.
    Emit {
        dropped: u64,
    },
    Drop,
}

/// What a tenant's rate limits do while the shared quota store cannot answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuotaFailure {
    /// Admit (availability first; the replica's own caps still hold).
    #[default]
    Open,
    /// Refuse with 429 until the store is back (budgets first).
    Closed,
}

/// How soon a client refused because the store is down should retry.
const STORE_DOWN_RETRY_MS: u64 = 1000;

impl Default for TenantServices {
    fn default() -> Self {
        TenantServices::new("", Arc::new(LocalQuotas::default()), QuotaFailure::Open)
    }
}

struct KvEntry {
    value: Vec<u8>,
    version: u64,
    expires: Option<Instant>,
}

/// Most keys a tenant may keep, and the largest value.
const KV_MAX_KEYS: usize = 10_000;
const KV_MAX_VALUE: usize = 64 << 10;

impl TenantServices {
    pub fn new(tenant: &str, quotas: Arc<dyn QuotaStore>, on_store_failure: QuotaFailure) -> TenantServices {
        TenantServices {
            kv: Mutex::new(HashMap::new()),
            quotas,
            scope: tenant.to_string(),
            on_store_failure,
            store_failures_allowed: AtomicU64::new(0),
            store_failures_refused: AtomicU64::new(0),
            metrics: PluginMetricStore::default(),
            log_buckets: Mutex::new(HashMap::new()),
            log_dropped: AtomicU64::new(0),
        }
    }

    /// Takes one line from `plugin`'s log budget.
    pub fn log_admit(&self, plugin: &str) -> LogAdmit {
        let mut m = self.log_buckets.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if m.len() >= 1024 && !m.contains_key(plugin) {
            m.retain(|_, b| b.tokens < LOG_BURST);
        }
        let b = m.entry(plugin.to_string()).or_insert(LogBucket { tokens: LOG_BURST, last: now, dropped: 0 });
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * LOG_PER_SECOND).min(LOG_BURST);
        b.last = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            LogAdmit::Emit { dropped: std::mem::take(&mut b.dropped) }
        } else {
            b.dropped += 1;
            self.log_dropped.fetch_add(1, Ordering::Relaxed);
            LogAdmit::Drop
        }
    }

    /// Services with this process's own rate-limit buckets.
    pub fn new_local(tenant: &str) -> TenantServices {
        TenantServices::new(tenant, Arc::new(LocalQuotas::default()), QuotaFailure::Open)
    }

    /// `memory` or `redis`.
    pub fn quota_store(&self) -> &'static str {
        self.quotas.kind()
    }

    pub fn kv_get(&self, key: &str) -> Option<(Vec<u8>, u64)> {
        let mut m = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if m.get(key).is_some_and(|e| e.expires.is_some_and(|t| t <= now)) {
            m.remove(key);
        }
        m.get(key).map(|e| (e.value.clone(), e.version))
    }

    pub fn kv_cas(&self, key: &str, value: Vec<u8>, expected: Option<u64>, ttl_ms: u32) -> bool {
        if value.len() > KV_MAX_VALUE || key.len() > 1024 {
            return false;
        }
        let mut m = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if m.get(key).is_some_and(|e| e.expires.is_some_and(|t| t <= now)) {
            m.remove(key);
        }
        let current = m.get(key).map(|e| e.version);
        if current != expected {
            return false;
        }
        if current.is_none() && m.len() >= KV_MAX_KEYS {
            return false;
        }
        let expires = (ttl_ms > 0).then(|| now + Duration::from_millis(ttl_ms as u64));
        m.insert(key.to_string(), KvEntry { value, version: current.map_or(1, |v| v + 1), expires });
        true
    }

    /// Token bucket: Ok, or milliseconds until `amount` is available. While the store cannot
    /// answer, the tenant's failure policy decides (and the failure is counted).
    pub fn try_acquire(&self, name: &str, amount: u32, per_second: f64, burst: u32) -> Result<(), u64> {
        match self.quotas.try_acquire(&self.scope, name, amount, per_second, burst) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(tenant = %self.scope, error = %e, policy = ?self.on_store_failure, "quota store failed");
                match self.on_store_failure {
                    QuotaFailure::Open => {
                        self.store_failures_allowed.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    QuotaFailure::Closed => {
                        self.store_failures_refused.fetch_add(1, Ordering::Relaxed);
                        Err(STORE_DOWN_RETRY_MS)
                    }
                }
            }
        }
    }

    pub fn release(&self, name: &str, amount: u32) {
        if let Err(e) = self.quotas.release(&self.scope, name, amount) {
            tracing::warn!(tenant = %self.scope, error = %e, "quota store failed on release");
        }
    }
}

/// Marker for the `step-logits` resource; the rows themselves live in [`HostState::step`].
pub struct StepLogits;

/// Borrowed logits rows, valid only while a `sample` call runs (the caller holds the borrow).
#[derive(Default)]
pub struct StepView {
    rows: Vec<(usize, usize)>,
    /// Per-row stats computed once by the host for this step.
    stats: Vec<types::LogitStats>,
    full_access: bool,
}

// SAFETY: the pointers are only dereferenced during the call that set them, on the calling thread.
unsafe impl Send for StepView {}

impl StepView {
    /// # Safety
    /// The rows must stay alive and unmodified until [`StepView::clear`].
    pub unsafe fn set(&mut self, rows: &[&[f32]], stats: Vec<types::LogitStats>, full_access: bool) {
        self.rows = rows.iter().map(|r| (r.as_ptr() as usize, r.len())).collect();
        self.stats = stats;
        self.full_access = full_access;
    }

    pub fn clear(&mut self) {
        self.rows.clear();
        self.stats.clear();
    }

    fn stats(&self, i: u32) -> Option<types::LogitStats> {
        self.stats.get(i as usize).copied()
    }

    fn row(&self, i: u32) -> wasmtime::Result<&[f32]> {
        let &(p, n) =
            self.rows.get(i as usize).ok_or_else(|| wasmtime::format_err!("step-logits row {i} out of range"))?;
        // SAFETY: see `set`.
        Ok(unsafe { std::slice::from_raw_parts(p as *const f32, n) })
    }
}

/// Per-store host state.
pub struct HostState {
    pub limits: StoreLimits,
    pub table: ResourceTable,
    pub env: Arc<PluginEnv>,
    pub tenant: Arc<TenantServices>,
    pub plugin: String,
    pub tenant_name: String,
    pub step: StepView,
    /// Set by the resource limiter when the guest asked for memory past its cap: how a failed
    /// call is told apart as out-of-memory (not by its error text).
    pub memory_cap_hit: bool,
}

impl HostState {
    pub fn new(
        env: Arc<PluginEnv>,
        tenant: Arc<TenantServices>,
        tenant_name: &str,
        plugin: &str,
        limits: StoreLimits,
    ) -> Self {
        HostState {
            limits,
            table: ResourceTable::new(),
            env,
            tenant,
            plugin: plugin.to_string(),
            tenant_name: tenant_name.to_string(),
            step: StepView::default(),
            memory_cap_hit: false,
        }
    }
}

impl ResourceLimiter for HostState {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let r = self.limits.memory_growing(current, desired, maximum);
        if !matches!(r, Ok(true)) {
            self.memory_cap_hit = true;
        }
        r
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

impl types::Host for HostState {}

impl log::Host for HostState {
    fn emit(&mut self, lvl: log::Level, msg: String) -> wasmtime::Result<()> {
        let dropped = match self.tenant.log_admit(&self.plugin) {
            LogAdmit::Emit { dropped } => dropped,
            LogAdmit::Drop => return Ok(()),
        };
        let (tenant, plugin) = (&self.tenant_name, &self.plugin);
        if dropped > 0 {
            tracing::warn!(tenant, plugin, dropped, "plugin log lines dropped (rate limit)");
        }
        let mut msg = msg;
        if msg.len() > 1024 {
            let mut cut = 1024;
            while !msg.is_char_boundary(cut) {
                cut -= 1;
            }
            msg.truncate(cut);
        }
        match lvl {
            log::Level::Debug => tracing::debug!(tenant, plugin, "{msg}"),
            log::Level::Info => tracing::info!(tenant, plugin, "{msg}"),
            log::Level::Warn => tracing::warn!(tenant, plugin, "{msg}"),
            log::Level::Error => tracing::error!(tenant, plugin, "{msg}"),
        }
        Ok(())
    }
}

impl metrics::Host for HostState {
    fn counter_add(&mut self, name: String, value: u64) -> wasmtime::Result<()> {
        self.tenant.metrics.counter_add(&self.plugin, &name, value);
        Ok(())
    }

    fn observe(&mut self, name: String, value: f64) -> wasmtime::Result<()> {
        self.tenant.metrics.observe(&self.plugin, &name, value);
        Ok(())
    }
}

impl tokenizer::Host for HostState {
    fn vocab_size(&mut self) -> wasmtime::Result<u32> {
        Ok(self.env.vocab_size)
    }

    fn eos_tokens(&mut self) -> wasmtime::Result<Vec<u32>> {
        Ok(self.env.eos_tokens.clone())
    }

    fn special_id(&mut self, name: String) -> wasmtime::Result<Option<u32>> {
        Ok(self.env.tokenizer.as_ref().and_then(|t| t.special_id(&name)))
    }

    fn token_bytes(&mut self, ids: Vec<u32>) -> wasmtime::Result<Vec<Vec<u8>>> {
        Ok(ids
            .iter()
            .map(|&i| {
                self.env.tokenizer.as_ref().and_then(|t| t.token_bytes(i)).map(<[u8]>::to_vec).unwrap_or_default()
            })
            .collect())
    }

    fn is_special(&mut self, ids: Vec<u32>) -> wasmtime::Result<Vec<bool>> {
        Ok(ids.iter().map(|&i| self.env.tokenizer.as_ref().is_some_and(|t| t.is_special(i))).collect())
    }

    fn encode(&mut self, text: String) -> wasmtime::Result<Vec<u32>> {
        Ok(self.env.tokenizer.as_ref().map(|t| t.encode_text(&text)).unwrap_or_default())
    }

    fn decode(&mut self, ids: Vec<u32>) -> wasmtime::Result<String> {
        Ok(match &self.env.tokenizer {
            Some(t) => {
                let bytes: Vec<u8> = ids.iter().filter_map(|&i| t.token_bytes(i)).flatten().copied().collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            None => String::new(),
        })
    }
}

fn stats_of(row: &[f32]) -> types::LogitStats {
    use kimi_kernels::cpu::reduce;
    let (argmax, max) = reduce::argmax(row);
    types::LogitStats { max_logit: max, log_sum_exp: reduce::log_sum_exp_with_max(row, max, 1.0), argmax }
}

/// A sampler row's `k` candidates and its stats. The largest candidate is the argmax (same tie
/// and NaN rules), so the row is scanned for the top-k and the log-sum-exp only, not a third time.
pub fn row_candidates_and_stats(row: &[f32], k: usize) -> (types::LogitStats, Vec<(u32, f32)>) {
    use kimi_kernels::cpu::reduce;
    let mut top = reduce::top_k(row, k.max(1));
    let (argmax, max) = top.first().copied().unwrap_or((0, f32::NEG_INFINITY));
    let stats = types::LogitStats { max_logit: max, log_sum_exp: reduce::log_sum_exp_with_max(row, max, 1.0), argmax };
    top.truncate(k);
    (stats, top)
}

impl logits::Host for HostState {}

impl logits::HostStepLogits for HostState {
    fn rows(&mut self, _s: Resource<StepLogits>) -> wasmtime::Result<u32> {
        Ok(self.step.rows.len() as u32)
    }

    fn stats(&mut self, _s: Resource<StepLogits>, row: u32) -> wasmtime::Result<types::LogitStats> {
        match self.step.stats(row) {
            Some(s) => Ok(s),
            None => Ok(stats_of(self.step.row(row)?)),
        }
    }

    fn log_sum_exp(&mut self, _s: Resource<StepLogits>, row: u32, temperature: f32) -> wasmtime::Result<f32> {
        if temperature.is_nan() || temperature <= 0.0 {
            wasmtime::bail!("log-sum-exp: temperature must be > 0");
        }
        let r = self.step.row(row)?;
        Ok(match self.step.stats(row) {
            Some(s) if temperature == 1.0 => s.log_sum_exp,
            Some(s) => kimi_kernels::cpu::reduce::log_sum_exp_with_max(r, s.max_logit, temperature),
            None => kimi_kernels::cpu::reduce::log_sum_exp(r, temperature),
        })
    }

    fn top_k(&mut self, _s: Resource<StepLogits>, row: u32, k: u32) -> wasmtime::Result<types::Candidates> {
        let top = kimi_kernels::cpu::reduce::top_k(self.step.row(row)?, k as usize);
        Ok(types::Candidates { tokens: top.iter().map(|c| c.0).collect(), logits: top.iter().map(|c| c.1).collect() })
    }

    fn gather(&mut self, _s: Resource<StepLogits>, row: u32, ids: Vec<u32>) -> wasmtime::Result<Vec<f32>> {
        let r = self.step.row(row)?;
        Ok(ids.iter().map(|&i| r.get(i as usize).copied().unwrap_or(f32::NAN)).collect())
    }

    fn masked_argmax(
        &mut self,
        _s: Resource<StepLogits>,
        row: u32,
        allowed: Vec<u32>,
    ) -> wasmtime::Result<Option<types::Candidate>> {
        let r = self.step.row(row)?;
        let best = allowed
            .iter()
            .filter_map(|&i| r.get(i as usize).map(|&l| (i, l)))
            .filter(|(_, l)| !l.is_nan())
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        Ok(best.map(|(token, logit)| types::Candidate { token, logit }))
    }

    fn read(&mut self, _s: Resource<StepLogits>, row: u32, start: u32, len: u32) -> wasmtime::Result<Vec<f32>> {
        if !self.step.full_access {
            wasmtime::bail!("step-logits.read: this plugin did not ask for full logits in `describe`");
        }
        let r = self.step.row(row)?;
        let s = (start as usize).min(r.len());
        let e = s.saturating_add(len as usize).min(r.len());
        Ok(r[s..e].to_vec())
    }

    fn drop(&mut self, s: Resource<StepLogits>) -> wasmtime::Result<()> {
        self.table.delete(s)?;
        Ok(())
    }
}

impl grammar_engine::Host for HostState {
    fn validate(&mut self, c: grammar_engine::Constraint) -> wasmtime::Result<Option<String>> {
        if let Some(err) = crate::plugins::grammar_check::validate(&c) {
            return Ok(Some(err));
        }
        Ok(self.env.grammar.as_ref().and_then(|g| g.validate(&c.into())))
    }
}

impl kv::Host for HostState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<(Vec<u8>, u64)>> {
        Ok(self.tenant.kv_get(&key))
    }

    fn compare_and_set(
        &mut self,
        key: String,
        value: Vec<u8>,
        expected: Option<u64>,
        ttl_ms: u32,
    ) -> wasmtime::Result<bool> {
        Ok(self.tenant.kv_cas(&key, value, expected, ttl_ms))
    }
}

impl rate_limit::Host for HostState {
    fn try_acquire(
        &mut self,
        name: String,
        amount: u32,
        per_second: f64,
        burst: u32,
    ) -> wasmtime::Result<Result<(), u64>> {
        Ok(self.tenant.try_acquire(&name, amount, per_second, burst))
    }

    fn release(&mut self, name: String, amount: u32) -> wasmtime::Result<()> {
        self.tenant.release(&name, amount);
        Ok(())
    }
}

impl clock::Host for HostState {
    fn now_ms(&mut self) -> wasmtime::Result<u64> {
        Ok(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_and_stats_agree_with_the_separate_reductions() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rows: Vec<Vec<f32>> = vec![vec![], vec![f32::NAN; 5], vec![1.0, 3.0, 3.0, f32::NAN, -2.0]];
        for n in [17usize, 300, 163_840] {
            rows.push(
                (0..n)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> 40) as f32 / 1e5 - 50.0
                    })
                    .collect(),
            );
        }
        for row in &rows {
            for k in [0usize, 1, 4, 256] {
                let (stats, top) = row_candidates_and_stats(row, k);
                let want = stats_of(row);
                assert_eq!((stats.argmax, stats.max_logit.to_bits()), (want.argmax, want.max_logit.to_bits()));
                assert_eq!(stats.log_sum_exp.to_bits(), want.log_sum_exp.to_bits());
                assert_eq!(top, kimi_kernels::cpu::reduce::top_k(row, k));
            }
        }
    }
}
