//! The native grammar engine (llguidance) over the real Kimi vocabulary: every token chosen
//! under its masks yields output that satisfies the constraint.

use crate::common;

use std::sync::Arc;

use kimi_host::grammar::{Constraint, GrammarEngine};
use kimi_host::tokenizer::Tokenizer;

fn engine() -> (Arc<Tokenizer>, GrammarEngine) {
    let tok = Arc::new(Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("tokenizer"));
    let eos = tok.special_id("<|end_of_msg|>").expect("eos");
    let g = GrammarEngine::new(tok.clone(), 163_840, eos).expect("engine");
    (tok, g)
}

/// Walks the constraint choosing pseudo-random allowed tokens until EOS; returns the text.
fn walk(tok: &Tokenizer, g: &GrammarEngine, c: &Constraint, seed: u64) -> String {
    let eos = tok.special_id("<|end_of_msg|>").expect("eos");
    let mut m = g.matcher(c).expect("compiles");
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::new();
    for _ in 0..400 {
        let mask = m.mask().expect("mask");
        let mut allowed = Vec::new();
        mask.iter_set_entries(|i| allowed.push(i as u32));
        assert!(!allowed.is_empty(), "dead end after {:?}", tok.decode(&out));
        if allowed.contains(&eos) {
            break;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = allowed[(x % allowed.len() as u64) as usize];
        m.consume(t).expect("consume");
        out.push(t);
    }
    assert!(m.is_accepting(), "not accepting after {:?}", tok.decode(&out));
    tok.decode(&out).expect("decode")
}

#[test]
fn masks_keep_output_inside_json_schema_regex_and_choice() {
    let (tok, g) = engine();
    let schema = r#"{"type":"object","properties":{"city":{"type":"string","maxLength":6},
        "days":{"type":"integer","minimum":1,"maximum":7},"unit":{"enum":["c","f"]}},
        "required":["city","days","unit"],"additionalProperties":false}"#;
    let c = Constraint::JsonSchema(schema.into());
    for seed in 1..=6 {
        let text = walk(&tok, &g, &c, seed);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let days = v["days"].as_i64().expect("days");
        assert!((1..=7).contains(&days), "{text}");
        assert!(v["city"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text}");
        assert!(matches!(v["unit"].as_str(), Some("c" | "f")), "{text}");
        assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
    }
    let re = regex::Regex::new(r"^[0-9]{3}-[a-z]{2,4}$").expect("regex");
    for seed in 1..=4 {
        let text = walk(&tok, &g, &Constraint::Regex("[0-9]{3}-[a-z]{2,4}".into()), seed);
        assert!(re.is_match(&text), "{text:?}");
    }
    let choice = Constraint::Choice(vec!["yes".into(), "no".into(), "<|open|> maybe".into()]);
    for seed in 1..=4 {
        let text = walk(&tok, &g, &choice, seed);
        assert!(["yes", "no", "<|open|> maybe"].contains(&text.as_str()), "{text:?}");
    }
}

#[test]
fn invalid_constraints_are_reported_not_panicked() {
    let (_tok, g) = engine();
    assert!(g.validate(&Constraint::JsonSchema("{\"type\": \"object\"}".into())).is_none());
    assert!(g.validate(&Constraint::JsonSchema("{not json".into())).is_some());
    assert!(g.validate(&Constraint::Lark("start: ( ".into())).is_some());
    assert!(g.validate(&Constraint::Choice(vec![])).is_some());
    // Compiled once, then cloned from the cache: a second matcher starts fresh.
    let c = Constraint::Regex("ab+".into());
    let mut a = g.matcher(&c).expect("a");
    let b = g.matcher(&c).expect("b");
    let tok_a = 64; // 'a'
    a.consume(tok_a).expect("consume");
    let mut b = b;
    assert!(!b.is_accepting());
}

/// Forced bytes that end inside a character ("你" and "佬" share their first two bytes): the
/// forced tokens spell a prefix of them and the grammar accepts them. (llguidance also answers a
/// mask with the first forced token alone, so a wrong one — U+FFFD from a lossy decode — made
/// the first mask allow only a token the grammar then refuses.)
#[test]
fn forced_tokens_that_end_inside_a_character_spell_the_forced_bytes() {
    let (tok, g) = engine();
    let c = Constraint::Regex("(你|佬)x".into());
    let mut first = g.matcher(&c).expect("compiles");
    let mask = first.mask().expect("mask");
    mask.iter_set_entries(|id| {
        let b = tok.decode_bytes(&[id as u32]).expect("decode");
        assert!("你x".as_bytes().starts_with(&b) || "佬x".as_bytes().starts_with(&b), "first mask allows {id} = {b:?}");
    });
    let mut m = g.matcher(&c).expect("compiles");
    let forced = m.forced_tokens();
    let bytes = tok.decode_bytes(&forced).expect("decode");
    assert!("你".as_bytes().starts_with(&bytes), "forced {forced:?} = {bytes:?}");
    for t in forced {
        m.consume(t).expect("a forced token is allowed");
    }
    // A full walk still ends in one of the two texts.
    let text = walk(&tok, &g, &c, 7);
    assert!(text == "你x" || text == "佬x", "{text:?}");
}

/// A plugin-made constraint with 20,000 properties (2.5× the count that overflowed a 2 MiB
/// worker stack and killed the server inside llguidance's JSON compiler) compiles on the
/// engine's own compile stack; the test thread has the default stack.
#[test]
fn huge_schemas_compile_without_overflowing_the_callers_stack() {
    let (_tok, g) = engine();
    let props: serde_json::Map<String, serde_json::Value> =
        (0..20_000).map(|i| (format!("p{i}"), serde_json::json!({"type": "string", "pattern": "a+"}))).collect();
    let keys: Vec<&String> = props.keys().collect();
    let schema = serde_json::json!({"type": "object", "properties": props, "required": keys});
    let c = Constraint::JsonSchema(schema.to_string());
    let r = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || g.matcher(&c).map(|mut m| m.mask().map(|mask| mask.num_set())).err().map(|e| e.to_string()))
        .expect("spawn")
        .join()
        .expect("no panic");
    // Compiling or refusing (llguidance's own size limits) are both fine; crashing is not.
    if let Some(e) = r {
        assert!(e.contains("invalid constraint") || e.contains("grammar engine"), "{e}");
    }
}

/// Regexes whose automata explode (and grammars of the same kind) are refused or bounded by the
/// engine's work budgets: compiling and masking end with an answer, never a hang.
#[test]
fn exploding_regexes_hit_the_work_budgets_not_a_hang() {
    let (_tok, g) = engine();
    for re in ["(a|b)*a(a|b){60}", "(x+x+)+y", "([a-z]{1,50}){1,50}[0-9]{100}", "(.*a){40}"] {
        let c = Constraint::Regex(re.into());
        match g.matcher(&c) {
            Err(e) => assert!(e.to_string().contains("constraint"), "{re}: {e}"),
            Ok(mut m) => common::walk_lowest_allowed(&mut m, 8),
        }
    }
}
