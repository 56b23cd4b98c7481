//! Token masks inside JSON strings without walking the token trie for plain text.
//!
//! llguidance computes a mask by walking the token trie from the lexer's state; its slicer lets
//! it skip a set of tokens only when it can prove all of them allowed. Inside a JSON string with
//! `r` characters left before its `maxLength`, every token longer than `r` characters is walked
//! until the lexer rejects it, and that walk (most of the 163,840-token Kimi vocabulary) made
//! those masks ~0.2–1.2 ms.
//!
//! `JsonTextBias` handles one case exactly: the lexer is inside a `json_string` lexeme of ours
//! (content `.{min,max}`: any characters, only the count bounded), at a character boundary. There,
//! a *plain* token (valid UTF-8 with no `"`, `\`, control character or DEL) is allowed iff it has
//! at most `r` characters, so the plain part of the mask is one precomputed set. A token of plain
//! text then `"` (`abc",`) is allowed iff the string may close after that many characters and its
//! tail may follow the close; the tails are tried once per mask, not once per token. A token of
//! plain text then the start of a character cut short (most of the vocabulary's CJK fragments) is
//! allowed iff there is room for one character more. Tokens with escapes or DEL but no `"` never
//! leave the string, so their verdicts depend on the room alone: they are walked once per room
//! value and kept for every grammar. Only the rest (specials, escapes before a `"`) are walked on
//! every mask. `r` is found by pushing a probe
//! character through the lexer. Every other state goes to llguidance's slicer.
//!
//! Why this is exact. When every lexeme the lexer state may still be in is one of these strings:
//! - the state cannot end a lexeme before a closing quote, so pushing a quote-free token only
//!   follows the lexer's DFA (llguidance's trie walk does the same, with no parser step);
//! - the probe `g` is accepted only at a character boundary with room for one more character: not
//!   after `\` (no such escape), inside `\u` (not hex), mid-UTF-8 or before the opening quote;
//! - at a boundary with room `r` (the largest over the possible lexemes), a plain token of `n`
//!   characters is accepted iff `n ≤ r`, since any plain character is valid content; so is `n`
//!   plain characters then a valid incomplete UTF-8 sequence iff `n + 1 ≤ r`, since every
//!   character it may complete to is non-ASCII and so plain, and bytes that are not UTF-8 never.
//!
//! The direct-path tests compare these masks with llguidance's own at every step of walks.

use std::sync::Arc;

use llguidance::earley::lexerspec::LexemeIdx;
use llguidance::earley::{BiasComputer, ParserRecognizer, SlicedBiasComputer};
use llguidance::toktrie::{Recognizer, SimpleVob, TokTrie};

/// A content character no JSON escape or `\u` digit starts with.
const PROBE: u8 = b'g';

/// How a token fares inside one of our strings at a character boundary.
enum Kind {
    /// Plain text of this many characters: allowed iff the string has room for them.
    Plain(usize),
    /// Plain text of this many characters, then the start of one more character (a valid but
    /// incomplete UTF-8 sequence): allowed iff the string has room for one character more.
    Partial(usize),
    /// Never allowed: plain text (possibly none) then a raw control character (the string cannot
    /// end before it, and JSON strings hold no raw control characters) or bytes that are not
    /// UTF-8 (a continuation byte at a character boundary, an overlong or surrogate start).
    Never,
    /// Plain text of this many characters, then `"` at byte `at`: allowed iff the string may
    /// close after that many characters and the rest of the token may follow a close.
    Quoted { chars: usize, at: usize },
    /// Anything else (escapes, specials, DEL): walked.
    Other,
}

impl Kind {
    fn of(token: &[u8]) -> Kind {
        if token.is_empty() {
            return Kind::Other;
        }
        // The longest valid UTF-8 prefix, and whether what follows is a valid start of a
        // character cut short (`error_len() == None`) or not UTF-8 at all.
        let (text, tail) = match std::str::from_utf8(token) {
            Ok(t) => (t, None),
            Err(e) => {
                let t = std::str::from_utf8(&token[..e.valid_up_to()]).unwrap_or_default();
                (t, Some(e.error_len().is_none()))
            }
        };
        match text.chars().find(|c| matches!(c, '"' | '\\' | '\0'..='\x1f' | '\x7f')) {
            None => match tail {
                None => Kind::Plain(text.chars().count()),
                Some(true) => Kind::Partial(text.chars().count()),
                Some(false) => Kind::Never,
            },
            Some('\0'..='\x1f') => Kind::Never,
            Some('"') => {
                let at = text.find('"').unwrap_or(0);
                Kind::Quoted { chars: text[..at].chars().count(), at }
            }
            Some(_) => Kind::Other,
        }
    }
}

/// The vocabulary split for `JsonTextBias`: plain tokens by character count, and the rest.
pub struct PlainTokens {
    /// `up_to[n]`: the plain and partial tokens that fit in `n` characters of room (a partial
    /// token needs one more than it holds whole), `n` up to the longest.
    up_to: Vec<SimpleVob>,
    /// A trie of the `Kind::Quoted` tokens and the `Kind::Other` ones not in `steady`, walked
    /// when more than one string lexeme is possible.
    rest: TokTrie,
    /// A trie of the `Kind::Other` tokens not in `steady`, walked on every mask.
    other: TokTrie,
    /// A trie of the `Kind::Other` tokens that hold no `"` and are not specials (escapes, DEL):
    /// such a token never leaves the string, so whether it is allowed depends only on the room,
    /// and it is walked once per room value, for the first grammar that needs it.
    steady: TokTrie,
    /// `steady_at[r]`: the `steady` tokens allowed with `r` characters of room, once walked.
    steady_at: Vec<std::sync::OnceLock<SimpleVob>>,
    /// The `Kind::Quoted` tokens' tails from the quote on, sorted and distinct.
    closers: Vec<Vec<u8>>,
    /// Each `Kind::Quoted` token, its characters before the quote and its tail in `closers`.
    quoted: Vec<(u32, usize, usize)>,
}

impl PlainTokens {
    pub fn new(trie: &TokTrie) -> PlainTokens {
        let kinds: Vec<Kind> = (0..trie.vocab_size() as u32).map(|id| Kind::of(trie.token(id))).collect();
        let is_steady = |id: usize| {
            let t = trie.token(id as u32);
            !t.contains(&b'"') && t.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER)
        };
        // A steady token has at most as many characters as bytes, so with room for its byte
        // length it fits: `room` stops counting there.
        let longest = kinds
            .iter()
            .enumerate()
            .filter_map(|(id, k)| match k {
                Kind::Plain(n) | Kind::Quoted { chars: n, .. } => Some(*n),
                Kind::Partial(n) => Some(n + 1),
                Kind::Other if is_steady(id) => Some(trie.token(id as u32).len()),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let mut by_len: Vec<Vec<u32>> = vec![Vec::new(); longest + 1];
        let (mut rest, mut other, mut steady) =
            (trie.alloc_token_set(), trie.alloc_token_set(), trie.alloc_token_set());
        let mut closers = Vec::new();
        for (id, kind) in kinds.iter().enumerate() {
            match kind {
                Kind::Plain(n) => by_len[*n].push(id as u32),
                Kind::Partial(n) => by_len[n + 1].push(id as u32),
                Kind::Quoted { at, .. } => {
                    rest.allow_token(id as u32);
                    closers.push(trie.token(id as u32)[*at..].to_vec());
                }
                Kind::Other if is_steady(id) => steady.allow_token(id as u32),
                Kind::Other => {
                    rest.allow_token(id as u32);
                    other.allow_token(id as u32);
                }
                Kind::Never => {}
            }
        }
        closers.sort();
        closers.dedup();
        let quoted = kinds
            .iter()
            .enumerate()
            .filter_map(|(id, k)| match k {
                Kind::Quoted { chars, at } => {
                    let tail = &trie.token(id as u32)[*at..];
                    closers.binary_search_by(|c| c.as_slice().cmp(tail)).ok().map(|c| (id as u32, *chars, c))
                }
                _ => None,
            })
            .collect();
        let mut up_to = Vec::with_capacity(longest + 1);
        let mut set = trie.alloc_token_set();
        for ids in &by_len {
            for &id in ids {
                set.allow_token(id);
            }
            up_to.push(set.clone());
        }
        PlainTokens {
            up_to,
            rest: trie.filter(&rest),
            other: trie.filter(&other),
            steady: trie.filter(&steady),
            steady_at: (0..=longest).map(|_| std::sync::OnceLock::new()).collect(),
            closers,
            quoted,
        }
    }

    fn longest(&self) -> usize {
        self.up_to.len() - 1
    }

    /// The steady tokens allowed with `room` characters of room, walked with `rec` (at a
    /// character boundary inside one of our strings with that room) the first time.
    fn steady_at(&self, room: usize, rec: &mut ParserRecognizer<'_>) -> &SimpleVob {
        self.steady_at[room].get_or_init(|| {
            let mut set = self.steady.alloc_token_set();
            self.steady.add_bias(rec, &mut set, &[]);
            set
        })
    }
}

/// A grammar's bias computer: `PlainTokens` inside its `json_string` lexemes, llguidance's
/// slicer everywhere else.
pub struct JsonTextBias {
    slicer: Arc<SlicedBiasComputer>,
    plain: Arc<PlainTokens>,
    /// `is_text[lexeme]`: whether the lexeme is a `json_string`.
    is_text: Vec<bool>,
}

impl JsonTextBias {
    pub fn new(slicer: Arc<SlicedBiasComputer>, plain: Arc<PlainTokens>, texts: &[LexemeIdx]) -> JsonTextBias {
        let mut is_text = Vec::new();
        for lx in texts {
            let i = lx.as_usize();
            if is_text.len() <= i {
                is_text.resize(i + 1, false);
            }
            is_text[i] = true;
        }
        JsonTextBias { slicer, plain, is_text }
    }

    /// Whether the lexer state can only be inside one of our JSON strings, short of its end.
    fn only_in_text(&self, rec: &mut ParserRecognizer<'_>) -> bool {
        let state = rec.lexer_state();
        let possible = rec.lexer().possible_lexemes(state);
        !possible.is_empty()
            && possible.iter().all(|lx| self.is_text.get(lx.as_usize()).copied().unwrap_or(false))
            && rec.lexer_mut().try_lexeme_end(state).is_error()
    }

    /// Characters the current string has room for (capped at the longest plain token), when the
    /// lexer is at a character boundary inside one of our strings with room for at least one.
    fn room(&self, rec: &mut ParserRecognizer<'_>) -> Option<usize> {
        if !self.only_in_text(rec) {
            return None;
        }
        rec.trie_started("json text room");
        let mut room = 0;
        while room < self.plain.longest() && rec.try_push_byte(PROBE) {
            room += 1;
            // Only our string lexemes can follow; checked anyway, it is cheap.
            if !self.only_in_text(rec) {
                room = 0;
                break;
            }
        }
        rec.trie_finished();
        (room > 0).then_some(room)
    }

    /// Adds the `Kind::Quoted` tokens allowed when exactly one string lexeme is possible, with
    /// `room` characters of room: the string may close after `k` more characters for `k` from the
    /// first that allows it up to `room`, and what may follow the close does not depend on `k`
    /// (the same lexeme ends, in the same parser row), so each tail is tried once, after the
    /// probe written `k` times. Returns false (nothing added) when more than one lexeme is
    /// possible.
    fn add_quoted(&self, rec: &mut ParserRecognizer<'_>, room: usize, set: &mut SimpleVob) -> bool {
        if rec.lexer().possible_lexemes(rec.lexer_state()).iter().nth(1).is_some() {
            return false;
        }
        rec.trie_started("json text close");
        let mut pushed = 0;
        let mut need = None;
        for k in 0..=room {
            if k > 0 {
                if !rec.try_push_byte(PROBE) {
                    break;
                }
                pushed += 1;
            }
            if rec.try_push_byte(b'"') {
                rec.pop_bytes(1);
                need = Some(k);
                break;
            }
        }
        if let Some(need) = need {
            let ok = self.walk_closers(rec);
            for &(tok, chars, c) in &self.plain.quoted {
                if chars >= need && chars <= room && ok[c] {
                    set.allow_token(tok);
                }
            }
        }
        rec.pop_bytes(pushed);
        rec.trie_finished();
        true
    }

    /// Which `closers` the recognizer accepts from its current state (a walk of their sorted
    /// list, sharing prefixes, skipping the extensions of a rejected prefix).
    fn walk_closers(&self, rec: &mut ParserRecognizer<'_>) -> Vec<bool> {
        let closers = &self.plain.closers;
        let mut ok = vec![false; closers.len()];
        let mut stack: Vec<u8> = Vec::new();
        let mut dead: Option<Vec<u8>> = None;
        for (i, w) in closers.iter().enumerate() {
            if dead.as_ref().is_some_and(|d| w.starts_with(d)) {
                continue;
            }
            let common = stack.iter().zip(w).take_while(|(a, b)| a == b).count();
            rec.pop_bytes(stack.len() - common);
            stack.truncate(common);
            ok[i] = true;
            for &b in &w[common..] {
                if rec.try_push_byte(b) {
                    stack.push(b);
                } else {
                    let mut d = stack.clone();
                    d.push(b);
                    dead = Some(d);
                    ok[i] = false;
                    break;
                }
            }
        }
        rec.pop_bytes(stack.len());
        ok
    }
}

impl BiasComputer for JsonTextBias {
    fn compute_bias(&self, rec: &mut ParserRecognizer<'_>, start: &[u8]) -> SimpleVob {
        if start.is_empty()
            && let Some(room) = self.room(rec)
        {
            let mut set = self.plain.up_to[room].clone();
            set.or(self.plain.steady_at(room, rec));
            if self.add_quoted(rec, room, &mut set) {
                self.plain.other.add_bias(rec, &mut set, &[]);
            } else {
                self.plain.rest.add_bias(rec, &mut set, &[]);
            }
            return set;
        }
        self.slicer.compute_bias(rec, start)
    }

    fn trie(&self) -> &TokTrie {
        self.slicer.trie()
    }
}
