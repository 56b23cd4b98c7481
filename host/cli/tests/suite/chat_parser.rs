//! The Kimi-K3 output parser (`kimi-xtml::parse`): rendering an assistant message with tool calls
//! and parsing it back gives the same calls; any chunking of the stream gives the same result.

use crate::common;

use kimi_host::tokenizer::Tokenizer;
use kimi_xtml::parse::{Event, OutputParser, ParsedCall, Piece};
use kimi_xtml::{RenderOptions, Segment, render};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

/// The assistant turn as the model would generate it: pieces after `…<|open|>think<|sep|>`.
fn generated(tok: &Tokenizer, assistant: &Value) -> Vec<Piece> {
    let opts = RenderOptions { add_generation_prompt: false, ..Default::default() };
    let segs = render(std::slice::from_ref(assistant), None, &opts).expect("render");
    let mut pieces = Vec::new();
    for s in segs {
        match s {
            Segment::Special("<|open|>") => pieces.push(Piece::Open),
            Segment::Special("<|close|>") => pieces.push(Piece::Close),
            Segment::Special("<|sep|>") => pieces.push(Piece::Sep),
            Segment::Special(_) => pieces.push(Piece::EndOfMsg),
            Segment::Text(t) => {
                for id in tok.encode_text(&t) {
                    pieces.push(Piece::Bytes(tok.token_bytes(id).expect("bytes").to_vec()));
                }
            }
        }
    }
    // Drop `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (the generation prompt).
    let mut seps = 0;
    let cut = pieces.iter().position(|p| {
        if *p == Piece::Sep {
            seps += 1;
        }
        seps == 2
    });
    pieces.split_off(cut.expect("prompt") + 1)
}

fn collect(events: Vec<Event>) -> (String, String, Vec<ParsedCall>) {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    for e in events {
        match e {
            Event::Reasoning(t) => r += &t,
            Event::Content(t) => c += &t,
            Event::ToolCall(call) => calls.push(call),
        }
    }
    (r, c, calls)
}

#[test]
fn render_then_parse_round_trips_in_any_chunking() {
    let tok = Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("tokenizer");
    let args1 = json!({"city": "Zürich \"old\" <|open|> town", "days": 3, "ratio": 0.5, "ok": true, "none": null,
                        "tags": ["a", "b"], "opts": {"unit": "°C"}});
    let args2 = json!({"q": "日本語 😀 & more"});
    let assistant = json!({"role": "assistant", "reasoning_content": "Let me think… 🤔 about <|close|> it.",
        "content": "Checking two cities.",
        "tool_calls": [{"id": "a", "function": {"name": "get_weather", "arguments": args1.to_string()}},
                       {"id": "b", "function": {"name": "search_web", "arguments": args2}}]});
    let pieces = generated(&tok, &assistant);
    let mut whole = OutputParser::new(true);
    let mut events = whole.feed(&pieces).expect("feed");
    events.extend(whole.finish().expect("finish"));
    let (reasoning, content, calls) = collect(events);
    assert_eq!(reasoning, "Let me think… 🤔 about <|close|> it.");
    assert_eq!(content, "Checking two cities.");
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].index, calls[0].name.as_str()), (1, "get_weather"));
    assert_eq!(calls[0].arguments, args1);
    assert_eq!((calls[1].index, calls[1].name.as_str()), (2, "search_web"));
    assert_eq!(calls[1].arguments, args2);

    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..50 {
        let mut p = OutputParser::new(true);
        let mut events = Vec::new();
        let mut i = 0;
        while i < pieces.len() {
            let n = rng.random_range(1..6).min(pieces.len() - i);
            let chunk = p.feed(&pieces[i..i + n]).expect("feed");
            for e in &chunk {
                if let Event::Reasoning(t) | Event::Content(t) = e {
                    assert!(!t.contains('\u{FFFD}'), "split character in {t:?}");
                }
            }
            events.extend(chunk);
            i += n;
        }
        events.extend(p.finish().expect("finish"));
        assert_eq!(collect(events), (reasoning.clone(), content.clone(), calls.clone()));
    }
}

#[test]
fn a_call_cut_off_by_max_tokens_is_an_error() {
    let tok = Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("tokenizer");
    let assistant = json!({"role": "assistant", "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": {"x": "long value"}}}]});
    let pieces = generated(&tok, &assistant);
    let cut = pieces.len() - 12;
    let mut p = OutputParser::new(true);
    p.feed(&pieces[..cut]).expect("feed");
    assert!(p.finish().is_err());
}
