//! Constrained tool calls on a random-weight model: with the K3 output grammar from `kimi-xtml`
//! compiled by the native engine, every generated call parses and its arguments validate against
//! the tool's JSON schema — random weights, so only the constraint can make this true.

use std::sync::Arc;

use kimi_host::grammar::{Constraint, GrammarEngine};
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::model::{LogitsFor, Model};
use kimi_host::tokenizer::{Segment as TokSegment, Tokenizer};
use kimi_xtml::grammar::{ThinkChannel, ToolChoice, output_grammar};
use kimi_xtml::parse::{Event, OutputParser, Piece};
use kimi_xtml::{RenderOptions, Segment, render};
use serde_json::{Value, json};

fn schemas() -> Vec<Value> {
    kimi_host_cli::bench_plugins::tool_schemas()
}

struct Harness {
    model: Model,
    tok: Arc<Tokenizer>,
    engine: GrammarEngine,
    eos: u32,
}

fn harness() -> (tempfile::TempDir, Harness) {
    let dir = tempfile::tempdir().expect("tempdir");
    make_tiny(dir.path(), &TinyOptions { seed: 11, k31: true, mxfp4: true, vision: false }).expect("make-tiny");
    let model = Model::load(dir.path()).expect("model");
    let tok = Arc::new(Tokenizer::load(dir.path()).expect("byte-level tokenizer"));
    let eos = tok.special_id("<|end_of_msg|>").expect("eos");
    let engine = GrammarEngine::new(tok.clone(), model.text_config().vocab_size, eos).expect("engine");
    (dir, Harness { model, tok, engine, eos })
}

/// Generates under `grammar` with seeded sampling (Gumbel-max over allowed tokens); returns the
/// ids, or None when `max_tokens` ran out first.
fn generate(h: &Harness, prompt: &[u32], grammar: &str, seed: u64, max_tokens: usize) -> Option<Vec<u32>> {
    let mut m = h.engine.matcher(&Constraint::Lark(grammar.to_string())).expect("grammar compiles");
    let mut state = h.model.new_state();
    let mut logits = h.model.forward(prompt, &mut state, LogitsFor::LastToken, None).expect("prefill");
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let mask = m.mask().expect("mask");
        let mut best = (f64::NEG_INFINITY, 0u32);
        mask.iter_set_entries(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let g = logits[i] as f64 - (-u.ln()).ln();
            if g > best.0 {
                best = (g, i as u32);
            }
        });
        let t = best.1;
        if t == h.eos {
            return Some(out);
        }
        m.consume(t).expect("consume");
        out.push(t);
        logits = h.model.forward(&[t], &mut state, LogitsFor::LastToken, None).expect("decode");
    }
    None
}

fn parse(h: &Harness, ids: &[u32]) -> Result<Vec<Event>, String> {
    parse_from(h, ids, false)
}

fn parse_from(h: &Harness, ids: &[u32], thinking: bool) -> Result<Vec<Event>, String> {
    let sp = |n: &str| h.tok.special_id(n).expect("special");
    let (open, close, sep) = (sp("<|open|>"), sp("<|close|>"), sp("<|sep|>"));
    let pieces: Vec<Piece> = ids
        .iter()
        .map(|&i| match i {
            _ if i == open => Piece::Open,
            _ if i == close => Piece::Close,
            _ if i == sep => Piece::Sep,
            _ => Piece::Bytes(h.tok.token_bytes(i).unwrap_or_default().to_vec()),
        })
        .collect();
    let mut p = OutputParser::new(thinking);
    let mut ev = p.feed(&pieces).map_err(|e| e.0)?;
    ev.extend(p.finish().map_err(|e| e.0)?);
    Ok(ev)
}

fn prompt(h: &Harness, tools: &Value, tool_choice: &str) -> Vec<u32> {
    prompt_with(h, tools, tool_choice, false)
}

fn prompt_with(h: &Harness, tools: &Value, tool_choice: &str, thinking: bool) -> Vec<u32> {
    let msgs = vec![json!({"role": "user", "content": "Call the tool with minimal valid arguments."})];
    let opts = RenderOptions { thinking, tool_choice: Some(json!(tool_choice)), ..Default::default() };
    let segs = render(&msgs, Some(tools), &opts).expect("render");
    let segs: Vec<TokSegment> = segs
        .into_iter()
        .map(|s| match s {
            Segment::Text(t) => TokSegment::Text(t),
            Segment::Special(n) => TokSegment::Special(n.to_string()),
        })
        .collect();
    h.tok.encode_segments(&segs).expect("encode")
}

#[test]
fn required_tool_calls_always_validate_against_their_schemas() {
    let (_dir, h) = harness();
    let mut generated = 0;
    for (k, schema) in schemas().into_iter().enumerate() {
        let tools = json!([{"type": "function", "function": {"name": format!("tool_{k}"), "parameters": schema}}]);
        let grammar = output_grammar(Some(&tools), &ToolChoice::Required, None, ThinkChannel::Off)
            .expect("grammar")
            .expect("some");
        let validator = jsonschema::validator_for(&schema).expect("schema");
        let p = prompt(&h, &tools, "required");
        for seed in 0..20 {
            let ids = generate(&h, &p, &grammar, seed, 1500)
                .unwrap_or_else(|| panic!("schema {k} seed {seed}: cut off by max_tokens"));
            let events = parse(&h, &ids).unwrap_or_else(|e| panic!("schema {k} seed {seed}: {e}"));
            let calls: Vec<_> =
                events.iter().filter_map(|e| if let Event::ToolCall(c) = e { Some(c) } else { None }).collect();
            assert!(!calls.is_empty(), "schema {k} seed {seed}: no tool call");
            for c in calls {
                assert_eq!(c.name, format!("tool_{k}"));
                assert!(validator.is_valid(&c.arguments), "schema {k} seed {seed}: {} does not validate", c.arguments);
            }
            generated += 1;
        }
    }
    assert_eq!(generated, 200);
}

#[test]
fn json_schema_response_format_and_tool_choice_none() {
    let (_dir, h) = harness();
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                        "score": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "score"],
                        "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}});
    let grammar =
        output_grammar(None, &ToolChoice::Auto, Some(&rf), ThinkChannel::Off).expect("grammar").expect("some");
    let validator = jsonschema::validator_for(&schema).expect("schema");
    let tools = json!([{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
                        "properties": {"command": {"type": "string", "maxLength": 8}}, "required": ["command"]}}}]);
    let p = prompt(&h, &tools, "auto");
    for seed in 0..20 {
        let ids = generate(&h, &p, &grammar, seed, 800).expect("finishes");
        let events = parse(&h, &ids).expect("parses");
        let content: String =
            events.iter().filter_map(|e| if let Event::Content(t) = e { Some(t.as_str()) } else { None }).collect();
        let v: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("seed {seed}: {content:?}: {e}"));
        assert!(validator.is_valid(&v), "seed {seed}: {v}");
        assert!(!content.contains('\n') && !content.contains('\t'), "compact JSON: {content:?}");
    }
    let none =
        output_grammar(Some(&tools), &ToolChoice::None, None, ThinkChannel::Off).expect("grammar").expect("some");
    let p = prompt(&h, &tools, "none");
    for seed in 0..10 {
        if let Some(ids) = generate(&h, &p, &none, seed, 300) {
            let events = parse(&h, &ids).expect("parses");
            assert!(!events.iter().any(|e| matches!(e, Event::ToolCall(_))), "tool_choice none produced a call");
        }
    }
}

#[test]
fn thinking_budget_closes_the_think_channel() {
    let (_dir, h) = harness();
    let close = h.tok.special_id("<|close|>").expect("close");
    for (k, schema) in schemas().into_iter().enumerate().take(4) {
        let tools = json!([{"type": "function", "function": {"name": format!("tool_{k}"), "parameters": schema}}]);
        let budget = 6 + 4 * k as u32;
        let grammar = output_grammar(Some(&tools), &ToolChoice::Required, None, ThinkChannel::Budget(budget))
            .expect("grammar")
            .expect("some");
        let validator = jsonschema::validator_for(&schema).expect("schema");
        let p = prompt_with(&h, &tools, "required", true);
        for seed in 0..5 {
            let ids = generate(&h, &p, &grammar, seed, 1500)
                .unwrap_or_else(|| panic!("schema {k} seed {seed}: cut off by max_tokens"));
            // The prompt opened the think channel; its text ends at the first `<|close|>`.
            let think_len = ids.iter().position(|&t| t == close).expect("think channel closed");
            assert!(think_len <= budget as usize, "schema {k} seed {seed}: {think_len} reasoning tokens > {budget}");
            let events = parse_from(&h, &ids, true).unwrap_or_else(|e| panic!("schema {k} seed {seed}: {e}"));
            let calls: Vec<_> =
                events.iter().filter_map(|e| if let Event::ToolCall(c) = e { Some(c) } else { None }).collect();
            assert!(!calls.is_empty(), "schema {k} seed {seed}: no tool call");
            for c in calls {
                assert!(validator.is_valid(&c.arguments), "schema {k} seed {seed}: {} does not validate", c.arguments);
            }
        }
    }
}

/// The same 10 schemas × 20 seeds, served by the engine with speculative decoding on (a random
/// DSpark draft, 2 drafts a step, drawn from the sampler through the constraint's lookahead and
/// verified by rejection sampling): every call still parses and validates. With greedy drafts,
/// requests run one at a time give the same engine's output without speculation token for token
/// (the matcher only ever consumes emitted tokens, so rejected drafts never touch it).
#[test]
fn required_tool_calls_validate_with_speculation_on() {
    use kimi_host::engine::{Engine, EngineConfig, GenRequest, SamplerRequest, SamplingSpec, SeqEvent, Speculation};
    use kimi_host::model::dspark::DsparkDraft;
    use kimi_host::plugins::builtin::builtin;
    use kimi_host::plugins::{PluginEnv, PluginRuntime, RuntimeOptions, SamplerPlugin, TenantSampler, TenantServices};
    use std::sync::Mutex;

    let (dir, h) = harness();
    let draft_dir = tempfile::tempdir().expect("tempdir");
    kimi_host::model::tiny::make_draft(dir.path(), draft_dir.path(), 3, 2).expect("make-draft");
    let model = Arc::new(Model::load(dir.path()).expect("model"));
    let draft = Arc::new(DsparkDraft::load(draft_dir.path(), &model).expect("draft"));
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load("sampler-standard", builtin("sampler-standard").expect("builtin")).expect("loads");
    let plugin = Arc::new(SamplerPlugin::new(rt, &compiled).expect("sampler"));
    let env = Arc::new(PluginEnv::bare(model.text_config().vocab_size as u32, vec![]));
    let sampler = Arc::new(Mutex::new(TenantSampler::new(plugin, env, Arc::new(TenantServices::default()), "t")));
    let base = EngineConfig { max_seqs: 200, max_batched_tokens: 1024, state_memory: 1 << 30, ..Default::default() };
    // Drafts drawn from the sampler through the constraint's lookahead (the default), and
    // greedy drafts (sample-and-match, which gives plain decoding's very tokens).
    let spec = Engine::start(
        model.clone(),
        EngineConfig { speculation: Some(Speculation::new(draft.clone(), 2)), ..base.clone() },
    )
    .expect("speculative engine");
    let greedy_drafts = Speculation { drafts: kimi_host::engine::DraftMode::Greedy, ..Speculation::new(draft, 2) };
    let spec_greedy = Engine::start(
        model.clone(),
        EngineConfig { speculation: Some(greedy_drafts), state_memory: 64 << 20, ..base.clone() },
    )
    .expect("speculative engine with greedy drafts");
    let plain = Engine::start(model.clone(), base).expect("plain engine");
    let submit_with = |e: &Engine, prompt: &[u32], grammar: &str, seed: u64, params: &str| {
        let req = GenRequest {
            prompt: prompt.to_vec(),
            max_tokens: 1500,
            n: 1,
            stop_tokens: vec![h.eos],
            constraint: Some(h.engine.matcher(&Constraint::Lark(grammar.to_string())).expect("grammar compiles")),
            sampling: SamplingSpec {
                sampler: sampler.clone(),
                params_json: params.into(),
                seed,
                info: SamplerRequest::default(),
            },
            logprobs: None,
            cache_salt: None,
            media: None,
        };
        e.submit(req).expect("submit")
    };
    let submit = |e: &Engine, prompt: &[u32], grammar: &str, seed: u64| {
        submit_with(e, prompt, grammar, seed, r#"{"temperature": 1.0, "top_p": 0.95}"#)
    };
    let collect = |mut handle: kimi_host::engine::GenHandle| {
        let mut ids = Vec::new();
        loop {
            match handle.events.blocking_recv() {
                Some(SeqEvent::Token { id, .. }) => ids.push(id),
                Some(SeqEvent::Finished { .. }) => return ids,
                Some(SeqEvent::Failed { error, .. }) => panic!("failed: {error}"),
                Some(SeqEvent::Cached { .. }) => {}
                None => panic!("stream closed early"),
            }
        }
    };
    // Token identity with plain decoding, one request at a time: a prompt's prefill chunks then
    // fall the same way in both engines. (Under load they do not: the chunk budget shrinks with
    // the decoding sequences, and KDA's chunked prefill rounds differently for other chunk
    // boundaries, which can move a sampled token at temperature 1.)
    for k in [0usize, 4, 9] {
        let schema = &schemas()[k];
        let tools = json!([{"type": "function", "function": {"name": format!("tool_{k}"), "parameters": schema}}]);
        let grammar = output_grammar(Some(&tools), &ToolChoice::Required, None, ThinkChannel::Off)
            .expect("grammar")
            .expect("some");
        let p = prompt(&h, &tools, "required");
        let with = collect(submit(&spec_greedy, &p, &grammar, 0));
        let without = collect(submit(&plain, &p, &grammar, 0));
        assert_eq!(with, without, "schema {k}: speculation changed the output");
        if k == 0 {
            // Sampled drafts at temperature 0: the lookahead's masks and the emitted tokens'
            // matcher are the plain run's, so the argmax tokens are too.
            let greedy = r#"{"temperature": 0}"#;
            let with = collect(submit_with(&spec, &p, &grammar, 0, greedy));
            let without = collect(submit_with(&plain, &p, &grammar, 0, greedy));
            assert_eq!(with, without, "schema {k}: sampled drafts changed the greedy output");
        }
    }
    // Every schema's 20 seeds decode side by side, all 200 at once.
    let t0 = std::time::Instant::now();
    let mut jobs = Vec::new();
    for (k, schema) in schemas().into_iter().enumerate() {
        let tools = json!([{"type": "function", "function": {"name": format!("tool_{k}"), "parameters": schema}}]);
        let grammar = output_grammar(Some(&tools), &ToolChoice::Required, None, ThinkChannel::Off)
            .expect("grammar")
            .expect("some");
        let p = prompt(&h, &tools, "required");
        for seed in 0..20 {
            jobs.push((k, seed, schema.clone(), submit(&spec, &p, &grammar, seed)));
        }
    }
    let mut checked = 0;
    let mut tokens = 0;
    for (k, seed, schema, handle) in jobs {
        let mut ids = collect(handle);
        tokens += ids.len();
        assert_eq!(ids.pop(), Some(h.eos), "schema {k} seed {seed}: ends with end-of-message");
        let validator = jsonschema::validator_for(&schema).expect("schema");
        let events = parse(&h, &ids).unwrap_or_else(|e| panic!("schema {k} seed {seed}: {e}"));
        let calls: Vec<_> =
            events.iter().filter_map(|e| if let Event::ToolCall(c) = e { Some(c) } else { None }).collect();
        assert!(!calls.is_empty(), "schema {k} seed {seed}: no tool call");
        for c in calls {
            assert!(validator.is_valid(&c.arguments), "schema {k} seed {seed}: {} does not validate", c.arguments);
        }
        checked += 1;
    }
    eprintln!("200 constrained generations with speculation: {tokens} tokens in {:?}", t0.elapsed());
    assert_eq!(checked, 200);
    let st = &spec.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let (rounds, proposed, accepted) = (load(&st.spec_rounds), load(&st.spec_proposed), load(&st.spec_accepted));
    eprintln!("sampled drafts: {rounds} rounds, {proposed} proposed, {accepted} accepted");
    assert!(rounds > 0 && accepted > 0, "speculation ran and drafts were accepted");
    spec.shutdown(std::time::Duration::from_secs(5));
    spec_greedy.shutdown(std::time::Duration::from_secs(5));
    plain.shutdown(std::time::Duration::from_secs(5));
}
