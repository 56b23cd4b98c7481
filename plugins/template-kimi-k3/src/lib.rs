//! `builtin:template-kimi-k3`: an OpenAI chat-completions body → Kimi-K3 XTML prompt segments
//! (via `kimi-xtml`, exact against the release renderer), with the request checks Moonshot's
//! vendor verifier expects (HTTP 400 via `bad-config`), and the incremental output parser.
//!
//! Thinking: Kimi's `thinking` object wins over `reasoning_effort`, which wins over
//! `chat_template_kwargs`; `thinking.type = "disabled"` or `reasoning_effort = "none"` turns it
//! off; efforts map `minimal → low`, `medium → high`, `xhigh → max`; absent → `max`.

use std::cell::RefCell;

use kimi_plugin::template::exports::kimi::host::template_plugin::{
    Capabilities, Guest, GuestOutputParser, OutputEvent, Rendered, ToolCall,
};
use kimi_plugin::template::kimi::host::tokenizer;
use kimi_plugin::template::kimi::host::types::{PluginError, RequestInfo, Segment};
use kimi_xtml::parse::{Event, OutputParser as Xtml, Piece};
use kimi_xtml::thinking::thinking_of;
use kimi_xtml::{RenderOptions, render};
use serde_json::Value;

fn bad(msg: impl Into<String>) -> PluginError {
    PluginError::BadConfig(msg.into())
}

/// (thinking on, effort) from the request body.
fn thinking(body: &Value) -> Result<(bool, String), PluginError> {
    let t = thinking_of(body).map_err(|e| bad(e.0))?;
    Ok((t.on, t.effort))
}

fn check_tool_list(tools: &Value, seen: &mut Vec<String>, what: &str) -> Result<(), PluginError> {
    let list = tools.as_array().ok_or_else(|| bad(format!("{what} must be an array")))?;
    for (i, t) in list.iter().enumerate() {
        let t = t.as_object().ok_or_else(|| bad(format!("{what}[{i}] must be an object")))?;
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!("{what}[{i}].type must be \"function\"")));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(format!("{what}[{i}].function is missing")))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("{what}[{i}].function.name is missing")))?;
        let valid = !name.is_empty()
            && name.len() <= 256
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !valid {
            return Err(bad(format!("{what}[{i}].function.name \"{name}\" is not a valid tool name")));
        }
        if seen.iter().any(|s| s == name) {
            return Err(bad(format!("duplicate tool name \"{name}\"")));
        }
        seen.push(name.to_string());
    }
    Ok(())
}

fn options_and_check(body: &Value) -> Result<(RenderOptions, Vec<Value>, Option<Value>), PluginError> {
    let messages = body.get("messages").and_then(Value::as_array).ok_or_else(|| bad("messages must be an array"))?;
    if messages.is_empty() {
        return Err(bad("messages must not be empty"));
    }
    let mut names = Vec::new();
    let tools = body.get("tools").filter(|t| !t.is_null()).cloned();
    if let Some(t) = &tools {
        check_tool_list(t, &mut names, "tools")?;
    }
    for (i, m) in messages.iter().enumerate() {
        let role =
            m.get("role").and_then(Value::as_str).ok_or_else(|| bad(format!("messages[{i}].role is missing")))?;
        if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
            return Err(bad(format!("messages[{i}].role \"{role}\" is not supported")));
        }
        if let Some(t) = m.get("tools").filter(|t| !t.is_null()) {
            if role != "system" {
                return Err(bad(format!("messages[{i}]: tools are only allowed on system messages")));
            }
            let has_content = match m.get("content") {
                None | Some(Value::Null) => false,
                Some(Value::String(s)) => !s.is_empty(),
                Some(_) => true,
            };
            if has_content {
                return Err(bad(format!("messages[{i}]: a system message declaring tools must have empty content")));
            }
            check_tool_list(t, &mut names, &format!("messages[{i}].tools"))?;
        }
        if role == "tool" && m.get("tool_call_id").and_then(Value::as_str).is_none() {
            return Err(bad(format!("messages[{i}]: a tool message needs tool_call_id")));
        }
    }
    let tool_choice = body.get("tool_choice").filter(|t| !t.is_null()).cloned();
    match &tool_choice {
        None => {}
        Some(Value::String(s)) if s == "auto" || s == "none" => {}
        Some(Value::String(s)) if s == "required" && names.is_empty() => {
            return Err(bad("tool_choice \"required\" needs at least one tool"));
        }
        Some(Value::String(s)) if s == "required" => {}
        Some(Value::Object(o)) => {
            let n = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match n {
                Some(n) if names.iter().any(|x| x == n) => {}
                Some(n) => return Err(bad(format!("tool_choice names unknown tool \"{n}\""))),
                None => return Err(bad("tool_choice object needs function.name")),
            }
        }
        Some(v) => return Err(bad(format!("invalid tool_choice {v}"))),
    }
    let response_format = body.get("response_format").filter(|t| !t.is_null()).cloned();
    if let Some(rf) = &response_format {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") | Some("json_object") => {}
            Some("json_schema") => {
                let js = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or_else(|| bad("response_format.json_schema is missing"))?;
                if js.get("name").and_then(Value::as_str).is_none() {
                    return Err(bad("response_format.json_schema.name is missing"));
                }
                match js.get("schema") {
                    Some(Value::Object(_)) => {}
                    Some(_) => return Err(bad("response_format.json_schema.schema must be an object")),
                    None => return Err(bad("response_format.json_schema.schema is missing")),
                }
                if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                    return Err(bad("response_format.json_schema.strict must be a boolean"));
                }
            }
            Some(other) => return Err(bad(format!("unknown response_format type \"{other}\""))),
            None => return Err(bad("response_format.type is missing")),
        }
    }
    let (on, effort) = thinking(body)?;
    let opts = RenderOptions {
        thinking: on,
        thinking_effort: on.then_some(effort),
        add_generation_prompt: true,
        tool_choice: tool_choice.clone(),
        response_format,
        response_schema: None,
    };
    Ok((opts, messages.clone(), tools))
}

struct KimiK3;

impl Guest for KimiK3 {
    type OutputParser = Parser;

    fn describe() -> Capabilities {
        Capabilities { name: "template-kimi-k3".into() }
    }

    fn render(_req: RequestInfo, chat_json: String) -> Result<Rendered, PluginError> {
        let body: Value =
            serde_json::from_str(&chat_json).map_err(|e| bad(format!("request body is not JSON: {e}")))?;
        let (opts, messages, tools) = options_and_check(&body)?;
        let segs = render(&messages, tools.as_ref(), &opts).map_err(|e| bad(e.0))?;
        Ok(Rendered {
            segments: segs
                .into_iter()
                .map(|s| match s {
                    kimi_xtml::Segment::Text(t) => Segment::Text(t),
                    kimi_xtml::Segment::Special(n) => Segment::Special(n.to_string()),
                })
                .collect(),
            stop_specials: vec!["<|end_of_msg|>".into(), "[EOS]".into()],
        })
    }
}

/// Marker ids of the served vocabulary.
struct Markers {
    open: Option<u32>,
    close: Option<u32>,
    sep: Option<u32>,
    end: Vec<u32>,
}

pub struct Parser {
    inner: RefCell<Xtml>,
    markers: Markers,
}

fn event(e: Event) -> OutputEvent {
    match e {
        Event::Reasoning(t) => OutputEvent::Reasoning(t),
        Event::Content(t) => OutputEvent::Content(t),
        Event::ToolCall(c) => {
            OutputEvent::ToolCall(ToolCall { index: c.index, name: c.name, arguments_json: c.arguments.to_string() })
        }
    }
}

impl GuestOutputParser for Parser {
    fn new(req: RequestInfo) -> Parser {
        let body: Value = serde_json::from_str(&req.params_json).unwrap_or(Value::Null);
        let on = thinking(&body).map(|t| t.0).unwrap_or(true);
        let markers = Markers {
            open: tokenizer::special_id("<|open|>"),
            close: tokenizer::special_id("<|close|>"),
            sep: tokenizer::special_id("<|sep|>"),
            end: ["<|end_of_msg|>", "[EOS]"].iter().filter_map(|n| tokenizer::special_id(n)).collect(),
        };
        Parser { inner: RefCell::new(Xtml::new(on)), markers }
    }

    fn feed(&self, ids: Vec<u32>) -> Result<Vec<OutputEvent>, PluginError> {
        let m = &self.markers;
        // Other control tokens (reserved ids, media markers) are not text: dropped, as a server
        // skipping special tokens would.
        let special = tokenizer::is_special(&ids);
        let ids: Vec<u32> = ids
            .iter()
            .zip(special)
            .filter(|(i, sp)| {
                !sp || Some(**i) == m.open || Some(**i) == m.close || Some(**i) == m.sep || m.end.contains(i)
            })
            .map(|(i, _)| *i)
            .collect();
        let text_ids: Vec<u32> =
            ids.iter().copied().filter(|i| Some(*i) != m.open && Some(*i) != m.close && Some(*i) != m.sep).collect();
        let mut bytes = tokenizer::token_bytes(&text_ids).into_iter();
        let pieces: Vec<Piece> = ids
            .iter()
            .map(|&i| {
                if Some(i) == m.open {
                    Piece::Open
                } else if Some(i) == m.close {
                    Piece::Close
                } else if Some(i) == m.sep {
                    Piece::Sep
                } else if m.end.contains(&i) {
                    let _ = bytes.next();
                    Piece::EndOfMsg
                } else {
                    Piece::Bytes(bytes.next().unwrap_or_default())
                }
            })
            .collect();
        let events = self.inner.borrow_mut().feed(&pieces).map_err(|e| PluginError::Internal(e.0))?;
        Ok(events.into_iter().map(event).collect())
    }

    fn finish(&self) -> Result<Vec<OutputEvent>, PluginError> {
        let events = self.inner.borrow_mut().finish().map_err(|e| PluginError::Internal(e.0))?;
        Ok(events.into_iter().map(event).collect())
    }
}

kimi_plugin::template::export_template!(KimiK3);
