//! `/v1/plugins`: a tenant uploads, lists and removes its own components. An upload goes through
//! the platform's checks (world, imports, compilation, a trial instantiation) before it is stored;
//! it is visible to its tenant only.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};

use super::openai::ApiError;
use super::tenants::{MAX_COMPONENT_BYTES, PluginEntry, instantiate};
use super::{Shared, json_object};
use crate::plugins::PluginKind;

fn entry_json(p: &PluginEntry) -> Value {
    json!({"name": p.name, "kind": p.plugin.kind().name(), "sha256": p.sha256, "builtin": p.builtin, "object": "plugin"})
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
        let body = body.map_err(|e| ApiError::new(e.status(), "invalid_request_error", e.body_text()))?;
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
            Ok(PluginEntry { name, sha256: compiled.sha256.clone(), builtin: false, plugin, health })
        })
        .await
        .map_err(|e| ApiError::internal(format!("upload failed: {e}")))??;
        let out = entry_json(&entry);
        tenant.add_upload(entry).map_err(ApiError::bad)?;
        Ok(out)
    }
    .await;
    match r {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn remove(State(s): State<Shared>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    let tenant = match s.authenticate(&headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    match tenant.remove_upload(&name) {
        Ok(()) => axum::Json(json!({"name": name, "object": "plugin", "deleted": true})).into_response(),
        Err(m) if m.starts_with("no plugin") => ApiError::not_found(m).into_response(),
        Err(m) => ApiError::bad(m).into_response(),
    }
}
