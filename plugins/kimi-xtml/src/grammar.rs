//! Lark grammars (llguidance dialect) for Kimi-K3 output channels: what the model may write after
//! the generation prompt, given tools, `tool_choice` and `response_format`. Markers are special
//! tokens (`<|open|>` …) in the grammar, so text can never stand in for them; tool arguments are
//! typed `argument` blocks whose values follow each property's JSON schema.

use serde_json::{Value, json};

use crate::{RenderError, escape_attr};

/// Longest raw string argument when the schema gives no `maxLength` (keeps calls finite).
pub const DEFAULT_MAX_STRING: u64 = 256;
/// Most calls in one `tools` channel.
pub const MAX_CALLS: usize = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

impl ToolChoice {
    pub fn from_request(v: Option<&Value>) -> Result<ToolChoice, RenderError> {
        match v {
            None | Some(Value::Null) => Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "none" => Ok(ToolChoice::None),
            Some(Value::String(s)) if s == "required" => Ok(ToolChoice::Required),
            Some(Value::Object(o)) => o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .map(|n| ToolChoice::Named(n.to_string()))
                .ok_or_else(|| RenderError("tool_choice object needs function.name".into())),
            Some(v) => Err(RenderError(format!("invalid tool_choice {v}"))),
        }
    }
}

fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

struct Builder {
    rules: Vec<String>,
    n: usize,
}

impl Builder {
    fn fresh(&mut self, prefix: &str) -> String {
        self.n += 1;
        format!("{prefix}_{}", self.n)
    }

    fn rule(&mut self, name: &str, body: String) {
        self.rules.push(format!("{name}: {body}"));
    }

    /// A JSON value under `schema`, compact.
    fn json(&mut self, schema: &Value) -> String {
        let mut s = schema.clone();
        if let Some(o) = s.as_object_mut() {
            o.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
        }
        let name = self.fresh("json");
        self.rule(&name, format!("%json {s}"));
        name
    }

    /// A raw (unquoted) string argument.
    fn raw_string(&mut self, schema: &Value) -> String {
        if let Some(options) = schema.get("enum").and_then(Value::as_array) {
            let alts: Vec<String> = options.iter().filter_map(Value::as_str).map(lit).collect();
            if !alts.is_empty() {
                let name = self.fresh("enum");
                self.rule(&name, alts.join(" | "));
                return name;
            }
        }
        let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
        let max = schema.get("maxLength").and_then(Value::as_u64).unwrap_or(DEFAULT_MAX_STRING).max(min);
        let term = self.fresh("STR").to_uppercase();
        let rx = match schema.get("pattern").and_then(Value::as_str) {
            Some(p) => p.trim_start_matches('^').trim_end_matches('$').to_string(),
            None => format!("(?s:.{{{min},{max}}})"),
        };
        self.rules.push(format!("{term}: /{}/", rx.replace('/', "\\/")));
        let name = self.fresh("str");
        self.rule(&name, term);
        name
    }

    fn value(&mut self, schema: &Value) -> (String, &'static str) {
        let ty = schema.get("type").and_then(Value::as_str).unwrap_or("string");
        match ty {
            "integer" | "number" => (self.json(schema), "number"),
            "boolean" => (self.json(schema), "boolean"),
            "null" => (self.json(schema), "null"),
            "object" => (self.json(schema), "object"),
            "array" => (self.json(schema), "array"),
            _ => (self.raw_string(schema), "string"),
        }
    }

    /// The typed `argument` blocks of `tool` (an OpenAI tool object) as one rule, or None when
    /// it takes no arguments; with the tool's name.
    fn arguments(&mut self, tool: &Value) -> Result<(String, Option<String>), RenderError> {
        let f = tool.get("function").unwrap_or(tool);
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| RenderError("tool without a name".into()))?;
        let params = f.get("parameters").cloned().unwrap_or(json!({}));
        let required: Vec<&str> = params
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut args = Vec::new();
        if let Some(props) = params.get("properties").and_then(Value::as_object) {
            for (key, schema) in props {
                let (value, ty) = self.value(schema);
                let header = format!("argument key=\"{}\" type=\"{ty}\"", escape_attr(key));
                let arg = self.fresh("arg");
                self.rule(&arg, format!("<|open|> {} <|sep|> {value} <|close|> \"argument\" <|sep|>", lit(&header)));
                args.push(if required.contains(&key.as_str()) { arg } else { format!("{arg}?") });
            }
        }
        if args.is_empty() {
            return Ok((name.to_string(), None));
        }
        let rule = self.fresh("args");
        self.rule(&rule, args.join(" "));
        Ok((name.to_string(), Some(rule)))
    }

    /// One `call` block at `index` for a tool whose arguments rule was built once.
    fn call(&mut self, name: &str, args: &Option<String>, index: usize) -> String {
        let header = format!("call tool=\"{}\" index=\"{index}\"", escape_attr(name));
        let call = self.fresh("call");
        let body = args.as_ref().map_or(String::new(), |a| format!("{a} "));
        self.rule(&call, format!("<|open|> {} <|sep|> {body}<|close|> \"call\" <|sep|>", lit(&header)));
        call
    }

    /// A `tools` channel with 1..=MAX_CALLS calls of the given tools (one tool: that one only).
    /// Each tool's argument grammar is built once and shared by every call position, so the
    /// compiled constraint stays small (and compiles fast) however many calls are allowed.
    fn tools_channel(&mut self, tools: &[&Value], max_calls: usize) -> Result<String, RenderError> {
        let built = tools.iter().map(|t| self.arguments(t)).collect::<Result<Vec<_>, _>>()?;
        let mut per_index = Vec::new();
        for i in 1..=max_calls {
            let alts: Vec<String> = built.iter().map(|(name, args)| self.call(name, args, i)).collect();
            let r = self.fresh("calls_at");
            self.rule(&r, alts.join(" | "));
            per_index.push(r);
        }
        let seqs: Vec<String> = (1..=max_calls).map(|k| per_index[..k].join(" ")).collect();
        let chan = self.fresh("tools");
        self.rule(&chan, format!("<|open|> \"tools\" <|sep|> ({}) <|close|> \"tools\" <|sep|>", seqs.join(" | ")));
        Ok(chan)
    }
}

/// The think channel the generation prompt opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinkChannel {
    /// Thinking is off: the output starts in the response channel.
    Off,
    /// Free reasoning of any length.
    Open,
    /// Reasoning of at most this many tokens; the constraint then forces the channel closed.
    Budget(u32),
}

/// The grammar of everything the model writes after the generation prompt, or None when the
/// request has nothing to enforce (no forced or forbidden tools, no JSON response format, no
/// thinking budget).
pub fn output_grammar(
    tools: Option<&Value>,
    tool_choice: &ToolChoice,
    response_format: Option<&Value>,
    think: ThinkChannel,
) -> Result<Option<String>, RenderError> {
    let tools: Vec<&Value> = tools.and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default();
    let json_response = match response_format.and_then(|r| r.get("type")).and_then(Value::as_str) {
        Some("json_object") => Some(json!({"type": "object"})),
        Some("json_schema") => response_format.and_then(crate::response_schema),
        _ => None,
    };
    if json_response.is_none() && matches!(tool_choice, ToolChoice::Auto) && !matches!(think, ThinkChannel::Budget(_)) {
        return Ok(None);
    }
    let mut b = Builder { rules: Vec::new(), n: 0 };
    b.rules.push("TEXT: /(?s:.*)/".into());
    b.rules.push("text: TEXT".into());
    let response_body = match &json_response {
        Some(schema) => b.json(schema),
        None => "text".to_string(),
    };
    let tail = match tool_choice {
        ToolChoice::None => String::new(),
        ToolChoice::Auto => {
            let chan = b.tools_channel(&tools, MAX_CALLS)?;
            format!("{chan}?")
        }
        ToolChoice::Required => {
            if tools.is_empty() {
                return Err(RenderError("tool_choice \"required\" needs at least one tool".into()));
            }
            b.tools_channel(&tools, MAX_CALLS)?
        }
        ToolChoice::Named(n) => {
            let tool = tools
                .iter()
                .find(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) == Some(n.as_str()))
                .ok_or_else(|| RenderError(format!("tool_choice names unknown tool \"{n}\"")))?;
            b.tools_channel(&[tool], 1)?
        }
    };
    // A forced call comes with an empty response channel (no free text before the call).
    let response = if matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        "<|close|> \"response\" <|sep|>".to_string()
    } else {
        format!("{response_body} <|close|> \"response\" <|sep|>")
    };
    let think = match think {
        ThinkChannel::Off => "",
        ThinkChannel::Open => "text <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> ",
        ThinkChannel::Budget(n) => {
            // llguidance ends a `max_tokens` lexeme when its count is spent; `<|close|>` follows.
            b.rules.push(format!("think_text[max_tokens={n}]: /(?s:.*)/"));
            "think_text <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> "
        }
    };
    b.rules.insert(0, format!("start: {think}{response} {tail} <|close|> \"message\" <|sep|>"));
    Ok(Some(b.rules.join("\n")))
}
