//! Template plugins: render a chat request to prompt segments (once per request) and parse the
//! generated ids incrementally (an `output-parser` resource living for the sequence).

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::ResourceAny;

use super::bindings::host::kimi::host::types::RequestInfo;
pub use super::bindings::template::exports::kimi::host::template_plugin::{OutputEvent, Rendered, ToolCall};
use super::bindings::template::{Template, TemplatePre};
use super::error::PluginError;
use super::host::{HostState, PluginEnv, TenantServices};
use super::oneshot::{OneShot, guest_error};
use super::runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime, set_deadline};
use super::sampler::call_error;

pub struct TemplatePlugin(pub OneShot<TemplatePre<HostState>>);

impl TemplatePlugin {
    pub fn new(runtime: Arc<PluginRuntime>, compiled: &CompiledPlugin) -> Result<TemplatePlugin, PluginError> {
        OneShot::new(runtime, compiled, PluginKind::Template, TemplatePre::new).map(TemplatePlugin)
    }

    /// Segments for a chat request (`chat_json`: the OpenAI chat-completions body).
    pub fn render(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        req: &RequestInfo,
        chat_json: &str,
    ) -> Result<Rendered, PluginError> {
        let (r, _, _) = self.0.call(
            env,
            services,
            &req.tenant,
            |p, s| p.instantiate(s),
            |b, s| b.kimi_host_template_plugin().call_render(s, req, chat_json),
        )?;
        r.map_err(|e| guest_error(&self.0.name, e))
    }

    /// An incremental output parser for one generated sequence.
    pub fn parser(
        &self,
        env: &Arc<PluginEnv>,
        services: &Arc<TenantServices>,
        req: &RequestInfo,
    ) -> Result<OutputParser, PluginError> {
        let (parser, bindings, store) = self.0.call(
            env,
            services,
            &req.tenant,
            |p, s| p.instantiate(s),
            |b, s| b.kimi_host_template_plugin().output_parser().call_constructor(s, req),
        )?;
        Ok(OutputParser { name: self.0.name.clone(), limits: self.0.limits, store, bindings, parser, poisoned: false })
    }
}

pub struct OutputParser {
    name: String,
    limits: KindLimits,
    store: Store<HostState>,
    bindings: Template,
    parser: ResourceAny,
    poisoned: bool,
}

impl OutputParser {
    fn run(
        &mut self,
        f: impl FnOnce(
            &Template,
            &mut Store<HostState>,
            ResourceAny,
        )
            -> wasmtime::Result<Result<Vec<OutputEvent>, super::bindings::host::kimi::host::types::PluginError>>,
    ) -> Result<Vec<OutputEvent>, PluginError> {
        if self.poisoned {
            return Err(PluginError::Trap {
                plugin: self.name.clone(),
                msg: "parser was discarded after a failure".into(),
            });
        }
        set_deadline(&mut self.store, self.limits.call);
        match f(&self.bindings, &mut self.store, self.parser) {
            Ok(r) => r.map_err(|e| guest_error(&self.name, e)),
            Err(e) => {
                self.poisoned = true;
                Err(call_error(&self.name, &self.limits, e, self.store.data()))
            }
        }
    }

    /// Newly generated ids → what is now certain.
    pub fn feed(&mut self, ids: &[u32]) -> Result<Vec<OutputEvent>, PluginError> {
        self.run(|b, s, p| b.kimi_host_template_plugin().output_parser().call_feed(s, p, ids))
    }

    /// End of generation.
    pub fn finish(&mut self) -> Result<Vec<OutputEvent>, PluginError> {
        self.run(|b, s, p| b.kimi_host_template_plugin().output_parser().call_finish(s, p))
    }
}
