//! The plugin platform: tenants' WebAssembly components (samplers, grammars, templates,
//! policies) run sandboxed in wasmtime — memory caps, call deadlines, no ambient authority — and
//! a failing plugin fails only the request or sequence it was serving.

pub mod bindings;
pub mod builtin;
pub mod error;
pub mod grammar;
pub mod grammar_check;
pub mod health;
pub mod host;
pub mod oneshot;
pub mod plugin_metrics;
pub mod policy;
pub mod quota;
pub mod runtime;
pub mod sampler;
pub mod template;

pub use error::PluginError;
pub use grammar::{EffortBudget, GrammarPlugin, GrammarRequest};
pub use health::PluginHealth;
pub use host::{PluginEnv, QuotaFailure, TenantServices};
pub use policy::{Admission, PolicyPlugin, Rejection, RequestMeta};
pub use quota::{LocalQuotas, QuotaError, QuotaStore, RedisQuotas};
pub use runtime::{CompiledPlugin, KindLimits, PluginKind, PluginRuntime, RuntimeOptions};
pub use sampler::{SamplerInstance, SamplerPlugin, SeqHandle, TenantSampler};
pub use template::{OutputEvent, OutputParser, Rendered, TemplatePlugin, ToolCall};
