//! The OpenAI-compatible HTTP server (axum on hyper/tokio): authentication to a tenant, the
//! chat / completions endpoints over the shared engine, tenant plugin uploads, health and
//! Prometheus metrics. One request: `auth` → `chat::prepare` (policies, template, tokenizer,
//! grammar) → `engine` → `chat::respond` (output parser, stop strings, JSON or SSE).

pub mod bounds;
pub mod chat;
pub mod config;
pub mod embedded;
pub mod images;
pub mod listener;
pub mod metrics;
pub mod openai;
pub mod plugins_api;
pub mod tenants;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::{Map, Value, json};
use tower_http::request_id::{MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::engine::{Engine, Speculation};
use crate::grammar::GrammarEngine;
use crate::model::dspark::DsparkDraft;
use crate::model::vision::VisionModel;
use crate::model::{Model, Parallelism, WeightFormat};
use crate::plugins::{PluginEnv, PluginRuntime, RuntimeOptions};
use crate::tokenizer::Tokenizer;
use config::{HttpSection, LimitsSection, OperatorSection, ServeConfig, key_hash};
use metrics::Metrics;
use openai::ApiError;
use tenants::Tenant;

/// Everything a request handler needs.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub model_name: String,
    pub tok: Arc<Tokenizer>,
    pub grammar: Arc<GrammarEngine>,
    pub env: Arc<PluginEnv>,
    pub runtime: Arc<PluginRuntime>,
    pub tenants: Vec<Arc<Tenant>>,
    pub limits: LimitsSection,
    pub http: HttpSection,
    pub operator: OperatorSection,
    pub metrics: Metrics,
    pub max_context: usize,
    pub vocab: u32,
    /// The vision tower (a checkpoint with `vision_config`), or `None`: images are refused.
    pub vision: Option<Arc<VisionModel>>,
    pub created: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("model {path}: {msg}")]
    Model { path: PathBuf, msg: String },
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("{0}")]
    Setup(String),
    #[error("engine: {0}")]
    Engine(#[from] crate::engine::EngineStartError),
    #[error(transparent)]
    Tenant(#[from] tenants::TenantError),
    #[error(transparent)]
    Embedded(#[from] embedded::EmbeddedModelError),
    #[error(transparent)]
    Backend(#[from] kimi_kernels::gpu::runtime::DeviceError),
}

impl AppState {
    /// Loads the model, tokenizer, plugins and tenants and starts the engine.
    pub fn build(cfg: &ServeConfig, model_dir: &std::path::Path) -> Result<AppState, ServeError> {
        cfg.validate()?;
        // The backend first: a GPU asked for and not there is a start-up error, before any load.
        let kind = cfg.backend_kind()?;
        let mut notes = Vec::new();
        kimi_kernels::gpu::runtime::resolve(kind, &mut notes)?;
        for n in notes {
            tracing::info!(backend = "auto", "{n}");
        }
        let model = Arc::new(
            Model::load_as(
                model_dir,
                Parallelism {
                    tensor: cfg.tensor_parallel.unwrap_or(1),
                    context: cfg.context_parallel.unwrap_or(1),
                    expert: cfg.expert_parallel,
                },
                WeightFormat { fp8_dense: cfg.fp8_dense, mxfp4_tiles: cfg.mxfp4_tiles },
            )
            .map_err(|e| ServeError::Model { path: model_dir.into(), msg: e.to_string() })?,
        );
        let tok_dir = cfg.tokenizer.clone().unwrap_or_else(|| model_dir.to_path_buf());
        let tok = Arc::new(
            Tokenizer::load(&tok_dir)
                .map_err(|e| ServeError::Tokenizer { path: tok_dir.clone(), msg: e.to_string() })?,
        );
        let vocab = model.text_config().vocab_size;
        let eos = tok
            .special_id("<|end_of_msg|>")
            .ok_or_else(|| ServeError::Tokenizer { path: tok_dir.clone(), msg: "no <|end_of_msg|> token".into() })?;
        let grammar = Arc::new(
            GrammarEngine::new(tok.clone(), vocab, eos).map_err(|e| ServeError::Setup(format!("grammar: {e}")))?,
        );
        let mut env = PluginEnv::from_tokenizer(tok.clone(), vocab as u32);
        env.grammar = Some(grammar.clone());
        let env = Arc::new(env);
        let cache_dir = cfg.plugin_cache.clone().or_else(crate::plugins::runtime::default_cache_dir);
        let runtime = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir })
            .map_err(|e| ServeError::Setup(format!("plugin runtime: {e}")))?;
        let quotas = cfg.quota_store().map_err(|e| ServeError::Setup(e.to_string()))?;
        if let Err(e) = quotas.check() {
            // Not fatal: the store may come up later; meanwhile each tenant's
            // `quota_store_failure` decides.
            tracing::warn!(error = %e, "quota store unreachable; tenants' rate limits follow their quota_store_failure policy until it answers");
        }
        let tenants = cfg
            .tenants
            .iter()
            .map(|t| Tenant::from_config(t, &runtime, &env, &quotas).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let max_context = cfg.limits.max_context.map_or(model.text_config().max_position_embeddings, |m| {
            m.min(model.text_config().max_position_embeddings)
        });
        let vision = match &model.config.vision_config {
            Some(vc) => Some(Arc::new(load_vision(model_dir, vc, &model, &tok)?)),
            None => None,
        };
        let mut engine_config = cfg.engine.engine_config()?;
        engine_config.vision = vision.clone();
        if let Some(dir) = &cfg.draft {
            let draft = DsparkDraft::load(dir, &model)
                .map_err(|e| ServeError::Model { path: dir.clone(), msg: format!("draft: {e}") })?;
            let tokens = cfg.num_speculative_tokens.unwrap_or(config::DEFAULT_SPECULATIVE_TOKENS);
            tracing::info!(draft = %dir.display(), tokens, layers = draft.layers(), drafts = ?cfg.speculative_drafts.unwrap_or_default(), "speculative decoding on");
            let drafts = cfg.speculative_drafts.unwrap_or_default();
            engine_config.speculation = Some(Speculation { draft: Arc::new(draft), tokens, drafts });
        }
        let engine = Engine::start(model, engine_config)?;
        let model_name = cfg.model_name.clone().unwrap_or_else(|| {
            model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "kimi".into())
        });
        Ok(AppState {
            engine,
            model_name,
            tok,
            grammar,
            env,
            runtime,
            tenants,
            limits: cfg.limits.clone(),
            http: cfg.http.clone(),
            operator: cfg.operator.clone(),
            metrics: Metrics::new(),
            max_context,
            vocab: vocab as u32,
            vision,
            created: openai::unix_now(),
        })
    }

    /// The tenant of a request: its bearer key's, or the anonymous tenant when no key is sent.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        match headers.get(header::AUTHORIZATION) {
            None => self
                .tenants
                .iter()
                .find(|t| t.anonymous)
                .cloned()
                .ok_or_else(|| ApiError::unauthorized("missing API key: send `Authorization: Bearer <key>`")),
            Some(v) => {
                let v = v.to_str().map_err(|_| ApiError::unauthorized("malformed Authorization header"))?;
                let key = v
                    .strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
                    .map(str::trim)
                    .ok_or_else(|| ApiError::unauthorized("Authorization must be `Bearer <key>`"))?;
                let h = key_hash(key);
                if let Some(t) = self.tenants.iter().find(|t| t.has_key_hash(&h)) {
                    return Ok(t.clone());
                }
                // Clients that always send a key (the openai package needs one) still reach the
                // anonymous tenant when it is the only way in and the key is a placeholder.
                match self.tenants.iter().find(|t| t.anonymous) {
                    Some(t) if self.tenants.iter().all(|t| t.anonymous || !t.has_any_key()) => Ok(t.clone()),
                    _ => Err(ApiError::unauthorized("incorrect API key")),
                }
            }
        }
    }
}

/// The checkpoint's vision tower, checked against the text model and tokenizer it feeds.
fn load_vision(
    model_dir: &std::path::Path,
    vc: &serde_json::Value,
    model: &Model,
    tok: &Tokenizer,
) -> Result<VisionModel, ServeError> {
    let err = |msg: String| ServeError::Model { path: model_dir.into(), msg };
    let vm = VisionModel::load(model_dir, vc, model.backend()).map_err(|e| err(format!("vision tower: {e}")))?;
    let hidden = model.text_config().hidden_size;
    if vm.config.text_hidden_size != hidden {
        return Err(err(format!(
            "vision_config.text_hidden_size is {} but the text model's hidden size is {hidden}",
            vm.config.text_hidden_size
        )));
    }
    let pad = tok.special_id("<|media_pad|>");
    if pad.is_none() || model.config.media_placeholder_token_id.is_some_and(|id| Some(id) != pad) {
        return Err(err(format!(
            "media_placeholder_token_id {:?} is not the tokenizer's <|media_pad|> ({pad:?})",
            model.config.media_placeholder_token_id
        )));
    }
    tracing::info!(layers = vm.config.vt_num_hidden_layers, hidden = vm.config.vt_hidden_size, "vision tower loaded");
    Ok(vm)
}

impl AppState {
    /// Whether the request carries one of the operator's keys.
    pub fn is_operator(&self, headers: &HeaderMap) -> bool {
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        key.is_some_and(|k| self.operator.api_key_sha256.iter().any(|h| h.eq_ignore_ascii_case(&key_hash(k))))
    }

    /// Plugins whose breaker is open now, as (tenant, plugin, origin).
    pub fn disabled_plugins(&self) -> Vec<(String, String, tenants::PluginOrigin)> {
        let mut out = Vec::new();
        for t in &self.tenants {
            for p in t.list() {
                if p.health.is_open() {
                    out.push((t.name.clone(), p.name.clone(), p.origin));
                }
            }
        }
        out
    }
}

/// A request body that could not be read: too large (413), too slow (408) or cut off (400).
pub fn body_error(e: axum::extract::rejection::BytesRejection, max_body_bytes: usize) -> ApiError {
    let status = e.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(
            status,
            "invalid_request_error",
            format!("request body exceeds this server's limit of {max_body_bytes} bytes"),
        );
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if err.is::<tower_http::timeout::TimeoutError>() {
            return ApiError {
                code: Some("request_timeout"),
                ..ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "the request body was not received in time",
                )
            };
        }
        source = err.source();
    }
    ApiError::new(status, "invalid_request_error", e.body_text())
}

/// A short, non-secret id of the request's key (for per-key policies and logs).
pub fn key_id(headers: &HeaderMap) -> String {
    match headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        Some(v) => {
            let key = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v).trim();
            key_hash(key)[..12].to_string()
        }
        None => "anonymous".into(),
    }
}

/// Parses a JSON object body: bad UTF-8, bad JSON and non-objects are 400s with the reason.
pub fn json_object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| ApiError::bad(format!("request body is not valid UTF-8: {e}")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(ApiError::bad(format!("request body must be a JSON object, got {}", type_name(&other)))),
        Err(e) => Err(ApiError::bad(format!("request body is not valid JSON: {e}"))),
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub type Shared = Arc<AppState>;

pub fn router(state: Shared) -> Router {
    let limit = state.limits.max_body_bytes;
    let body_timeout = Duration::from_millis(state.http.body_timeout_ms);
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .route("/v1/models", get(models))
        .route("/v1/plugins", get(plugins_api::list).post(plugins_api::upload))
        .route("/v1/plugins/{name}", delete(plugins_api::remove))
        .route("/admin/plugins", get(plugins_api::admin_list))
        .route("/admin/tenants/{tenant}/plugins/{name}/reset", post(plugins_api::admin_reset))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(body_timeout))
        // Outermost last: every request gets an id (kept if the client sent `x-request-id`),
        // a span carrying it (the handler adds the tenant), one log line with its status and
        // latency, and the id echoed in the response.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_request(())
                .on_response(|res: &axum::http::Response<_>, latency: Duration, span: &tracing::Span| {
                    span.record("status", res.status().as_u16());
                    tracing::info!(ms = latency.as_secs_f64() * 1e3, "request");
                })
                .on_failure(()),
        )
        .layer(SetRequestIdLayer::x_request_id(RequestIds))
        .with_state(state)
}

/// Request ids in the same `req-…` form as the rest of the server's ids.
#[derive(Clone, Copy)]
struct RequestIds;

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        axum::http::HeaderValue::from_str(&openai::new_id("req-")).ok().map(RequestId::new)
    }
}

fn request_span<B>(req: &axum::http::Request<B>) -> tracing::Span {
    let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("-");
    tracing::info_span!(
        "request",
        id,
        method = %req.method(),
        path = req.uri().path(),
        tenant = tracing::field::Empty,
        status = tracing::field::Empty,
    )
}

/// The id `SetRequestIdLayer` gave this request.
pub fn request_id(headers: &HeaderMap) -> Option<String> {
    headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} does not accept {method}", uri.path()),
    )
}

/// How long a contained engine fault keeps `/health` at `degraded`.
const RECENT_FAULT_SECS: f64 = 60.0;

/// Readiness: 503 once the engine has stopped (shutdown or a fault), so a load balancer stops
/// sending requests here. A builtin plugin whose breaker is open, or an engine fault in the last
/// minute, makes the status `degraded` (still 200: the other tenants are served); only builtin
/// names are shown, since `/health` needs no key.
async fn health(State(s): State<Shared>) -> Response {
    let stats = &s.engine.stats;
    let alive = s.engine.is_running();
    let disabled = s.disabled_plugins();
    let mut builtins: Vec<&str> =
        disabled.iter().filter(|d| d.2 == tenants::PluginOrigin::Builtin).map(|d| d.1.as_str()).collect();
    builtins.sort_unstable();
    builtins.dedup();
    // A fault the engine contained in the last minute also makes the status `degraded`: the
    // server still serves, but an operator should look at the log.
    let since_fault = stats.seconds_since_fault();
    let recent_fault = since_fault.is_some_and(|s| s < RECENT_FAULT_SECS);
    let status = match (alive, builtins.is_empty() && !recent_fault) {
        (false, _) => "engine stopped",
        (true, false) => "degraded",
        (true, true) => "ok",
    };
    let body = json!({
        "status": status,
        "model": s.model_name,
        "waiting": stats.waiting.load(std::sync::atomic::Ordering::Relaxed),
        "running": stats.running_seqs.load(std::sync::atomic::Ordering::Relaxed),
        "disabled_plugins": disabled.len(),
        "disabled_builtins": builtins,
        "engine_faults": stats.faults.load(std::sync::atomic::Ordering::Relaxed),
        "seconds_since_engine_fault": since_fault.map(|s| s.round()),
    });
    let code = if alive { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, axum::Json(body)).into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = s.authenticate(&headers) {
        return e.into_response();
    }
    axum::Json(json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "kimi-host",
        "max_model_len": s.max_context,
    }]}))
    .into_response()
}

async fn metrics_text(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if s.operator.metrics_require_key && !s.is_operator(&headers) {
        return ApiError::unauthorized("/metrics needs an operator key").into_response();
    }
    let text = s.metrics.render(&s.engine.stats, &s.tenants, s.operator.metrics_plugin_names);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// Serves until SIGTERM / Ctrl-C, then lets running streams finish (up to `grace`; connections
/// still open after that are closed, so a stuck client cannot keep the process alive).
pub async fn serve(state: Shared, listener: tokio::net::TcpListener, grace: Duration) -> Result<(), ServeError> {
    let addr = listener.local_addr().map_err(|e| ServeError::Setup(format!("listener: {e}")))?;
    let engine = state.engine.clone();
    let http = state.http.clone();
    let tenants: Vec<String> = state
        .tenants
        .iter()
        .map(|t| {
            let plugins: Vec<String> = t.list().into_iter().map(|p| p.name).collect();
            format!("{} [{}]", t.name, plugins.join(", "))
        })
        .collect();
    tracing::info!(
        listen = %format!("http://{addr}"),
        model = %state.model_name,
        backend = %engine.backend,
        max_context = state.max_context,
        tenants = %tenants.join("; "),
        "kimi-host serving"
    );
    let app = router(state);
    let shutdown = async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        tracing::info!(grace_s = grace.as_secs_f64(), "shutting down: finishing running requests");
        // Stop admitting and drain on a blocking thread while hyper finishes open responses.
        let e = engine.clone();
        tokio::task::spawn_blocking(move || e.shutdown(grace));
    };
    listener::serve(listener, app, http, shutdown, grace).await;
    Ok(())
}
