//! OpenAI wire shapes: the error body, and the checks and defaults for request fields shared by
//! `/v1/chat/completions` and `/v1/completions`. Every refusal names the parameter.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kimi_sampling_params::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// An OpenAI-shaped error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429 / 503.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::bad(message) }
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn busy(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        r
    }
}

/// Sampling and output options common to both endpoints.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub model: String,
    pub n: usize,
    /// As given (`max_completion_tokens` wins over `max_tokens`).
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    /// None: no logprobs; Some(k): the chosen token's and k alternatives.
    pub logprobs: Option<usize>,
    /// The sampler's parameters (OpenAI names), as JSON.
    pub sampling_json: String,
    /// Per-request plugin choices (`"plugins": {"sampler": "…", "template": "…", "grammar": "…"}`).
    pub sampler: Option<String>,
    pub template: Option<String>,
    pub grammar: Option<String>,
    /// Narrows the request's prefix-cache partition (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
}

/// Longest `cache_salt`.
pub const MAX_CACHE_SALT: usize = 256;

/// The fields of a request body that the host reads (`messages`, `prompt`, `tools` and the rest
/// go to the template plugin and policies as JSON). Parsed with `serde_path_to_error`, so a
/// wrong type is refused with the field's path.
#[derive(Deserialize)]
struct CommonWire {
    model: Option<String>,
    n: Option<i64>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<Stop>,
    seed: Option<i64>,
    logprobs: Option<Logprobs>,
    top_logprobs: Option<i64>,
    plugins: Option<PluginChoice>,
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `/v1/completions` takes an integer (alternatives); chat a boolean plus `top_logprobs`.
#[derive(Deserialize)]
#[serde(untagged, expecting = "a boolean or an integer")]
enum Logprobs {
    On(bool),
    Count(i64),
}

/// Per-request plugin choices; any other key is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginChoice {
    sampler: Option<String>,
    template: Option<String>,
    grammar: Option<String>,
}

/// Deserializes the fields of `body` that `T` names (the rest are skipped, not copied) into
/// `T`; a failure names the path, under `prefix` (e.g. `sampler_params.`).
fn typed<'a, T: Deserialize<'a>>(body: &'a Map<String, Value>, prefix: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let top = path.split(['.', '[']).next().unwrap_or_default();
        ApiError::param(&format!("{prefix}{top}"), format!("{prefix}{path}: {}", e.inner()))
    })
}

fn in_range(key: &str, v: Option<i64>, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match v {
        Some(v) if v < lo || v > hi => {
            Err(ApiError::param(key, format!("{key} must be between {lo} and {hi}, got {v}")))
        }
        v => Ok(v),
    }
}

/// The standard sampling fields of `body` (their one definition, `kimi-sampling-params`),
/// checked.
fn sampling(body: &Map<String, Value>, vocab: u32, prefix: &str) -> Result<SamplingParams, ApiError> {
    let p: SamplingParams = typed(body, prefix)?;
    p.check(vocab).map_err(|e| ApiError::param(&format!("{prefix}{}", e.param), format!("{prefix}{}", e.message)))?;
    Ok(p)
}

/// Reads and checks the common fields; `vocab` bounds `logit_bias` keys.
pub fn gen_params(body: &Map<String, Value>, max_n: usize, vocab: u32) -> Result<GenParams, ApiError> {
    let w: CommonWire = typed(body, "")?;
    let model = match w.model {
        Some(s) if !s.is_empty() => s,
        Some(_) => return Err(ApiError::param("model", "model must be a non-empty string")),
        None => return Err(ApiError::param("model", "model is required")),
    };
    let n = in_range("n", w.n, 1, max_n as i64)?.unwrap_or(1) as usize;
    let max_tokens = match in_range("max_completion_tokens", w.max_completion_tokens, 1, i64::MAX)? {
        Some(v) => Some(v),
        None => in_range("max_tokens", w.max_tokens, 1, i64::MAX)?,
    }
    .map(|v| usize::try_from(v).unwrap_or(usize::MAX));
    let stop = match w.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) if v.len() <= 4 => v,
        Some(Stop::Many(_)) => return Err(ApiError::param("stop", "at most 4 stop sequences")),
    };
    let logprobs = match w.logprobs {
        Some(Logprobs::Count(k)) => Some(in_range("logprobs", Some(k), 0, 20)?.unwrap_or(0) as usize),
        on => {
            let on = matches!(on, Some(Logprobs::On(true)));
            let top = in_range("top_logprobs", w.top_logprobs, 0, 20)?;
            if top.is_some() && !on {
                return Err(ApiError::param("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            on.then_some(top.unwrap_or(0) as usize)
        }
    };

    let top = sampling(body, vocab, "")?;
    let mut s = match serde_json::to_value(&top) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    // Extension: parameters for a tenant's own sampler (e.g. `typical_p`), passed through as given;
    // the standard fields among them get the same checks as at the top level (which wins).
    match body.get("sampler_params") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            let checked = match serde_json::to_value(sampling(o, vocab, "sampler_params.")?) {
                Ok(Value::Object(m)) => m,
                _ => Map::new(),
            };
            for (k, v) in o {
                let v = checked.get(k).unwrap_or(v);
                s.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        Some(other) => {
            return Err(ApiError::param("sampler_params", format!("sampler_params must be an object, got {other}")));
        }
    }

    let plugins = w.plugins.unwrap_or(PluginChoice { sampler: None, template: None, grammar: None });
    if w.cache_salt.as_ref().is_some_and(|c| c.len() > MAX_CACHE_SALT) {
        return Err(ApiError::param("cache_salt", format!("cache_salt is longer than {MAX_CACHE_SALT} bytes")));
    }
    Ok(GenParams {
        model,
        n,
        max_tokens,
        stream: w.stream.unwrap_or(false),
        include_usage: w.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        stop,
        seed: w.seed.map(|s| s as u64),
        logprobs,
        sampling_json: Value::Object(s).to_string(),
        sampler: plugins.sampler,
        template: plugins.template,
        grammar: plugins.grammar,
        cache_salt: w.cache_salt,
    })
}

/// A new id with a prefix (`chatcmpl-`, `cmpl-`, `call_`).
pub fn new_id(prefix: &str) -> String {
    use rand::RngExt;
    let mut rng = rand::rng();
    let s: String = (0..24)
        .map(|_| {
            let c = rng.random_range(0..62u8);
            (match c {
                0..=9 => b'0' + c,
                10..=35 => b'a' + c - 10,
                _ => b'A' + c - 36,
            }) as char
        })
        .collect();
    format!("{prefix}{s}")
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn checks_name_the_parameter() {
        for (body, param) in [
            (json!({"model": "m", "temperature": -1}), "temperature"),
            (json!({"model": "m", "n": 0}), "n"),
            (json!({"model": "m", "max_tokens": "x"}), "max_tokens"),
            (json!({"model": "m", "top_p": 0}), "top_p"),
            (json!({"model": "m", "stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"model": "m", "top_logprobs": 3}), "top_logprobs"),
            (json!({"model": "m", "logit_bias": {"99999": 1}}), "logit_bias"),
            (json!({"temperature": 1}), "model"),
            (json!({"model": "m", "stream_options": {"include_usage": "yes"}}), "stream_options"),
            (json!({"model": "m", "plugins": {"policy": "x"}}), "plugins"),
            (json!({"model": "m", "stop": 5}), "stop"),
            (json!({"model": "m", "temperature": "hot"}), "temperature"),
        ] {
            let e = gen_params(&obj(body.clone()), 8, 512).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(param), "{body}: the message names the field: {}", e.message);
        }
        let p = gen_params(
            &obj(json!({"model": "m", "temperature": 0, "max_completion_tokens": 5, "max_tokens": 9,
            "logprobs": true, "top_logprobs": 2, "stop": "x", "seed": 7})),
            8,
            512,
        )
        .expect("valid");
        assert_eq!((p.max_tokens, p.logprobs, p.seed, p.stop.len()), (Some(5), Some(2), Some(7), 1));
        assert_eq!(p.sampling_json, r#"{"temperature":0.0}"#);
    }

    #[test]
    fn top_k_reaches_the_sampler_as_an_integer() {
        let p = gen_params(&obj(json!({"model": "m", "top_k": 40})), 8, 512).expect("valid");
        assert_eq!(p.sampling_json, r#"{"top_k":40}"#);
    }

    #[test]
    fn sampler_params_get_the_named_fields_checks() {
        for (k, v) in [
            ("temperature", json!(1e9)),
            ("top_p", json!(0)),
            ("top_k", json!(1.5)),
            ("logit_bias", json!({"9999": 1})),
        ] {
            let body = obj(json!({"model": "m", "sampler_params": {k: v}}));
            let e = gen_params(&body, 8, 512).expect_err(k);
            assert_eq!(e.param.as_deref(), Some(format!("sampler_params.{k}").as_str()), "{}", e.message);
        }
        // Unknown keys pass through; the named field wins over a sampler_params duplicate.
        let p = gen_params(
            &obj(json!({"model": "m", "temperature": 0.5, "sampler_params": {"temperature": 1.0, "typical_p": 0.3}})),
            8,
            512,
        )
        .expect("valid");
        let v: Value = serde_json::from_str(&p.sampling_json).expect("json");
        assert_eq!(v, json!({"temperature": 0.5, "typical_p": 0.3}));
    }
}
