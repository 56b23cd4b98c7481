//! How a chat request asks for thinking (spec k3-serving §1.7), shared by the template plugin
//! (which renders the effort message) and the grammar plugin (which bounds the think channel).
//!
//! Kimi's `thinking` object wins over `reasoning_effort`, which wins over `chat_template_kwargs`;
//! `thinking.type = "disabled"` or `reasoning_effort = "none"` turns thinking off; efforts map
//! `minimal → low`, `medium → high`, `xhigh → max`; absent → `max`. A budget comes from
//! `thinking.budget_tokens` (our extension, named as in Anthropic's API).

use serde_json::Value;

use crate::RenderError;

/// What a request asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thinking {
    pub on: bool,
    /// `low`, `high` or `max`.
    pub effort: String,
    /// Most tokens the think channel may hold before it is closed, when the request set one.
    pub budget_tokens: Option<u32>,
}

fn bad<T>(msg: String) -> Result<T, RenderError> {
    Err(RenderError(msg))
}

/// Reads the thinking fields of a chat-completions body (other fields are ignored).
pub fn thinking_of(body: &Value) -> Result<Thinking, RenderError> {
    let kw = body.get("chat_template_kwargs");
    let mut on = kw
        .and_then(|k| k.get("thinking").or_else(|| k.get("enable_thinking")))
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut effort = kw.and_then(|k| k.get("thinking_effort")).and_then(Value::as_str).map(str::to_string);
    let mut budget_tokens = None;
    match body.get("reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if e == "none" => on = false,
        Some(Value::String(e)) => effort = Some(e.clone()),
        Some(v) => return bad(format!("reasoning_effort must be a string, got {v}")),
    }
    match body.get("thinking") {
        None | Some(Value::Null) => {}
        Some(Value::Object(t)) => {
            match t.get("type").and_then(Value::as_str) {
                None | Some("enabled") => on = true,
                Some("disabled") => on = false,
                Some(other) => {
                    return bad(format!("thinking.type must be \"enabled\" or \"disabled\", got \"{other}\""));
                }
            }
            if let Some(e) = t.get("effort").and_then(Value::as_str) {
                effort = Some(e.to_string());
            }
            match t.get("budget_tokens") {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_u64().filter(|&n| n >= 1).and_then(|n| u32::try_from(n).ok()) {
                    Some(n) => budget_tokens = Some(n),
                    None => return bad(format!("thinking.budget_tokens must be a positive integer, got {v}")),
                },
            }
        }
        Some(v) => return bad(format!("thinking must be an object, got {v}")),
    }
    let effort = match effort.as_deref().unwrap_or("max") {
        "low" | "minimal" => "low",
        "high" | "medium" => "high",
        "max" | "xhigh" => "max",
        other => return bad(format!("unsupported reasoning effort \"{other}\" (use low, high or max)")),
    };
    Ok(Thinking { on, effort: effort.to_string(), budget_tokens })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn precedence_and_budget() {
        let t = thinking_of(&json!({"reasoning_effort": "low", "thinking": {"effort": "xhigh", "budget_tokens": 64}}))
            .expect("valid");
        assert_eq!(t, Thinking { on: true, effort: "max".into(), budget_tokens: Some(64) });
        let t = thinking_of(&json!({"reasoning_effort": "none"})).expect("valid");
        assert!(!t.on);
        let t = thinking_of(&json!({"chat_template_kwargs": {"thinking": false, "thinking_effort": "medium"}}))
            .expect("valid");
        assert_eq!((t.on, t.effort.as_str()), (false, "high"));
        assert!(thinking_of(&json!({"thinking": {"budget_tokens": 0}})).is_err());
        assert!(thinking_of(&json!({"thinking": {"budget_tokens": "x"}})).is_err());
        assert!(thinking_of(&json!({"reasoning_effort": "extreme"})).is_err());
    }
}
