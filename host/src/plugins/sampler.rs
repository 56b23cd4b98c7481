//! Sampler plugins: one instance per (tenant, plugin), per-sequence state in `sequence`
//! resources, one batched `sample` call per engine step with the logits kept on the host.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::Store;
use wasmtime::component::{InstancePre, Resource, ResourceAny};

use super::bindings::host::kimi::host::types::{Candidates, LogitStats, PluginError as GuestError, RequestInfo};
use super::bindings::sampler::exports::kimi::host::sampler_plugin::{self, Capabilities, Row};
use super::bindings::sampler::exports::kimi::host::speculation::{self, SpecRow};
use super::error::PluginError;
use super::health::PluginHealth;
use super::host::{HostState, PluginEnv, StepLogits, TenantServices, row_candidates_and_stats};
use super::runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime, set_deadline};
use crate::engine::{Sampler as EngineSampler, SamplerError, SamplerErrorKind, SamplerRequest, SamplerSeq};

/// A loaded sampler component, ready to instantiate cheaply.
pub struct SamplerPlugin {
    pub name: String,
    pre: InstancePre<HostState>,
    /// The `sampler-plugin` export, looked up once.
    guest: sampler_plugin::GuestIndices,
    /// The optional `speculation` export.
    speculation: Option<speculation::GuestIndices>,
    runtime: Arc<PluginRuntime>,
    pub limits: KindLimits,
    /// A builtin (see `PluginHealth::trusted`).
    pub trusted: bool,
}

impl SamplerPlugin {
    pub fn new(runtime: Arc<PluginRuntime>, compiled: &CompiledPlugin) -> Result<SamplerPlugin, PluginError> {
        if compiled.kind != PluginKind::Sampler {
            return Err(PluginError::Rejected {
                plugin: compiled.name.clone(),
                reason: format!("is a {} plugin, not a sampler", compiled.kind.name()),
            });
        }
        let linker = runtime.linker(PluginKind::Sampler, &compiled.component)?;
        let pre = linker
            .instantiate_pre(&compiled.component)
            .map_err(|e| PluginError::Rejected { plugin: compiled.name.clone(), reason: format!("{e:#}") })?;
        // Interface by interface rather than the whole `speculative-sampler` world, so a plain
        // `sampler` component (no `speculation` export) loads too.
        let rejected = |e: wasmtime::Error| PluginError::Rejected {
            plugin: compiled.name.clone(),
            reason: format!("does not match the sampler world: {e:#}"),
        };
        let guest = sampler_plugin::GuestIndices::new(&pre).map_err(rejected)?;
        let exports_speculation = compiled.exports.contains(&super::runtime::speculation_export());
        let speculation =
            if exports_speculation { Some(speculation::GuestIndices::new(&pre).map_err(rejected)?) } else { None };
        Ok(SamplerPlugin {
            name: compiled.name.clone(),
            pre,
            guest,
            speculation,
            runtime,
            limits: PluginKind::Sampler.default_limits(),
            trusted: compiled.trusted,
        })
    }

    /// Whether the component exports `speculation`.
    pub fn describes_distributions(&self) -> bool {
        self.speculation.is_some()
    }

    pub fn with_limits(mut self, limits: KindLimits) -> Self {
        self.limits = limits;
        self
    }

    /// A fresh instance for one tenant (its own store, memory and state).
    pub fn instantiate(
        &self,
        env: Arc<PluginEnv>,
        tenant: Arc<TenantServices>,
        tenant_name: &str,
    ) -> Result<SamplerInstance, PluginError> {
        let mut store = self.runtime.store(PluginKind::Sampler, self.limits, env, tenant, tenant_name, &self.name);
        let loaded = (|| {
            let instance = self.pre.instantiate(&mut store)?;
            let guest = self.guest.load(&mut store, &instance)?;
            let speculation = self.speculation.as_ref().map(|i| i.load(&mut store, &instance)).transpose()?;
            let caps = guest.call_describe(&mut store)?;
            Ok((guest, speculation, caps))
        })();
        let (guest, speculation, caps) = loaded.map_err(|e| call_error(&self.name, &self.limits, e, store.data()))?;
        Ok(SamplerInstance {
            name: self.name.clone(),
            store,
            guest,
            speculation,
            caps,
            limits: self.limits,
            poisoned: false,
            last_call: std::time::Duration::ZERO,
        })
    }
}

/// A sequence's state inside a sampler instance.
pub struct SeqHandle(ResourceAny);

pub struct SamplerInstance {
    pub name: String,
    store: Store<HostState>,
    guest: sampler_plugin::Guest,
    speculation: Option<speculation::Guest>,
    pub caps: Capabilities,
    limits: KindLimits,
    poisoned: bool,
    last_call: std::time::Duration,
}

/// Maps a wasmtime error from a call to a plugin error naming the plugin. `state`: the store's
/// host state, whose limiter recorded whether the guest ran into its memory cap.
pub fn call_error(plugin: &str, limits: &KindLimits, e: wasmtime::Error, state: &HostState) -> PluginError {
    if let Some(trap) = e.downcast_ref::<wasmtime::Trap>()
        && *trap == wasmtime::Trap::Interrupt
    {
        return PluginError::Timeout { plugin: plugin.to_string(), ms: limits.call.as_millis() };
    }
    let msg = format!("{e:#}");
    if state.memory_cap_hit {
        return PluginError::OutOfMemory { plugin: plugin.to_string(), mib: limits.memory_bytes >> 20 };
    }
    PluginError::Trap { plugin: plugin.to_string(), msg: first_line(&msg) }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).chars().take(300).collect()
}

fn guest_error(plugin: &str, e: GuestError) -> PluginError {
    let client = !matches!(e, GuestError::Internal(_));
    let msg = match e {
        GuestError::BadConfig(m) => format!("bad parameters: {m}"),
        GuestError::Unsupported(m) => format!("unsupported: {m}"),
        GuestError::Rejected(m) => format!("rejected: {m}"),
        GuestError::Internal(m) => m,
    };
    PluginError::Guest { plugin: plugin.to_string(), msg, client }
}

impl SamplerInstance {
    /// Duration of the guest part of the last `sample` call (host preparation excluded).
    pub fn last_call_time(&self) -> std::time::Duration {
        self.last_call
    }

    /// True after a trap: the instance must be discarded.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    fn guard<T>(&mut self, r: wasmtime::Result<T>) -> Result<T, PluginError> {
        r.map_err(|e| {
            self.poisoned = true;
            call_error(&self.name, &self.limits, e, self.store.data())
        })
    }

    fn arm(&mut self) -> Result<(), PluginError> {
        if self.poisoned {
            return Err(PluginError::Trap {
                plugin: self.name.clone(),
                msg: "instance was discarded after a failure".into(),
            });
        }
        set_deadline(&mut self.store, self.limits.call);
        Ok(())
    }

    pub fn create_sequence(
        &mut self,
        req: &RequestInfo,
        params_json: &str,
        seed: u64,
    ) -> Result<SeqHandle, PluginError> {
        self.arm()?;
        let r = self.guest.sequence().call_create(&mut self.store, req, params_json, seed);
        match self.guard(r)? {
            Ok(h) => Ok(SeqHandle(h)),
            Err(e) => Err(guest_error(&self.name, e)),
        }
    }

    pub fn accept(&mut self, seq: &SeqHandle, ids: &[u32]) -> Result<(), PluginError> {
        self.arm()?;
        let r = self.guest.sequence().call_accept(&mut self.store, seq.0, ids);
        self.guard(r)
    }

    pub fn rollback(&mut self, seq: &SeqHandle, n: u32) -> Result<(), PluginError> {
        self.arm()?;
        let r = self.guest.sequence().call_rollback(&mut self.store, seq.0, n);
        self.guard(r)
    }

    pub fn fork(&mut self, seq: &SeqHandle, seed: u64) -> Result<SeqHandle, PluginError> {
        self.arm()?;
        let r = self.guest.sequence().call_fork(&mut self.store, seq.0, seed);
        self.guard(r).map(SeqHandle)
    }

    /// Frees a sequence's state in the guest.
    pub fn drop_sequence(&mut self, seq: SeqHandle) -> Result<(), PluginError> {
        if self.poisoned {
            return Ok(());
        }
        set_deadline(&mut self.store, self.limits.call);
        let r = seq.0.resource_drop(&mut self.store);
        self.guard(r)
    }

    /// Candidates and stats for each row (host work over the full rows; in parallel when the
    /// rows are large enough for the hand-off to pay).
    fn prepare(&self, rows: &[&[f32]]) -> Vec<(LogitStats, Candidates)> {
        let k = self.caps.max_candidates as usize;
        let prep = |logits: &[f32]| {
            let (st, cands) = row_candidates_and_stats(logits, k);
            (
                st,
                Candidates { tokens: cands.iter().map(|c| c.0).collect(), logits: cands.iter().map(|c| c.1).collect() },
            )
        };
        let total: usize = rows.iter().map(|r| r.len()).sum();
        if rows.len() > 1 && total >= 1 << 18 {
            use rayon::prelude::*;
            rows.par_iter().map(|r| prep(r)).collect()
        } else {
            rows.iter().map(|r| prep(r)).collect()
        }
    }

    /// Runs `call` with the rows behind a `step-logits` resource, under the call deadline (which
    /// covers the guest's work only, not the host's preparation); records the guest time.
    fn with_step_logits<R>(
        &mut self,
        rows: &[&[f32]],
        stats: Vec<LogitStats>,
        health: Option<&PluginHealth>,
        call: impl FnOnce(&mut Self, Resource<StepLogits>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        // SAFETY: `rows` outlive this call, and the rows are cleared before it returns.
        unsafe { self.store.data_mut().step.set(rows, stats, self.caps.full_logits) };
        let handle: Resource<StepLogits> = match self.store.data_mut().table.push(StepLogits) {
            Ok(h) => h,
            Err(e) => {
                self.store.data_mut().step.clear();
                return Err(PluginError::Runtime(format!("resource table: {e}")));
            }
        };
        let rep = handle.rep();
        set_deadline(&mut self.store, self.limits.call);
        let t = Instant::now();
        let r = call(self, Resource::new_borrow(rep));
        let elapsed = t.elapsed();
        self.last_call = elapsed;
        self.store.data_mut().step.clear();
        let _ = self.store.data_mut().table.delete(handle);
        if let Some(h) = health {
            h.record_call(elapsed);
        }
        self.guard(r)
    }

    /// One engine step: for each (sequence, logits row) a token, or an error for that sequence.
    /// A trap or timeout fails the whole call (and poisons the instance).
    pub fn sample(
        &mut self,
        rows: &[(&SeqHandle, &[f32])],
        health: Option<&PluginHealth>,
    ) -> Result<Vec<Result<u32, PluginError>>, PluginError> {
        self.arm()?;
        let vocab = self.store.data().env.vocab_size;
        let slices: Vec<&[f32]> = rows.iter().map(|r| r.1).collect();
        let prepared = self.prepare(&slices);
        let stats: Vec<_> = prepared.iter().map(|p| p.0).collect();
        let wit_rows: Vec<Row> = rows
            .iter()
            .zip(prepared)
            .map(|((seq, _), (stats, candidates))| Row { seq: seq.0, candidates, stats })
            .collect();
        let out = self.with_step_logits(&slices, stats, health, |me, logits| {
            me.guest.call_sample(&mut me.store, &wit_rows, logits)
        })?;
        if out.len() != rows.len() {
            self.poisoned = true;
            return Err(PluginError::BadReturn {
                plugin: self.name.clone(),
                msg: format!("`sample` returned {} results for {} rows", out.len(), rows.len()),
            });
        }
        Ok(out
            .into_iter()
            .map(|r| match r {
                Ok(id) if id < vocab => Ok(id),
                Ok(id) => Err(PluginError::BadReturn {
                    plugin: self.name.clone(),
                    msg: format!("token id {id} is outside the vocabulary ({vocab})"),
                }),
                Err(e) => Err(guest_error(&self.name, e)),
            })
            .collect())
    }

    /// Whether this sampler exports `speculation`.
    pub fn describes_distributions(&self) -> bool {
        self.speculation.is_some()
    }

    /// The sampler's distributions for rows of one sequence (`rows[i]`: how many of `drafts`
    /// precede it, and its logits), as whole-vocabulary probability rows. `Ok(None)`: the
    /// sampler does not describe these (no `speculation` export, or it answered `unsupported`).
    /// A trap, a timeout or a malformed answer is an error and poisons the instance.
    pub fn distributions(
        &mut self,
        seq: &SeqHandle,
        drafts: &[u32],
        rows: &[(usize, &[f32])],
        health: Option<&PluginHealth>,
    ) -> Result<Option<Vec<Vec<f32>>>, PluginError> {
        if self.speculation.is_none() {
            return Ok(None);
        }
        self.arm()?;
        let vocab = self.store.data().env.vocab_size;
        let slices: Vec<&[f32]> = rows.iter().map(|r| r.1).collect();
        let prepared = self.prepare(&slices);
        let stats: Vec<_> = prepared.iter().map(|p| p.0).collect();
        let wit_rows: Vec<SpecRow> = rows
            .iter()
            .zip(prepared)
            .map(|(&(before, _), (stats, candidates))| SpecRow { drafts_before: before as u32, candidates, stats })
            .collect();
        let answer = self.with_step_logits(&slices, stats, health, |me, logits| match &me.speculation {
            Some(g) => g.call_distributions(&mut me.store, seq.0, drafts, &wit_rows, logits),
            None => Ok(Err(GuestError::Unsupported("no speculation export".into()))),
        })?;
        let ds = match answer {
            Ok(ds) => ds,
            Err(GuestError::Unsupported(_)) => return Ok(None),
            Err(e) => return Err(guest_error(&self.name, e)),
        };
        let bad = |me: &mut Self, msg: String| {
            me.poisoned = true;
            Err(PluginError::BadReturn { plugin: me.name.clone(), msg })
        };
        if ds.len() != rows.len() {
            return bad(self, format!("`distributions` returned {} rows for {}", ds.len(), rows.len()));
        }
        let mut out = Vec::with_capacity(ds.len());
        for (d, (_, logits)) in ds.into_iter().zip(rows) {
            let tail = d.tail.map(|t| kimi_sampling_core::Tail { temperature: t.temperature, log_z: t.log_z });
            if tail.is_some_and(|t| !(t.temperature > 0.0 && t.log_z.is_finite())) {
                return bad(self, "a tail needs a positive temperature and a finite log-z".into());
            }
            if d.tokens.len() != d.probs.len()
                || d.tokens.iter().any(|&t| t >= vocab)
                || d.probs.iter().any(|p| !(p.is_finite() && *p >= 0.0))
            {
                return bad(self, "a distribution's tokens and probabilities do not match the vocabulary".into());
            }
            let mut dense = kimi_sampling_core::Distribution { tokens: d.tokens, probs: d.probs, tail }.dense(logits);
            // A tail over a masked row leaves out the masked tokens; a distribution must still
            // put its mass where the row allows it.
            let mass: f64 =
                dense.iter().zip(*logits).filter(|(_, l)| **l > f32::NEG_INFINITY).map(|(p, _)| *p as f64).sum();
            let total: f64 = dense.iter().map(|&p| p as f64).sum();
            if !(mass > 0.98 && total < 1.02) {
                return bad(
                    self,
                    format!("a distribution's probabilities sum to {total:.4} ({mass:.4} on allowed tokens)"),
                );
            }
            dense
                .iter_mut()
                .zip(*logits)
                .for_each(|(p, l)| *p = if *l > f32::NEG_INFINITY { (*p as f64 / mass) as f32 } else { 0.0 });
            out.push(dense);
        }
        Ok(Some(out))
    }
}

/// One tenant's use of one sampler plugin: a live instance (re-created after a failure) and the
/// circuit breaker that disables the plugin for this tenant after repeated failures.
pub struct TenantSampler {
    pub plugin: Arc<SamplerPlugin>,
    pub health: Arc<PluginHealth>,
    env: Arc<PluginEnv>,
    services: Arc<TenantServices>,
    tenant: String,
    instance: Option<SamplerInstance>,
    /// Bumped for every new instance: sequence handles from an older one are void.
    generation: u64,
    /// The engine's open sequences: the instance generation that holds each, and its handle.
    open: std::collections::HashMap<u64, (u64, SeqHandle)>,
    next_seq: u64,
}

impl TenantSampler {
    pub fn new(plugin: Arc<SamplerPlugin>, env: Arc<PluginEnv>, services: Arc<TenantServices>, tenant: &str) -> Self {
        TenantSampler {
            health: Arc::new(PluginHealth::new(plugin.trusted)),
            plugin,
            env,
            services,
            tenant: tenant.to_string(),
            instance: None,
            generation: 0,
            open: std::collections::HashMap::new(),
            next_seq: 0,
        }
    }

    /// The live instance, instantiating a fresh one if there is none or the last one failed.
    pub fn instance(&mut self) -> Result<&mut SamplerInstance, PluginError> {
        if self.health.is_disabled() {
            return Err(PluginError::Disabled { plugin: self.plugin.name.clone() });
        }
        if self.instance.as_ref().is_none_or(|i| i.is_poisoned()) {
            self.instance = None;
            match self.plugin.instantiate(self.env.clone(), self.services.clone(), &self.tenant) {
                Ok(i) => {
                    self.instance = Some(i);
                    self.generation += 1;
                }
                Err(e) => {
                    // Instantiation takes no request input: always a strike.
                    self.health.record_failure(true, matches!(e, PluginError::Timeout { .. }));
                    return Err(e);
                }
            }
        }
        self.instance.as_mut().ok_or_else(|| PluginError::Runtime("no sampler instance".into()))
    }

    /// Which instance handles belong to (see `instance`); call after `instance()`.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Records the outcome of a call for the circuit breaker; a trusted sampler's request-caused
    /// failures come back as the request's error (see `PluginHealth::failed`).
    pub fn judge<T>(&self, r: Result<T, PluginError>) -> Result<T, PluginError> {
        match r {
            Ok(v) => {
                self.health.record_success();
                Ok(v)
            }
            Err(e) => Err(self.health.failed(e)),
        }
    }
}

/// A plugin failure as the engine's sampler error (which decides the HTTP status).
fn sampler_error(e: PluginError) -> SamplerError {
    let kind = match &e {
        PluginError::Guest { client: true, .. } => SamplerErrorKind::Request,
        PluginError::RequestTooLarge { .. } => SamplerErrorKind::TooLarge,
        PluginError::Disabled { .. } => SamplerErrorKind::Disabled,
        _ => SamplerErrorKind::Internal,
    };
    SamplerError { kind, message: e.to_string() }
}

impl TenantSampler {
    /// The live instance if it is the one that holds `seq` (never a fresh one: a new instance
    /// has none of the old one's sequences).
    fn holder(&mut self, seq: SamplerSeq) -> Option<(&mut SamplerInstance, SeqHandle)> {
        let (generation, h) = self.open.get(&seq.0)?;
        let h = SeqHandle(h.0);
        let inst = self.instance.as_mut().filter(|i| !i.is_poisoned() && *generation == self.generation)?;
        Some((inst, h))
    }
}

impl EngineSampler for TenantSampler {
    fn name(&self) -> &str {
        &self.plugin.name
    }

    fn open(
        &mut self,
        req: &SamplerRequest,
        params_json: &str,
        seed: u64,
        prompt: &[u32],
    ) -> Result<SamplerSeq, SamplerError> {
        let info = RequestInfo {
            tenant: req.tenant.clone(),
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            params_json: req.params_json.clone(),
        };
        let created = (|| {
            let inst = self.instance()?;
            let h = inst.create_sequence(&info, params_json, seed)?;
            inst.accept(&h, prompt)?;
            Ok(h)
        })();
        let h = self.judge(created).map_err(sampler_error)?;
        self.next_seq += 1;
        self.open.insert(self.next_seq, (self.generation, h));
        Ok(SamplerSeq(self.next_seq))
    }

    fn sample(&mut self, rows: &[(SamplerSeq, &[f32])]) -> Vec<Result<u32, SamplerError>> {
        let all = |e: SamplerError| rows.iter().map(|_| Err(e.clone())).collect();
        if let Err(e) = self.instance() {
            return all(sampler_error(e));
        }
        let generation = self.generation;
        // Sequences of a replaced instance lost their sampler state.
        let mut out: Vec<Option<Result<u32, SamplerError>>> = vec![None; rows.len()];
        let mut live = Vec::with_capacity(rows.len());
        for (k, (seq, logits)) in rows.iter().enumerate() {
            match self.open.get(&seq.0) {
                Some((g, h)) if *g == generation => live.push((k, SeqHandle(h.0), *logits)),
                _ => {
                    out[k] = Some(Err(SamplerError::internal(format!(
                        "sampler `{}` was restarted after a failure; this sequence's sampler state is gone",
                        self.plugin.name
                    ))))
                }
            }
        }
        if !live.is_empty() {
            let health = self.health.clone();
            let batch: Vec<(&SeqHandle, &[f32])> = live.iter().map(|(_, h, l)| (h, *l)).collect();
            let r = match self.instance() {
                Ok(inst) => inst.sample(&batch, Some(&health)),
                Err(e) => Err(e),
            };
            match self.judge(r) {
                Ok(results) => {
                    for ((k, _, _), r) in live.iter().zip(results) {
                        out[*k] = Some(self.judge(r).map_err(sampler_error));
                    }
                }
                Err(e) => {
                    let e = sampler_error(e);
                    for (k, _, _) in &live {
                        out[*k] = Some(Err(e.clone()));
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(SamplerError::internal("the sampler gave no token for this sequence"))))
            .collect()
    }

    fn describes_distributions(&self) -> bool {
        self.plugin.describes_distributions() && !self.health.is_disabled()
    }

    fn distributions(
        &mut self,
        seq: SamplerSeq,
        drafts: &[u32],
        rows: &[(usize, &[f32])],
    ) -> Result<Option<Vec<Vec<f32>>>, SamplerError> {
        let health = self.health.clone();
        let r = match self.holder(seq) {
            Some((inst, h)) => inst.distributions(&h, drafts, rows, Some(&health)),
            None => return Ok(None),
        };
        self.judge(r).map_err(sampler_error)
    }

    fn accept(&mut self, seq: SamplerSeq, token: u32) {
        if let Some((inst, h)) = self.holder(seq) {
            let _ = inst.accept(&h, &[token]);
        }
    }

    fn close(&mut self, seq: SamplerSeq) {
        if let Some((inst, h)) = self.holder(seq) {
            let _ = inst.drop_sequence(h);
        }
        self.open.remove(&seq.0);
    }
}
