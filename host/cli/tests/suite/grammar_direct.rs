//! The direct grammar path (our Lark subset and JSON-schema rules built straight into
//! llguidance's internal form) against llguidance's own front ends and an independent JSON
//! Schema validator, on the real Kimi vocabulary.

use crate::common;

use std::sync::Arc;

use kimi_host::grammar::{Constraint, ConstraintMatcher, GrammarEngine};
use kimi_host::tokenizer::Tokenizer;
use kimi_xtml::grammar::{ThinkChannel, ToolChoice, output_grammar};
use serde_json::{Value, json};

fn engine() -> (Arc<Tokenizer>, GrammarEngine, u32) {
    let tok = Arc::new(Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("tokenizer"));
    let eos = tok.special_id("<|end_of_msg|>").expect("eos");
    let g = GrammarEngine::new(tok.clone(), 163_840, eos).expect("engine");
    (tok, g, eos)
}

fn allowed(m: &mut ConstraintMatcher) -> Vec<u32> {
    let mask = m.mask().expect("mask");
    let mut v = Vec::new();
    mask.iter_set_entries(|i| v.push(i as u32));
    v
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The K3 output grammars the grammar plugin writes for the bench / constrained-test schemas.
fn k3_grammars() -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for (k, schema) in kimi_host_cli::bench_plugins::tool_schemas().into_iter().enumerate() {
        let name = format!("tool_{k}");
        let tools = json!([{"type": "function", "function": {"name": name, "parameters": schema}}]);
        let rf = json!({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}});
        let cases = [
            (ToolChoice::Required, None, ThinkChannel::Off),
            (ToolChoice::Named(name.clone()), None, ThinkChannel::Open),
            (ToolChoice::Auto, Some(&rf), ThinkChannel::Off),
            (ToolChoice::None, None, ThinkChannel::Budget(5)),
        ];
        for (choice, rf, think) in cases {
            let g = output_grammar(Some(&tools), &choice, rf, think).expect("grammar").expect("a constraint");
            // A JSON response may add properties; there the direct path writes fewer key
            // spellings (no general \u escapes), so its masks are a subset, not equal.
            out.push((g, rf.is_some()));
        }
    }
    out
}

/// How the direct path's masks must relate to llguidance's own.
#[derive(Clone, Copy)]
enum Masks {
    Equal,
    /// Within llguidance's, never empty where llguidance's is not (additional-property keys
    /// have fewer spellings on the direct path).
    Within,
}

/// Three pseudo-random walks of up to `steps` tokens under the direct matcher, comparing every
/// mask with llguidance's compile of the same constraint.
fn compare_walks(g: &GrammarEngine, c: &Constraint, eos: u32, steps: usize, masks: Masks, x: &mut u64) {
    assert!(g.compiles_directly(c), "fell back to llguidance's front end: {c:?}");
    for _walk in 0..3 {
        let mut direct = g.matcher(c).expect("direct");
        let mut reference = g.matcher_via_llguidance(c).expect("llguidance");
        for step in 0..steps {
            let a = allowed(&mut direct);
            let b = allowed(&mut reference);
            match masks {
                Masks::Equal => assert_eq!(a, b, "step {step}: masks differ for {c:?}"),
                Masks::Within => {
                    assert!(!a.is_empty() || b.is_empty(), "step {step}: dead end for {c:?}");
                    assert!(a.iter().all(|t| b.binary_search(t).is_ok()), "step {step}: direct allows more for {c:?}");
                }
            }
            if a.is_empty() || a.contains(&eos) {
                break;
            }
            let t = a[(next(x) % a.len() as u64) as usize];
            direct.consume(t).expect("consume direct");
            reference.consume(t).expect("consume llguidance");
        }
    }
}

#[test]
fn k3_output_grammars_compile_directly_with_llguidance_masks() {
    let (_tok, g, eos) = engine();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for (text, response_json) in k3_grammars() {
        let masks = if response_json { Masks::Within } else { Masks::Equal };
        compare_walks(&g, &Constraint::Lark(text), eos, 120, masks, &mut x);
    }
}

/// Schemas for the JSON rules: each compiles directly, and every walk under its masks ends in
/// JSON that the `jsonschema` crate accepts. (Numbers are bounded on both sides here: a random
/// walk under a half-open range writes integers too long for serde_json's f64; the rules' unit
/// tests cover half-open ranges.)
fn json_cases() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": -40, "maximum": 1234},
               "b": {"type": "number", "minimum": -3, "maximum": 2}, "c": {"type": "number", "minimum": -99999, "maximum": -7}},
               "required": ["a", "b", "c"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"x": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9},
               "y": {"type": ["string", "null"], "maxLength": 3}, "z": {"const": {"k": [1, "two"]}}},
               "required": ["x", "z"], "additionalProperties": false}),
        json!({"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"enum": ["q\"uote", 7, null]}]},
               "minItems": 2, "maxItems": 4}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}, "maxItems": 3},
               "opt1": {"type": "boolean"}, "opt2": {"type": "null"}},
               "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}),
        json!({"type": "object", "properties": {"n": {"type": "object", "properties": {"m": {"type": "integer", "maximum": 0}},
               "required": ["m"], "additionalProperties": false}}, "required": ["n"], "additionalProperties": false,
               "description": "nested"}),
        json!({"type": "object", "properties": {}, "additionalProperties": false}),
        json!({"type": "string", "minLength": 2, "maxLength": 5}),
    ]
}

/// No whitespace outside string literals.
fn compact(json: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            (false, _, c) if c.is_whitespace() => return false,
            _ => {}
        }
    }
    true
}

#[test]
fn json_rules_walks_validate_against_the_schema() {
    let (tok, g, eos) = engine();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for schema in json_cases() {
        let mut s = schema.clone();
        s["x-guidance"] = json!({"whitespace_flexible": false});
        let c = Constraint::Lark(format!("start: value\nvalue: %json {s}"));
        assert!(g.compiles_directly(&c), "fell back: {schema}");
        let validator = jsonschema::validator_for(&schema).expect("schema");
        for _walk in 0..12 {
            let mut m = g.matcher(&c).expect("compiles");
            let mut out = Vec::new();
            for _ in 0..3000 {
                let a = allowed(&mut m);
                assert!(!a.is_empty(), "dead end after {:?}", tok.decode(&out));
                if a.contains(&eos) {
                    break;
                }
                // Unbounded digit runs and keys would outlast any step budget under a uniform
                // pick, so a third of the picks take a token with JSON punctuation when one is allowed.
                let structural: Vec<u32> = if next(&mut x).is_multiple_of(3) {
                    let punct = |s: String| s.contains(['"', ',', ':', '}', ']']);
                    a.iter().copied().filter(|&t| tok.decode(&[t]).is_ok_and(punct)).collect()
                } else {
                    Vec::new()
                };
                let pool = if structural.is_empty() { &a } else { &structural };
                let t = pool[(next(&mut x) % pool.len() as u64) as usize];
                m.consume(t).expect("consume");
                out.push(t);
            }
            let text = tok.decode(&out).expect("decode");
            assert!(m.is_accepting(), "walk did not finish: {text:?}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} for {schema}: {e}"));
            assert!(validator.is_valid(&v), "{text} does not validate against {schema}");
            assert!(compact(&text), "whitespace between JSON tokens: {text:?}");
        }
    }
}

#[test]
fn constraints_outside_the_subset_still_compile_through_llguidance() {
    let (_tok, g, _eos) = engine();
    let cases = [
        "start: \"a\"+ \"b\"",
        "start: x\nx: %json {\"type\": \"string\", \"pattern\": \"^[a-c]+$\"}",
        "start: x\nx: %json {\"$defs\": {\"n\": {\"type\": \"integer\"}}, \"$ref\": \"#/$defs/n\"}",
        "start: x\nx: %json {\"type\": \"number\", \"minimum\": 0.5}",
        "start: \"A\"i",
        "start: x  // comment\nx: \"y\"",
    ];
    for text in cases {
        let c = Constraint::Lark(text.into());
        assert!(!g.compiles_directly(&c), "{text} took the direct path");
        g.matcher(&c).unwrap_or_else(|e| panic!("{text}: {e}"));
    }
    // Deep nesting (a plugin's grammar) is refused by the direct path rather than recursed
    // into; llguidance's front end then answers for it. So is text it cannot read.
    let chain: String = (0..500).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
    let deep_rules = format!("start: r0\n{chain}r500: \"x\"");
    let deep_groups = format!("start: {}\"x\"{}", "(".repeat(500), ")".repeat(500));
    let non_ascii = format!("start: {}", "中".repeat(12));
    for text in [deep_rules, deep_groups, non_ascii] {
        let c = Constraint::Lark(text);
        assert!(!g.compiles_directly(&c));
        let _ = g.matcher(&c);
    }
    // Errors come from llguidance's front end, named as before.
    let bad = Constraint::Lark("start: nowhere".into());
    assert!(!g.compiles_directly(&bad));
    assert!(g.matcher(&bad).is_err());
}

#[test]
fn json_schema_constraints_compile_directly_within_llguidance_masks() {
    let (_tok, g, eos) = engine();
    let mut x = 0x1234_5678_9abc_def1u64;
    for schema in kimi_host_cli::bench_plugins::tool_schemas().into_iter().chain(json_cases()) {
        compare_walks(&g, &Constraint::JsonSchema(schema.to_string()), eos, 80, Masks::Within, &mut x);
    }
}

/// Inside JSON strings the direct path computes the plain-text part of a mask from character
/// counts instead of walking the trie (`JsonTextBias`). These walks steer into the states where
/// that is easiest to get wrong: after `\`, inside `\u`, mid-UTF-8, a full string, the quote
/// itself. Every mask must equal llguidance's own.
#[test]
fn masks_inside_json_strings_equal_llguidance() {
    let (tok, g, eos) = engine();
    let plain = |t: u32| {
        tok.token_bytes(t)
            .and_then(|b| std::str::from_utf8(b).ok())
            .is_some_and(|s| !s.is_empty() && !s.chars().any(|c| matches!(c, '"' | '\\' | '\0'..='\x1f' | '\x7f')))
    };
    let schemas = [
        json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 1}, "b": {"type": "string", "maxLength": 2},
               "c": {"type": "string", "maxLength": 5}, "d": {"type": "string", "minLength": 3, "maxLength": 9}},
               "required": ["a", "b", "c", "d"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"long": {"type": "string", "maxLength": 40}, "free": {"type": "string"},
               "least": {"type": "string", "minLength": 4}}, "required": ["long", "free", "least"], "additionalProperties": false}),
        json!({"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 6, "maxLength": 7},
               {"type": "null"}]}, "maxItems": 4}),
        json!({"type": "array", "items": {"type": ["string", "integer"], "maxLength": 4, "minimum": 0, "maximum": 99}, "maxItems": 3}),
    ];
    let mut x = 0x0bad_cafe_f00d_d00du64;
    for schema in schemas {
        let c = Constraint::JsonSchema(schema.to_string());
        assert!(g.compiles_directly(&c), "fell back: {schema}");
        for walk in 0..12 {
            let mut direct = g.matcher(&c).expect("direct");
            let mut reference = g.matcher_via_llguidance(&c).expect("llguidance");
            let mut out = Vec::new();
            for step in 0..400 {
                let a = allowed(&mut direct);
                let b = allowed(&mut reference);
                assert_eq!(
                    a,
                    b,
                    "walk {walk} step {step} after {:?}: masks differ for {schema}",
                    String::from_utf8_lossy(&tok.decode_bytes(&out).unwrap_or_default())
                );
                if a.is_empty() || a.contains(&eos) {
                    break;
                }
                // Mostly short or non-plain tokens (escapes, quotes, partial UTF-8), so strings
                // pass through every state before they fill up.
                let pick = next(&mut x) % 4;
                let pool: Vec<u32> = match pick {
                    0 => a.clone(),
                    1 => a.iter().copied().filter(|&t| !plain(t)).collect(),
                    _ => a.iter().copied().filter(|&t| tok.token_bytes(t).is_some_and(|b| b.len() <= 2)).collect(),
                };
                let pool = if pool.is_empty() { &a } else { &pool };
                let t = pool[(next(&mut x) % pool.len() as u64) as usize];
                direct.consume(t).expect("consume direct");
                reference.consume(t).expect("consume llguidance");
                out.push(t);
            }
        }
    }
}
