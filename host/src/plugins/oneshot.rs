//! Per-request plugin kinds (policy, grammar, template) share one calling convention: a fresh
//! pooled instance per call, the kind's deadline, and failures counted in the plugin's health.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::Store;

use super::error::PluginError;
use super::health::PluginHealth;
use super::host::{HostState, PluginEnv, TenantServices};
use super::runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime, set_deadline};
use super::sampler::call_error;

/// A validated component of a per-request kind, ready to instantiate.
pub struct OneShot<P> {
    pub name: String,
    pub pre: P,
    pub runtime: Arc<PluginRuntime>,
    pub limits: KindLimits,
    pub health: Arc<PluginHealth>,
    pub kind: PluginKind,
}

impl<P> OneShot<P> {
    /// Links `compiled` for `kind` and wraps the instance-pre with `wrap` (the world's `*Pre::new`).
    pub fn new(
        runtime: Arc<PluginRuntime>,
        compiled: &CompiledPlugin,
        kind: PluginKind,
        wrap: impl FnOnce(wasmtime::component::InstancePre<HostState>) -> wasmtime::Result<P>,
    ) -> Result<OneShot<P>, PluginError> {
        if compiled.kind != kind {
            return Err(PluginError::Rejected {
                plugin: compiled.name.clone(),
                reason: format!("is a {} plugin, not a {}", compiled.kind.name(), kind.name()),
            });
        }
        let linker = runtime.linker(kind, &compiled.component)?;
        let rejected =
            |e: wasmtime::Error| PluginError::Rejected { plugin: compiled.name.clone(), reason: format!("{e:#}") };
        let pre = linker.instantiate_pre(&compiled.component).map_err(rejected)?;
        let pre = wrap(pre).map_err(|e| PluginError::Rejected {
            plugin: compiled.name.clone(),
            reason: format!("does not match the {} world: {e:#}", kind.name()),
        })?;
        Ok(OneShot {
            name: compiled.name.clone(),
            pre,
            runtime,
            limits: kind.default_limits(),
            health: Arc::new(PluginHealth::new(compiled.trusted)),
            kind,
        })
    }

    /// A fresh store, instantiated with `inst`, then `f` under the call deadline.
    pub fn call<B, T>(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        tenant: &str,
        inst: impl FnOnce(&P, &mut Store<HostState>) -> wasmtime::Result<B>,
        f: impl FnOnce(&B, &mut Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<(T, B, Store<HostState>), PluginError> {
        if self.health.is_disabled() {
            return Err(PluginError::Disabled { plugin: self.name.clone() });
        }
        let t = Instant::now();
        let mut store = self.runtime.store(self.kind, self.limits, env.clone(), services.clone(), tenant, &self.name);
        let r = inst(&self.pre, &mut store).and_then(|b| {
            set_deadline(&mut store, self.limits.call);
            f(&b, &mut store).map(|v| (v, b))
        });
        self.health.record_call(t.elapsed());
        match r {
            Ok((v, b)) => {
                self.health.record_success();
                Ok((v, b, store))
            }
            Err(e) => Err(self.health.failed(call_error(&self.name, &self.limits, e, store.data()))),
        }
    }
}

/// A guest-reported error as a plugin error naming the plugin.
pub fn guest_error(plugin: &str, e: super::bindings::host::kimi::host::types::PluginError) -> PluginError {
    use super::bindings::host::kimi::host::types::PluginError as G;
    let client = !matches!(e, G::Internal(_));
    let msg = match e {
        G::BadConfig(m) => format!("bad configuration or parameters: {m}"),
        G::Unsupported(m) => format!("unsupported: {m}"),
        G::Rejected(m) | G::Internal(m) => m,
    };
    PluginError::Guest { plugin: plugin.to_string(), msg, client }
}
