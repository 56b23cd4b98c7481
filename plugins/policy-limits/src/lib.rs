//! `builtin:policy-limits`: per-tenant and per-key rate limits (requests and tokens per minute),
//! prompt / completion caps and concurrency caps, kept in the host's tenant-scoped `rate-limit`
//! buckets (so every instance of the plugin, and every request, sees the same counters).
//!
//! Config (JSON, every field optional):
//! `{"requests_per_minute": 600, "tokens_per_minute": 1000000, "max_prompt_tokens": 131072,
//!   "max_completion_tokens": 32768, "max_concurrent": 64, "per_key": true}`

use kimi_plugin::policy::exports::kimi::host::policy_plugin::{Admission, Capabilities, Guest, Rejection, RequestMeta};
use kimi_plugin::policy::kimi::host::types::PluginError;
use kimi_plugin::policy::kimi::host::{metrics, rate_limit};
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Config {
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u32>,
    max_prompt_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    max_concurrent: Option<u32>,
    per_key: bool,
}

fn config(s: &str) -> Result<Config, PluginError> {
    if s.trim().is_empty() {
        return Ok(Config::default());
    }
    serde_json::from_str(s).map_err(|e| PluginError::BadConfig(format!("policy-limits config: {e}")))
}

fn scope(c: &Config, meta: &RequestMeta) -> String {
    if c.per_key { format!("key:{}", meta.key_id) } else { "tenant".to_string() }
}

fn reject(status: u16, message: String, retry_after_ms: Option<u64>) -> Admission {
    metrics::counter_add("rejected", 1);
    Admission::Reject(Rejection { status, message, retry_after_ms })
}

struct Limits;

impl Guest for Limits {
    fn describe() -> Capabilities {
        Capabilities { name: "policy-limits".into() }
    }

    fn admit(config_json: String, meta: RequestMeta, _body_json: String) -> Result<Admission, PluginError> {
        let c = config(&config_json)?;
        metrics::observe("prompt_tokens", f64::from(meta.prompt_tokens));
        if let Some(max) = c.max_prompt_tokens
            && meta.prompt_tokens > max
        {
            return Ok(reject(
                400,
                format!("prompt has {} tokens; this tenant allows at most {max}", meta.prompt_tokens),
                None,
            ));
        }
        if let Some(max) = c.max_completion_tokens
            && meta.max_tokens > max
        {
            return Ok(reject(
                400,
                format!("max_tokens {} exceeds this tenant's limit of {max}", meta.max_tokens),
                None,
            ));
        }
        let s = scope(&c, &meta);
        if let Some(rpm) = c.requests_per_minute
            && let Err(ms) = rate_limit::try_acquire(&format!("{s}:requests"), 1, rpm as f64 / 60.0, rpm.max(1))
        {
            return Ok(reject(429, format!("rate limit: {rpm} requests per minute"), Some(ms)));
        }
        if let Some(tpm) = c.tokens_per_minute {
            let want = meta.prompt_tokens.saturating_add(meta.max_tokens.saturating_mul(meta.n.max(1)));
            if let Err(ms) =
                rate_limit::try_acquire(&format!("{s}:tokens"), want.min(tpm.max(1)), tpm as f64 / 60.0, tpm.max(1))
            {
                return Ok(reject(429, format!("rate limit: {tpm} tokens per minute"), Some(ms)));
            }
        }
        if let Some(max) = c.max_concurrent
            && let Err(_) = rate_limit::try_acquire(&format!("{s}:concurrent"), 1, 0.0, max.max(1))
        {
            return Ok(reject(429, format!("too many concurrent requests (limit {max})"), Some(1000)));
        }
        metrics::counter_add("admitted", 1);
        Ok(Admission::Allow)
    }

    fn on_complete(config_json: String, meta: RequestMeta, _prompt_tokens: u32, completion_tokens: u32) {
        let Ok(c) = config(&config_json) else { return };
        let s = scope(&c, &meta);
        if c.max_concurrent.is_some() {
            rate_limit::release(&format!("{s}:concurrent"), 1);
        }
        if c.tokens_per_minute.is_some() {
            // Give back what was reserved but not generated.
            let reserved = meta.max_tokens.saturating_mul(meta.n.max(1));
            rate_limit::release(&format!("{s}:tokens"), reserved.saturating_sub(completion_tokens));
        }
    }
}

kimi_plugin::policy::export_policy!(Limits);
