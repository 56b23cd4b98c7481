//! A small builder for llguidance's internal grammar form (`earley::Grammar` + `LexerSpec`):
//! symbols, rules and lexemes, without going through its Lark front end. That front end was about
//! two thirds of a K3 output grammar's 1.3 ms compile (it rebuilds a Lark-syntax lexer every
//! time), so the constraints we generate ourselves are built directly with this.

use std::collections::HashMap;

use llguidance::api::{NodeProps, ParserLimits};
use llguidance::derivre::{JsonQuoteOptions, RegexAst};
use llguidance::earley::lexerspec::{LexemeClass, LexemeIdx, LexerSpec};
use llguidance::earley::{Grammar, SymIdx, SymbolProps};
use llguidance::toktrie::TokTrie;

/// Why a constraint could not be built here (the caller falls back to llguidance's front end).
#[derive(Debug)]
pub struct Unsupported(pub String);

pub type Built<T> = Result<T, Unsupported>;

pub fn unsupported<T>(why: impl Into<String>) -> Built<T> {
    Err(Unsupported(why.into()))
}

/// JSON string escapes llguidance's own JSON compiler allows (`\uXXXX` only for control bytes).
const JSON_ESCAPES: &str = "nrbtf\\\"u";

pub struct RuleBuilder<'a> {
    grammar: Grammar,
    spec: LexerSpec,
    class: LexemeClass,
    trie: &'a TokTrie,
    literals: HashMap<String, SymIdx>,
    specials: HashMap<String, SymIdx>,
    empty: Option<SymIdx>,
    limits: ParserLimits,
    json_texts: Vec<LexemeIdx>,
}

/// A grammar in llguidance's internal form, and which of its lexemes are `json_string`s.
pub struct BuiltGrammar {
    pub grammar: Grammar,
    pub lexer: LexerSpec,
    pub json_texts: Vec<LexemeIdx>,
}

impl<'a> RuleBuilder<'a> {
    /// A grammar whose symbol 0 is its start symbol, with one lexeme class and no skipped text.
    pub fn new(trie: &'a TokTrie) -> Built<RuleBuilder<'a>> {
        let mut spec = LexerSpec::new().map_err(|e| Unsupported(e.to_string()))?;
        let class = spec.setup_lexeme_class(RegexAst::Or(vec![])).map_err(|e| Unsupported(e.to_string()))?;
        let mut b = RuleBuilder {
            grammar: Grammar::new(None),
            spec,
            class,
            trie,
            literals: HashMap::new(),
            specials: HashMap::new(),
            empty: None,
            limits: ParserLimits::default(),
            json_texts: Vec::new(),
        };
        let start = b
            .grammar
            .fresh_symbol_ext("start", SymbolProps { grammar_id: class, is_start: true, ..Default::default() });
        debug_assert_eq!(start, b.grammar.start());
        Ok(b)
    }

    pub fn start(&self) -> SymIdx {
        self.grammar.start()
    }

    /// A fresh nonterminal (no rules yet).
    pub fn symbol(&mut self, name: &str) -> SymIdx {
        self.grammar.fresh_symbol_ext(name, SymbolProps { grammar_id: self.class, ..Default::default() })
    }

    /// `lhs → rhs` (an empty `rhs` derives the empty string).
    pub fn rule(&mut self, lhs: SymIdx, rhs: Vec<SymIdx>) -> Built<()> {
        self.grammar.add_rule(lhs, rhs).map_err(|e| Unsupported(e.to_string()))
    }

    /// A symbol deriving only the empty string.
    pub fn empty(&mut self) -> Built<SymIdx> {
        if let Some(e) = self.empty {
            return Ok(e);
        }
        let e = self.symbol("empty");
        self.rule(e, vec![])?;
        self.empty = Some(e);
        Ok(e)
    }

    /// Exactly the text `s` (one lexeme; shared by every use).
    pub fn literal(&mut self, s: &str) -> Built<SymIdx> {
        if s.is_empty() {
            return self.empty();
        }
        if let Some(&sym) = self.literals.get(s) {
            return Ok(sym);
        }
        let sym = self.lexeme(RegexAst::Literal(s.to_string()), None)?;
        self.literals.insert(s.to_string(), sym);
        Ok(sym)
    }

    /// A greedy lexeme for `rx`; with `max_tokens`, the lexeme ends once that many tokens are spent.
    pub fn lexeme(&mut self, rx: RegexAst, max_tokens: Option<usize>) -> Built<SymIdx> {
        let sym = self.symbol("lexeme");
        self.lexeme_into(sym, rx, max_tokens)?;
        Ok(sym)
    }

    /// Makes the (rule-less) symbol `sym` the lexeme `rx`.
    pub fn lexeme_into(&mut self, sym: SymIdx, rx: RegexAst, max_tokens: Option<usize>) -> Built<()> {
        let lx = self
            .spec
            .add_greedy_lexeme(String::new(), rx, false, None, max_tokens.unwrap_or(usize::MAX))
            .map_err(|e| Unsupported(format!("regex: {e}")))?;
        self.terminal(sym, lx)?;
        if max_tokens.is_some() {
            self.grammar.apply_node_props(sym, NodeProps { max_tokens, ..Default::default() });
        }
        Ok(())
    }

    /// A JSON string (quotes included) of `min..=max` characters of any kind (escaped where JSON
    /// needs it). These lexemes are recorded for `JsonTextBias`, which relies on their content
    /// being unrestricted apart from its length.
    pub fn json_string(&mut self, min: u64, max: Option<u64>) -> Built<SymIdx> {
        let content = match max {
            Some(max) => format!("(?s:.{{{min},{max}}})"),
            None if min == 0 => "(?s:.*)".to_string(),
            None => format!("(?s:.{{{min},}})"),
        };
        let sym = self.symbol("json_string");
        let lx = self
            .spec
            .add_greedy_lexeme(String::new(), json_quoted(RegexAst::Regex(content)), false, None, usize::MAX)
            .map_err(|e| Unsupported(format!("regex: {e}")))?;
        self.terminal(sym, lx)?;
        self.json_texts.push(lx);
        Ok(sym)
    }

    /// The special token `<|name|>` (a token, never text).
    pub fn special(&mut self, name: &str) -> Built<SymIdx> {
        if let Some(&sym) = self.specials.get(name) {
            return Ok(sym);
        }
        let Some(id) = self.trie.get_special_token(name) else {
            return unsupported(format!("unknown special token {name}"));
        };
        let lx =
            self.spec.add_special_token(name.to_string(), vec![id..=id]).map_err(|e| Unsupported(e.to_string()))?;
        let sym = self.symbol(name);
        self.terminal(sym, lx)?;
        self.specials.insert(name.to_string(), sym);
        Ok(sym)
    }

    fn terminal(&mut self, sym: SymIdx, lx: LexemeIdx) -> Built<()> {
        self.grammar.make_terminal(sym, lx, &self.spec).map_err(|e| Unsupported(e.to_string()))
    }

    /// The sequence `items` as one symbol.
    pub fn seq(&mut self, items: Vec<SymIdx>) -> Built<SymIdx> {
        if let [one] = items.as_slice() {
            return Ok(*one);
        }
        let s = self.symbol("seq");
        self.rule(s, items)?;
        Ok(s)
    }

    /// Any one of `alternatives` (each a sequence).
    pub fn alt(&mut self, alternatives: Vec<Vec<SymIdx>>) -> Built<SymIdx> {
        let s = self.symbol("alt");
        for a in alternatives {
            self.rule(s, a)?;
        }
        Ok(s)
    }

    /// `item` or nothing.
    pub fn optional(&mut self, item: SymIdx) -> Built<SymIdx> {
        self.alt(vec![vec![], vec![item]])
    }

    /// Zero or more `item`s.
    pub fn star(&mut self, item: SymIdx) -> Built<SymIdx> {
        let s = self.symbol("star");
        self.rule(s, vec![])?;
        self.rule(s, vec![s, item])?;
        Ok(s)
    }

    /// The finished grammar, within llguidance's default size limits.
    pub fn finish(self) -> Built<BuiltGrammar> {
        if self.spec.cost() > self.limits.initial_lexer_fuel {
            return unsupported("lexer too big");
        }
        if self.grammar.num_symbols() > self.limits.max_grammar_size {
            return unsupported("grammar too big");
        }
        Ok(BuiltGrammar { grammar: self.grammar, lexer: self.spec, json_texts: self.json_texts })
    }
}

/// `content` as the body of a JSON string literal, quotes and escapes included.
pub fn json_quoted(content: RegexAst) -> RegexAst {
    RegexAst::JsonQuote(
        Box::new(content),
        JsonQuoteOptions { allowed_escapes: JSON_ESCAPES.to_string(), raw_mode: false },
    )
}
