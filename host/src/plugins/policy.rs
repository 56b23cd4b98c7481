//! Policy plugins: a fresh, pooled instance per call (admission and completion), with the
//! tenant's state kept in host `kv` / `rate-limit` services rather than in guest memory.

use std::sync::Arc;
use std::time::Instant;

use super::bindings::host::kimi::host::types::PluginError as GuestError;
pub use super::bindings::policy::exports::kimi::host::policy_plugin::{Admission, Rejection, RequestMeta};
use super::bindings::policy::{Policy, PolicyPre};
use super::error::PluginError;
use super::health::PluginHealth;
use super::host::{HostState, PluginEnv, TenantServices};
use super::runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime, set_deadline};
use super::sampler::call_error;

pub struct PolicyPlugin {
    pub name: String,
    pre: PolicyPre<HostState>,
    runtime: Arc<PluginRuntime>,
    pub limits: KindLimits,
    pub health: Arc<PluginHealth>,
}

impl PolicyPlugin {
    pub fn new(runtime: Arc<PluginRuntime>, compiled: &CompiledPlugin) -> Result<PolicyPlugin, PluginError> {
        if compiled.kind != PluginKind::Policy {
            return Err(PluginError::Rejected {
                plugin: compiled.name.clone(),
                reason: format!("is a {} plugin, not a policy", compiled.kind.name()),
            });
        }
        let linker = runtime.linker(PluginKind::Policy, &compiled.component)?;
        let pre = linker
            .instantiate_pre(&compiled.component)
            .map_err(|e| PluginError::Rejected { plugin: compiled.name.clone(), reason: format!("{e:#}") })?;
        let pre = PolicyPre::new(pre).map_err(|e| PluginError::Rejected {
            plugin: compiled.name.clone(),
            reason: format!("does not match the policy world: {e:#}"),
        })?;
        Ok(PolicyPlugin {
            name: compiled.name.clone(),
            pre,
            runtime,
            limits: PluginKind::Policy.default_limits(),
            health: Arc::default(),
        })
    }

    pub fn with_limits(mut self, limits: KindLimits) -> Self {
        self.limits = limits;
        self
    }

    fn run<T>(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        tenant: &str,
        f: impl FnOnce(&Policy, &mut wasmtime::Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<T, PluginError> {
        if self.health.is_disabled() {
            return Err(PluginError::Disabled { plugin: self.name.clone() });
        }
        let t = Instant::now();
        let mut store =
            self.runtime.store(PluginKind::Policy, self.limits, env.clone(), services.clone(), tenant, &self.name);
        let r = self.pre.instantiate(&mut store).and_then(|p| {
            set_deadline(&mut store, self.limits.call);
            f(&p, &mut store)
        });
        self.health.record_call(t.elapsed());
        r.map_err(|e| {
            let e = call_error(&self.name, &self.limits, e);
            self.health.record_failure(true, matches!(e, PluginError::Timeout { .. }));
            e
        })
    }

    /// Admission decision for one request.
    pub fn admit(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        tenant: &str,
        config: &str,
        meta: &RequestMeta,
        body_json: &str,
    ) -> Result<Admission, PluginError> {
        let r =
            self.run(env, services, tenant, |p, s| p.kimi_host_policy_plugin().call_admit(s, config, meta, body_json))?;
        r.map_err(|e| {
            let msg = match e {
                GuestError::BadConfig(m) => format!("bad configuration: {m}"),
                GuestError::Unsupported(m) | GuestError::Rejected(m) | GuestError::Internal(m) => m,
            };
            PluginError::Guest { plugin: self.name.clone(), msg }
        })
    }

    /// Accounting after a request ended.
    #[allow(clippy::too_many_arguments)]
    pub fn on_complete(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        tenant: &str,
        config: &str,
        meta: &RequestMeta,
        prompt_tokens: u32,
        completion_tokens: u32,
    ) -> Result<(), PluginError> {
        self.run(env, services, tenant, |p, s| {
            p.kimi_host_policy_plugin().call_on_complete(s, config, meta, prompt_tokens, completion_tokens)
        })
    }
}
