//! Validation of declarative constraints before they reach the native grammar engine.

use super::bindings::host::kimi::host::grammar_engine::Constraint;

/// None when the constraint is well-formed; otherwise what is wrong.
pub fn validate(c: &Constraint) -> Option<String> {
    match c {
        Constraint::JsonSchema(s) => match serde_json::from_str::<serde_json::Value>(s) {
            Ok(v) if v.is_object() || v.is_boolean() => None,
            Ok(_) => Some("a JSON schema must be an object or a boolean".into()),
            Err(e) => Some(format!("JSON schema is not valid JSON: {e}")),
        },
        Constraint::Regex(r) => regex::Regex::new(r).err().map(|e| format!("invalid regex: {e}")),
        Constraint::Choice(options) => options.is_empty().then(|| "choice needs at least one option".into()),
        Constraint::Lark(g) => g.trim().is_empty().then(|| "empty Lark grammar".into()),
    }
}
