//! `/metrics` (Prometheus text format): requests, tokens, latency histograms, queue and pool
//! usage from the engine, per-(tenant, plugin) call time, traps and timeouts, and the
//! plugins' own counters and histograms.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::tenants::{PluginOrigin, Tenant};
use crate::engine::EngineStats;
use crate::plugins::PluginHealth;
use crate::plugins::plugin_metrics::{BUCKETS, Series};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub tenant: String,
    pub endpoint: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub tenant: String,
    pub plugin: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreFailureLabels {
    pub tenant: String,
    /// `allowed` (the tenant fails open) or `refused` (fails closed).
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginMetricLabels {
    tenant: String,
    plugin: String,
    name: String,
}

/// What the plugin-metrics collector exports at the next scrape (set by `render`).
#[derive(Default)]
struct PluginView {
    tenants: Vec<Arc<Tenant>>,
    plugin_names: bool,
}

/// Encodes the plugins' own series at scrape time. A builtin's series are always shown; an
/// uploaded or configured plugin's only with `metrics_plugin_names` (its name, and the names
/// it gives its metrics, are its tenant's business otherwise).
struct PluginMetricsCollector(Arc<parking_lot::Mutex<PluginView>>);

impl std::fmt::Debug for PluginMetricsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PluginMetricsCollector")
    }
}

impl Collector for PluginMetricsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let view = self.0.lock();
        let mut counters = Vec::new();
        let mut histograms = Vec::new();
        let mut dropped = Vec::new();
        for t in &view.tenants {
            let builtins: std::collections::HashSet<String> =
                t.list().into_iter().filter(|p| p.origin == PluginOrigin::Builtin).map(|p| p.name).collect();
            for ((plugin, name), series) in t.services.metrics.snapshot() {
                if !view.plugin_names && !builtins.contains(&plugin) {
                    continue;
                }
                let labels = PluginMetricLabels { tenant: t.name.clone(), plugin, name };
                match series {
                    Series::Counter(v) => counters.push((labels, v)),
                    Series::Histogram { buckets, sum, count } => histograms.push((labels, buckets, sum, count)),
                }
            }
            let n = t.services.metrics.dropped.load(Ordering::Relaxed);
            if n > 0 {
                dropped.push((TenantLabels { tenant: t.name.clone() }, n));
            }
        }
        if !counters.is_empty() {
            let mut m = encoder.encode_descriptor(
                "plugin_counter",
                "Counters defined by plugins",
                None,
                MetricType::Counter,
            )?;
            for (labels, v) in &counters {
                m.encode_family(labels)?.encode_counter::<NoLabelSet, u64, u64>(v, None)?;
            }
        }
        if !histograms.is_empty() {
            let mut m = encoder.encode_descriptor(
                "plugin_histogram",
                "Histograms defined by plugins",
                None,
                MetricType::Histogram,
            )?;
            for (labels, buckets, sum, count) in &histograms {
                let bounds: Vec<(f64, u64)> =
                    BUCKETS.iter().copied().chain([f64::MAX]).zip(buckets.iter().copied()).collect();
                m.encode_family(labels)?.encode_histogram::<NoLabelSet>(*sum, *count, &bounds, None)?;
            }
        }
        if !dropped.is_empty() {
            let mut m = encoder.encode_descriptor(
                "plugin_metric_updates_dropped",
                "Plugin metric updates refused (series cap per tenant, name too long, or kind clash)",
                None,
                MetricType::Counter,
            )?;
            for (labels, v) in &dropped {
                m.encode_family(labels)?.encode_counter::<NoLabelSet, u64, u64>(v, None)?;
            }
        }
        Ok(())
    }
}

pub struct Metrics {
    registry: Registry,
    plugin_view: Arc<parking_lot::Mutex<PluginView>>,
    /// One scrape at a time (the plugin view is set for the scrape that encodes it).
    render_lock: parking_lot::Mutex<()>,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Family<TenantLabels, Counter>,
    pub completion_tokens: Family<TenantLabels, Counter>,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub request_seconds: Histogram,
    queue_depth: Gauge,
    running_requests: Gauge,
    running_seqs: Gauge,
    slots_used: Gauge,
    slots_total: Gauge,
    pages_used: Gauge,
    pages_total: Gauge,
    state_bytes_used: Gauge,
    spec_mean_accepted: Gauge<f64, std::sync::atomic::AtomicU64>,
    steps: Counter,
    prefill_tokens: Counter,
    decode_tokens: Counter,
    spec_rounds: Counter,
    prefix_hits: Counter,
    prefix_hit_tokens: Counter,
    prefix_inserted: Counter,
    prefix_evictions: Counter,
    prefix_entries: Gauge,
    prefix_bytes: Gauge,
    spec_proposed: Counter,
    spec_accepted: Counter,
    vision_calls: Counter,
    vision_items: Counter,
    vision_patches: Counter,
    vision_seconds: Counter<f64, AtomicU64>,
    cancelled: Counter,
    pool_timeouts: Counter,
    faults: Counter,
    plugin_calls: Family<PluginLabels, Counter>,
    plugin_seconds: Family<PluginLabels, Counter<f64, AtomicU64>>,
    plugin_traps: Family<PluginLabels, Counter>,
    plugin_timeouts: Family<PluginLabels, Counter>,
    plugin_failures: Family<PluginLabels, Counter>,
    plugin_disabled: Family<PluginLabels, Gauge>,
    quota_store_failures: Family<StoreFailureLabels, Counter>,
}

/// One label set's plugin figures (several plugins when names are hidden).
#[derive(Default)]
struct PluginTotals {
    calls: u64,
    nanos: u64,
    traps: u64,
    timeouts: u64,
    failures: u64,
    disabled: i64,
}

impl PluginTotals {
    fn add(&mut self, h: &PluginHealth) {
        self.calls += h.calls.load(Ordering::Relaxed);
        self.nanos += h.call_nanos.load(Ordering::Relaxed);
        self.traps += h.traps.load(Ordering::Relaxed);
        self.timeouts += h.timeouts.load(Ordering::Relaxed);
        self.failures += h.failures.load(Ordering::Relaxed);
        self.disabled += i64::from(h.is_open());
    }
}

/// Brings a counter up to an externally kept monotonic total.
fn sync(c: &Counter, total: u64) {
    let cur = c.get();
    if total > cur {
        c.inc_by(total - cur);
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("kimi");
        let requests = Family::<RequestLabels, Counter>::default();
        r.register("requests", "HTTP requests by tenant, endpoint and status", requests.clone());
        let prompt_tokens = Family::<TenantLabels, Counter>::default();
        r.register("prompt_tokens", "Prompt tokens processed", prompt_tokens.clone());
        let completion_tokens = Family::<TenantLabels, Counter>::default();
        r.register("completion_tokens", "Tokens generated", completion_tokens.clone());
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        r.register("time_to_first_token_seconds", "Request arrival to first generated token", ttft.clone());
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        r.register("inter_token_seconds", "Time between generated tokens of a sequence", inter_token.clone());
        let request_seconds = Histogram::new(exponential_buckets(0.005, 2.0, 16));
        r.register("request_duration_seconds", "Request arrival to its last byte", request_seconds.clone());
        let g = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let queue_depth = g(&mut r, "queue_depth", "Requests waiting for sequence state");
        let running_requests = g(&mut r, "running_requests", "Requests holding sequence state");
        let running_seqs = g(&mut r, "running_sequences", "Sequences being generated");
        let slots_used = g(&mut r, "pool_slots_used", "KDA state slots in use");
        let slots_total = g(&mut r, "pool_slots_total", "KDA state slots in the pool");
        let pages_used = g(&mut r, "pool_pages_used", "Latent-cache pages in use");
        let pages_total = g(&mut r, "pool_pages_total", "Latent-cache pages in the pool");
        let state_bytes_used = g(&mut r, "pool_bytes_used", "Sequence-state bytes reserved");
        let prefix_entries = g(&mut r, "prefix_cache_entries", "Prefix states held");
        let prefix_bytes = g(&mut r, "prefix_cache_bytes", "Pool bytes reserved by cached prefix states");
        let spec_mean_accepted = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        r.register(
            "engine_spec_mean_accepted_tokens",
            "Mean draft tokens accepted per speculative verify since start",
            spec_mean_accepted.clone(),
        );
        let c = |r: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            r.register(name, help, c.clone());
            c
        };
        let steps = c(&mut r, "engine_steps", "Engine steps run");
        let prefill_tokens = c(&mut r, "engine_prefill_tokens", "Prompt tokens run through the model");
        let decode_tokens = c(&mut r, "engine_decode_tokens", "Decode tokens run through the model");
        let spec_rounds = c(
            &mut r,
            "engine_spec_verify_rounds",
            "Speculative verify steps (one per sequence and step that proposed)",
        );
        let spec_proposed = c(&mut r, "engine_spec_proposed_tokens", "Draft tokens proposed for verification");
        let prefix_hits = c(&mut r, "prefix_cache_hits", "Requests that started from a cached prompt prefix");
        let prefix_hit_tokens = c(&mut r, "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache");
        let prefix_inserted = c(&mut r, "prefix_cache_stored", "Prefix states stored (KDA snapshot + shared pages)");
        let prefix_evictions = c(&mut r, "prefix_cache_evictions", "Prefix states evicted (least recently used first)");
        let spec_accepted = c(
            &mut r,
            "engine_spec_accepted_tokens",
            "Draft tokens accepted; mean accept length = accepted / verify rounds",
        );
        let vision_calls =
            c(&mut r, "engine_vision_calls", "Vision tower calls (one per step with images, batched across requests)");
        let vision_items = c(&mut r, "engine_vision_images", "Images (and clips) run through the vision tower");
        let vision_patches = c(&mut r, "engine_vision_patches", "Vision tower patches (after the release resize)");
        let vision_seconds = Counter::<f64, AtomicU64>::default();
        r.register("engine_vision_seconds", "Time in the vision tower and projector", vision_seconds.clone());
        let cancelled = c(&mut r, "engine_cancelled_requests", "Requests freed because the client left");
        let pool_timeouts = c(&mut r, "engine_pool_timeouts", "Requests refused after waiting for state");
        let faults = c(&mut r, "engine_faults", "Panics caught inside engine steps (their requests failed)");
        let plugin_calls = Family::<PluginLabels, Counter>::default();
        r.register("plugin_calls", "Plugin calls", plugin_calls.clone());
        let plugin_seconds = Family::<PluginLabels, Counter<f64, AtomicU64>>::default();
        r.register("plugin_call_seconds", "Time spent in plugin calls", plugin_seconds.clone());
        let plugin_traps = Family::<PluginLabels, Counter>::default();
        r.register("plugin_traps", "Plugin traps (panics, out of memory, bad results)", plugin_traps.clone());
        let plugin_timeouts = Family::<PluginLabels, Counter>::default();
        r.register("plugin_timeouts", "Plugin calls that ran past their deadline", plugin_timeouts.clone());
        let plugin_failures = Family::<PluginLabels, Counter>::default();
        r.register("plugin_failures", "Failed plugin calls of any cause", plugin_failures.clone());
        let plugin_disabled = Family::<PluginLabels, Gauge>::default();
        r.register("plugin_disabled", "1 when repeated failures disabled the plugin", plugin_disabled.clone());
        let quota_store_failures = Family::<StoreFailureLabels, Counter>::default();
        r.register(
            "quota_store_failures",
            "Rate-limit checks the shared quota store could not answer, by what the tenant's policy did",
            quota_store_failures.clone(),
        );
        let plugin_view = Arc::new(parking_lot::Mutex::new(PluginView::default()));
        r.register_collector(Box::new(PluginMetricsCollector(plugin_view.clone())));
        Metrics {
            registry: r,
            plugin_view,
            render_lock: parking_lot::Mutex::new(()),
            requests,
            prompt_tokens,
            completion_tokens,
            ttft,
            inter_token,
            request_seconds,
            queue_depth,
            running_requests,
            running_seqs,
            slots_used,
            slots_total,
            pages_used,
            pages_total,
            state_bytes_used,
            spec_mean_accepted,
            steps,
            prefill_tokens,
            decode_tokens,
            spec_rounds,
            prefix_hits,
            prefix_hit_tokens,
            prefix_inserted,
            prefix_evictions,
            prefix_entries,
            prefix_bytes,
            spec_proposed,
            spec_accepted,
            vision_calls,
            vision_items,
            vision_patches,
            vision_seconds,
            cancelled,
            pool_timeouts,
            faults,
            plugin_calls,
            plugin_seconds,
            plugin_traps,
            plugin_timeouts,
            plugin_failures,
            plugin_disabled,
            quota_store_failures,
        }
    }

    pub fn request(&self, tenant: &str, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                tenant: tenant.into(),
                endpoint: endpoint.into(),
                status: status.to_string(),
            })
            .inc();
    }

    fn plugin(&self, l: &PluginLabels, t: &PluginTotals) {
        sync(&self.plugin_calls.get_or_create(l), t.calls);
        let secs = t.nanos as f64 * 1e-9;
        let c = self.plugin_seconds.get_or_create(l);
        if secs > c.get() {
            c.inc_by(secs - c.get());
        }
        sync(&self.plugin_traps.get_or_create(l), t.traps);
        sync(&self.plugin_timeouts.get_or_create(l), t.timeouts);
        sync(&self.plugin_failures.get_or_create(l), t.failures);
        self.plugin_disabled.get_or_create(l).set(t.disabled);
    }

    /// The exposition text, with engine and plugin figures read now. Unless `plugin_names`,
    /// a tenant's uploaded and configured plugins are summed per kind under `upload` /
    /// `configured`, so an open `/metrics` never shows one tenant's plugin names to another.
    pub fn render(&self, stats: &EngineStats, tenants: &[Arc<Tenant>], plugin_names: bool) -> String {
        let _one_at_a_time = self.render_lock.lock();
        let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as i64;
        self.queue_depth.set(load(&stats.waiting));
        self.running_requests.set(load(&stats.running_requests));
        self.running_seqs.set(load(&stats.running_seqs));
        self.slots_used.set(load(&stats.used_slots));
        self.slots_total.set(load(&stats.total_slots));
        self.pages_used.set(load(&stats.used_pages));
        self.pages_total.set(load(&stats.total_pages));
        self.state_bytes_used.set(load(&stats.used_bytes));
        let rounds = stats.spec_rounds.load(Ordering::Relaxed);
        if rounds > 0 {
            self.spec_mean_accepted.set(stats.spec_accepted.load(Ordering::Relaxed) as f64 / rounds as f64);
        }
        sync(&self.steps, stats.steps.load(Ordering::Relaxed));
        sync(&self.prefill_tokens, stats.prefill_tokens.load(Ordering::Relaxed));
        sync(&self.decode_tokens, stats.decode_tokens.load(Ordering::Relaxed));
        sync(&self.spec_rounds, stats.spec_rounds.load(Ordering::Relaxed));
        sync(&self.prefix_hits, stats.prefix_hits.load(Ordering::Relaxed));
        sync(&self.prefix_hit_tokens, stats.prefix_hit_tokens.load(Ordering::Relaxed));
        sync(&self.prefix_inserted, stats.prefix_inserted.load(Ordering::Relaxed));
        sync(&self.prefix_evictions, stats.prefix_evictions.load(Ordering::Relaxed));
        self.prefix_entries.set(load(&stats.prefix_entries));
        self.prefix_bytes.set(load(&stats.prefix_bytes));
        sync(&self.spec_proposed, stats.spec_proposed.load(Ordering::Relaxed));
        sync(&self.spec_accepted, stats.spec_accepted.load(Ordering::Relaxed));
        sync(&self.vision_calls, stats.vision_calls.load(Ordering::Relaxed));
        sync(&self.vision_items, stats.vision_items.load(Ordering::Relaxed));
        sync(&self.vision_patches, stats.vision_patches.load(Ordering::Relaxed));
        let secs = stats.vision_micros.load(Ordering::Relaxed) as f64 * 1e-6;
        if secs > self.vision_seconds.get() {
            self.vision_seconds.inc_by(secs - self.vision_seconds.get());
        }
        sync(&self.cancelled, stats.cancelled.load(Ordering::Relaxed));
        sync(&self.pool_timeouts, stats.pool_timeouts.load(Ordering::Relaxed));
        sync(&self.faults, stats.faults.load(Ordering::Relaxed));
        let mut totals: std::collections::BTreeMap<(String, String, String), PluginTotals> = Default::default();
        for t in tenants {
            for p in t.list() {
                let shown = match p.origin {
                    _ if plugin_names => p.name.clone(),
                    PluginOrigin::Builtin => p.name.clone(),
                    other => other.name().to_string(),
                };
                let key = (t.name.clone(), shown, p.plugin.kind().name().to_string());
                totals.entry(key).or_default().add(&p.health);
            }
        }
        for t in tenants {
            for (outcome, n) in
                [("allowed", &t.services.store_failures_allowed), ("refused", &t.services.store_failures_refused)]
            {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    let l = StoreFailureLabels { tenant: t.name.clone(), outcome: outcome.into() };
                    sync(&self.quota_store_failures.get_or_create(&l), n);
                }
            }
        }
        for ((tenant, plugin, kind), t) in totals {
            self.plugin(&PluginLabels { tenant, plugin, kind }, &t);
        }
        *self.plugin_view.lock() = PluginView { tenants: tenants.to_vec(), plugin_names };
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        self.plugin_view.lock().tenants.clear();
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
