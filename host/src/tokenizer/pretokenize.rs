//! Kimi pre-tokenisation (spec §6 / serving §2.3) and the release's long-input chunking.
//!
//! The release pattern ends with `\s+(?!\S)|\s+`; the `regex` crate has no look-ahead, so the
//! pattern here ends with plain `\s+` and the look-ahead is applied by hand: a whitespace run that
//! is followed by a non-space character gives back its last character (which then starts the next
//! piece, e.g. " word"), unless the run is a single character. Everything before that is the
//! release pattern verbatim, so leftmost-first alternation picks the same piece.

use regex::Regex;

/// The release `pat_str` without the look-ahead alternative.
const PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+",
);

/// Characters per encode window (the release: tiktoken panics above this).
pub const MAX_WINDOW_CHARS: usize = 400_000;
/// Longest run of whitespace / non-whitespace characters encoded as one unit.
pub const MAX_RUN_CHARS: usize = 25_000;

pub struct PreTokenizer {
    re: Regex,
}

impl Default for PreTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl PreTokenizer {
    pub fn new() -> PreTokenizer {
        // The pattern is a compile-time constant; failing to build it is a programming error.
        PreTokenizer { re: Regex::new(PATTERN).expect("the Kimi pre-tokenisation pattern compiles") }
    }

    /// Calls `f` with each piece of `text`, in order.
    pub fn pieces<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.re.find_at(text, pos) else {
                break;
            };
            let mut end = m.end();
            let piece = m.as_str();
            // `\s+` matched (only whitespace, and no earlier alternative did): apply `(?!\S)`.
            if end < text.len() && piece.chars().all(char::is_whitespace) && !ends_with_newline_rule(piece) {
                let next_is_space = text[end..].chars().next().is_some_and(char::is_whitespace);
                let mut chars = piece.char_indices();
                if !next_is_space && chars.nth(1).is_some() {
                    // Give back the last character.
                    end = m.start() + piece.char_indices().last().map_or(0, |(i, _)| i);
                }
            }
            f(&text[m.start()..end]);
            pos = end;
        }
    }
}

/// A whitespace-only match that ends in a newline came from `\s*[\r\n]+` (which comes first and
/// has no look-ahead), not from the trailing `\s+`: leave it alone.
fn ends_with_newline_rule(piece: &str) -> bool {
    piece.ends_with(['\r', '\n'])
}

/// Python's `str.isspace()`, which the release chunker uses (Unicode White_Space plus the
/// information separators U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The release chunking: 400,000-character windows, each cut so that no run of more than 25,000
/// whitespace or non-whitespace characters stays in one part. BPE never merges across a cut.
pub fn release_chunks(text: &str, mut f: impl FnMut(&str)) {
    let mut window_start = 0;
    while window_start < text.len() {
        let window_end =
            text[window_start..].char_indices().nth(MAX_WINDOW_CHARS).map_or(text.len(), |(i, _)| window_start + i);
        let window = &text[window_start..window_end];
        let mut slice_start = 0;
        let mut run_len = 0usize;
        let mut run_is_space = window.chars().next().is_some_and(py_isspace);
        for (i, c) in window.char_indices() {
            let is_space = py_isspace(c);
            if is_space != run_is_space {
                run_len = 1;
                run_is_space = is_space;
            } else {
                run_len += 1;
                if run_len > MAX_RUN_CHARS {
                    f(&window[slice_start..i]);
                    slice_start = i;
                    run_len = 1;
                }
            }
        }
        f(&window[slice_start..]);
        window_start = window_end;
    }
}
