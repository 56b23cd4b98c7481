//! Incremental parser of Kimi-K3 output (ids already split into markers and text bytes):
//! reasoning and content deltas as they arrive, tool calls when complete. Matching happens on
//! marker *tokens*, so text that merely spells `<|open|>` can never open a channel.

use serde_json::{Map, Value};

use crate::{RenderError, unescape_attr};

/// One generated piece: a marker token or the bytes of an ordinary token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Open,
    Close,
    Sep,
    EndOfMsg,
    Bytes(Vec<u8>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub index: u32,
    pub name: String,
    /// Arguments as a JSON object (typed values rebuilt from each argument's `type`).
    pub arguments: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Reasoning(String),
    Content(String),
    ToolCall(ParsedCall),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Channel {
    Think,
    Response,
    /// Between channels (after a close, inside `tools` outside a call, after the message).
    Outside,
    Argument,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Mode {
    /// Collecting a tag header after `<|open|>` or `<|close|>` until `<|sep|>`.
    Header {
        open: bool,
        text: Vec<u8>,
    },
    Body,
}

#[derive(Clone, Debug)]
pub struct OutputParser {
    channel: Channel,
    mode: Mode,
    /// Bytes of an incomplete UTF-8 sequence in the current channel.
    pending: Vec<u8>,
    call: Option<(String, u32, Map<String, Value>)>,
    arg: Option<(String, String, Vec<u8>)>,
    calls_seen: u32,
    done: bool,
}

impl OutputParser {
    /// `thinking`: the generation prompt opened the think channel (else the response channel).
    pub fn new(thinking: bool) -> OutputParser {
        OutputParser {
            channel: if thinking { Channel::Think } else { Channel::Response },
            mode: Mode::Body,
            pending: Vec::new(),
            call: None,
            arg: None,
            calls_seen: 0,
            done: false,
        }
    }

    fn flush_text(&mut self, out: &mut Vec<Event>, last: bool) {
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() && !last => e.valid_up_to(),
            Err(_) => self.pending.len(),
        };
        if valid == 0 {
            return;
        }
        let bytes: Vec<u8> = self.pending.drain(..valid).collect();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        match self.channel {
            Channel::Think => out.push(Event::Reasoning(text)),
            Channel::Response => out.push(Event::Content(text)),
            // Stray text between channels is kept as content rather than dropped.
            Channel::Outside if !text.trim().is_empty() && self.call.is_none() => out.push(Event::Content(text)),
            _ => {}
        }
    }

    pub fn feed(&mut self, pieces: &[Piece]) -> Result<Vec<Event>, RenderError> {
        let mut out = Vec::new();
        for p in pieces {
            if self.done {
                break;
            }
            match (&mut self.mode, p) {
                (Mode::Header { text, .. }, Piece::Bytes(b)) => text.extend_from_slice(b),
                (Mode::Header { open, text }, Piece::Sep) => {
                    let (open, header) = (*open, String::from_utf8_lossy(text).into_owned());
                    self.mode = Mode::Body;
                    self.tag(open, &header, &mut out)?;
                }
                (Mode::Header { .. }, other) => {
                    return Err(RenderError(format!("unexpected {other:?} inside a tag header")));
                }
                (Mode::Body, Piece::Bytes(b)) => {
                    if self.channel == Channel::Argument {
                        if let Some(a) = self.arg.as_mut() {
                            a.2.extend_from_slice(b);
                        }
                    } else {
                        self.pending.extend_from_slice(b);
                        self.flush_text(&mut out, false);
                    }
                }
                (Mode::Body, Piece::Open) => {
                    self.flush_text(&mut out, true);
                    self.mode = Mode::Header { open: true, text: Vec::new() };
                }
                (Mode::Body, Piece::Close) => {
                    self.flush_text(&mut out, true);
                    self.mode = Mode::Header { open: false, text: Vec::new() };
                }
                // A doubled separator is tolerated (seen in real outputs).
                (Mode::Body, Piece::Sep) => {}
                (Mode::Body, Piece::EndOfMsg) => {
                    self.flush_text(&mut out, true);
                    self.done = true;
                }
            }
        }
        Ok(out)
    }

    /// End of generation: flushes text; an unfinished call is an error (cut off).
    pub fn finish(&mut self) -> Result<Vec<Event>, RenderError> {
        let mut out = Vec::new();
        self.flush_text(&mut out, true);
        if let Some((name, _, _)) = &self.call {
            return Err(RenderError(format!("generation ended inside tool call `{name}`")));
        }
        self.done = true;
        Ok(out)
    }

    fn tag(&mut self, open: bool, header: &str, out: &mut Vec<Event>) -> Result<(), RenderError> {
        let (name, attrs) = parse_header(header);
        match (open, name.as_str()) {
            (true, "think") => self.channel = Channel::Think,
            (true, "response") => self.channel = Channel::Response,
            (true, "tools") | (false, _) if name != "argument" && name != "call" => self.channel = Channel::Outside,
            (true, "call") => {
                self.calls_seen += 1;
                let tool = attrs.iter().find(|a| a.0 == "tool").map(|a| a.1.clone()).unwrap_or_default();
                let index =
                    attrs.iter().find(|a| a.0 == "index").and_then(|a| a.1.parse().ok()).unwrap_or(self.calls_seen);
                self.call = Some((tool, index, Map::new()));
                self.channel = Channel::Outside;
            }
            (true, "argument") => {
                let key = attrs.iter().find(|a| a.0 == "key").map(|a| a.1.clone()).unwrap_or_default();
                let ty = attrs.iter().find(|a| a.0 == "type").map(|a| a.1.clone()).unwrap_or_else(|| "string".into());
                self.arg = Some((key, ty, Vec::new()));
                self.channel = Channel::Argument;
            }
            (false, "argument") => {
                let (key, ty, raw) = self.arg.take().ok_or_else(|| RenderError("argument closed twice".into()))?;
                let text = String::from_utf8_lossy(&raw).into_owned();
                let value = if ty == "string" {
                    Value::String(text)
                } else {
                    serde_json::from_str(&text).unwrap_or(Value::String(text))
                };
                if let Some(c) = self.call.as_mut() {
                    c.2.insert(key, value);
                }
                self.channel = Channel::Outside;
            }
            (false, "call") => {
                let (name, index, args) = self.call.take().ok_or_else(|| RenderError("call closed twice".into()))?;
                out.push(Event::ToolCall(ParsedCall { index, name, arguments: Value::Object(args) }));
                self.channel = Channel::Outside;
            }
            (true, _) => self.channel = Channel::Outside,
            _ => self.channel = Channel::Outside,
        }
        Ok(())
    }
}

/// `call tool="x" index="1"` → ("call", [("tool","x"), ("index","1")]), attribute values unescaped.
fn parse_header(h: &str) -> (String, Vec<(String, String)>) {
    let h = h.trim();
    let (name, mut rest) = h.split_once(' ').unwrap_or((h, ""));
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let end = after.find('"').unwrap_or(after.len());
        attrs.push((key, unescape_attr(&after[..end])));
        rest = after.get(end + 1..).unwrap_or("");
    }
    (name.to_string(), attrs)
}
