//! Plugin errors: each names the plugin, and says whether it was refused at load, trapped,
//! timed out, ran out of memory, returned something invalid, or reported an error itself.

use thiserror::Error;

#[derive(Debug, Error, Clone)]
pub enum PluginError {
    #[error("plugin `{plugin}` rejected: {reason}")]
    Rejected { plugin: String, reason: String },
    #[error("plugin `{plugin}` exceeded its {ms} ms deadline")]
    Timeout { plugin: String, ms: u128 },
    #[error("plugin `{plugin}` exceeded its memory cap of {mib} MiB")]
    OutOfMemory { plugin: String, mib: usize },
    #[error("plugin `{plugin}` trapped: {msg}")]
    Trap { plugin: String, msg: String },
    #[error("plugin `{plugin}` returned an invalid result: {msg}")]
    BadReturn { plugin: String, msg: String },
    /// The plugin reported an error. `client`: the request's fault (bad parameters, unsupported
    /// or rejected input — HTTP 400), not the plugin's.
    #[error("plugin `{plugin}`: {msg}")]
    Guest { plugin: String, msg: String, client: bool },
    #[error("plugin `{plugin}` is disabled for this tenant after repeated failures")]
    Disabled { plugin: String },
    /// A trusted (builtin) plugin trapped or ran out of memory or time on this request's input:
    /// the request is too large or complex for the plugin's limits (HTTP 400, not a strike).
    #[error("plugin `{plugin}` could not process this request within its limits ({cause}); send a smaller request")]
    RequestTooLarge { plugin: String, cause: String },
    #[error("plugin runtime: {0}")]
    Runtime(String),
}

impl PluginError {
    /// This failure as the request's fault (see `PluginHealth::failed`).
    pub fn charged_to_request(self) -> PluginError {
        match self {
            PluginError::Timeout { plugin, ms } => {
                PluginError::RequestTooLarge { plugin, cause: format!("its {ms} ms deadline") }
            }
            PluginError::OutOfMemory { plugin, mib } => {
                PluginError::RequestTooLarge { plugin, cause: format!("its {mib} MiB memory cap") }
            }
            PluginError::Trap { plugin, msg } => {
                PluginError::RequestTooLarge { plugin, cause: format!("trapped: {msg}") }
            }
            other => other,
        }
    }
}
