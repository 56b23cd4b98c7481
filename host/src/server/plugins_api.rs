//! `/v1/plugins`: a tenant uploads, lists and removes its own components. An upload goes through
//! the platform's checks (world, imports, compilation, a trial instantiation) before it is stored;
//! it is visible to its tenant only.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};

use super::openai::ApiError;
use super::tenants::{MAX_COMPONENT_BYTES, PluginEntry, PluginListError, PluginOrigin, instantiate};
use super::{Shared, json_object};
use crate::plugins::PluginKind;

fn entry_json(p: &PluginEntry) -> Value {
    json!({"name": p.name, "kind": p.plugin.kind().name(), "sha256": p.sha256, "builtin": p.origin == PluginOrigin::Builtin, "origin": p.origin.name(), "object": "plugin"})
}

pub async fn list(State(s): State<Shared>, headers: HeaderMap) -> Response {
    let tenant = match s.authenticate(&headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let data: Vec<Value> = tenant.list().iter().map(entry_json).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Body: `{"kind": "sampler", "name": "my-sampler", "component": "<base64 of the .wasm>"}`.
pub async fn upload(State(s): State<Shared>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let tenant = match s.authenticate(&headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let r = async {
        if !tenant.allow_uploads {
            return Err(ApiError::new(StatusCode::FORBIDDEN, "permission_error", "this tenant may not upload plugins"));
        }
        let body = body.map_err(|e| super::body_error(e, s.limits.max_body_bytes))?;
        let obj = json_object(&body)?;
        let field = |k: &str| {
            obj.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::param(k, format!("`{k}` (a string) is required")))
        };
        let kind = PluginKind::parse(field("kind")?)
            .ok_or_else(|| ApiError::param("kind", "kind is one of sampler, grammar, template, policy"))?;
        let name = field("name")?.to_string();
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !valid {
            return Err(ApiError::param("name", "names are 1–64 characters of letters, digits, `-`, `_` and `.`"));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(field("component")?.as_bytes())
            .map_err(|e| ApiError::param("component", format!("component is not base64: {e}")))?;
        if bytes.len() > MAX_COMPONENT_BYTES {
            return Err(ApiError::param("component", format!("components are at most {MAX_COMPONENT_BYTES} bytes")));
        }
        let (s2, tenant2) = (s.clone(), tenant.clone());
        let entry = tokio::task::spawn_blocking(move || {
            let compiled = s2.runtime.load(&name, &bytes).map_err(|e| ApiError::param("component", e.to_string()))?;
            if compiled.kind != kind {
                return Err(ApiError::param(
                    "kind",
                    format!("the component is a {} plugin, not a {}", compiled.kind.name(), kind.name()),
                ));
            }
            let plugin = instantiate(&s2.runtime, &compiled, &s2.env, &tenant2.services, &tenant2.name)
                .map_err(|e| ApiError::param("component", e.to_string()))?;
            let health = plugin.health();
            Ok(PluginEntry { name, sha256: compiled.sha256.clone(), origin: PluginOrigin::Upload, plugin, health })
        })
        .await
        .map_err(|e| ApiError::internal(format!("upload failed: {e}")))??;
        let out = entry_json(&entry);
        tenant.add_upload(entry).map_err(list_error)?;
        Ok(out)
    }
    .await;
    match r {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn list_error(e: PluginListError) -> ApiError {
    match e {
        PluginListError::NotFound(m) => ApiError::not_found(m),
        PluginListError::Reserved(m) => ApiError::new(StatusCode::FORBIDDEN, "permission_error", m),
        PluginListError::Full(m) => ApiError::bad(m),
    }
}

pub async fn remove(
    State(s): State<Shared>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Response {
    let tenant = match s.authenticate(&headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let name = match name {
        Ok(Path(n)) => n,
        Err(e) => {
            return ApiError::param("name", format!("bad plugin name in the path: {}", e.body_text())).into_response();
        }
    };
    match tenant.remove_upload(&name) {
        Ok(()) => axum::Json(json!({"name": name, "object": "plugin", "deleted": true})).into_response(),
        Err(e) => list_error(e).into_response(),
    }
}

/// `GET /admin/plugins` (operator key): every tenant's plugins with their breaker state.
pub async fn admin_list(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if !s.is_operator(&headers) {
        return ApiError::unauthorized("this endpoint needs an operator key").into_response();
    }
    let mut data = Vec::new();
    for t in &s.tenants {
        for p in t.list() {
            let mut v = entry_json(&p);
            v["tenant"] = json!(t.name);
            v["disabled"] = json!(p.health.is_open());
            v["failures"] = json!(p.health.failures.load(std::sync::atomic::Ordering::Relaxed));
            data.push(v);
        }
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /admin/tenants/{tenant}/plugins/{name}/reset` (operator key): closes a plugin's breaker.
pub async fn admin_reset(
    State(s): State<Shared>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    if !s.is_operator(&headers) {
        return ApiError::unauthorized("this endpoint needs an operator key").into_response();
    }
    let (tenant, name) = match path {
        Ok(Path(p)) => p,
        Err(e) => return ApiError::bad(format!("bad path: {}", e.body_text())).into_response(),
    };
    let Some(t) = s.tenants.iter().find(|t| t.name == tenant) else {
        return ApiError::not_found(format!("no tenant named `{tenant}`")).into_response();
    };
    let Some(p) = t.plugin(&name) else {
        return ApiError::not_found(format!("tenant `{tenant}` has no plugin named `{name}`")).into_response();
    };
    p.health.reset();
    tracing::info!(tenant = %tenant, plugin = %p.name, "plugin re-enabled by the operator");
    axum::Json(json!({"tenant": tenant, "name": p.name, "object": "plugin", "disabled": false})).into_response()
}
