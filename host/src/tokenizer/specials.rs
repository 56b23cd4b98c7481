//! The special-token table: from a checkpoint's `tokenizer_config.json` (`added_tokens_decoder`)
//! when present, else the K3 defaults (spec §6): 256 reserved ids right after the BPE ranks.

use std::path::Path;

use serde_json::Value;

use super::TokenizerError;

/// K3's named specials as offsets from the first special id (163584 in the real vocabulary).
pub const K3_NAMED: [(u32, &str); 16] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|close|>"),
    (5, "<|sep|>"),
    (6, "[start_header_id]"),
    (7, "[end_header_id]"),
    (9, "[EOT]"),
    (18, "<|media_begin|>"),
    (19, "<|media_content|>"),
    (20, "<|media_end|>"),
    (21, "<|media_pad|>"),
    (65, "<osagent_mode>"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

/// Number of reserved special ids.
pub const NUM_SPECIALS: u32 = 256;

/// (id, name) for all 256 K3 specials starting at `base`.
pub fn k3_defaults(base: u32) -> Vec<(u32, String)> {
    (0..NUM_SPECIALS)
        .map(|off| {
            let id = base + off;
            let name = K3_NAMED
                .iter()
                .find(|(o, _)| *o == off)
                .map_or_else(|| format!("<|reserved_token_{id}|>"), |(_, n)| n.to_string());
            (id, name)
        })
        .collect()
}

/// The `added_tokens_decoder` table of `tokenizer_config.json`, if the file exists.
pub fn from_tokenizer_config(dir: &Path) -> Result<Option<Vec<(u32, String)>>, TokenizerError> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let file = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|e| TokenizerError::Io { path: file.clone(), source: e })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| TokenizerError::Format {
        path: file.clone(),
        line: e.line(),
        msg: e.to_string(),
    })?;
    let Some(table) = v.get("added_tokens_decoder").and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(table.len());
    for (id, entry) in table {
        let bad = |msg: String| TokenizerError::Format { path: file.clone(), line: 0, msg };
        let id: u32 = id.parse().map_err(|_| bad(format!("added_tokens_decoder key `{id}` is not a token id")))?;
        let name = entry
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("added_tokens_decoder[{id}] has no string `content`")))?;
        out.push((id, name.to_string()));
    }
    out.sort();
    Ok(Some(out))
}
