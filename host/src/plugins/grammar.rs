//! Grammar plugins: once per request, turn tools / tool_choice / response_format into a
//! declarative constraint for the host's native engine.

use std::sync::Arc;

use super::bindings::grammar::GrammarPre;
pub use super::bindings::grammar::exports::kimi::host::grammar_plugin::{EffortBudget, GrammarRequest};
use super::bindings::host::kimi::host::types::RequestInfo;
use super::error::PluginError;
use super::host::{HostState, PluginEnv, TenantServices};
use super::oneshot::{OneShot, guest_error};
use super::runtime::{CompiledPlugin, PluginKind, PluginRuntime};

pub struct GrammarPlugin(pub OneShot<GrammarPre<HostState>>);

impl GrammarPlugin {
    pub fn new(runtime: Arc<PluginRuntime>, compiled: &CompiledPlugin) -> Result<GrammarPlugin, PluginError> {
        OneShot::new(runtime, compiled, PluginKind::Grammar, GrammarPre::new).map(GrammarPlugin)
    }

    /// The constraint for a request (None: unconstrained).
    pub fn plan(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        req: &RequestInfo,
        g: &GrammarRequest,
    ) -> Result<Option<crate::grammar::Constraint>, PluginError> {
        let (r, _, _) = self.0.call(
            env,
            services,
            &req.tenant,
            |p, s| p.instantiate(s),
            |b, s| b.kimi_host_grammar_plugin().call_plan(s, req, g),
        )?;
        Ok(r.map_err(|e| guest_error(&self.0.name, e))?.map(Into::into))
    }
}
