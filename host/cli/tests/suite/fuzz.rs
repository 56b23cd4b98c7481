//! Property-based fuzzing of every parser that sees untrusted bytes (issue: hardening, item 1):
//! safetensors headers and the shard index, `config.json`, `tiktoken.model` and the special
//! table, the tokenizer's encode/decode, chat requests through the builtin template plugin, the
//! output parser (native and as a plugin resource), our Lark subset and JSON-schema lowering,
//! request parameters and caps, and plugin uploads. The property everywhere: an answer (a value or
//! a named error) and never a panic, an abort or a trap of a builtin plugin.
//!
//! `cargo test` runs a bounded number of cases per target. A longer run:
//! `KIMI_FUZZ_CASES=20000 cargo test -p kimi-host-cli --test suite fuzz::`. A failing case is shrunk
//! and its seed saved by proptest in `fuzz.proptest-regressions` beside this file (commit it);
//! each finding also becomes a named test at the end of this file.

use crate::common;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use kimi_host::grammar::{Constraint, GrammarEngine};
use kimi_host::model::Model;
use kimi_host::model::checkpoint::{Checkpoint, parse_weight_map};
use kimi_host::model::config::parse_config;
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::plugins::bindings::host::kimi::host::types::RequestInfo;
use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{PluginEnv, PluginError, PluginRuntime, RuntimeOptions, TemplatePlugin, TenantServices};
use kimi_host::server::bounds;
use kimi_host::server::config::LimitsSection;
use kimi_host::server::openai::gen_params;
use kimi_host::tokenizer::{Segment, Tokenizer};
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Map, Value, json};

/// Cases per target: `default`, or `KIMI_FUZZ_CASES` for long runs.
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("KIMI_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    ProptestConfig { cases, max_shrink_iters: 4096, ..ProptestConfig::default() }
}

// ---------------------------------------------------------------- shared fixtures

fn kimi_tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        Arc::new(Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("the real Kimi tokenizer"))
    })
    .clone()
}

fn grammar() -> &'static GrammarEngine {
    static G: OnceLock<GrammarEngine> = OnceLock::new();
    G.get_or_init(|| {
        let tok = kimi_tokenizer();
        let eos = tok.special_id("<|end_of_msg|>").expect("eos");
        GrammarEngine::new(tok, 163_840, eos).expect("grammar engine")
    })
}

struct Templates {
    rt: Arc<PluginRuntime>,
    plugin: TemplatePlugin,
    env: Arc<PluginEnv>,
    svc: Arc<TenantServices>,
}

fn templates() -> &'static Templates {
    static T: OnceLock<Templates> = OnceLock::new();
    T.get_or_init(|| {
        let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
        let compiled = rt.load("template-kimi-k3", builtin("template-kimi-k3").expect("builtin")).expect("loads");
        let plugin = TemplatePlugin::new(rt.clone(), &compiled).expect("template");
        let env = Arc::new(PluginEnv::from_tokenizer(kimi_tokenizer(), 163_840));
        Templates { rt, plugin, env, svc: Arc::new(TenantServices::default()) }
    })
}

/// A tiny K3.1 checkpoint written once (its config is mutated per case, its weights shared).
fn tiny_model() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        make_tiny(dir.path(), &TinyOptions { seed: 3, k31: true, mxfp4: true, vision: false }).expect("make-tiny");
        dir
    })
    .path()
}

fn info(body: &Value) -> RequestInfo {
    RequestInfo { tenant: "t".into(), request_id: "r".into(), model: "kimi-k3".into(), params_json: body.to_string() }
}

// ---------------------------------------------------------------- strategies

/// Integers that break size arithmetic: small ones, and the edges of u32 / u64.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0..24u64,
        1 => Just(u32::MAX as u64),
        1 => Just(u64::MAX),
        1 => Just(1u64 << 40),
        1 => Just((1u64 << 62) + 1),
        1 => any::<u64>(),
    ]
}

fn short_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => ".{0,16}",
        1 => select(vec!["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "\u{0}", "\"", "\\", "</", "日本語 😀"])
            .prop_map(String::from),
    ]
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        edgy_u64().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f).map(Value::Number)),
        short_text().prop_map(Value::from),
    ]
}

fn json_any() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(4, 48, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{0,8}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn object(entries: Vec<(String, Value)>) -> Value {
    Value::Object(entries.into_iter().collect::<Map<String, Value>>())
}

// ---------------------------------------------------------------- safetensors and the index

#[derive(Clone, Debug)]
struct TensorEntry {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    /// Offsets computed from the shape (so the length checks pass and later checks are reached).
    consistent: bool,
}

fn tensor_entry() -> impl Strategy<Value = TensorEntry> {
    (
        "[a-z.]{1,10}",
        select(vec!["F32", "BF16", "F16", "U8", "I8", "I32", "I64", "F64", "F8_E4M3", "F8_E8M0", "XX", ""]),
        prop::collection::vec(edgy_u64(), 0..4),
        prop::collection::vec(edgy_u64(), 0..3),
        any::<bool>(),
    )
        .prop_map(|(name, dtype, shape, offsets, consistent)| TensorEntry {
            name,
            dtype,
            shape,
            offsets,
            consistent,
        })
}

fn dtype_size(d: &str) -> u64 {
    match d {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        _ => 1,
    }
}

/// A safetensors file: raw bytes, or a header built from entries with a (possibly wrong) length.
fn safetensors_file() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..48),
        4 => (
            prop::collection::vec(tensor_entry(), 0..5),
            prop::option::of(edgy_u64()),
            0..256usize,
            prop::option::of(json_any()),
        )
            .prop_map(|(entries, length, payload, junk)| {
                let mut header = Map::new();
                let mut at = 0u64;
                for e in entries {
                    let offsets = if e.consistent {
                        let n = e.shape.iter().fold(1u64, |a, &d| a.wrapping_mul(d)).wrapping_mul(dtype_size(e.dtype));
                        let r = vec![at, at.wrapping_add(n)];
                        at = at.wrapping_add(n);
                        r
                    } else {
                        e.offsets
                    };
                    header.insert(e.name, json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": offsets}));
                }
                if let Some(j) = junk {
                    header.insert("junk".into(), j);
                }
                let text = Value::Object(header).to_string();
                let mut out = length.unwrap_or(text.len() as u64).to_le_bytes().to_vec();
                out.extend(text.as_bytes());
                out.extend(std::iter::repeat_n(0u8, payload));
                out
            }),
    ]
}

/// A small valid shard with one tensor `w` (F32, 2×2).
fn valid_shard(path: &Path) {
    let header = json!({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend([0u8; 16]);
    std::fs::write(path, bytes).expect("write shard");
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn safetensors_headers_never_panic(file in safetensors_file()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, &file).expect("write");
        if let Ok(ck) = Checkpoint::open_file(&path) {
            for (_, t) in ck.tensors() {
                // Every range the loader accepted lies inside the file.
                prop_assert_eq!(ck.bytes(t).bytes().len(), t.nbytes());
                prop_assert!(t.nbytes() <= file.len());
            }
        }
    }

    #[test]
    fn shard_indexes_never_panic_or_leave_the_model_directory(
        map in prop::collection::btree_map(
            prop_oneof![3 => Just("w".to_string()), 1 => "[a-z]{1,4}"],
            select(vec!["model-1.safetensors", "missing.safetensors", "../outside.safetensors", "/tmp/x.safetensors",
                        "", ".", "sub/model-1.safetensors", "model-1.safetensors\u{0}"]),
            0..4,
        ),
        junk in prop::option::of(json_any()),
        raw in prop::option::of(".{0,40}"),
    ) {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("model");
        std::fs::create_dir_all(dir.join("sub")).expect("dirs");
        valid_shard(&dir.join("model-1.safetensors"));
        valid_shard(&dir.join("sub/model-1.safetensors"));
        valid_shard(&root.path().join("outside.safetensors"));
        let mut index = json!({"metadata": {}, "weight_map": map});
        if let Some(j) = junk {
            index["weight_map"]["junk"] = j;
        }
        let text = raw.unwrap_or_else(|| index.to_string());
        let _ = parse_weight_map(&text, std::path::Path::new("index.json"));
        std::fs::write(dir.join("model.safetensors.index.json"), &text).expect("index");
        if Checkpoint::open(&dir).is_ok() {
            // Only plain file names inside the model directory may be opened.
            for file in map.values() {
                prop_assert!(!file.contains('/') && !file.contains("..") && !file.is_empty(), "opened {file:?}");
            }
        }
    }
}

// ---------------------------------------------------------------- config.json

fn config_mutations() -> impl Strategy<Value = Vec<(prop::sample::Index, prop::sample::Index, Value)>> {
    let value = prop_oneof![
        3 => json_leaf(),
        1 => Just(json!(0)),
        1 => Just(json!(-1)),
        1 => Just(json!(1u64 << 40)),
        1 => Just(json!(u64::MAX)),
        1 => Just(json!(1e300)),
        1 => json_any(),
    ];
    prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>(), value), 1..4)
}

/// Replaces values at (top-level key, nested key) positions of a config object.
fn mutate(config: &mut Value, muts: &[(prop::sample::Index, prop::sample::Index, Value)]) {
    for (top, inner, v) in muts {
        let Some(obj) = config.as_object_mut() else { return };
        let keys: Vec<String> = obj.keys().cloned().collect();
        let key = top.get(&keys).clone();
        match obj.get_mut(&key) {
            Some(Value::Object(sub)) if !sub.is_empty() && inner.index(2) == 0 => {
                let keys: Vec<String> = sub.keys().cloned().collect();
                sub.insert(inner.get(&keys).clone(), v.clone());
            }
            _ => {
                obj.insert(key, v.clone());
            }
        }
    }
}

proptest! {
    #![proptest_config(config(96))]

    #[test]
    fn mutated_configs_are_refused_or_load(muts in config_mutations()) {
        let base = tiny_model();
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).expect("config")).expect("json");
        mutate(&mut cfg, &muts);
        let text = cfg.to_string();
        if parse_config(&text).is_ok() {
            // A config that parses is loaded against the real weights: it must fit them or be
            // refused by name, never allocate by a bogus size or index out of bounds.
            let dir = tempfile::tempdir().expect("tempdir");
            for entry in std::fs::read_dir(base).expect("read dir").flatten() {
                let name = entry.file_name();
                if name != "config.json" {
                    std::os::unix::fs::symlink(entry.path(), dir.path().join(&name)).expect("link");
                }
            }
            std::fs::write(dir.path().join("config.json"), &text).expect("write");
            let _ = Model::load(dir.path());
        }
    }

    #[test]
    fn arbitrary_config_text_never_panics(text in ".{0,200}", v in json_any()) {
        let _ = parse_config(&text);
        let _ = parse_config(&v.to_string());
    }
}

// ---------------------------------------------------------------- tiktoken.model and specials

fn tiktoken_text() -> impl Strategy<Value = String> {
    use base64::Engine as _;
    let line = prop_oneof![
        6 => (prop::collection::vec(any::<u8>(), 0..4), prop_oneof![0..48u32, Just(u32::MAX), any::<u32>()])
            .prop_map(|(b, r)| format!("{} {r}", base64::engine::general_purpose::STANDARD.encode(b))),
        1 => ".{0,12}",
    ];
    let junk = prop::collection::vec(line, 0..48).prop_map(|l| l.join("\n"));
    // A well-formed file (distinct tokens, dense ranks in any order, not every byte present),
    // sometimes with one line replaced: the loader's later paths and encoding get reached.
    let tokens = prop::collection::btree_set(prop::collection::vec(any::<u8>(), 1..3), 1..64);
    let valid = (tokens, any::<prop::sample::Index>(), prop::option::of(".{0,12}")).prop_map(|(set, at, edit)| {
        let mut lines: Vec<String> = set
            .into_iter()
            .enumerate()
            .map(|(r, b)| format!("{} {r}", base64::engine::general_purpose::STANDARD.encode(b)))
            .collect();
        lines.reverse();
        if let Some(e) = edit {
            let i = at.index(lines.len());
            lines[i] = e;
        }
        lines.join("\n")
    });
    prop_oneof![1 => junk, 2 => valid]
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn tokenizer_files_never_panic(
        model in tiktoken_text(),
        added in prop::option::of(prop::collection::btree_map(
            prop_oneof![0..300u64, Just(u32::MAX as u64), Just(u64::MAX), any::<u64>()],
            short_text(),
            0..4,
        )),
        text in ".{0,24}",
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("tiktoken.model"), model).expect("write");
        if let Some(added) = added {
            let table: Map<String, Value> =
                added.into_iter().map(|(id, name)| (id.to_string(), json!({"content": name}))).collect();
            std::fs::write(dir.path().join("tokenizer_config.json"), json!({"added_tokens_decoder": table}).to_string())
                .expect("write");
        }
        if let Ok(tok) = Tokenizer::load(dir.path()) {
            // A loaded tokenizer answers for any text, even one whose ranks miss some bytes.
            let ids = tok.encode_with_specials(&text);
            let _ = tok.decode(&ids);
            let _ = tok.decode(&[u32::MAX, 0, tok.vocab_size() as u32]);
        }
    }
}

// ---------------------------------------------------------------- the real tokenizer

fn user_text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => any::<String>(),
        3 => prop::collection::vec(
            select(vec!["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "[EOS]", "<|media_pad|>",
                        "<|reserved_token_163600|>", "<|", "|>", " ", "\n\n", "\t", "日本", "😀", "'s", "123456",
                        "a", "Zürich", "\u{200b}", "\r\n", "  "]),
            0..16,
        )
        .prop_map(|v| v.concat()),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn user_text_round_trips_and_never_becomes_a_control_token(text in user_text()) {
        let tok = kimi_tokenizer();
        let ids = tok.encode_text(&text);
        prop_assert!(ids.iter().all(|&i| !tok.is_special(i)), "special id in {ids:?}");
        prop_assert_eq!(tok.decode(&ids).expect("decodes"), text.clone());
        let segs = tok.encode_segments(&[Segment::Text(text)]).expect("segments");
        prop_assert_eq!(segs, ids);
    }

    #[test]
    fn arbitrary_ids_decode_or_are_refused(ids in prop::collection::vec(prop_oneof![0..163_840u32, any::<u32>()], 0..32)) {
        let tok = kimi_tokenizer();
        let _ = tok.decode(&ids);
        let _ = tok.decode_bytes(&ids);
    }
}

// ---------------------------------------------------------------- chat requests → template plugin

fn content_part() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => short_text().prop_map(|t| json!({"type": "text", "text": t})),
        1 => image_url().prop_map(|url| json!({"type": "image_url", "image_url": {"url": url}})),
        1 => json_any(),
    ]
}

/// Image bytes: headers of each format with any sizes, cut anywhere, or noise.
fn image_bytes() -> impl Strategy<Value = Vec<u8>> {
    let dims = (any::<u32>(), any::<u32>());
    let png = dims.prop_map(|(w, h)| {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend(w.to_be_bytes());
        b.extend(h.to_be_bytes());
        b
    });
    let gif = (any::<u16>(), any::<u16>()).prop_map(|(w, h)| {
        let mut b = b"GIF89a".to_vec();
        b.extend(w.to_le_bytes());
        b.extend(h.to_le_bytes());
        b
    });
    let jpeg = (prop::collection::vec((any::<u8>(), any::<u16>()), 0..6), any::<u16>(), any::<u16>()).prop_map(
        |(segments, w, h)| {
            let mut b = vec![0xff, 0xd8];
            for (marker, len) in segments {
                b.extend([0xff, marker]);
                b.extend(len.to_be_bytes());
            }
            b.extend([0xff, 0xc0, 0, 17, 8]);
            b.extend(h.to_be_bytes());
            b.extend(w.to_be_bytes());
            b
        },
    );
    let webp = (select(vec![&b"VP8 "[..], b"VP8L", b"VP8X", b"XXXX"]), prop::collection::vec(any::<u8>(), 0..20))
        .prop_map(|(kind, rest)| {
            let mut b = b"RIFF\0\0\0\0WEBP".to_vec();
            b.extend(kind);
            b.extend(rest);
            b
        });
    let header = prop_oneof![png, gif, jpeg, webp, prop::collection::vec(any::<u8>(), 0..32)];
    (header, any::<prop::sample::Index>(), any::<bool>())
        .prop_map(|(b, cut, whole)| if whole { b } else { b[..cut.index(b.len() + 1)].to_vec() })
}

fn image_url() -> impl Strategy<Value = String> {
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    prop_oneof![
        6 => (select(vec!["image/png", "image/jpeg", "image/webp", "image/gif", "", "text/plain"]), image_bytes())
            .prop_map(move |(mime, b)| format!("data:{mime};base64,{}", b64(&b))),
        1 => select(vec!["http://127.0.0.1/x.png", "file:///etc/passwd", "data:", "data:,", "data:image/png;base64,@@@",
                         "data:image/png,raw", "", "data:image/png;base64"]).prop_map(String::from),
        1 => ".{0,24}",
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        8 => select(vec!["system", "user", "assistant", "tool"]),
        1 => select(vec!["developer", "function", "", "x"]),
    ];
    let content = prop_oneof![
        6 => short_text().prop_map(Value::from),
        1 => Just(Value::Null),
        2 => prop::collection::vec(content_part(), 0..4).prop_map(Value::Array),
        1 => json_leaf(),
    ];
    let arguments = prop_oneof![
        4 => prop::collection::btree_map("[a-z]{1,4}", json_any(), 0..3)
            .prop_map(|m| Value::Object(m.into_iter().collect()).to_string()),
        1 => json_any().prop_map(|v| v.to_string()),
        1 => short_text(),
    ];
    let call = ("[a-z_]{1,8}", arguments).prop_map(
        |(name, args)| json!({"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}),
    );
    (
        role,
        content,
        prop::option::weighted(0.2, prop::collection::vec(call, 0..3)),
        prop::option::weighted(0.2, short_text()),
        prop::option::weighted(0.8, prop_oneof![4 => Just("call_0".to_string()), 1 => short_text()]),
        prop::option::weighted(0.1, json_leaf()),
    )
        .prop_map(|(role, content, calls, reasoning, call_id, name)| {
            let mut m = vec![("role".to_string(), json!(role)), ("content".to_string(), content)];
            if let Some(c) = calls {
                m.push(("tool_calls".into(), Value::Array(c)));
            }
            if let Some(r) = reasoning {
                m.push(("reasoning_content".into(), json!(r)));
            }
            if let Some(c) = call_id {
                m.push(("tool_call_id".into(), json!(c)));
            }
            if let Some(n) = name {
                m.push(("name".into(), n));
            }
            object(m)
        })
}

fn chat_request() -> impl Strategy<Value = Value> {
    let params = prop_oneof![
        3 => schema(),
        1 => json_any(),
    ];
    let tool = ("[a-z_]{1,8}", params, prop::option::of(short_text())).prop_map(|(name, params, desc)| {
        json!({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    });
    (
        prop::collection::vec(message(), 1..6),
        prop::option::weighted(0.4, prop::collection::vec(tool, 0..3)),
        prop::option::weighted(0.2, json_any()),
        prop::option::weighted(0.3, select(vec!["low", "medium", "high", "max", "none", ""])),
        prop::option::weighted(0.2, json_any()),
        prop::option::weighted(0.1, json_any()),
    )
        .prop_map(|(messages, tools, tool_choice, effort, thinking, extra)| {
            let mut body = json!({"model": "kimi-k3", "messages": messages});
            if let Some(t) = tools {
                body["tools"] = Value::Array(t);
            }
            if let Some(c) = tool_choice {
                body["tool_choice"] = c;
            }
            if let Some(e) = effort {
                body["reasoning_effort"] = json!(e);
            }
            if let Some(t) = thinking {
                body["thinking"] = t;
            }
            if let Some(x) = extra {
                body["chat_template_kwargs"] = x;
            }
            body
        })
}

/// A builtin plugin may refuse a request (a guest error) but must not trap, time out or return
/// something invalid on small inputs.
fn builtin_answered(r: &Result<impl Sized, PluginError>) -> Result<(), TestCaseError> {
    match r {
        Ok(_) | Err(PluginError::Guest { .. }) => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!("builtin plugin failed: {e}"))),
    }
}

proptest! {
    #![proptest_config(config(192))]

    #[test]
    fn chat_requests_render_or_are_refused(body in chat_request()) {
        let t = templates();
        let r = t.plugin.render(&t.env, &t.svc, &info(&body), &body.to_string());
        builtin_answered(&r)?;
        if let Ok(r) = r {
            let segs: Vec<Segment> = r
                .segments
                .into_iter().map(Segment::from).collect();
            // Every special the template emits exists, and text never turns into one.
            let tok = kimi_tokenizer();
            let ids = tok.encode_segments(&segs).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let specials = segs.iter().filter(|s| matches!(s, Segment::Special(_))).count();
            prop_assert_eq!(ids.iter().filter(|&&i| tok.is_special(i)).count(), specials);
        }
    }

    #[test]
    fn arbitrary_chat_bodies_never_trap_the_template(body in json_any(), text in ".{0,64}") {
        let t = templates();
        let r = t.plugin.render(&t.env, &t.svc, &info(&body), &body.to_string());
        builtin_answered(&r)?;
        let r = t.plugin.render(&t.env, &t.svc, &info(&body), &text);
        builtin_answered(&r)?;
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Images in user content: the header is read natively and in the plugin; any bytes give a
    /// size or a named refusal.
    #[test]
    fn image_parts_render_or_are_refused(urls in prop::collection::vec(image_url(), 1..3)) {
        let parts: Vec<Value> = urls
            .iter()
            .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
            .chain([json!({"type": "text", "text": "what is this?"})])
            .collect();
        let body = json!({"messages": [{"role": "user", "content": parts}]});
        let _ = kimi_xtml::render(body["messages"].as_array().expect("messages"), None, &Default::default());
        let t = templates();
        builtin_answered(&t.plugin.render(&t.env, &t.svc, &info(&body), &body.to_string()))?;
        // The server's decoder: pixels or a named refusal, never a panic; what decodes goes
        // through the release processor (the tiny limits keep it small).
        let caps = kimi_host::server::images::ImageCaps { max_bytes: 1 << 16, max_pixels: 1 << 16 };
        let cfg = kimi_host::model::vision::MediaProcConfig::parse(
            &kimi_host::model::tiny::tiny_preprocessor_config().to_string(),
        )
        .expect("tiny preprocessor config");
        for (i, u) in urls.iter().enumerate() {
            match kimi_host::server::images::decode_data_uri(u, i, caps) {
                Ok(img) => {
                    let out = kimi_host::model::vision::preprocess(&img, &cfg);
                    prop_assert!(out.input.tokens() > 0);
                }
                Err(e) => prop_assert!(e.status == 400 && !e.message.is_empty()),
            }
        }
    }
}

// ---------------------------------------------------------------- the output parser

fn piece() -> impl Strategy<Value = kimi_xtml::parse::Piece> {
    use kimi_xtml::parse::Piece;
    prop_oneof![
        1 => Just(Piece::Open),
        1 => Just(Piece::Close),
        1 => Just(Piece::Sep),
        1 => Just(Piece::EndOfMsg),
        4 => prop_oneof![
            select(vec!["think", "response", "tools", "call name=\"f\"", "arg name=\"a\" type=\"int\"", "message role=\"assistant\"",
                        "\"", "=", " ", "name=", "type=\"json\"", "{", "12", "\u{ff}"]).prop_map(|s| s.as_bytes().to_vec()),
            prop::collection::vec(any::<u8>(), 0..4),
        ]
        .prop_map(Piece::Bytes),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn the_native_output_parser_never_panics(pieces in prop::collection::vec(piece(), 0..48), thinking in any::<bool>(), cut in 0..48usize) {
        let mut p = kimi_xtml::parse::OutputParser::new(thinking);
        let cut = cut.min(pieces.len());
        let _ = p.feed(&pieces[..cut]);
        let _ = p.feed(&pieces[cut..]);
        let _ = p.finish();
    }
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn the_template_output_parser_never_traps(
        ids in prop::collection::vec(prop_oneof![4 => 0..163_584u32, 4 => 163_584..163_590u32, 1 => any::<u32>()], 0..64),
        cut in 0..64usize,
    ) {
        let t = templates();
        let body = json!({"messages": [{"role": "user", "content": "hi"}]});
        let mut p = t.plugin.parser(&t.env, &t.svc, &info(&body)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cut = cut.min(ids.len());
        builtin_answered(&p.feed(&ids[..cut]))?;
        builtin_answered(&p.feed(&ids[cut..]))?;
        builtin_answered(&p.finish())?;
    }
}

// ---------------------------------------------------------------- grammars and schemas

fn lark_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        select(vec![
            "start: ",
            "start",
            "a: ",
            "a",
            "b",
            "\"x\"",
            "\"\"",
            "/[a-z]+/",
            "/(?=a)b/",
            "/\\d{1,99999}/",
            "/.{0,100000}/",
            "|",
            "(",
            ")",
            "*",
            "+",
            "?",
            "~",
            "3",
            "..",
            "{",
            "}",
            "\n",
            " ",
            "%ignore ",
            "%import common.WS",
            "%json {\"type\": \"string\"}",
            "<[163584]>",
            "<|open|>",
            "@sub",
            "start: start\n",
            "a: a a\n",
            "[",
            "]",
            "\"\\u0000\"",
            "/[/",
            "{1,0}",
            "{0,4294967295}",
        ]),
        0..24,
    )
    .prop_map(|v| v.concat())
}

fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        select(vec!["string", "integer", "number", "boolean", "null", "object", "array", "bogus"])
            .prop_map(|t| json!({"type": t})),
        select(vec![
            "#",
            "#/$defs/a",
            "#/$defs/missing",
            "#/properties/a",
            "http://example.com/s",
            "#/$defs/a/properties/x"
        ])
        .prop_map(|r| json!({"$ref": r})),
        select(vec!["^[a-z]+$", "(a|b)*c", "[", "\\d{1,100000}", "(?=x)", ".*", "\\p{L}+", "a{5,2}", "(((((a)))))*"])
            .prop_map(|p| json!({"type": "string", "pattern": p})),
        (edgy_u64(), edgy_u64()).prop_map(|(a, b)| json!({"type": "string", "minLength": a, "maxLength": b})),
        (json_leaf(), json_leaf()).prop_map(|(a, b)| json!({"type": "integer", "minimum": a, "maximum": b})),
        prop::collection::vec(json_leaf(), 0..4).prop_map(|e| json!({"enum": e})),
        json_leaf().prop_map(|c| json!({"const": c})),
        Just(json!(true)),
        Just(json!(false)),
        json_leaf(),
    ];
    leaf.prop_recursive(6, 64, 4, |inner| {
        prop_oneof![
            (prop::collection::btree_map("[a-c]{1,2}", inner.clone(), 0..4), prop::collection::vec("[a-c]{1,2}", 0..3), any::<bool>())
                .prop_map(|(props, required, additional)| {
                    json!({"type": "object", "properties": props, "required": required, "additionalProperties": additional})
                }),
            (inner.clone(), edgy_u64(), edgy_u64())
                .prop_map(|(items, a, b)| json!({"type": "array", "items": items, "minItems": a, "maxItems": b})),
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| json!({"anyOf": v})),
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| json!({"oneOf": v})),
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| json!({"allOf": v})),
            (inner.clone(), inner).prop_map(|(a, root)| {
                let mut root = if root.is_object() { root } else { json!({}) };
                root["$defs"] = json!({"a": a});
                root
            }),
        ]
    })
}

/// Compiles `c` (directly and through the cache), then walks a few tokens of its matcher.
fn exercise(c: &Constraint) -> Result<(), TestCaseError> {
    let g = grammar();
    let _ = g.compiles_directly(c);
    match g.matcher(c) {
        Ok(mut m) => {
            common::walk_lowest_allowed(&mut m, 6);
            Ok(())
        }
        Err(e) => {
            let e = e.to_string();
            prop_assert!(!e.contains("panicked"), "compilation panicked: {e}");
            Ok(())
        }
    }
}

proptest! {
    #![proptest_config(config(160))]

    #[test]
    fn lark_grammars_compile_or_are_refused(text in lark_text()) {
        exercise(&Constraint::Lark(text))?;
    }

    #[test]
    fn json_schemas_compile_or_are_refused(s in schema()) {
        exercise(&Constraint::JsonSchema(s.to_string()))?;
    }

    #[test]
    fn regexes_and_choices_compile_or_are_refused(
        re in prop::collection::vec(select(vec!["a", "[", "]", "(", ")", "*", "+", "?", "{2,}", "{0,99999}", "\\", "\\d", ".", "|", "^", "$", "(?i)", "\\p{Greek}"]), 0..12),
        choices in prop::collection::vec(short_text(), 0..4),
    ) {
        exercise(&Constraint::Regex(re.concat()))?;
        exercise(&Constraint::Choice(choices))?;
    }
}

// ---------------------------------------------------------------- request parameters and caps

fn request_object() -> impl Strategy<Value = Map<String, Value>> {
    let key = select(vec![
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "sampler_params",
        "response_format",
        "tools",
        "messages",
        "stream",
        "stream_options",
        "tool_choice",
        "prompt",
    ]);
    prop::collection::btree_map(key.prop_map(String::from), json_any(), 0..8).prop_map(|m| m.into_iter().collect())
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn request_parameters_are_checked_without_panicking(body in request_object()) {
        let _ = bounds::check(&body, &LimitsSection::default());
        let _ = gen_params(&body, 8, 163_840);
    }
}

// ---------------------------------------------------------------- plugin uploads

fn upload() -> impl Strategy<Value = Vec<u8>> {
    let base: &'static [u8] = builtin("sampler-standard").expect("builtin");
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..64),
        1 => Just(b"\0asm\x0d\0\x01\0".to_vec()),
        // A real component cut short or with a few bytes changed.
        2 => (0..base.len()).prop_map(move |n| base[..n].to_vec()),
        1 => prop::collection::vec((0..base.len(), any::<u8>()), 1..4).prop_map(move |edits| {
            let mut b = base.to_vec();
            for (at, v) in edits {
                b[at] = v;
            }
            b
        }),
    ]
}

proptest! {
    #![proptest_config(config(24))]

    #[test]
    fn uploaded_bytes_are_checked_without_panicking(bytes in upload()) {
        let rt = &templates().rt;
        let _ = rt.check(&bytes);
        let _ = rt.load("fuzz-upload", &bytes);
    }
}

// ---------------------------------------------------------------- findings, kept as named cases

// ---------------------------------------------------------------- findings, kept as named cases

/// Found by `tokenizer_files_never_panic`: a rank of 4e9 made the loader allocate 4e9 entries
/// and abort the process; a special id far past the ranks did the same.
#[test]
fn finding_huge_tokenizer_ranks_are_errors_not_allocations() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tiktoken.model"), "YQ== 0\nYg== 4000000000\n").expect("write");
    let Err(e) = Tokenizer::load(dir.path()) else { panic!("accepted") };
    assert!(e.to_string().contains("rank 4000000000"), "{e}");
    std::fs::write(dir.path().join("tiktoken.model"), "YQ== 0\nYg== 1\n").expect("write");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"added_tokens_decoder": {"4294967295": {"content": "<|x|>"}}}"#,
    )
    .expect("write");
    let Err(e) = Tokenizer::load(dir.path()) else { panic!("accepted") };
    assert!(e.to_string().contains("4294967295"), "{e}");
}

/// Found by `safetensors_headers_never_panic`: a shape whose product overflows `usize` panicked
/// (debug) or wrapped (release) in the size check.
#[test]
fn finding_overflowing_tensor_shapes_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    let header = json!({"w": {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 0]}}).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    std::fs::write(&path, bytes).expect("write");
    let Err(e) = Checkpoint::open_file(&path) else { panic!("accepted") };
    assert!(e.to_string().contains("too large"), "{e}");
}

/// Found by `mutated_configs_are_refused_or_load`: `num_attention_heads = 2^40` overflowed the
/// weight-shape arithmetic of the MLA loader. Sizes are capped when the config is read.
#[test]
fn finding_oversized_config_dimensions_are_named() {
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_model().join("config.json")).expect("config"))
            .expect("json");
    cfg["text_config"]["num_attention_heads"] = json!(1u64 << 40);
    let Err(e) = parse_config(&cfg.to_string()) else { panic!("accepted") };
    assert!(e.to_string().contains("num_attention_heads"), "{e}");
}

/// Found by `shard_indexes_never_panic_or_leave_the_model_directory`: the index could name a
/// shard outside the checkpoint directory (`../x`, `/abs`, `sub/x`).
#[test]
fn finding_shard_names_must_be_plain_file_names() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).expect("dir");
    valid_shard(&root.path().join("outside.safetensors"));
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"weight_map": {"w": "../outside.safetensors"}}).to_string(),
    )
    .expect("index");
    let Err(e) = Checkpoint::open(&dir) else { panic!("accepted") };
    assert!(e.to_string().contains("not a file name"), "{e}");
}
