//! The tokenizer against the real `tiktoken` library's ids (`../shared/golden/tokenizer`) with the
//! real Kimi `tiktoken.model` (`../shared/tokenizer/kimi`, read in place, never copied).

use crate::common;

use kimi_host::tokenizer::{Segment, Tokenizer};
use serde_json::Value;

fn kimi() -> Tokenizer {
    Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("the Kimi tokenizer loads")
}

fn lines(name: &str) -> Vec<Value> {
    std::fs::read_to_string(common::golden_dir().join("tokenizer").join(name))
        .expect("golden file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("jsonl"))
        .collect()
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn every_golden_string_encodes_exactly_and_round_trips() {
    let tok = kimi();
    assert_eq!(tok.num_base_tokens(), 163_584);
    assert_eq!(tok.vocab_size(), 163_840);
    let cases = lines("encode.jsonl");
    assert_eq!(cases.len(), 300);
    let mut with_specials = 0;
    for c in &cases {
        let name = c["name"].as_str().expect("name");
        let text = c["text"].as_str().expect("text");
        let got = tok.encode_text(text);
        assert_eq!(got, ids(&c["ids"]), "{name} ({}): {text:?}", c["category"]);
        assert_eq!(tok.decode(&got).expect("decode"), text, "{name}: decode(encode(x)) != x");
        if let Some(allowed) = c.get("ids_allow_special") {
            assert_eq!(tok.encode_with_specials(text), ids(allowed), "{name} with specials allowed");
            with_specials += 1;
        }
    }
    assert!(with_specials > 0);
}

#[test]
fn spec_goldens() {
    let tok = kimi();
    assert_eq!(tok.encode_text("Hello world"), [19180, 2695]);
    assert_eq!(tok.encode_text("你好世界"), [33845, 2243]);
    assert_eq!(tok.encode_text("1234567890"), [6694, 12972, 16242, 15]);
    assert_eq!(tok.special_id("<|end_of_msg|>"), Some(163_586));
    assert_eq!(tok.special_id("<|media_pad|>"), Some(163_605));
    assert_eq!(tok.special_id("<|reserved_token_163592|>"), Some(163_592));
    assert_eq!(tok.special_id("[PAD]"), Some(163_839));
}

#[test]
fn long_inputs_follow_the_release_chunking() {
    let tok = kimi();
    for c in lines("encode_long.jsonl") {
        let name = c["name"].as_str().expect("name");
        let unit = c["unit"].as_str().expect("unit");
        let count = c["count"].as_u64().expect("count") as usize;
        let text = unit.repeat(count) + c["suffix"].as_str().unwrap_or("");
        let got = tok.encode_text(&text);
        assert_eq!(got.len() as u64, c["num_ids"].as_u64().expect("num_ids"), "{name}: id count");
        if let Some(want) = c.get("ids") {
            assert_eq!(got, ids(want), "{name}");
        }
        let json = serde_json::to_string(&got).expect("json");
        assert_eq!(sha256_hex(json.as_bytes()), c["ids_sha256"].as_str().expect("sha"), "{name}: ids sha256");
    }
}

#[test]
fn text_spelling_every_special_yields_no_special_id() {
    let tok = kimi();
    let all: String = (163_584..163_840u32).map(|id| tok.decode(&[id]).expect("special name")).collect();
    assert!(all.contains("<|open|>") && all.contains("<|reserved_token_163700|>"));
    let ids = tok.encode_segments(&[Segment::Text(all.clone())]).expect("encode");
    assert!(ids.iter().all(|&id| !tok.is_special(id)), "a text segment produced a special id");
    assert_eq!(tok.decode(&ids).expect("decode"), all);
    // The same spelling as a special segment is the special.
    let seg = [Segment::Text("hi ".into()), Segment::Special("<|open|>".into()), Segment::Text("<|open|>".into())];
    let ids = tok.encode_segments(&seg).expect("encode");
    assert_eq!(ids.iter().filter(|&&i| i == 163_587).count(), 1);
    assert!(tok.encode_segments(&[Segment::Special("<|nope|>".into())]).is_err());
}

#[test]
fn bytes_that_end_inside_a_character_encode_to_exactly_those_bytes() {
    let tok = kimi();
    for text in ["kimi 你好 world", "naïve café", "emoji 🙂 end", "日本語のテキスト"] {
        let bytes = text.as_bytes();
        // Valid UTF-8 encodes as text does.
        assert_eq!(tok.encode_bytes(bytes), tok.encode_text(text), "{text:?}");
        for cut in 1..bytes.len() {
            for part in [&bytes[..cut], &bytes[cut..]] {
                let ids = tok.encode_bytes(part);
                assert!(ids.iter().all(|&id| !tok.is_special(id)), "{part:?}");
                assert_eq!(tok.decode_bytes(&ids).expect("ids decode"), part, "{text:?} cut at {cut}");
            }
        }
    }
    // The valid prefix is tokenized as ordinary text.
    let prefix = "hello world ";
    let mut bytes = prefix.as_bytes().to_vec();
    bytes.extend_from_slice(&"你".as_bytes()[..2]);
    let ids = tok.encode_bytes(&bytes);
    assert!(ids.starts_with(&tok.encode_text(prefix)), "{ids:?}");
}
