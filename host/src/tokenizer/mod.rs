//! The Kimi tokenizer: tiktoken-format byte-level BPE (`tiktoken.model`), the Kimi
//! pre-tokenisation regex with the release's long-input chunking, special tokens addressed by
//! name, and a streaming detokenizer.
//!
//! User text can never become a control token: [`Segment::Text`] is encoded with no special-token
//! recognition at all; only [`Segment::Special`] yields a special id.

mod bpe;
pub mod pretokenize;
pub mod specials;
pub mod stream;

use std::collections::HashMap;
use std::path::Path;

use base64::Engine as _;
use rustc_hash::FxHashMap;
use thiserror::Error;

use bpe::Ranks;
use pretokenize::{PreTokenizer, release_chunks};

pub use stream::{StreamDecoder, StreamOutput};

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {msg}")]
    Format { path: String, line: usize, msg: String },
    #[error("unknown special token `{0}`")]
    UnknownSpecial(String),
    #[error("token id {id} is out of range for vocab size {vocab}")]
    IdOutOfRange { id: u32, vocab: usize },
}

/// A piece of a prompt: ordinary text, or a special token by name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    Text(String),
    Special(String),
}

pub struct Tokenizer {
    ranks: Ranks,
    /// Bytes of every id (specials: their name's UTF-8), indexed by id.
    decoder: Vec<Vec<u8>>,
    is_special: Vec<bool>,
    special_ids: HashMap<String, u32>,
    pre: PreTokenizer,
    /// Specials recognised in `encode_with_specials` (longest names first).
    special_re: Option<regex::Regex>,
}

/// How far past the BPE ranks a special id may lie (K3 uses 256; the gap is allocated).
const MAX_SPECIAL_SPAN: usize = 1 << 16;

impl Tokenizer {
    /// Loads `<dir>/tiktoken.model` and the special table (`tokenizer_config.json` or K3 defaults).
    pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let path = dir.join("tiktoken.model");
        let file = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|e| TokenizerError::Io { path: file.clone(), source: e })?;
        let bad = |line: usize, msg: String| TokenizerError::Format { path: file.clone(), line, msg };
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut map: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        map.reserve(text.len() / 16);
        let mut decoder: Vec<Vec<u8>> = Vec::new();
        // Ranks are dense, so none can reach the number of lines; checked before `resize` so a
        // bogus rank is an error, not an allocation of its size.
        let lines = text.lines().filter(|l| !l.is_empty()).count();
        for (i, line) in text.lines().enumerate() {
            let lineno = i + 1;
            if line.is_empty() {
                continue;
            }
            let (tok, rank) =
                line.split_once(' ').ok_or_else(|| bad(lineno, "expected `<base64> <rank>`".to_string()))?;
            let bytes = b64.decode(tok).map_err(|e| bad(lineno, format!("invalid base64 `{tok}`: {e}")))?;
            let rank: u32 = rank.trim().parse().map_err(|_| bad(lineno, format!("invalid rank `{rank}`")))?;
            if rank as usize >= lines {
                return Err(bad(
                    lineno,
                    format!("rank {rank} is not below the file's {lines} tokens (ranks are dense)"),
                ));
            }
            if rank as usize >= decoder.len() {
                decoder.resize(rank as usize + 1, Vec::new());
            }
            if !decoder[rank as usize].is_empty() {
                return Err(bad(lineno, format!("rank {rank} appears twice")));
            }
            if map.insert(bytes.clone(), rank).is_some() {
                return Err(bad(lineno, format!("token `{tok}` appears twice")));
            }
            decoder[rank as usize] = bytes;
        }
        if let Some(hole) = decoder.iter().position(Vec::is_empty) {
            return Err(bad(0, format!("ranks are not dense: rank {hole} is missing")));
        }
        if decoder.is_empty() {
            return Err(bad(0, "no tokens".to_string()));
        }
        let base = decoder.len() as u32;
        // The 256 reserved ids after the ranks always exist (as in the release tokenizer); the
        // config's added tokens name them (and may add more).
        let mut table = specials::k3_defaults(base);
        if let Some(added) = specials::from_tokenizer_config(dir)? {
            for (id, name) in added {
                table.retain(|(i, n)| *i != id && *n != name);
                table.push((id, name));
            }
        }
        Tokenizer::assemble(Ranks::new(map), decoder, table, &dir.join("tokenizer_config.json").display().to_string())
    }

    fn assemble(
        ranks: Ranks,
        mut decoder: Vec<Vec<u8>>,
        table: Vec<(u32, String)>,
        source: &str,
    ) -> Result<Tokenizer, TokenizerError> {
        let base = decoder.len();
        let mut is_special = vec![false; base];
        let mut special_ids = HashMap::new();
        for (id, name) in table {
            let idx = id as usize;
            if idx < base {
                return Err(TokenizerError::Format {
                    path: source.to_string(),
                    line: 0,
                    msg: format!("special `{name}` has id {id}, inside the BPE ranks (0..{base})"),
                });
            }
            if idx >= base + MAX_SPECIAL_SPAN {
                return Err(TokenizerError::Format {
                    path: source.to_string(),
                    line: 0,
                    msg: format!("special `{name}` has id {id}, more than {MAX_SPECIAL_SPAN} past the BPE ranks"),
                });
            }
            if idx >= decoder.len() {
                decoder.resize(idx + 1, Vec::new());
                is_special.resize(idx + 1, false);
            }
            decoder[idx] = name.as_bytes().to_vec();
            is_special[idx] = true;
            special_ids.insert(name, id);
        }
        let mut names: Vec<&String> = special_ids.keys().collect();
        names.sort_by_key(|n| std::cmp::Reverse(n.len()));
        let special_re = if names.is_empty() {
            None
        } else {
            let alt = names.iter().map(|n| regex::escape(n)).collect::<Vec<_>>().join("|");
            regex::Regex::new(&alt).ok()
        };
        Ok(Tokenizer { ranks, decoder, is_special, special_ids, pre: PreTokenizer::new(), special_re })
    }

    /// Ids this tokenizer can produce (BPE ranks plus specials, including gaps).
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }

    /// Number of BPE ranks (the first special id).
    pub fn num_base_tokens(&self) -> usize {
        self.ranks.len()
    }

    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.is_special.get(id as usize).copied().unwrap_or(false)
    }

    /// The bytes of one id (a special's name for specials).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.decoder.get(id as usize).map(Vec::as_slice).filter(|b| !b.is_empty())
    }

    /// Ordinary text → ids, never a special id (text spelling `<|open|>` is plain BPE).
    pub fn encode_text(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        release_chunks(text, |chunk| self.encode_chunk(chunk, &mut out));
        out
    }

    /// Bytes that need not be UTF-8 (a grammar's forced bytes can end inside a character) → ids
    /// whose bytes are exactly `bytes`: valid runs as ordinary text, each invalid run by byte-pair
    /// merges of its own bytes. Never a special id.
    pub fn encode_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        let mut out = Vec::with_capacity(bytes.len() / 3 + 1);
        for chunk in bytes.utf8_chunks() {
            if !chunk.valid().is_empty() {
                out.extend(self.encode_text(chunk.valid()));
            }
            if !chunk.invalid().is_empty() {
                self.ranks.encode_piece(chunk.invalid(), &mut out);
            }
        }
        out
    }

    fn encode_chunk(&self, chunk: &str, out: &mut Vec<u32>) {
        self.pre.pieces(chunk, |piece| self.ranks.encode_piece(piece.as_bytes(), out));
    }

    /// Text in which every special token's spelling is recognised (tiktoken `allowed_special="all"`;
    /// for raw completion prompts, never for chat user text).
    pub fn encode_with_specials(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        release_chunks(text, |chunk| {
            let mut pos = 0;
            if let Some(re) = &self.special_re {
                for m in re.find_iter(chunk) {
                    self.encode_chunk(&chunk[pos..m.start()], &mut out);
                    if let Some(id) = self.special_id(m.as_str()) {
                        out.push(id);
                    }
                    pos = m.end();
                }
            }
            self.encode_chunk(&chunk[pos..], &mut out);
        });
        out
    }

    /// Segments → ids. Text never yields a special; a special is looked up by name.
    pub fn encode_segments(&self, segments: &[Segment]) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        for s in segments {
            match s {
                Segment::Text(t) => out.extend(self.encode_text(t)),
                Segment::Special(name) => {
                    out.push(self.special_id(name).ok_or_else(|| TokenizerError::UnknownSpecial(name.clone()))?)
                }
            }
        }
        Ok(out)
    }

    /// Ids → bytes (specials as their names).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            let b = self.token_bytes(id).ok_or(TokenizerError::IdOutOfRange { id, vocab: self.vocab_size() })?;
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    /// Ids → text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Writes a byte-level tokenizer into `dir`: 256 single-byte ranks in `tiktoken.model` format
    /// and the K3 special names at ids 256..511 in `tokenizer_config.json` (the embedded default's
    /// tokenizer; the same loader reads it).
    pub fn write_byte_level(dir: &Path) -> std::io::Result<()> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut model = String::new();
        for b in 0..=255u8 {
            model.push_str(&format!("{} {b}\n", b64.encode([b])));
        }
        std::fs::write(dir.join("tiktoken.model"), model)?;
        let mut table = serde_json::Map::new();
        for (id, name) in specials::k3_defaults(256) {
            // The XTML markers are `special: false` in the release table (they survive
            // skip_special_tokens); the rest are special.
            let special = !matches!(name.as_str(), "<|open|>" | "<|close|>" | "<|sep|>");
            table.insert(
                id.to_string(),
                serde_json::json!({"content": name, "lstrip": false, "normalized": false, "rstrip": false,
                                   "single_word": false, "special": special}),
            );
        }
        let cfg = serde_json::json!({
            "added_tokens_decoder": table,
            "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
            "tokenizer_class": "TikTokenTokenizer",
            "model_max_length": 1048576
        });
        std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&cfg).unwrap_or_default())
    }
}
