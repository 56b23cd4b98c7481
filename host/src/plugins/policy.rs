//! Policy plugins: a fresh, pooled instance per call (admission and completion), with the
//! tenant's state kept in host `kv` / `rate-limit` services rather than in guest memory.

use std::sync::Arc;

use super::bindings::policy::PolicyPre;
pub use super::bindings::policy::exports::kimi::host::policy_plugin::{Admission, Rejection, RequestMeta};
use super::error::PluginError;
use super::host::{HostState, PluginEnv, TenantServices};
use super::oneshot::{OneShot, guest_error};
use super::runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime};

pub struct PolicyPlugin(pub OneShot<PolicyPre<HostState>>);

impl PolicyPlugin {
    pub fn new(runtime: Arc<PluginRuntime>, compiled: &CompiledPlugin) -> Result<PolicyPlugin, PluginError> {
        OneShot::new(runtime, compiled, PluginKind::Policy, PolicyPre::new).map(PolicyPlugin)
    }

    pub fn with_limits(mut self, limits: KindLimits) -> Self {
        self.0.limits = limits;
        self
    }

    pub fn name(&self) -> &str {
        &self.0.name
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
        let (r, _, _) = self.0.call(
            env,
            services,
            tenant,
            |p, s| p.instantiate(s),
            |b, s| b.kimi_host_policy_plugin().call_admit(s, config, meta, body_json),
        )?;
        r.map_err(|e| guest_error(&self.0.name, e))
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
        self.0
            .call(
                env,
                services,
                tenant,
                |p, s| p.instantiate(s),
                |b, s| b.kimi_host_policy_plugin().call_on_complete(s, config, meta, prompt_tokens, completion_tokens),
            )
            .map(|_| ())
    }
}
