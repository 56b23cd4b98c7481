//! Kimi-K3 "XTML" chat rendering (spec k3-serving §1): messages, tool declarations, tool calls
//! with typed arguments, tool results bound to calls, effort / tool-choice / response-format
//! system messages and the generation prompt — as segments, so that user text can never become
//! a control token. Only the four markers are special segments.

pub mod grammar;
mod media;
pub mod parse;
pub mod thinking;

use serde_json::{Map, Value};

/// A piece of the prompt: ordinary text (never a special token) or a special token by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Text(String),
    Special(&'static str),
}

pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";
pub const MEDIA_BEGIN: &str = "<|media_begin|>";
pub const MEDIA_CONTENT: &str = "<|media_content|>";
pub const MEDIA_PAD: &str = "<|media_pad|>";
pub const MEDIA_END: &str = "<|media_end|>";

#[derive(Clone, Debug)]
pub struct RenderOptions {
    pub thinking: bool,
    /// `low`, `high` or `max`; None: no effort message (the release renderer's own default).
    pub thinking_effort: Option<String>,
    pub add_generation_prompt: bool,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    /// Overrides the schema of a `json_schema` response format.
    pub response_schema: Option<Value>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            thinking: true,
            thinking_effort: None,
            add_generation_prompt: true,
            tool_choice: None,
            response_format: None,
            response_schema: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderError(pub String);

impl std::fmt::Display for RenderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, RenderError> {
    Err(RenderError(msg.into()))
}

const EFFORT_TEXT: &str = "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=";
const TOOLS_HEADER: &str = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n";
const DYNAMIC_TOOLS_HEADER: &str = "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n";
const RAW_JSON: &str =
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";

struct Out(Vec<Segment>);

impl Out {
    fn special(&mut self, s: &'static str) {
        self.0.push(Segment::Special(s));
    }

    fn text(&mut self, s: impl Into<String>) {
        let s = s.into();
        if !s.is_empty() {
            self.0.push(Segment::Text(s));
        }
    }

    /// `<|open|>tag key="value"…<|sep|>`, each attribute as ` key`, `="`, value, `"`.
    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.special(OPEN);
        self.text(tag);
        for (k, v) in attrs {
            self.text(format!(" {k}"));
            self.text("=\"");
            self.text(escape_attr(v));
            self.text("\"");
        }
        self.special(SEP);
    }

    fn close(&mut self, tag: &str) {
        self.special(CLOSE);
        self.text(tag);
        self.special(SEP);
    }

    fn message(&mut self, attrs: &[(&str, &str)], body: &str) {
        self.message_parts(attrs, vec![Part::Text(body.to_string())]);
    }

    fn message_parts(&mut self, attrs: &[(&str, &str)], parts: Vec<Part>) {
        self.open("message", attrs);
        for p in parts {
            self.part(p);
        }
        self.close("message");
        self.special(END_OF_MSG);
    }

    fn part(&mut self, p: Part) {
        match p {
            Part::Text(t) => self.text(t),
            Part::Image { width, height } => {
                self.special(MEDIA_BEGIN);
                self.text(format!("image {width}x{height}"));
                self.special(MEDIA_CONTENT);
                self.special(MEDIA_PAD);
                self.special(MEDIA_END);
            }
        }
    }
}

/// `&` first, then `"`; angle brackets stay (the real markers are tokens).
pub fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

pub fn unescape_attr(v: &str) -> String {
    v.replace("&quot;", "\"").replace("&amp;", "&")
}

/// Python `json.dumps(v, ensure_ascii=False)` with the given separators; keys sorted if asked.
pub fn py_json(v: &Value, item_sep: &str, key_sep: &str, sort_keys: bool) -> String {
    let mut s = String::new();
    write_json(v, item_sep, key_sep, sort_keys, &mut s);
    s
}

fn write_json(v: &Value, is: &str, ks: &str, sort: bool, out: &mut String) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(is);
                }
                write_json(x, is, ks, sort, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            let mut keys: Vec<&String> = o.keys().collect();
            if sort {
                keys.sort();
            }
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(is);
                }
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(ks);
                write_json(&o[k.as_str()], is, ks, sort, out);
            }
            out.push('}');
        }
        Value::Number(n) => out.push_str(&py_number(n)),
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// Python's float repr for non-integers (`1e-05`, `1e+16`), integers as they are.
fn py_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(0.0);
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let s = format!("{f:e}");
    // Rust: 1e-5 / 1.5e16 → Python: 1e-05 / 1.5e+16 (for exponents outside Python's plain range).
    let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let e: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&e) {
        return f.to_string();
    }
    format!("{mant}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
}

fn str_field<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a str> {
    m.get(k).and_then(Value::as_str)
}

/// One piece of a message's content.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    /// An image of this original size, rendered as a media block with one `<|media_pad|>` that
    /// the engine expands to the image's vision embeddings (spec k3-serving §4.2).
    Image {
        width: u32,
        height: u32,
    },
}

/// A message's content as pieces: a string, or an OpenAI parts list in order (text and image
/// parts where they stand). Each text part is its own segment (BPE never merges across parts,
/// as in the release).
fn content_parts(m: &Map<String, Value>) -> Result<Vec<Part>, RenderError> {
    match m.get("content") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Part::Text(s.clone())]),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("text") => Ok(Part::Text(p.get("text").and_then(Value::as_str).unwrap_or("").to_string())),
                Some("image_url") => {
                    let url = p.get("image_url").and_then(|u| u.get("url").or(Some(u))).and_then(Value::as_str);
                    image_part(url.ok_or_else(|| RenderError("image_url part without a url".into()))?)
                }
                Some("image") => image_part(
                    p.get("image")
                        .and_then(Value::as_str)
                        .ok_or_else(|| RenderError("image part without a url".into()))?,
                ),
                Some(t) => err(format!("content part type `{t}` is not supported by this renderer")),
                None => err("content part without `type`"),
            })
            .collect(),
        Some(_) => err("message content must be a string or a list of parts"),
    }
}

/// Tool results get reordered (§1.9), which could swap same-size images: no images there.
fn content_parts_tool(m: &Map<String, Value>) -> Result<Vec<Part>, RenderError> {
    Ok(text_parts(m, "tool messages")?.into_iter().map(Part::Text).collect())
}

fn image_part(url: &str) -> Result<Part, RenderError> {
    let (width, height) = media::data_uri_image_size(url)?;
    Ok(Part::Image { width, height })
}

/// Text parts only (for messages whose content is not a user turn).
fn text_parts(m: &Map<String, Value>, what: &str) -> Result<Vec<String>, RenderError> {
    content_parts(m)?
        .into_iter()
        .map(|p| match p {
            Part::Text(t) => Ok(t),
            Part::Image { .. } => err(format!("images are not allowed in {what}")),
        })
        .collect()
}

/// A tool call's (name, arguments as a JSON object or a raw non-JSON string).
/// Call arguments: a JSON object, or (not valid JSON) the raw string.
type CallArgs = Result<Map<String, Value>, String>;

fn call_parts(call: &Value) -> Result<(String, CallArgs), RenderError> {
    let f = call.get("function").unwrap_or(call);
    let name =
        f.get("name").and_then(Value::as_str).ok_or_else(|| RenderError("tool call without a function name".into()))?;
    let args = match f.get("arguments") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) => Ok(o.clone()),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(o)) => Ok(o),
            Ok(_) => return err(format!("arguments of tool call `{name}` must be a JSON object")),
            Err(_) => Err(s.clone()),
        },
        Some(_) => return err(format!("arguments of tool call `{name}` must be an object or a JSON string")),
    };
    Ok((name.to_string(), args))
}

fn arg_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// Sorts each run of tool results into the order of the preceding assistant's calls (matched by
/// `tool_call_id`) and names them after the matched call; a run with an unmatched id is left as is.
fn bind_tool_results(messages: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = messages.to_vec();
    let mut i = 0;
    while i < out.len() {
        if out[i].get("role").and_then(Value::as_str) != Some("tool") {
            i += 1;
            continue;
        }
        let start = i;
        while i < out.len() && out[i].get("role").and_then(Value::as_str) == Some("tool") {
            i += 1;
        }
        let calls: Vec<Value> = out[..start]
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
            .and_then(|m| m.get("tool_calls"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let pos: Option<Vec<usize>> = out[start..i]
            .iter()
            .map(|m| {
                let id = m.get("tool_call_id").and_then(Value::as_str)?;
                calls.iter().position(|c| c.get("id").and_then(Value::as_str) == Some(id))
            })
            .collect();
        if let Some(pos) = pos {
            let mut run: Vec<(usize, Value)> = pos.into_iter().zip(out[start..i].iter().cloned()).collect();
            run.sort_by_key(|(p, _)| *p);
            for (k, (p, mut m)) in run.into_iter().enumerate() {
                if let (Some(obj), Some(name)) = (m.as_object_mut(), calls[p].pointer("/function/name").cloned()) {
                    obj.insert("tool".into(), name);
                }
                out[start + k] = m;
            }
        }
    }
    out
}

/// The release's `json_schema` lookup: `json_schema.schema`, `json_schema.json_schema`, or itself.
fn response_schema(rf: &Value) -> Option<Value> {
    let js = rf.get("json_schema")?;
    js.get("schema").or_else(|| js.get("json_schema")).cloned().or_else(|| Some(js.clone()))
}

/// Renders a conversation (OpenAI message objects) to segments.
pub fn render(messages: &[Value], tools: Option<&Value>, opts: &RenderOptions) -> Result<Vec<Segment>, RenderError> {
    let mut o = Out(Vec::new());
    let has_tools = match tools {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(m)) => !m.is_empty(),
        Some(_) => return err("`tools` must be a list"),
    };
    if let (true, Some(t)) = (has_tools, tools) {
        let body = format!("{TOOLS_HEADER}{}\n```", py_json(t, ",", ":", true));
        o.message(&[("role", "system"), ("type", "tool-declare")], &body);
    }
    if opts.thinking
        && let Some(effort) = &opts.thinking_effort
    {
        if !["low", "high", "max"].contains(&effort.as_str()) {
            return err(format!("thinking effort `{effort}` is not one of low, high, max"));
        }
        o.message(&[("role", "system"), ("type", "thinking-effort")], &format!("{EFFORT_TEXT}{effort}`."));
    }
    let messages = bind_tool_results(messages);
    let mut tool_index = 0;
    let mut last_calls: Vec<String> = Vec::new();
    for (n, msg) in messages.iter().enumerate() {
        let m = msg.as_object().ok_or_else(|| RenderError(format!("message {n} is not an object")))?;
        let role = str_field(m, "role").ok_or_else(|| RenderError(format!("message {n} has no role")))?;
        let name = str_field(m, "name");
        match role {
            "system" | "developer" => {
                if let Some(t) = m.get("tools").filter(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
                    let body = format!("{DYNAMIC_TOOLS_HEADER}{}\n```", py_json(t, ",", ":", true));
                    o.message(&[("role", "system"), ("type", "tool-declare")], &body);
                } else {
                    let mut attrs = vec![("role", "system")];
                    if let Some(nm) = name {
                        attrs.push(("name", nm));
                    }
                    o.message_parts(&attrs, content_parts(m)?);
                }
            }
            "user" => {
                let mut attrs = vec![("role", "user")];
                if let Some(nm) = name {
                    attrs.push(("name", nm));
                }
                o.message_parts(&attrs, content_parts(m)?);
            }
            "assistant" => {
                tool_index = 0;
                let mut attrs = vec![("role", "assistant")];
                if let Some(nm) = name {
                    attrs.push(("name", nm));
                }
                o.open("message", &attrs);
                if opts.thinking {
                    let reasoning =
                        str_field(m, "reasoning_content").or_else(|| str_field(m, "reasoning")).unwrap_or("");
                    o.open("think", &[]);
                    if !reasoning.trim().is_empty() {
                        o.text(reasoning);
                    }
                    o.close("think");
                }
                o.open("response", &[]);
                for p in text_parts(m, "assistant messages")? {
                    o.text(p);
                }
                o.close("response");
                last_calls.clear();
                if let Some(calls) = m.get("tool_calls").and_then(Value::as_array).filter(|c| !c.is_empty()) {
                    o.open("tools", &[]);
                    for (i, call) in calls.iter().enumerate() {
                        let (fname, args) = call_parts(call)?;
                        let idx = (i + 1).to_string();
                        o.open("call", &[("tool", &fname), ("index", &idx)]);
                        match args {
                            Ok(args) => {
                                for (k, v) in &args {
                                    o.open("argument", &[("key", k), ("type", arg_type(v))]);
                                    match v {
                                        Value::String(s) => o.text(s.clone()),
                                        other => o.text(py_json(other, ", ", ": ", false)),
                                    }
                                    o.close("argument");
                                }
                            }
                            Err(raw) => {
                                o.open("json", &[("type", "object")]);
                                o.text(raw);
                                o.close("json");
                            }
                        }
                        o.close("call");
                        last_calls.push(fname);
                    }
                    o.close("tools");
                }
                o.close("message");
                o.special(END_OF_MSG);
            }
            "tool" => {
                tool_index += 1;
                let tname = str_field(m, "tool")
                    .or(name)
                    .map(str::to_string)
                    .or_else(|| last_calls.get(tool_index - 1).cloned())
                    .ok_or_else(|| RenderError(format!("tool message {n} has no matching tool call")))?;
                let idx = tool_index.to_string();
                o.message_parts(&[("role", "tool"), ("tool", &tname), ("index", &idx)], content_parts_tool(m)?);
            }
            other => return err(format!("unknown role `{other}`")),
        }
    }
    match opts.tool_choice.as_ref().and_then(Value::as_str) {
        Some("required") => o.message(
            &[("role", "system"), ("type", "tool-choice")],
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        Some("none") => o.message(
            &[("role", "system"), ("type", "tool-choice")],
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        _ => {}
    }
    if let Some(rf) = &opts.response_format {
        match rf.get("type").and_then(Value::as_str) {
            Some("json_object") => o.message(
                &[("role", "system"), ("type", "response-format")],
                &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
            ),
            Some("json_schema") => {
                let schema = opts.response_schema.clone().or_else(|| response_schema(rf)).unwrap_or(Value::Null);
                o.message(
                    &[("role", "system"), ("type", "response-format")],
                    &format!(
                        "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\nThe JSON data must match the following schema:\n```json\n{}\n```",
                        py_json(&schema, ",", ":", true)
                    ),
                );
            }
            _ => {}
        }
    }
    if opts.add_generation_prompt {
        o.open("message", &[("role", "assistant")]);
        o.open(if opts.thinking { "think" } else { "response" }, &[]);
    }
    Ok(o.0)
}
