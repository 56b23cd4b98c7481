//! Streaming detokenizer properties, on the real Kimi tokenizer and on the byte-level tokenizer
//! that `make-tiny` writes (which splits every multi-byte character across tokens).

use crate::common;

use kimi_host::tokenizer::{Segment, StreamDecoder, Tokenizer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn kimi() -> Tokenizer {
    Tokenizer::load(&common::golden_dir().join("../tokenizer/kimi")).expect("Kimi tokenizer")
}

fn byte_level() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().expect("tempdir");
    Tokenizer::write_byte_level(dir.path()).expect("write");
    let tok = Tokenizer::load(dir.path()).expect("byte-level tokenizer loads");
    (dir, tok)
}

const POOL: &[&str] = &[
    "a",
    "b",
    "Z",
    " ",
    "  ",
    "\n",
    "\t",
    "'s",
    "The",
    " quick",
    "fox",
    "123",
    "4567",
    ".",
    ",",
    "!?",
    "é",
    "ü",
    "ß",
    "中",
    "文",
    "字",
    "日本語",
    "한국어",
    "Привет",
    "مرحبا",
    "שלום",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "e\u{301}",
    "\u{200d}",
    "<|open|>",
    "<|end_of_msg|>",
    "{\"k\": [1, 2]}",
    "fn main() {}",
    "\r\n",
    "\u{3000}",
    "\u{a0}",
];

fn random_text(rng: &mut StdRng, max_parts: usize) -> String {
    let n = rng.random_range(0..max_parts);
    (0..n).map(|_| POOL[rng.random_range(0..POOL.len())]).collect()
}

/// Encodes `text` split at random char boundaries (each part its own text segment).
fn encode_split(tok: &Tokenizer, rng: &mut StdRng, text: &str) -> Vec<u32> {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let mut cuts: Vec<usize> = (0..rng.random_range(0..4)).map(|_| bounds[rng.random_range(0..bounds.len())]).collect();
    cuts.push(0);
    cuts.push(text.len());
    cuts.sort();
    cuts.dedup();
    let segs: Vec<Segment> = cuts.windows(2).map(|w| Segment::Text(text[w[0]..w[1]].to_string())).collect();
    tok.encode_segments(&segs).expect("encode")
}

fn stream(tok: &Tokenizer, ids: &[u32], stops: &[&str]) -> (Vec<String>, Option<usize>) {
    let mut d = StreamDecoder::new(stops.iter().map(|s| s.to_string()).collect());
    let mut chunks = Vec::new();
    let mut stop = None;
    for &id in ids {
        let out = d.push(tok, id).expect("push");
        chunks.push(out.text);
        if out.stop.is_some() {
            stop = out.stop;
            break;
        }
    }
    let out = d.finish();
    chunks.push(out.text);
    (chunks, stop.or(out.stop))
}

#[test]
fn random_texts_stream_back_byte_identically_and_never_split_characters() {
    let (_dir, bytes) = byte_level();
    let kimi = kimi();
    let mut rng = StdRng::seed_from_u64(42);
    for tok in [&kimi, &bytes] {
        for _ in 0..400 {
            let text = random_text(&mut rng, 24);
            let ids = encode_split(tok, &mut rng, &text);
            assert!(ids.iter().all(|&i| !tok.is_special(i)), "text became a special: {text:?}");
            let (chunks, stop) = stream(tok, &ids, &[]);
            assert!(stop.is_none());
            for c in &chunks {
                assert!(!c.contains('\u{FFFD}'), "a character came out split in {text:?}: {chunks:?}");
            }
            assert_eq!(chunks.concat(), text);
        }
    }
}

#[test]
fn stop_string_across_two_tokens_is_detected_and_not_emitted() {
    let tok = kimi();
    let ids = tok.encode_text("Hello world, again");
    assert_eq!(&ids[..2], &[19180, 2695], "\"Hello\" and \" world\" are single tokens");
    // "lo wor" starts in the first token and ends in the second.
    let (chunks, stop) = stream(&tok, &ids, &["lo wor"]);
    assert_eq!(stop, Some(0));
    assert_eq!(chunks.concat(), "Hel");
    // Nothing of the stop string was emitted early: the first push held "lo" back.
    assert_eq!(chunks[0], "Hel");
}

#[test]
fn random_stop_strings_cut_at_their_first_occurrence() {
    let (_dir, bytes) = byte_level();
    let kimi = kimi();
    let mut rng = StdRng::seed_from_u64(7);
    for tok in [&kimi, &bytes] {
        for _ in 0..300 {
            let text = random_text(&mut rng, 16) + "STOP" + &random_text(&mut rng, 8);
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let a = bounds[rng.random_range(0..bounds.len())];
            let b = bounds[rng.random_range(0..bounds.len())];
            let (a, b) = (a.min(b), a.max(b));
            let stop = if a == b { "STOP" } else { &text[a..b] };
            let ids = tok.encode_text(&text);
            let (chunks, hit) = stream(tok, &ids, &[stop, "never-appears"]);
            let first = text.find(stop).expect("stop occurs");
            assert_eq!(hit, Some(0), "{text:?} stop {stop:?}");
            assert_eq!(chunks.concat(), &text[..first], "{text:?} stop {stop:?}");
        }
    }
}

#[test]
fn byte_level_tokenizer_has_k3_specials_on_top() {
    let (_dir, tok) = byte_level();
    assert_eq!(tok.num_base_tokens(), 256);
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.special_id("[BOS]"), Some(256));
    assert_eq!(tok.special_id("<|end_of_msg|>"), Some(258));
    assert_eq!(tok.special_id("<|open|>"), Some(259));
    assert_eq!(tok.special_id("<|media_pad|>"), Some(277));
    assert_eq!(tok.special_id("[PAD]"), Some(511));
    assert_eq!(tok.encode_text("hé"), vec![b'h' as u32, 0xc3, 0xa9]);
    let ids = tok.encode_text("<|open|>");
    assert_eq!(ids.len(), 8);
    // Skipping specials in the stream drops their names.
    let mut d = StreamDecoder::new(vec![]).skip_special(true);
    let mut out = String::new();
    for id in [b'a' as u32, 258, b'b' as u32] {
        out += &d.push(&tok, id).expect("push").text;
    }
    out += &d.finish().text;
    assert_eq!(out, "ab");
}

#[test]
fn malformed_tokenizer_files_name_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tiktoken.model"), "IQ== 0\nnot-base64! 1\n").expect("write");
    let err = Tokenizer::load(dir.path()).err().expect("must fail").to_string();
    assert!(err.contains("tiktoken.model:2") && err.contains("base64"), "{err}");
    std::fs::write(dir.path().join("tiktoken.model"), "IQ== 0\nIg== 0\n").expect("write");
    let err = Tokenizer::load(dir.path()).err().expect("must fail").to_string();
    assert!(err.contains(":2") && err.contains("rank 0"), "{err}");
}
