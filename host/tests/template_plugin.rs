//! `builtin:template-kimi-k3` through the plugin runtime: OpenAI-shaped requests render to the
//! release chat template's exact ids, bad requests are refused with the reason, and the output
//! parser resource turns generated ids back into reasoning, content and tool calls.

mod common;

use std::sync::Arc;

use kimi_host::plugins::bindings::host::kimi::host::types::{RequestInfo, Segment as WitSegment};
use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{OutputEvent, PluginEnv, PluginRuntime, RuntimeOptions, TemplatePlugin, TenantServices};
use kimi_host::tokenizer::{Segment, Tokenizer};
use serde_json::{Value, json};

struct Fixture {
    tok: Arc<Tokenizer>,
    plugin: TemplatePlugin,
    env: Arc<PluginEnv>,
    svc: Arc<TenantServices>,
}

fn fixture() -> Fixture {
    let tok = Arc::new(Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("tokenizer"));
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load("template-kimi-k3", builtin("template-kimi-k3").expect("builtin")).expect("loads");
    let plugin = TemplatePlugin::new(rt, &compiled).expect("template");
    let env = Arc::new(PluginEnv::from_tokenizer(tok.clone(), 163_840));
    Fixture { tok, plugin, env, svc: Arc::new(TenantServices::default()) }
}

fn req(body: &Value) -> RequestInfo {
    RequestInfo { tenant: "t".into(), request_id: "r".into(), model: "kimi-k3".into(), params_json: body.to_string() }
}

fn render_ids(f: &Fixture, body: &Value) -> Result<Vec<u32>, String> {
    let r = f.plugin.render(&f.env, &f.svc, &req(body), &body.to_string()).map_err(|e| e.to_string())?;
    let segs: Vec<Segment> = r
        .segments
        .into_iter()
        .map(|s| match s {
            WitSegment::Text(t) => Segment::Text(t),
            WitSegment::Special(n) => Segment::Special(n),
        })
        .collect();
    f.tok.encode_segments(&segs).map_err(|e| e.to_string())
}

#[test]
fn openai_requests_render_to_the_release_template_ids() {
    let f = fixture();
    let text = std::fs::read_to_string(common::golden_dir().join("chat/simply_kimi_k3_chat_template_goldens.json"))
        .expect("golden");
    let v: Value = serde_json::from_str(&text).expect("json");
    for (name, c) in v["chats"].as_object().expect("chats") {
        let mut body = json!({"model": "kimi-k3", "messages": c["messages"]});
        if !c["tools"].is_null() {
            body["tools"] = c["tools"].clone();
        }
        let kw = &c["kwargs"];
        if let Some(e) = kw.get("thinking_effort") {
            body["reasoning_effort"] = e.clone();
        }
        if kw.get("thinking") == Some(&Value::Bool(false)) {
            body["thinking"] = json!({"type": "disabled"});
        }
        let want: Vec<u32> = c["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
        assert_eq!(render_ids(&f, &body).expect("render"), want, "{name}");
    }
    // Kimi's thinking object wins over reasoning_effort.
    let base = json!({"messages": [{"role": "user", "content": "quick one"}]});
    let mut a = base.clone();
    a["reasoning_effort"] = json!("high");
    a["thinking"] = json!({"type": "enabled", "effort": "low"});
    let mut b = base.clone();
    b["reasoning_effort"] = json!("low");
    assert_eq!(render_ids(&f, &a), render_ids(&f, &b));
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let f = fixture();
    let tool = json!({"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}});
    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, word) in [
        (json!({"messages": user, "tool_choice": "required"}), "required"),
        (json!({"messages": user, "tools": [tool], "tool_choice": "sometimes"}), "tool_choice"),
        (json!({"messages": user, "response_format": {"type": "xml"}}), "xml"),
        (json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}), "schema"),
        (json!({"messages": user, "tools": [tool, tool]}), "duplicate"),
        (json!({"messages": user, "tools": [{"type": "function", "function": {"name": "1bad"}}]}), "1bad"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "wizard"),
        (json!({"messages": [{"role": "user", "content": "x", "tools": [tool]}]}), "system"),
        (json!({"messages": [{"role": "tool", "content": "x"}]}), "tool_call_id"),
        (json!({"messages": user, "reasoning_effort": "extreme"}), "extreme"),
    ] {
        let err = render_ids(&f, &body).expect_err(&body.to_string());
        assert!(err.contains(word) && err.contains("template-kimi-k3"), "{body}: {err}");
    }
}

#[test]
fn output_parser_resource_parses_generated_ids() {
    let f = fixture();
    let enc = |t: &str| f.tok.encode_text(t);
    let sp = |n: &str| f.tok.special_id(n).expect("special");
    // reasoning…<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|open|>tools<|sep|>…
    let mut ids = enc("Need a tool 🤔");
    for (special, text) in [
        ("<|close|>", "think"),
        ("<|sep|>", ""),
        ("<|open|>", "response"),
        ("<|sep|>", "On it."),
        ("<|close|>", "response"),
        ("<|sep|>", ""),
        ("<|open|>", "tools"),
        ("<|sep|>", ""),
        ("<|open|>", "call tool=\"bash\" index=\"1\""),
        ("<|sep|>", ""),
        ("<|open|>", "argument key=\"command\" type=\"string\""),
        ("<|sep|>", "ls -la"),
        ("<|close|>", "argument"),
        ("<|sep|>", ""),
        ("<|open|>", "argument key=\"n\" type=\"number\""),
        ("<|sep|>", "2"),
        ("<|close|>", "argument"),
        ("<|sep|>", ""),
        ("<|close|>", "call"),
        ("<|sep|>", ""),
        ("<|close|>", "tools"),
        ("<|sep|>", ""),
        ("<|close|>", "message"),
        ("<|sep|>", ""),
        ("<|end_of_msg|>", ""),
    ] {
        ids.push(sp(special));
        ids.extend(enc(text));
    }
    let body = json!({"messages": [{"role": "user", "content": "x"}]});
    let mut parser = f.plugin.parser(&f.env, &f.svc, &req(&body)).expect("parser");
    let mut events = Vec::new();
    for chunk in ids.chunks(3) {
        events.extend(parser.feed(chunk).expect("feed"));
    }
    events.extend(parser.finish().expect("finish"));
    let reasoning: String =
        events.iter().filter_map(|e| if let OutputEvent::Reasoning(t) = e { Some(t.as_str()) } else { None }).collect();
    let content: String =
        events.iter().filter_map(|e| if let OutputEvent::Content(t) = e { Some(t.as_str()) } else { None }).collect();
    let calls: Vec<_> =
        events.iter().filter_map(|e| if let OutputEvent::ToolCall(c) = e { Some(c) } else { None }).collect();
    assert_eq!(reasoning, "Need a tool 🤔");
    assert_eq!(content, "On it.");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "bash");
    let args: Value = serde_json::from_str(&calls[0].arguments_json).expect("json");
    assert_eq!(args, json!({"command": "ls -la", "n": 2}));
}

#[test]
fn grammar_plugin_plans_constraints_the_engine_compiles() {
    use kimi_host::grammar::GrammarEngine;
    use kimi_host::plugins::{GrammarPlugin, GrammarRequest};
    let f = fixture();
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load("grammar-kimi-k3", builtin("grammar-kimi-k3").expect("builtin")).expect("loads");
    let g = GrammarPlugin::new(rt, &compiled).expect("grammar plugin");
    let engine =
        GrammarEngine::new(f.tok.clone(), 163_840, f.tok.special_id("<|end_of_msg|>").expect("eos")).expect("engine");
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}]);
    let plan = |choice: Value, rf: Option<Value>| {
        let gr = GrammarRequest {
            tools_json: Some(tools.to_string()),
            tool_choice_json: Some(choice.to_string()),
            response_format_json: rf.map(|r| r.to_string()),
            thinking_json: Some(json!({"thinking": {"type": "disabled"}}).to_string()),
        };
        g.plan(&f.env, &f.svc, &req(&json!({})), &gr)
    };
    for (choice, rf) in [
        (json!("required"), None),
        (json!("none"), None),
        (json!({"type": "function", "function": {"name": "get_weather"}}), None),
        (json!("auto"), Some(json!({"type": "json_object"}))),
    ] {
        let c = plan(choice.clone(), rf).expect("plan").expect("a constraint");
        assert!(engine.validate(&c).is_none(), "{choice}: {:?}", engine.validate(&c));
    }
    assert!(plan(json!("auto"), None).expect("plan").is_none(), "auto without a JSON format needs no constraint");
    let err =
        plan(json!({"type": "function", "function": {"name": "nope"}}), None).expect_err("unknown tool").to_string();
    assert!(err.contains("nope"), "{err}");
}
