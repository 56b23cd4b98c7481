//! `builtin:policy-kimi-vendor`: the parameter rules of Moonshot's Kimi Vendor Verifier for K3
//! (`tests/params`): temperature in [0, 1], top_p only 0.95, no presence / frequency penalty,
//! n = 1. Anything else is an HTTP 400 naming the parameter — what a hosting vendor runs to pass
//! the verifier. Config may override the allowed values:
//! `{"temperature_max": 1.0, "top_p": [0.95], "allow_penalties": false, "max_n": 1}`.

use kimi_plugin::policy::exports::kimi::host::policy_plugin::{Admission, Capabilities, Guest, Rejection, RequestMeta};
use kimi_plugin::policy::kimi::host::types::PluginError;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    temperature_max: f64,
    top_p: Vec<f64>,
    allow_penalties: bool,
    max_n: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config { temperature_max: 1.0, top_p: vec![0.95], allow_penalties: false, max_n: 1 }
    }
}

fn bad(msg: String) -> Result<Admission, PluginError> {
    Ok(Admission::Reject(Rejection { status: 400, message: msg, retry_after_ms: None }))
}

struct Vendor;

impl Guest for Vendor {
    fn describe() -> Capabilities {
        Capabilities { name: "policy-kimi-vendor".into() }
    }

    fn admit(config_json: String, _meta: RequestMeta, body_json: String) -> Result<Admission, PluginError> {
        let c: Config = if config_json.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(&config_json)
                .map_err(|e| PluginError::BadConfig(format!("policy-kimi-vendor config: {e}")))?
        };
        let body: Value = serde_json::from_str(&body_json)
            .map_err(|e| PluginError::Rejected(format!("request body is not JSON: {e}")))?;
        let num = |k: &str| body.get(k).filter(|v| !v.is_null());
        if let Some(t) = num("temperature") {
            match t.as_f64() {
                Some(t) if (0.0..=c.temperature_max).contains(&t) => {}
                _ => {
                    return bad(format!(
                        "temperature must be between 0 and {} for this model, got {t}",
                        c.temperature_max
                    ));
                }
            }
        }
        if let Some(p) = num("top_p") {
            match p.as_f64() {
                Some(p) if c.top_p.iter().any(|a| (a - p).abs() < 1e-9) => {}
                _ => {
                    let allowed: Vec<String> = c.top_p.iter().map(|x| x.to_string()).collect();
                    return bad(format!("top_p must be {} for this model, got {p}", allowed.join(" or ")));
                }
            }
        }
        if !c.allow_penalties {
            for k in ["presence_penalty", "frequency_penalty"] {
                if let Some(v) = num(k)
                    && v.as_f64() != Some(0.0)
                {
                    return bad(format!("{k} is not supported for this model (must be 0), got {v}"));
                }
            }
        }
        if let Some(n) = num("n") {
            match n.as_u64() {
                Some(n) if n >= 1 && n <= c.max_n => {}
                _ => {
                    return bad(format!("n must be between 1 and {} for this model, got {n}", c.max_n));
                }
            }
        }
        Ok(Admission::Allow)
    }

    fn on_complete(_config_json: String, _meta: RequestMeta, _prompt_tokens: u32, _completion_tokens: u32) {}
}

kimi_plugin::policy::export_policy!(Vendor);
