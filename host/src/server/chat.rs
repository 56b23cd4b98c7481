//! `/v1/chat/completions` and `/v1/completions`: prepare a request (policies, template, tokenizer,
//! grammar, sampler), run it on the engine, and answer as one JSON body or as SSE chunks.
//! Streaming and non-streaming share one per-sequence accumulator, so both give the same result.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::config::PrefixPartition;
use super::openai::{ApiError, GenParams, gen_params, new_id, unix_now};
use super::tenants::{InFlight, LoadedPlugin, Tenant};
use super::{Shared, json_object};
use crate::engine::{
    EngineError, FinishReason, GenHandle, GenRequest, MediaPrompt, SamplerError, SamplerErrorKind, SamplerRequest,
    SamplingSpec, SeqEvent, TokenLogprob,
};
use crate::model::vision::expand_media_pads;
use crate::plugins::bindings::host::kimi::host::types::RequestInfo;
use crate::plugins::{GrammarRequest, OutputEvent, OutputParser, PluginError, RequestMeta, TemplatePlugin};
use crate::tokenizer::stream::StreamDecoder;
use crate::tokenizer::{Segment, Tokenizer};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

pub async fn chat_completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(s, headers, body, Endpoint::Chat).await
}

pub async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    handle(s, headers, body, Endpoint::Completions).await
}

/// Plugin failures: the request's own fault (bad configuration it asked for) is a 400; a plugin
/// that trapped or timed out is a 500 naming the plugin.
pub fn plugin_error(e: PluginError) -> ApiError {
    match &e {
        PluginError::Guest { client: true, .. } => ApiError::bad(e.to_string()),
        PluginError::RequestTooLarge { .. } => {
            ApiError { code: Some("request_too_large"), ..ApiError::bad(e.to_string()) }
        }
        PluginError::Disabled { .. } => ApiError {
            code: Some("plugin_disabled"),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string())
        },
        _ => ApiError::internal(e.to_string()),
    }
}

/// A sampler's failure, by the kind the engine reports.
fn sampler_error(e: SamplerError) -> ApiError {
    match e.kind {
        SamplerErrorKind::Request => ApiError::bad(e.message),
        SamplerErrorKind::TooLarge => ApiError { code: Some("request_too_large"), ..ApiError::bad(e.message) },
        SamplerErrorKind::Disabled => ApiError {
            code: Some("plugin_disabled"),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.message)
        },
        SamplerErrorKind::Internal => ApiError::internal(e.message),
    }
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::PoolTimeout(_) | EngineError::QueueFull => ApiError::busy(e.to_string(), 1),
        EngineError::TooLarge { .. } | EngineError::Invalid(_) => ApiError::bad(e.to_string()),
        EngineError::ShuttingDown => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string()),
        EngineError::Sampler(e) => sampler_error(e),
        EngineError::Model(_) | EngineError::Constraint(_) | EngineError::Fault(_) => ApiError::internal(e.to_string()),
    }
}

async fn handle(s: Shared, headers: HeaderMap, body: Result<Bytes, BytesRejection>, ep: Endpoint) -> Response {
    let t0 = Instant::now();
    let tenant = match s.authenticate(&headers) {
        Ok(t) => t,
        Err(e) => {
            s.metrics.request("-", ep.path(), e.status.as_u16());
            return e.into_response();
        }
    };
    tracing::Span::current().record("tenant", tenant.name.as_str());
    let request_id = super::request_id(&headers).unwrap_or_else(|| new_id("req-"));
    let r = run(&s, &tenant, super::key_id(&headers), request_id, body, ep, t0).await;
    let (status, resp) = match r {
        Ok(resp) => (resp.status().as_u16(), resp),
        Err(e) => (e.status.as_u16(), e.into_response()),
    };
    s.metrics.request(&tenant.name, ep.path(), status);
    resp
}

async fn run(
    s: &Shared,
    tenant: &Arc<Tenant>,
    key_id: String,
    request_id: String,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
    t0: Instant,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| super::body_error(e, s.limits.max_body_bytes))?;
    let obj = json_object(&body)?;
    let params = gen_params(&obj, s.limits.max_n, s.vocab)?;
    if params.model != s.model_name {
        return Err(ApiError {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..ApiError::not_found(format!(
                "the model `{}` does not exist; this server has `{}`",
                params.model, s.model_name
            ))
        });
    }
    let Some(in_flight) = tenant.enter() else {
        return Err(ApiError::busy(
            format!("too many concurrent requests for this tenant (limit {})", tenant.max_concurrency),
            1,
        ));
    };
    let prep = {
        let (s, tenant, params) = (s.clone(), tenant.clone(), params.clone());
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            span.in_scope(|| prepare(&s, &tenant, key_id, request_id, obj, &params, ep))
        })
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??
    };
    let Prepared { request, template, parser_info, admitted, prompt_len } = prep;
    let n = request.n;
    let stop_tokens = request.stop_tokens.clone();
    let mut handle = s.engine.submit(request).map_err(engine_error)?;
    // Wait for the first event so that a refusal (e.g. the pool stayed full) is a real status. A
    // stream waits at most one keep-alive interval: past that it starts (200), keeps the
    // connection alive with SSE comments, and reports a later refusal as an error event.
    let first = if params.stream {
        let wait = std::time::Duration::from_millis(s.http.sse_keepalive_ms);
        match tokio::time::timeout(wait, handle.events.recv()).await {
            Ok(Some(ev)) => Some(ev),
            Ok(None) => return Err(ApiError::internal("the engine stopped before answering")),
            Err(_) => None,
        }
    } else {
        handle.events.recv().await
    };
    if let Some(SeqEvent::Failed { index: None, error }) = &first {
        return Err(engine_error(error.clone()));
    }
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let parser = match (&template, ep) {
            (Some(t), Endpoint::Chat) => Some(t.parser(&s.env, &tenant.services, &parser_info).map_err(plugin_error)?),
            _ => None,
        };
        outs.push(SeqOut::new(i, parser, params.stop.clone(), params.logprobs.is_some()));
    }
    let run = Run {
        s: s.clone(),
        tenant: tenant.clone(),
        params,
        ep,
        id: new_id(if ep == Endpoint::Chat { "chatcmpl-" } else { "cmpl-" }),
        created: unix_now(),
        prompt_len,
        admitted,
        t0,
        _in_flight: in_flight,
        first_token: None,
        stop_tokens,
        cached_tokens: 0,
    };
    if run.params.stream {
        let keepalive = std::time::Duration::from_millis(s.http.sse_keepalive_ms);
        Ok(stream(run, handle, outs, first, keepalive))
    } else {
        collect(run, handle, outs, first).await
    }
}

struct Prepared {
    request: GenRequest,
    template: Option<Arc<TemplatePlugin>>,
    parser_info: RequestInfo,
    admitted: Admitted,
    prompt_len: usize,
}

fn pick<'a>(tenant: &'a Tenant, chosen: &'a Option<String>, default: &'a str) -> Result<LoadedPlugin, ApiError> {
    let name = chosen.as_deref().unwrap_or(default);
    tenant
        .plugin(name)
        .map(|p| p.plugin)
        .ok_or_else(|| ApiError::param("plugins", format!("this tenant has no plugin named `{name}`")))
}

/// SHA-256 (hex) over the request's image URLs, in order, or "" without images: images render
/// to placeholder ids, so the prefix cache's key must carry their content.
fn image_digest(obj: &Map<String, Value>) -> String {
    use sha2::{Digest, Sha256};
    let urls = super::images::image_urls(obj);
    if urls.is_empty() {
        return String::new();
    }
    let mut h = Sha256::new();
    for url in urls {
        h.update(url.unwrap_or("").as_bytes());
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Thinking-related fields of a chat body, for the parser and grammar plugins.
fn thinking_fields(obj: &Map<String, Value>) -> Value {
    let mut t = Map::new();
    for k in ["thinking", "reasoning_effort", "chat_template_kwargs"] {
        if let Some(v) = obj.get(k) {
            t.insert(k.into(), v.clone());
        }
    }
    Value::Object(t)
}

fn prepare(
    s: &Shared,
    tenant: &Arc<Tenant>,
    key_id: String,
    request_id: String,
    obj: Map<String, Value>,
    p: &GenParams,
    ep: Endpoint,
) -> Result<Prepared, ApiError> {
    let info = RequestInfo {
        tenant: tenant.name.clone(),
        request_id: request_id.clone(),
        model: s.model_name.clone(),
        params_json: p.sampling_json.clone(),
    };
    super::bounds::check(&obj, &s.limits)?;
    let body_json = Value::Object(obj.clone()).to_string();
    let PromptPlan { ids: prompt, media, stops: stop_tokens, template, grammar_job } = match ep {
        Endpoint::Chat => chat_prompt(s, tenant, p, &obj, &info, &body_json)?,
        Endpoint::Completions => completion_prompt(s, &obj)?,
    };
    let max_tokens = room_for(s, prompt.len(), p.max_tokens)?;
    // Planned and compiled only now that the prompt is known to fit (compiling costs more).
    let constraint = match grammar_job {
        Some((g, gr)) => match g.plan(&s.env, &tenant.services, &info, &gr).map_err(plugin_error)? {
            Some(c) => Some(s.grammar.matcher(&c).map_err(|e| ApiError::bad(format!("constraint: {e}")))?),
            None => None,
        },
        None => None,
    };
    // Policies see the final token counts.
    let meta = RequestMeta {
        tenant: tenant.name.clone(),
        key_id,
        model: s.model_name.clone(),
        path: ep.path().into(),
        prompt_tokens: prompt.len() as u32,
        max_tokens: max_tokens as u32,
        n: p.n as u32,
        streaming: p.stream,
    };
    let admitted = admit(s, tenant, meta, &body_json)?;

    let sampler = match pick(tenant, &p.sampler, &tenant.default_sampler)? {
        LoadedPlugin::Sampler(x) => x,
        other => {
            return Err(ApiError::param(
                "plugins",
                format!("that plugin is a {} plugin, not a sampler", other.kind().name()),
            ));
        }
    };
    let seed = p.seed.unwrap_or_else(|| {
        use rand::RngExt;
        rand::rng().random()
    });
    let parser_info = RequestInfo { params_json: thinking_fields(&obj).to_string(), ..info.clone() };
    let prompt_len = prompt.len();
    // The prefix-cache partition: the tenant's own (its name) or the shared one, narrowed by the
    // request's `cache_salt` and its images' content. What is hashed are the rendered ids, after
    // the template.
    let request_salt = format!("{}\u{0}{}", p.cache_salt.as_deref().unwrap_or(""), image_digest(&obj));
    let cache_salt = match tenant.prefix_cache {
        PrefixPartition::Off => None,
        PrefixPartition::Tenant => Some(format!("tenant\u{0}{}\u{0}{request_salt}", tenant.name)),
        PrefixPartition::Shared => Some(format!("shared\u{0}\u{0}{request_salt}")),
    };
    Ok(Prepared {
        request: GenRequest {
            prompt,
            max_tokens,
            n: p.n,
            stop_tokens,
            constraint,
            sampling: SamplingSpec {
                sampler,
                params_json: p.sampling_json.clone(),
                seed,
                info: SamplerRequest {
                    tenant: info.tenant,
                    request_id: info.request_id,
                    model: info.model,
                    params_json: info.params_json,
                },
            },
            logprobs: p.logprobs,
            cache_salt: if s.engine.config.prefix_cache { cache_salt } else { None },
            media,
        },
        template,
        parser_info,
        admitted,
        prompt_len,
    })
}

/// A request's prompt ids and stop tokens, the template that rendered them (chat), and the
/// grammar plugin call still to make.
struct PromptPlan {
    ids: Vec<u32>,
    /// The prompt's images (their `<|media_pad|>` already expanded in `ids`).
    media: Option<Arc<MediaPrompt>>,
    stops: Vec<u32>,
    template: Option<Arc<TemplatePlugin>>,
    grammar_job: Option<(Arc<crate::plugins::GrammarPlugin>, GrammarRequest)>,
}

/// Decodes and preprocesses a chat request's images (in prompt order, as the template rendered
/// their `<|media_pad|>` blocks) and expands each pad into the image's token count.
fn prompt_images(
    s: &Shared,
    obj: &Map<String, Value>,
    ids: Vec<u32>,
    pad: u32,
) -> Result<(Vec<u32>, MediaPrompt), ApiError> {
    let Some(vision) = &s.vision else {
        return Err(ApiError::param(
            "messages",
            "images are not supported by this model (the checkpoint has no vision tower)",
        ));
    };
    let urls = super::images::image_urls(obj);
    let pads = ids.iter().filter(|&&t| t == pad).count();
    if pads != urls.len() {
        return Err(ApiError::param(
            "messages",
            format!("the rendered prompt has {pads} image placeholders for {} images", urls.len()),
        ));
    }
    let caps = super::images::ImageCaps { max_bytes: s.limits.max_image_bytes, max_pixels: s.limits.max_image_pixels };
    let mut items = Vec::with_capacity(urls.len());
    let mut patches = 0usize;
    for (i, url) in urls.iter().enumerate() {
        let url = url.ok_or_else(|| ApiError::param("messages", format!("image {}: no url", i + 1)))?;
        let img = super::images::decode_data_uri(url, i, caps)?;
        // The patch count is known from the resize plan: check it before resizing.
        let plan = vision.media.plan(img.width, img.height);
        let grid = plan.grid_thw(&vision.media);
        patches += grid.iter().product::<usize>();
        if patches > s.limits.max_image_patches {
            return Err(ApiError {
                code: Some("request_too_large"),
                ..ApiError::param(
                    "messages",
                    format!(
                        "the images come to over {} vision patches, this server's limit per request",
                        s.limits.max_image_patches
                    ),
                )
            });
        }
        items.push(vision.preprocess(&img).input);
    }
    let tokens: Vec<usize> = items.iter().map(|i| i.tokens()).collect();
    let (ids, positions) =
        expand_media_pads(&ids, pad, &tokens).map_err(|e| ApiError::param("messages", e.to_string()))?;
    Ok((ids, MediaPrompt { items, positions }))
}

/// Chat: the template plugin renders the messages; the tenant's grammar plugin will turn tools,
/// tool_choice, response_format and the thinking budget into a constraint.
fn chat_prompt(
    s: &Shared,
    tenant: &Arc<Tenant>,
    p: &GenParams,
    obj: &Map<String, Value>,
    info: &RequestInfo,
    body_json: &str,
) -> Result<PromptPlan, ApiError> {
    match obj.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => {}
        Some(Value::Array(_)) => return Err(ApiError::param("messages", "messages must not be empty")),
        None => return Err(ApiError::param("messages", "messages is required")),
        Some(v) => {
            return Err(ApiError::param("messages", format!("messages must be an array, got {}", super::type_name(v))));
        }
    }
    let t = match pick(tenant, &p.template, &tenant.default_template)? {
        LoadedPlugin::Template(t) => t,
        other => {
            return Err(ApiError::param(
                "plugins",
                format!("that plugin is a {} plugin, not a template", other.kind().name()),
            ));
        }
    };
    let rendered = t.render(&s.env, &tenant.services, info, body_json).map_err(plugin_error)?;
    let segs: Vec<Segment> = rendered.segments.into_iter().map(Segment::from).collect();
    let ids = s.tok.encode_segments(&segs).map_err(|e| ApiError::bad(format!("prompt: {e}")))?;
    let (ids, media) = match s.tok.special_id("<|media_pad|>") {
        Some(pad) if ids.contains(&pad) => {
            let (ids, media) = prompt_images(s, obj, ids, pad)?;
            (ids, Some(Arc::new(media)))
        }
        _ => (ids, None),
    };
    let mut stops: Vec<u32> = rendered.stop_specials.iter().filter_map(|n| s.tok.special_id(n)).collect();
    if stops.is_empty() {
        stops = s.env.eos_tokens.clone();
    }
    let mut grammar_job = None;
    if let Some(g) = p.grammar.as_deref().or(tenant.default_grammar.as_deref()) {
        let g = match tenant.plugin(g).map(|e| e.plugin) {
            Some(LoadedPlugin::Grammar(g)) => g,
            Some(other) => {
                return Err(ApiError::param(
                    "plugins",
                    format!("`{g}` is a {} plugin, not a grammar", other.kind().name()),
                ));
            }
            None => return Err(ApiError::param("plugins", format!("this tenant has no plugin named `{g}`"))),
        };
        let field = |k: &str| obj.get(k).filter(|v| !v.is_null()).map(Value::to_string);
        let gr = GrammarRequest {
            tools_json: field("tools"),
            tool_choice_json: field("tool_choice"),
            response_format_json: field("response_format"),
            thinking_json: Some(thinking_fields(obj).to_string()),
            thinking_budgets: tenant.thinking_budgets.clone(),
        };
        grammar_job = Some((g, gr));
    }
    Ok(PromptPlan { ids, media, stops, template: Some(t), grammar_job })
}

/// Completions: the prompt is plain text only, so user text never becomes a special token.
fn completion_prompt(s: &Shared, obj: &Map<String, Value>) -> Result<PromptPlan, ApiError> {
    let text = match obj.get("prompt") {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        None => return Err(ApiError::param("prompt", "prompt is required")),
        Some(_) => return Err(ApiError::param("prompt", "prompt must be a string (one prompt per request)")),
    };
    Ok(PromptPlan {
        ids: s.tok.encode_text(&text),
        media: None,
        stops: s.env.eos_tokens.clone(),
        template: None,
        grammar_job: None,
    })
}

/// `max_tokens` for a prompt of `prompt_len`: the request's if it fits the context, else the
/// default capped by the room left; a prompt that leaves no room is refused.
fn room_for(s: &Shared, prompt_len: usize, asked: Option<usize>) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    if prompt_len >= s.max_context {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::param(
                "messages",
                format!("the prompt is {prompt_len} tokens; this model's context is {} tokens", s.max_context),
            )
        });
    }
    let room = s.max_context - prompt_len;
    match asked {
        Some(m) if m > room => Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::param(
                "max_tokens",
                format!(
                    "max_tokens is {m}, but the prompt is {prompt_len} tokens and the context is {} ({room} left)",
                    s.max_context
                ),
            )
        }),
        Some(m) => Ok(m),
        None => Ok(s.limits.default_max_tokens.min(room)),
    }
}

/// Every policy of the tenant, in order; the first refusal is the answer (the policies that had
/// already admitted it are told at once that it ended with nothing generated).
fn admit(s: &Shared, tenant: &Arc<Tenant>, meta: RequestMeta, body_json: &str) -> Result<Admitted, ApiError> {
    let mut admitted =
        Admitted { s: s.clone(), tenant: tenant.clone(), meta, policies: 0, completion: None, generated: 0 };
    for (name, config) in &tenant.policies {
        // A configured policy cannot be removed by the tenant; if it is missing anyway, fail
        // closed rather than serve without the limits it enforces.
        let Some(LoadedPlugin::Policy(policy)) = tenant.plugin(name).map(|e| e.plugin) else {
            tracing::error!(tenant = %tenant.name, policy = %name, "configured policy is missing; refusing the request");
            return Err(ApiError::internal(format!("this tenant's policy `{name}` is unavailable")));
        };
        let verdict = policy
            .admit(&s.env, &tenant.services, &tenant.name, config, &admitted.meta, body_json)
            .map_err(plugin_error)?;
        match verdict {
            crate::plugins::Admission::Allow => admitted.policies += 1,
            crate::plugins::Admission::Reject(r) => {
                let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
                let kind =
                    if status == StatusCode::TOO_MANY_REQUESTS { "rate_limit_error" } else { "invalid_request_error" };
                return Err(ApiError {
                    retry_after: r.retry_after_ms.map(|ms| ms.div_ceil(1000).max(1)),
                    ..ApiError::new(status, kind, r.message)
                });
            }
        }
    }
    Ok(admitted)
}

/// A request admitted by the first `policies` of its tenant's policies. Each of them hears how
/// it ended exactly once — when this is dropped, however the request ended (finished, failed
/// after admission, or left by its client) — so concurrency slots and reserved tokens always
/// come back.
struct Admitted {
    s: Shared,
    tenant: Arc<Tenant>,
    meta: RequestMeta,
    policies: usize,
    /// Completion tokens of a request that finished normally.
    completion: Option<u32>,
    /// Tokens generated so far (what an abandoned request reports).
    generated: u32,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.policies == 0 {
            return;
        }
        let (s, tenant, meta, n) = (self.s.clone(), self.tenant.clone(), self.meta.clone(), self.policies);
        let (prompt, completion) = (meta.prompt_tokens, self.completion.unwrap_or(self.generated));
        let tell = move || {
            for (name, config) in tenant.policies.iter().take(n) {
                if let Some(LoadedPlugin::Policy(p)) = tenant.plugin(name).map(|e| e.plugin) {
                    let _ = p.on_complete(&s.env, &tenant.services, &tenant.name, config, &meta, prompt, completion);
                }
            }
        };
        // Plugin calls block: off the async workers when there are some.
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(tell)),
            Err(_) => tell(),
        }
    }
}

/// A request being answered.
struct Run {
    s: Shared,
    tenant: Arc<Tenant>,
    params: GenParams,
    ep: Endpoint,
    id: String,
    created: u64,
    prompt_len: usize,
    /// The policies' side of the request: told how it ended when `Run` is dropped.
    admitted: Admitted,
    t0: Instant,
    _in_flight: InFlight,
    first_token: Option<Instant>,
    /// The tokens that end a sequence (kept out of text, logprobs stay with the text).
    stop_tokens: Vec<u32>,
    /// Prompt tokens served from the prefix cache (`usage.prompt_tokens_details`).
    cached_tokens: usize,
}

/// What one step of a sequence adds to its answer.
#[derive(Debug, Clone)]
enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall { index: usize, id: String, name: String, arguments: String },
}

/// One sequence's answer so far.
struct SeqOut {
    index: usize,
    parser: Option<OutputParser>,
    /// Content text → stop strings (and UTF-8 completion for raw completions).
    text: StreamDecoder,
    /// The parser failed: the rest of the output is shown as plain text.
    raw: bool,
    reasoning: String,
    content: String,
    tool_calls: Vec<(String, String, String)>,
    tokens: usize,
    logprobs: Vec<(u32, TokenLogprob)>,
    want_logprobs: bool,
    finish: Option<&'static str>,
    last_token: Option<Instant>,
}

impl SeqOut {
    fn new(index: usize, parser: Option<OutputParser>, stops: Vec<String>, want_logprobs: bool) -> SeqOut {
        SeqOut {
            index,
            parser,
            text: StreamDecoder::new(stops),
            raw: false,
            reasoning: String::new(),
            content: String::new(),
            tool_calls: Vec::new(),
            tokens: 0,
            logprobs: Vec::new(),
            want_logprobs,
            finish: None,
            last_token: None,
        }
    }

    fn done(&self) -> bool {
        self.finish.is_some()
    }

    /// Content text through the stop-string filter; a stop ends the sequence.
    fn content_delta(&mut self, text: &str, out: &mut Vec<Delta>) {
        let o = self.text.push_bytes(text.as_bytes());
        if !o.text.is_empty() {
            self.content.push_str(&o.text);
            out.push(Delta::Content(o.text));
        }
        if o.stop.is_some() {
            self.finish = Some("stop");
        }
    }

    fn parsed(&mut self, events: Vec<OutputEvent>, out: &mut Vec<Delta>) {
        for e in events {
            if self.done() {
                return;
            }
            match e {
                OutputEvent::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    out.push(Delta::Reasoning(t));
                }
                OutputEvent::Content(t) => self.content_delta(&t, out),
                OutputEvent::ToolCall(c) => {
                    let id = new_id("call_");
                    let index = self.tool_calls.len();
                    self.tool_calls.push((id.clone(), c.name.clone(), c.arguments_json.clone()));
                    out.push(Delta::ToolCall { index, id, name: c.name, arguments: c.arguments_json });
                }
            }
        }
    }

    fn on_token(&mut self, tok: &Tokenizer, id: u32, logprob: Option<TokenLogprob>, is_stop: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.done() {
            return out;
        }
        self.tokens += 1;
        if let (true, Some(lp)) = (self.want_logprobs && !is_stop, logprob) {
            self.logprobs.push((id, lp));
        }
        match (&mut self.parser, self.raw) {
            (Some(p), false) => match p.feed(&[id]) {
                Ok(ev) => self.parsed(ev, &mut out),
                Err(e) => {
                    tracing::warn!("output parser: {e}; showing the rest as text");
                    self.raw = true;
                }
            },
            _ => {
                if !is_stop && !tok.is_special(id) {
                    let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
                    let o = self.text.push_bytes(&bytes);
                    if !o.text.is_empty() {
                        self.content.push_str(&o.text);
                        out.push(Delta::Content(o.text));
                    }
                    if o.stop.is_some() {
                        self.finish = Some("stop");
                    }
                }
            }
        }
        out
    }

    fn on_finish(&mut self, reason: FinishReason) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.done() {
            return out;
        }
        if let (Some(p), false) = (&mut self.parser, self.raw) {
            match p.finish() {
                Ok(ev) => self.parsed(ev, &mut out),
                // A call cut off by max_tokens is dropped: a partial call is not a call.
                Err(e) => tracing::debug!("output parser at end: {e}"),
            }
        }
        if !self.done() {
            let o = self.text.finish();
            if !o.text.is_empty() {
                self.content.push_str(&o.text);
                out.push(Delta::Content(o.text));
            }
            self.finish = Some(match reason {
                _ if o.stop.is_some() => "stop",
                FinishReason::Stop if !self.tool_calls.is_empty() => "tool_calls",
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            });
        }
        out
    }

    fn logprobs_json(&self, tok: &Tokenizer, chat: bool, from: usize) -> Value {
        let text = |id: u32| String::from_utf8_lossy(tok.token_bytes(id).unwrap_or_default()).into_owned();
        let bytes = |id: u32| tok.token_bytes(id).unwrap_or_default().to_vec();
        let entries = &self.logprobs[from.min(self.logprobs.len())..];
        if chat {
            let content: Vec<Value> = entries
                .iter()
                .map(|(id, lp)| {
                    json!({"token": text(*id), "logprob": lp.logprob, "bytes": bytes(*id),
                        "top_logprobs": lp.top.iter().map(|(t, l)| json!({"token": text(*t), "logprob": l, "bytes": bytes(*t)})).collect::<Vec<_>>()})
                })
                .collect();
            json!({"content": content})
        } else {
            json!({
                "tokens": entries.iter().map(|(id, _)| text(*id)).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|(_, lp)| lp.logprob).collect::<Vec<_>>(),
                "top_logprobs": entries.iter().map(|(_, lp)| {
                    let m: Map<String, Value> = lp.top.iter().map(|(t, l)| (text(*t), json!(l))).collect();
                    Value::Object(m)
                }).collect::<Vec<_>>(),
            })
        }
    }
}

impl Run {
    fn usage(&self, outs: &[SeqOut]) -> Value {
        let completion: usize = outs.iter().map(|o| o.tokens).sum();
        json!({"prompt_tokens": self.prompt_len, "completion_tokens": completion, "total_tokens": self.prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }

    /// Applies one engine event; returns (sequence index, deltas), or an error for the request.
    fn apply(&mut self, ev: SeqEvent, outs: &mut [SeqOut]) -> Result<Option<(usize, Vec<Delta>)>, ApiError> {
        match ev {
            SeqEvent::Cached { tokens } => {
                self.cached_tokens = tokens;
                Ok(None)
            }
            SeqEvent::Token { index, id, logprob } => {
                self.admitted.generated = self.admitted.generated.saturating_add(1);
                let now = Instant::now();
                if self.first_token.is_none() {
                    self.first_token = Some(now);
                    self.s.metrics.ttft.observe(now.duration_since(self.t0).as_secs_f64());
                }
                let Some(o) = outs.get_mut(index) else { return Ok(None) };
                if let Some(last) = o.last_token {
                    self.s.metrics.inter_token.observe(now.duration_since(last).as_secs_f64());
                }
                o.last_token = Some(now);
                let d = o.on_token(&self.s.tok, id, logprob, self.stop_tokens.contains(&id));
                Ok(Some((index, d)))
            }
            SeqEvent::Finished { index, reason } => {
                let Some(o) = outs.get_mut(index) else { return Ok(None) };
                Ok(Some((index, o.on_finish(reason))))
            }
            SeqEvent::Failed { index, error } => {
                let e = engine_error(error);
                Err(ApiError {
                    message: match index {
                        Some(i) => format!("choice {i}: {}", e.message),
                        None => e.message,
                    },
                    ..e
                })
            }
        }
    }

    /// Accounting once the request is over.
    fn complete(&mut self, outs: &[SeqOut]) {
        let completion: usize = outs.iter().map(|o| o.tokens).sum();
        let t = crate::server::metrics::TenantLabels { tenant: self.tenant.name.clone() };
        self.s.metrics.prompt_tokens.get_or_create(&t).inc_by(self.prompt_len as u64);
        self.s.metrics.completion_tokens.get_or_create(&t).inc_by(completion as u64);
        self.s.metrics.request_seconds.observe(self.t0.elapsed().as_secs_f64());
        // The policies are told when `admitted` is dropped, with this count.
        self.admitted.completion = Some(completion as u32);
    }

    fn message(&self, o: &SeqOut) -> Value {
        let mut m = json!({"role": "assistant", "content": if o.content.is_empty() && !o.tool_calls.is_empty() { Value::Null } else { json!(o.content) }});
        if !o.reasoning.is_empty() {
            m["reasoning_content"] = json!(o.reasoning);
        }
        if !o.tool_calls.is_empty() {
            m["tool_calls"] = o
                .tool_calls
                .iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect();
        }
        m
    }

    fn chunk(&self, choices: Vec<Value>) -> Value {
        let object = if self.ep == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.s.model_name, "choices": choices})
    }

    fn delta_choice(&self, index: usize, d: &Delta) -> Value {
        if self.ep == Endpoint::Completions {
            let Delta::Content(t) = d else { return Value::Null };
            return json!({"index": index, "text": t, "logprobs": null, "finish_reason": null});
        }
        let delta = match d {
            Delta::Reasoning(t) => json!({"reasoning_content": t}),
            Delta::Content(t) => json!({"content": t}),
            Delta::ToolCall { index: k, id, name, arguments } => {
                json!({"tool_calls": [{"index": k, "id": id, "type": "function",
                "function": {"name": name, "arguments": arguments}}]})
            }
        };
        json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null})
    }
}

async fn collect(
    mut run: Run,
    mut handle: GenHandle,
    mut outs: Vec<SeqOut>,
    first: Option<SeqEvent>,
) -> Result<Response, ApiError> {
    let mut next = first;
    while outs.iter().any(|o| !o.done()) {
        let Some(ev) = next.take() else {
            match handle.events.recv().await {
                Some(ev) => {
                    next = Some(ev);
                    continue;
                }
                None => return Err(ApiError::internal("the engine ended the request without finishing it")),
            }
        };
        if let Some((i, _)) = run.apply(ev, &mut outs)?
            && outs[i].done()
        {
            handle.cancel(i);
        }
    }
    drop(handle);
    run.complete(&outs);
    let chat = run.ep == Endpoint::Chat;
    let choices: Vec<Value> = outs
        .iter()
        .map(|o| {
            let lp = if o.want_logprobs { o.logprobs_json(&run.s.tok, chat, 0) } else { Value::Null };
            if chat {
                json!({"index": o.index, "message": run.message(o), "logprobs": lp, "finish_reason": o.finish})
            } else {
                json!({"index": o.index, "text": o.content, "logprobs": lp, "finish_reason": o.finish})
            }
        })
        .collect();
    let object = if chat { "chat.completion" } else { "text_completion" };
    let body = json!({"id": run.id, "object": object, "created": run.created, "model": run.s.model_name,
        "choices": choices, "usage": run.usage(&outs)});
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn sse(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

fn done() -> Event {
    Event::default().data("[DONE]")
}

/// SSE: role first, then deltas as they become certain, a final chunk per choice with its finish
/// reason, optional usage, `[DONE]`. A client that goes away drops the channel, which drops the
/// engine handle, which frees the request's state at the engine's next step. Idle for
/// `keepalive` (queued, prefilling), the stream sends a `: keep-alive` comment.
fn stream(
    mut run: Run,
    mut handle: GenHandle,
    mut outs: Vec<SeqOut>,
    first: Option<SeqEvent>,
    keepalive: std::time::Duration,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let chat = run.ep == Endpoint::Chat;
        if chat {
            let roles: Vec<Value> = (0..outs.len())
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            if tx.send(Ok(sse(&run.chunk(roles)))).await.is_err() {
                return;
            }
        }
        let mut next = first;
        let mut sent_logprobs = vec![0usize; outs.len()];
        let mut sent_finish = vec![false; outs.len()];
        while outs.iter().any(|o| !o.done()) {
            let ev = match next.take() {
                Some(ev) => ev,
                None => match handle.events.recv().await {
                    Some(ev) => ev,
                    None => {
                        // The engine went away without finishing these choices: say so.
                        let e = ApiError::internal("the engine stopped before finishing this stream");
                        let _ = tx.send(Ok(sse(&e.body()))).await;
                        let _ = tx.send(Ok(done())).await;
                        return;
                    }
                },
            };
            match run.apply(ev, &mut outs) {
                Ok(Some((i, deltas))) => {
                    if sent_finish[i] {
                        continue;
                    }
                    // One choice per chunk (clients read `choices[0]`): a chunk per delta, the
                    // event's logprobs on the first, the finish reason on the last.
                    let mut choices: Vec<Value> =
                        deltas.iter().map(|d| run.delta_choice(i, d)).filter(|c| !c.is_null()).collect();
                    let empty = || {
                        if chat {
                            json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": null})
                        } else {
                            json!({"index": i, "text": "", "logprobs": null, "finish_reason": null})
                        }
                    };
                    if outs[i].want_logprobs && outs[i].logprobs.len() > sent_logprobs[i] {
                        let lp = outs[i].logprobs_json(&run.s.tok, chat, sent_logprobs[i]);
                        sent_logprobs[i] = outs[i].logprobs.len();
                        if choices.is_empty() {
                            choices.push(empty());
                        }
                        choices[0]["logprobs"] = lp;
                    }
                    if let Some(reason) = outs[i].finish {
                        handle.cancel(i);
                        sent_finish[i] = true;
                        if choices.is_empty() {
                            choices.push(empty());
                        }
                        if let Some(last) = choices.last_mut() {
                            last["finish_reason"] = json!(reason);
                        }
                    }
                    for c in choices {
                        if tx.send(Ok(sse(&run.chunk(vec![c])))).await.is_err() {
                            return;
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let _ = tx.send(Ok(sse(&e.body()))).await;
                    let _ = tx.send(Ok(done())).await;
                    return;
                }
            }
        }
        drop(handle);
        run.complete(&outs);
        if run.params.include_usage {
            let mut c = run.chunk(Vec::new());
            c["usage"] = run.usage(&outs);
            let _ = tx.send(Ok(sse(&c))).await;
        }
        let _ = tx.send(Ok(done())).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
        .into_response()
}
