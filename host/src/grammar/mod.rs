//! The native grammar engine: llguidance over the served tokenizer. Plugins describe a
//! constraint (JSON Schema, Lark, regex, choice); the host compiles it once per distinct
//! constraint (cached by hash) and computes token masks natively.
//!
//! Lark constraints in the subset our own grammars use (`lark_subset`, with `json_rules` for
//! their `%json` values) and JSON schemas in `json_rules`' subset are built straight into
//! llguidance's internal form; everything else goes through llguidance's own front ends.

mod json_rules;
mod lark_subset;
mod rules;
mod text_bias;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use llguidance::api::{GrammarInit, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::tokenizer::Tokenizer;

#[derive(Debug, Error, Clone)]
pub enum GrammarError {
    #[error("invalid constraint: {0}")]
    Invalid(String),
    #[error("grammar engine: {0}")]
    Engine(String),
}

/// A declarative constraint (mirrors the WIT `grammar-engine.constraint`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Constraint {
    JsonSchema(String),
    Lark(String),
    Regex(String),
    Choice(Vec<String>),
}

impl Constraint {
    fn key(&self) -> String {
        let mut h = Sha256::new();
        match self {
            Constraint::JsonSchema(s) => h.update(format!("json:{s}")),
            Constraint::Lark(s) => h.update(format!("lark:{s}")),
            Constraint::Regex(s) => h.update(format!("regex:{s}")),
            Constraint::Choice(v) => h.update(format!("choice:{}", serde_json::to_string(v).unwrap_or_default())),
        }
        crate::util::hex(&h.finalize())
    }

    fn grammar(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(json_schema(s)?),
            Constraint::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Choice(options) => {
                if options.is_empty() {
                    return Err(GrammarError::Invalid("choice needs at least one option".into()));
                }
                let alts: Vec<String> = options.iter().map(|o| serde_json::to_string(o).unwrap_or_default()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        })
    }
}

/// A JSON-schema constraint's schema, asking for compact JSON (no newlines or tabs, as the Kimi
/// vendor verifier requires for strict output) unless it says otherwise through llguidance's
/// `x-guidance` key.
fn json_schema(text: &str) -> Result<serde_json::Value, GrammarError> {
    let mut v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| GrammarError::Invalid(format!("JSON schema is not JSON: {e}")))?;
    if let Some(o) = v.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    Ok(v)
}

/// Our tokenizer as llguidance's `TokenizerEnv`: the trie holds every id's bytes (specials as
/// 0xFF + name, llguidance's convention, so grammars can name them as `<|open|>`).
struct KimiTokEnv {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for KimiTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    // Forced bytes can end inside a character; their ids must spell exactly those bytes.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tok.encode_bytes(s)
    }
}

/// Compiles constraints and hands out matchers (one per sequence).
pub struct GrammarEngine {
    factory: ParserFactory,
    cache: Mutex<HashMap<String, Matcher>>,
    vocab_size: usize,
    plain: Arc<text_bias::PlainTokens>,
}

/// Distinct constraints kept compiled.
const CACHE_ENTRIES: usize = 1024;

/// Largest constraint text (schema, grammar, regex or all choices together) compiled.
pub const MAX_CONSTRAINT_BYTES: usize = 1 << 20;

/// Stack of the thread a constraint compiles on. llguidance's front ends recurse once per
/// object property (an 8,000-property schema overflowed a 2 MiB worker stack and killed the
/// process), so compilation gets a stack of its own, 32× that; the pages are only committed
/// when touched. The server's schema caps (`[limits]`) keep requests far below it.
const COMPILE_STACK: usize = 64 << 20;

impl Constraint {
    fn text_len(&self) -> usize {
        match self {
            Constraint::JsonSchema(s) | Constraint::Lark(s) | Constraint::Regex(s) => s.len(),
            Constraint::Choice(v) => v.iter().map(String::len).sum(),
        }
    }
}

impl GrammarEngine {
    /// `vocab_size`: the logits width (may exceed the tokenizer's ids); `eos`: the stop token.
    pub fn new(tok: Arc<Tokenizer>, vocab_size: usize, eos: u32) -> Result<GrammarEngine, GrammarError> {
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let w = match tok.token_bytes(id) {
                Some(b) if tok.is_special(id) => {
                    let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    v.extend_from_slice(b);
                    v
                }
                Some(b) => b.to_vec(),
                None => Vec::new(),
            };
            words.push(w);
        }
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(KimiTokEnv { trie, tok });
        // Masks inside our own JSON strings come from `text_bias` (no trie walk for plain text);
        // llguidance's stock slices serve the rest.
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(&env, Default::default(), &slices)
            .map_err(|e| GrammarError::Engine(format!("{e:#}")))?;
        factory.quiet();
        // Work budgets, spelled out so a dependency update cannot loosen them silently: lexer
        // fuel bounds the regex work of compiling a constraint and of each token's mask,
        // `max_lexer_states` / `max_grammar_size` bound what a `pattern` or a schema may expand
        // to, `step_max_items` the Earley work per token. Past one, that request gets a 400.
        let limits = factory.limits_mut();
        limits.max_items_in_row = 2000;
        limits.initial_lexer_fuel = 1_000_000;
        limits.step_lexer_fuel = 200_000;
        limits.max_lexer_states = 250_000;
        limits.max_grammar_size = 500_000;
        limits.step_max_items = 50_000;
        let plain = Arc::new(text_bias::PlainTokens::new(env.tok_trie()));
        Ok(GrammarEngine { factory, cache: Mutex::new(HashMap::new()), vocab_size, plain })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A fresh matcher for `c` (compiled once per distinct constraint, then cloned).
    pub fn matcher(&self, c: &Constraint) -> Result<ConstraintMatcher, GrammarError> {
        let key = c.key();
        if let Some(m) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(ConstraintMatcher(m.deep_clone()));
        }
        if c.text_len() > MAX_CONSTRAINT_BYTES {
            return Err(GrammarError::Invalid(format!(
                "the constraint is {} bytes; the limit is {MAX_CONSTRAINT_BYTES}",
                c.text_len()
            )));
        }
        let m = self.on_compile_stack(|| match self.compile_direct(c) {
            Some(m) => Ok(m),
            None => self.compile_llguidance(c),
        })?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, m.deep_clone());
        Ok(ConstraintMatcher(m))
    }

    /// Runs `f` on a thread with `COMPILE_STACK` of stack.
    fn on_compile_stack<T: Send>(&self, f: impl FnOnce() -> Result<T, GrammarError> + Send) -> Result<T, GrammarError> {
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("kimi-grammar-compile".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(scope, f)
                .map_err(|e| GrammarError::Engine(format!("compile thread: {e}")))?;
            worker.join().map_err(|_| GrammarError::Engine("constraint compilation panicked".into()))?
        })
    }

    /// `c` built without llguidance's front ends, when it is in the subset that allows it.
    fn compile_direct(&self, c: &Constraint) -> Option<Matcher> {
        let trie = self.factory.tok_env().tok_trie();
        let built = match c {
            Constraint::Lark(text) => lark_subset::compile(text, trie),
            Constraint::JsonSchema(text) => json_schema(text).ok().map(|v| json_rules::compile_schema(&v, trie))?,
            Constraint::Regex(_) | Constraint::Choice(_) => return None,
        };
        let built = match built {
            Ok(built) => built,
            Err(why) => {
                tracing::debug!(reason = %why.0, "constraint outside the direct subset; using llguidance's front end");
                return None;
            }
        };
        let texts = built.json_texts;
        let mut parser =
            self.factory.create_parser_from_init_default(GrammarInit::Internal(built.grammar, built.lexer)).ok()?;
        // (A failure above gets llguidance's own, authoritative, error from the slow path.)
        if !texts.is_empty() {
            parser.bias_computer =
                Arc::new(text_bias::JsonTextBias::new(self.factory.slicer(), self.plain.clone(), &texts));
        }
        Some(Matcher::new(Ok(parser)))
    }

    fn compile_llguidance(&self, c: &Constraint) -> Result<Matcher, GrammarError> {
        let m = Matcher::new(self.factory.create_parser(c.grammar()?));
        match m.get_error() {
            Some(err) => Err(GrammarError::Invalid(err)),
            None => Ok(m),
        }
    }

    /// A matcher compiled by llguidance's own front end (no direct path, no cache): the
    /// reference the direct path is tested against.
    pub fn matcher_via_llguidance(&self, c: &Constraint) -> Result<ConstraintMatcher, GrammarError> {
        self.on_compile_stack(|| self.compile_llguidance(c)).map(ConstraintMatcher)
    }

    /// Whether `c` takes the direct path (no llguidance front end).
    pub fn compiles_directly(&self, c: &Constraint) -> bool {
        self.compile_direct(c).is_some()
    }

    /// None if `c` compiles for this tokenizer, else why not.
    pub fn validate(&self, c: &Constraint) -> Option<String> {
        self.matcher(c).err().map(|e| e.to_string())
    }
}

/// One sequence's position in a constraint.
#[derive(Clone)]
pub struct ConstraintMatcher(Matcher);

impl ConstraintMatcher {
    /// Allowed next tokens (EOS allowed when the constraint is satisfied).
    pub fn mask(&mut self) -> Result<SimpleVob, GrammarError> {
        self.0.compute_mask_or_eos().map_err(|e| GrammarError::Engine(format!("{e:#}")))
    }

    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.0.consume_token(token).map_err(|e| GrammarError::Engine(format!("{e:#}")))
    }

    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.0.rollback(n).map_err(|e| GrammarError::Engine(format!("{e:#}")))
    }

    pub fn is_accepting(&mut self) -> bool {
        self.0.is_accepting().unwrap_or(false)
    }

    pub fn is_stopped(&self) -> bool {
        self.0.is_stopped()
    }

    /// Tokens the constraint forces next (can be appended without sampling).
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        self.0.compute_ff_tokens()
    }
}
