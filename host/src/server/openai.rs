//! OpenAI wire shapes: the error body, and the checks and defaults for request fields shared by
//! `/v1/chat/completions` and `/v1/completions`. Every refusal names the parameter.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
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
}

fn number(body: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if v.is_finite() && v >= lo && v <= hi {
                Ok(Some(v))
            } else {
                Err(ApiError::param(key, format!("{key} must be between {lo} and {hi}, got {v}")))
            }
        }
        Some(other) => Err(ApiError::param(key, format!("{key} must be a number, got {other}"))),
    }
}

fn integer(body: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) if v >= lo && v <= hi => Ok(Some(v)),
            Some(v) => Err(ApiError::param(key, format!("{key} must be between {lo} and {hi}, got {v}"))),
            None => Err(ApiError::param(key, format!("{key} must be an integer, got {n}"))),
        },
        Some(other) => Err(ApiError::param(key, format!("{key} must be an integer, got {other}"))),
    }
}

fn boolean(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::param(key, format!("{key} must be a boolean, got {other}"))),
    }
}

/// Reads and checks the common fields; `vocab` bounds `logit_bias` keys.
pub fn gen_params(body: &Map<String, Value>, max_n: usize, vocab: u32) -> Result<GenParams, ApiError> {
    let model = match body.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        None | Some(Value::Null) => return Err(ApiError::param("model", "model is required")),
        Some(other) => return Err(ApiError::param("model", format!("model must be a non-empty string, got {other}"))),
    };
    let n = integer(body, "n", 1, max_n as i64)?.unwrap_or(1) as usize;
    let max_tokens = match integer(body, "max_completion_tokens", 1, i64::MAX)? {
        Some(v) => Some(v),
        None => integer(body, "max_tokens", 1, i64::MAX)?,
    }
    .map(|v| usize::try_from(v).unwrap_or(usize::MAX));
    let stream = boolean(body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?,
        Some(other) => {
            return Err(ApiError::param("stream_options", format!("stream_options must be an object, got {other}")));
        }
    };
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| ApiError::param("stop", "stop entries must be strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => return Err(ApiError::param("stop", "at most 4 stop sequences")),
        Some(other) => return Err(ApiError::param("stop", format!("stop must be a string or a list, got {other}"))),
    };
    let seed = integer(body, "seed", i64::MIN, i64::MAX)?.map(|s| s as u64);
    let logprobs = match body.get("logprobs") {
        // `/v1/completions` takes an integer (alternatives); chat a boolean plus `top_logprobs`.
        Some(Value::Number(_)) => integer(body, "logprobs", 0, 20)?.map(|k| k as usize),
        _ => {
            let on = boolean(body, "logprobs")?;
            let top = integer(body, "top_logprobs", 0, 20)?;
            if top.is_some() && !on {
                return Err(ApiError::param("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            on.then_some(top.unwrap_or(0) as usize)
        }
    };

    let mut s = sampling(body, vocab)?;
    // Extension: parameters for a tenant's own sampler (e.g. `typical_p`), passed through as given;
    // the standard fields among them get the same checks as at the top level (which wins).
    match body.get("sampler_params") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            let checked = sampling(o, vocab).map_err(|e| ApiError {
                param: Some(format!("sampler_params.{}", e.param.as_deref().unwrap_or(""))),
                message: format!("sampler_params: {}", e.message),
                ..e
            })?;
            for (k, v) in o {
                let v = checked.get(k).unwrap_or(v);
                s.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        Some(other) => {
            return Err(ApiError::param("sampler_params", format!("sampler_params must be an object, got {other}")));
        }
    }

    let (mut sampler, mut template, mut grammar) = (None, None, None);
    match body.get("plugins") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                let name = v
                    .as_str()
                    .ok_or_else(|| ApiError::param("plugins", format!("plugins.{k} must be a plugin name")))?
                    .to_string();
                match k.as_str() {
                    "sampler" => sampler = Some(name),
                    "template" => template = Some(name),
                    "grammar" => grammar = Some(name),
                    other => {
                        return Err(ApiError::param(
                            "plugins",
                            format!("plugins.{other}: only sampler, template and grammar can be chosen per request"),
                        ));
                    }
                }
            }
        }
        Some(other) => return Err(ApiError::param("plugins", format!("plugins must be an object, got {other}"))),
    }
    Ok(GenParams {
        model,
        n,
        max_tokens,
        stream,
        include_usage,
        stop,
        seed,
        logprobs,
        sampling_json: Value::Object(s).to_string(),
        sampler,
        template,
        grammar,
    })
}

/// The standard sampling fields of `body`, checked, as the sampler receives them (OpenAI names;
/// `top_k` an integer).
fn sampling(body: &Map<String, Value>, vocab: u32) -> Result<Map<String, Value>, ApiError> {
    let mut s = Map::new();
    let put = |s: &mut Map<String, Value>, k: &str, v: Option<f64>| {
        if let Some(v) = v {
            s.insert(k.to_string(), json!(v));
        }
    };
    put(&mut s, "temperature", number(body, "temperature", 0.0, 2.0)?);
    let top_p = number(body, "top_p", 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(ApiError::param("top_p", "top_p must be in (0, 1]"));
    }
    put(&mut s, "top_p", top_p);
    if let Some(k) = integer(body, "top_k", -1, i64::from(u32::MAX))? {
        s.insert("top_k".into(), json!(k));
    }
    put(&mut s, "min_p", number(body, "min_p", 0.0, 1.0)?);
    put(&mut s, "presence_penalty", number(body, "presence_penalty", -2.0, 2.0)?);
    put(&mut s, "frequency_penalty", number(body, "frequency_penalty", -2.0, 2.0)?);
    let rep = number(body, "repetition_penalty", 0.0, 10.0)?;
    if rep == Some(0.0) {
        return Err(ApiError::param("repetition_penalty", "repetition_penalty must be > 0"));
    }
    put(&mut s, "repetition_penalty", rep);
    match body.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                let id: u32 = k
                    .parse()
                    .map_err(|_| ApiError::param("logit_bias", format!("logit_bias key `{k}` is not a token id")))?;
                if id >= vocab {
                    return Err(ApiError::param(
                        "logit_bias",
                        format!("logit_bias token {id} is outside the vocabulary"),
                    ));
                }
                match v.as_f64() {
                    Some(b) if (-100.0..=100.0).contains(&b) => {}
                    _ => {
                        return Err(ApiError::param(
                            "logit_bias",
                            format!("logit_bias values are numbers in [-100, 100], got {v}"),
                        ));
                    }
                }
            }
            s.insert("logit_bias".into(), Value::Object(o.clone()));
        }
        Some(other) => return Err(ApiError::param("logit_bias", format!("logit_bias must be an object, got {other}"))),
    }

    Ok(s)
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
        ] {
            let e = gen_params(&obj(body.clone()), 8, 512).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
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
