//! Size caps on every list and string of a request, checked before any expensive work (the
//! template plugin, tokenization, grammar compilation). Each refusal is a 400 naming the field
//! and the cap; the caps live in `[limits]` of the serve config.

use serde_json::{Map, Value};

use super::config::LimitsSection;
use super::openai::ApiError;

/// Shape of the JSON schemas in a request (response_format + tools), walked without recursion.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchemaStats {
    /// JSON values in the schemas.
    pub nodes: usize,
    /// Entries of every `properties` object.
    pub properties: usize,
    /// Deepest nesting of JSON values.
    pub depth: usize,
}

/// Stats of one JSON value (iterative: a hostile schema cannot overflow the stack here).
pub fn schema_stats(v: &Value) -> SchemaStats {
    let mut s = SchemaStats::default();
    let mut stack: Vec<(&Value, usize)> = vec![(v, 1)];
    while let Some((v, depth)) = stack.pop() {
        s.nodes += 1;
        s.depth = s.depth.max(depth);
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(p)) = o.get("properties") {
                    s.properties += p.len();
                }
                stack.extend(o.values().map(|c| (c, depth + 1)));
            }
            Value::Array(a) => stack.extend(a.iter().map(|c| (c, depth + 1))),
            _ => {}
        }
    }
    s
}

fn too_many(param: &str, what: &str, got: usize, cap: usize) -> ApiError {
    ApiError {
        code: Some("request_too_large"),
        ..ApiError::param(param, format!("{what}: {got} is over this server's limit of {cap}"))
    }
}

/// Checks a chat or completions body against the caps.
pub fn check(body: &Map<String, Value>, l: &LimitsSection) -> Result<(), ApiError> {
    if let Some(Value::Array(messages)) = body.get("messages") {
        if messages.len() > l.max_messages {
            return Err(too_many("messages", "messages", messages.len(), l.max_messages));
        }
        let (mut parts, mut images) = (0usize, 0usize);
        for m in messages {
            if let Some(Value::Array(content)) = m.get("content") {
                parts += content.len();
                images += content
                    .iter()
                    .filter(|p| p.get("type").and_then(Value::as_str).is_some_and(|t| t.starts_with("image")))
                    .count();
            }
            if let Some(Value::Array(calls)) = m.get("tool_calls") {
                parts += calls.len();
            }
        }
        if parts > l.max_content_parts {
            return Err(too_many("messages", "content parts and tool calls", parts, l.max_content_parts));
        }
        if images > l.max_images {
            return Err(too_many("messages", "images", images, l.max_images));
        }
    }
    let mut schemas = SchemaStats::default();
    let mut add = |v: &Value| {
        let s = schema_stats(v);
        schemas.nodes += s.nodes;
        schemas.properties += s.properties;
        schemas.depth = schemas.depth.max(s.depth);
    };
    match body.get("tools") {
        Some(Value::Array(tools)) => {
            if tools.len() > l.max_tools {
                return Err(too_many("tools", "tools", tools.len(), l.max_tools));
            }
            tools.iter().for_each(&mut add);
        }
        Some(v) if !v.is_null() => add(v),
        _ => {}
    }
    if let Some(v) = body.get("response_format") {
        add(v);
    }
    let param = if body.get("response_format").is_some_and(|v| !v.is_null()) { "response_format" } else { "tools" };
    if schemas.properties > l.max_schema_properties {
        return Err(too_many(param, "schema properties", schemas.properties, l.max_schema_properties));
    }
    if schemas.nodes > l.max_schema_nodes {
        return Err(too_many(param, "schema values", schemas.nodes, l.max_schema_nodes));
    }
    if schemas.depth > l.max_schema_depth {
        return Err(too_many(param, "schema nesting depth", schemas.depth, l.max_schema_depth));
    }
    match body.get("stop") {
        Some(Value::String(s)) if s.len() > l.max_stop_bytes => {
            return Err(too_many("stop", "stop sequence bytes", s.len(), l.max_stop_bytes));
        }
        Some(Value::Array(a)) => {
            if let Some(s) = a.iter().filter_map(Value::as_str).find(|s| s.len() > l.max_stop_bytes) {
                return Err(too_many("stop", "stop sequence bytes", s.len(), l.max_stop_bytes));
            }
        }
        _ => {}
    }
    if let Some(Value::Object(b)) = body.get("logit_bias")
        && b.len() > l.max_logit_bias
    {
        return Err(too_many("logit_bias", "logit_bias entries", b.len(), l.max_logit_bias));
    }
    if let Some(Value::Object(p)) = body.get("sampler_params") {
        if p.len() > MAX_SAMPLER_PARAMS {
            return Err(too_many("sampler_params", "sampler_params entries", p.len(), MAX_SAMPLER_PARAMS));
        }
        let bytes = Value::Object(p.clone()).to_string().len();
        if bytes > MAX_SAMPLER_PARAMS_BYTES {
            return Err(too_many("sampler_params", "sampler_params bytes", bytes, MAX_SAMPLER_PARAMS_BYTES));
        }
    }
    Ok(())
}

/// Most entries in `sampler_params`, and its largest JSON text.
pub const MAX_SAMPLER_PARAMS: usize = 64;
pub const MAX_SAMPLER_PARAMS_BYTES: usize = 16 << 10;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn stats_count_properties_nodes_and_depth() {
        let s = schema_stats(&json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {
            "type": "object", "properties": {"c": {}}}}}));
        assert_eq!(s.properties, 3);
        assert_eq!(s.depth, 5);
        assert_eq!(s.nodes, 9);
    }

    #[test]
    fn each_cap_names_its_field() {
        let l = LimitsSection::default();
        let parts: Vec<Value> = (0..l.max_content_parts + 1).map(|_| json!({"type": "text", "text": ""})).collect();
        let props: Map<String, Value> =
            (0..l.max_schema_properties + 1).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        let cases = [
            (json!({"messages": vec![json!({"role": "user", "content": "x"}); l.max_messages + 1]}), "messages"),
            (json!({"messages": [{"role": "user", "content": parts}]}), "messages"),
            (json!({"tools": vec![json!({"type": "function"}); l.max_tools + 1]}), "tools"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": props}}}}),
                "response_format",
            ),
            (json!({"stop": "x".repeat(l.max_stop_bytes + 1)}), "stop"),
            (
                json!({"sampler_params": (0..65).map(|i| (format!("k{i}"), json!(1))).collect::<Map<_, _>>()}),
                "sampler_params",
            ),
        ];
        for (body, param) in cases {
            let e = check(&obj(body), &l).expect_err(param);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
        check(&obj(json!({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"]})), &l).expect("small");
    }
}
