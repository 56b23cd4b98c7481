//! `kimi-host bench tokenizer`: encode speed on a large mixed-language corpus, against Python
//! `tiktoken` (when importable) on the same documents in the same run.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use serde::Serialize;

use kimi_host::tokenizer::pretokenize::MAX_WINDOW_CHARS;
use kimi_host::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, Serialize)]
pub struct TokenizerBench {
    pub corpus_bytes: usize,
    pub documents: usize,
    pub ids: usize,
    pub seconds: f64,
    pub mb_per_s: f64,
    /// Python tiktoken on the same documents (single thread), if importable.
    pub tiktoken: Option<TiktokenRun>,
    pub ratio_vs_tiktoken: Option<f64>,
    pub ids_match_tiktoken: Option<bool>,
}

#[derive(Debug, Serialize, serde::Deserialize)]
pub struct TiktokenRun {
    pub version: String,
    pub seconds: f64,
    pub ids: usize,
    pub mb_per_s: f64,
    pub checksum: u64,
}

const SNIPPETS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. It's not what you'd expect, and they'll see why.\n",
    "In 2026, inference servers handle 163,840-token vocabularies at 1,000,000 tokens of context.\n",
    "大型语言模型的推理服务需要高效的分词器，以便在长上下文中保持低延迟。\n",
    "東京は日本の首都であり、多くの人々が住んでいます。",
    "Привет, мир! Это тест токенизатора на русском языке.\n",
    "مرحبا بالعالم، هذا اختبار للنص العربي.\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\", \"days\": [1, 2, 3]}}\n",
    "def encode(text):\n\treturn [ord(c) for c in text if not c.isspace()]\n\n",
    "Emoji 😀👍🏽 and flags 🇫🇷🇯🇵, café naïve façade — “quotes” and ‘more’.\n",
    "    indented    text   with   runs   of   spaces\t\tand tabs\n\n\n",
    "SELECT id, name FROM users WHERE created_at > '2026-01-01' ORDER BY id DESC LIMIT 100;\n",
];

/// A deterministic corpus of about `bytes` bytes, as documents of a few KB.
pub fn corpus(bytes: usize) -> Vec<String> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut docs = Vec::new();
    let mut total = 0;
    while total < bytes {
        let mut d = String::new();
        while d.len() < 4096 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            d.push_str(SNIPPETS[(x % SNIPPETS.len() as u64) as usize]);
        }
        total += d.len();
        docs.push(d);
    }
    docs
}

const PY: &str = r#"
import json, sys, time
import tiktoken
from tiktoken.load import load_tiktoken_bpe
model, docs_path, pat = sys.argv[1], sys.argv[2], sys.argv[3]
enc = tiktoken.Encoding(name="kimi", pat_str=pat, mergeable_ranks=load_tiktoken_bpe(model), special_tokens={})
docs = json.load(open(docs_path, encoding="utf-8"))
for d in docs[:4]:
    enc.encode_ordinary(d)
t = time.perf_counter()
out = [enc.encode_ordinary(d) for d in docs]
dt = time.perf_counter() - t
n = sum(len(o) for o in out)
chk = 0
for o in out:
    for i in o:
        chk = (chk * 1000003 + i) % (1 << 61)
size = sum(len(d.encode("utf-8")) for d in docs)
print(json.dumps({"version": tiktoken.__version__, "seconds": dt, "ids": n, "mb_per_s": size / dt / 1e6, "checksum": chk}))
"#;

/// The release `pat_str` (with its look-ahead), for the Python baseline.
const RELEASE_PAT: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub fn bench_tokenizer(dir: &Path, mb: f64) -> Result<TokenizerBench, TokenizerError> {
    let tok = Tokenizer::load(dir)?;
    let docs = corpus((mb * 1e6) as usize);
    debug_assert!(docs.iter().all(|d| d.chars().count() < MAX_WINDOW_CHARS));
    let bytes: usize = docs.iter().map(String::len).sum();
    for d in docs.iter().take(4) {
        std::hint::black_box(tok.encode_text(d));
    }
    let t = Instant::now();
    let out: Vec<Vec<u32>> = docs.iter().map(|d| tok.encode_text(d)).collect();
    let seconds = t.elapsed().as_secs_f64();
    let ids = out.iter().map(Vec::len).sum();
    let mut checksum = 0u64;
    for o in &out {
        for &i in o {
            checksum = ((checksum as u128 * 1_000_003 + i as u128) % (1u128 << 61)) as u64;
        }
    }
    let tiktoken = run_tiktoken(dir, &docs);
    let mb_per_s = bytes as f64 / seconds / 1e6;
    Ok(TokenizerBench {
        corpus_bytes: bytes,
        documents: docs.len(),
        ids,
        seconds,
        mb_per_s,
        ratio_vs_tiktoken: tiktoken.as_ref().map(|t| mb_per_s / t.mb_per_s),
        ids_match_tiktoken: tiktoken.as_ref().map(|t| t.ids == ids && t.checksum == checksum),
        tiktoken,
    })
}

fn run_tiktoken(dir: &Path, docs: &[String]) -> Option<TiktokenRun> {
    let tmp = std::env::temp_dir().join(format!("kimi-bench-docs-{}.json", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string(docs).ok()?).ok()?;
    let out =
        Command::new("python3").arg("-c").arg(PY).arg(dir.join("tiktoken.model")).arg(&tmp).arg(RELEASE_PAT).output();
    let _ = std::fs::remove_file(&tmp);
    let out = out.ok().filter(|o| o.status.success())?;
    serde_json::from_slice(&out.stdout).ok()
}

impl std::fmt::Display for TokenizerBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "kimi-host: {:.2} MB in {} documents → {} ids in {:.3} s = {:.2} MB/s (one thread)",
            self.corpus_bytes as f64 / 1e6,
            self.documents,
            self.ids,
            self.seconds,
            self.mb_per_s
        )?;
        match (&self.tiktoken, self.ratio_vs_tiktoken) {
            (Some(t), Some(r)) => {
                writeln!(f, "tiktoken {} (Python): {:.3} s = {:.2} MB/s", t.version, t.seconds, t.mb_per_s)?;
                writeln!(
                    f,
                    "ratio kimi-host / tiktoken: {r:.2}×; ids identical: {}",
                    self.ids_match_tiktoken.unwrap_or(false)
                )
            }
            _ => writeln!(f, "Python tiktoken not importable: no baseline in this run"),
        }
    }
}
