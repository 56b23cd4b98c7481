//! A direct compiler for a small subset of llguidance's Lark dialect: one rule per line,
//! `name: alternatives` with quoted literals, `<|special|>` tokens, rule and terminal names,
//! `( … )` groups and `?`; terminals `NAME: /regex/`; `name[max_tokens=N]: /regex/`; and
//! `name: %json {schema}` for the JSON schemas `json_rules` handles. This is what the Kimi-K3
//! output grammars use. Anything else is `Unsupported`, and the caller hands the text to
//! llguidance's own (complete, slower) Lark front end instead.

use std::collections::HashMap;

use llguidance::derivre::RegexAst;
use llguidance::earley::SymIdx;
use llguidance::toktrie::TokTrie;

use super::json_rules::JsonRules;
use super::rules::{Built, BuiltGrammar, RuleBuilder, Unsupported, unsupported};

/// Longest grammar text this path takes (larger ones are not what it is for).
const MAX_TEXT: usize = 256 * 1024;

/// Deepest nesting of groups, and of rules referring to rules, this path follows: the parser
/// and the lowering recurse, and plugin-written grammars must not exhaust the host's stack.
const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq)]
enum Atom {
    Literal(String),
    Special(String),
    Name(String),
    Group(Vec<Vec<Expr>>),
}

#[derive(Debug, Clone, PartialEq)]
struct Expr {
    atom: Atom,
    optional: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Body {
    Alternatives(Vec<Vec<Expr>>),
    Regex(String),
    Json(serde_json::Value),
}

#[derive(Debug)]
struct RuleDef {
    max_tokens: Option<usize>,
    body: Body,
}

/// Builds `text` into llguidance's internal grammar form, or says why this path does not apply.
pub fn compile(text: &str, trie: &TokTrie) -> Built<BuiltGrammar> {
    if text.len() > MAX_TEXT {
        return unsupported("grammar text too long");
    }
    let (rules, terminals) = parse(text)?;
    if !rules.contains_key("start") {
        return unsupported("no start rule");
    }
    let mut lower = Lower {
        b: RuleBuilder::new(trie)?,
        rules,
        terminals,
        done: HashMap::new(),
        terminal_syms: HashMap::new(),
        json: JsonRules::default(),
        depth: 0,
    };
    let body = lower.rule("start")?;
    let start = lower.b.start();
    lower.b.rule(start, vec![body])?;
    lower.b.finish()
}

fn parse(text: &str) -> Built<(HashMap<String, RuleDef>, HashMap<String, String>)> {
    let mut rules = HashMap::new();
    let mut terminals = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((head, body)) = line.split_once(':') else {
            return unsupported(format!("not a rule: {line}"));
        };
        let (name, max_tokens) = match head.split_once('[') {
            Some((name, attr)) => {
                let n = attr
                    .strip_prefix("max_tokens=")
                    .and_then(|a| a.strip_suffix(']'))
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&n| n > 0);
                match n {
                    Some(n) => (name, Some(n)),
                    None => return unsupported(format!("rule attribute {attr}")),
                }
            }
            None => (head, None),
        };
        let body = body.trim();
        if is_terminal_name(name) {
            if max_tokens.is_some() {
                return unsupported("max_tokens on a terminal");
            }
            let Some(rx) = whole_regex(body) else {
                return unsupported(format!("terminal {name} is not one regex"));
            };
            if terminals.insert(name.to_string(), rx).is_some() {
                return unsupported(format!("terminal {name} defined twice"));
            }
        } else if is_rule_name(name) {
            let body = if let Some(schema) = body.strip_prefix("%json") {
                let v: serde_json::Value =
                    serde_json::from_str(schema).map_err(|e| Unsupported(format!("%json: {e}")))?;
                Body::Json(v)
            } else if let Some(rx) = whole_regex(body) {
                Body::Regex(rx)
            } else {
                Body::Alternatives(Tokens::new(body).alternatives_to_end()?)
            };
            if max_tokens.is_some() && !matches!(body, Body::Regex(_)) {
                return unsupported("max_tokens on a rule that is not one regex");
            }
            if rules.insert(name.to_string(), RuleDef { max_tokens, body }).is_some() {
                return unsupported(format!("rule {name} defined twice"));
            }
        } else {
            return unsupported(format!("rule name {name:?}"));
        }
    }
    Ok((rules, terminals))
}

fn is_rule_name(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some('a'..='z' | '_')) && c.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn is_terminal_name(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some('A'..='Z')) && c.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// The regex of a body that is exactly `/…/` (no flags), as Lark keeps it (escapes included).
fn whole_regex(body: &str) -> Option<String> {
    let inner = body.strip_prefix('/')?.strip_suffix('/')?;
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next()?;
            }
            '/' => return None,
            _ => {}
        }
    }
    (!inner.is_empty()).then(|| inner.to_string())
}

/// Tokens of one rule body.
struct Tokens<'t> {
    rest: &'t str,
    depth: usize,
}

#[derive(Debug, PartialEq)]
enum Tok {
    Literal(String),
    Special(String),
    Name(String),
    Open,
    Close,
    Bar,
    Maybe,
}

impl<'t> Tokens<'t> {
    fn new(body: &'t str) -> Tokens<'t> {
        Tokens { rest: body, depth: 0 }
    }

    fn peek(&self) -> Built<Option<(Tok, &'t str)>> {
        let s = self.rest.trim_start();
        let Some(c) = s.chars().next() else {
            return Ok(None);
        };
        let one = |t: Tok| Ok(Some((t, &s[1..])));
        match c {
            '(' => one(Tok::Open),
            ')' => one(Tok::Close),
            '|' => one(Tok::Bar),
            '?' => one(Tok::Maybe),
            '"' => {
                let bytes = s.as_bytes();
                let mut i = 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' => i += 2,
                        b'"' => break,
                        _ => i += 1,
                    }
                }
                if i >= bytes.len() {
                    return unsupported("unterminated string");
                }
                let lit: String =
                    serde_json::from_str(&s[..=i]).map_err(|e| Unsupported(format!("string literal: {e}")))?;
                let rest = &s[i + 1..];
                // `"…"i` is a case-insensitive literal in Lark, not a literal and a name.
                if rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    return unsupported("literal flags");
                }
                Ok(Some((Tok::Literal(lit), rest)))
            }
            '<' => {
                let end = s.find('>').ok_or_else(|| Unsupported("unterminated special token".into()))?;
                let name = &s[..=end];
                if name[1..end].contains(['<', '[']) || name.chars().any(char::is_whitespace) {
                    return unsupported(format!("token form {name}"));
                }
                Ok(Some((Tok::Special(name.to_string()), &s[end + 1..])))
            }
            _ if c.is_ascii_alphabetic() || c == '_' => {
                let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
                let name = &s[..end];
                if !(is_rule_name(name) || is_terminal_name(name)) {
                    return unsupported(format!("name {name}"));
                }
                Ok(Some((Tok::Name(name.to_string()), &s[end..])))
            }
            _ => unsupported(format!("syntax at {:?}", s.chars().take(20).collect::<String>())),
        }
    }

    fn next(&mut self) -> Built<Option<Tok>> {
        Ok(self.peek()?.map(|(t, rest)| {
            self.rest = rest;
            t
        }))
    }

    fn alternatives_to_end(mut self) -> Built<Vec<Vec<Expr>>> {
        let alts = self.alternatives()?;
        match self.next()? {
            None => Ok(alts),
            Some(t) => unsupported(format!("unexpected {t:?}")),
        }
    }

    /// `seq ('|' seq)*`, stopping before `)` or the end.
    fn alternatives(&mut self) -> Built<Vec<Vec<Expr>>> {
        let mut alts = vec![self.sequence()?];
        while matches!(self.peek()?, Some((Tok::Bar, _))) {
            self.next()?;
            alts.push(self.sequence()?);
        }
        Ok(alts)
    }

    fn sequence(&mut self) -> Built<Vec<Expr>> {
        let mut seq = Vec::new();
        loop {
            let atom = match self.peek()? {
                None | Some((Tok::Bar | Tok::Close, _)) => return Ok(seq),
                Some((Tok::Maybe, _)) => return unsupported("'?' without an operand"),
                Some(_) => match self.next()? {
                    Some(Tok::Literal(s)) => Atom::Literal(s),
                    Some(Tok::Special(s)) => Atom::Special(s),
                    Some(Tok::Name(s)) => Atom::Name(s),
                    Some(Tok::Open) => {
                        self.depth += 1;
                        if self.depth > MAX_DEPTH {
                            return unsupported("groups nested too deeply");
                        }
                        let inner = self.alternatives()?;
                        self.depth -= 1;
                        if self.next()? != Some(Tok::Close) {
                            return unsupported("unclosed group");
                        }
                        Atom::Group(inner)
                    }
                    _ => return unsupported("syntax"),
                },
            };
            let optional = matches!(self.peek()?, Some((Tok::Maybe, _)));
            if optional {
                self.next()?;
            }
            seq.push(Expr { atom, optional });
        }
    }
}

/// Lowers parsed rules onto the builder, on demand from `start` (as llguidance does: rules not
/// reachable from `start` add nothing).
struct Lower<'a> {
    b: RuleBuilder<'a>,
    rules: HashMap<String, RuleDef>,
    terminals: HashMap<String, String>,
    done: HashMap<String, SymIdx>,
    terminal_syms: HashMap<String, SymIdx>,
    json: JsonRules,
    depth: usize,
}

impl Lower<'_> {
    fn rule(&mut self, name: &str) -> Built<SymIdx> {
        if let Some(&s) = self.done.get(name) {
            return Ok(s);
        }
        let Some(def) = self.rules.remove(name) else {
            return unsupported(format!("undefined rule {name}"));
        };
        let sym = self.b.symbol(name);
        self.done.insert(name.to_string(), sym);
        match def.body {
            Body::Regex(rx) => self.b.lexeme_into(sym, RegexAst::Regex(rx), def.max_tokens)?,
            Body::Json(schema) => {
                let v = self.json.compile(&mut self.b, &schema)?;
                self.b.rule(sym, vec![v])?;
            }
            Body::Alternatives(alts) => {
                for alt in alts {
                    let rhs = self.sequence(alt)?;
                    self.b.rule(sym, rhs)?;
                }
            }
        }
        Ok(sym)
    }

    fn sequence(&mut self, seq: Vec<Expr>) -> Built<Vec<SymIdx>> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return unsupported("rules nested too deeply");
        }
        let rhs = self.sequence_at_depth(seq);
        self.depth -= 1;
        rhs
    }

    fn sequence_at_depth(&mut self, seq: Vec<Expr>) -> Built<Vec<SymIdx>> {
        let mut rhs = Vec::with_capacity(seq.len());
        for e in seq {
            let s = match e.atom {
                Atom::Literal(s) => self.b.literal(&s)?,
                Atom::Special(s) => self.b.special(&s)?,
                Atom::Name(n) if is_terminal_name(&n) => self.terminal(&n)?,
                Atom::Name(n) => self.rule(&n)?,
                Atom::Group(alts) => {
                    let mut lowered = Vec::with_capacity(alts.len());
                    for a in alts {
                        lowered.push(self.sequence(a)?);
                    }
                    self.b.alt(lowered)?
                }
            };
            rhs.push(if e.optional { self.b.optional(s)? } else { s });
        }
        Ok(rhs)
    }

    fn terminal(&mut self, name: &str) -> Built<SymIdx> {
        if let Some(&s) = self.terminal_syms.get(name) {
            return Ok(s);
        }
        let Some(rx) = self.terminals.get(name).cloned() else {
            return unsupported(format!("undefined terminal {name}"));
        };
        let s = self.b.lexeme(RegexAst::Regex(rx), None)?;
        self.terminal_syms.insert(name.to_string(), s);
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_subset_and_refuses_the_rest() {
        let (rules, terms) = parse(
            "start: a? (b | \"x\\\"y\") <|open|>\nTEXT: /(?s:.*)/\nt[max_tokens=5]: /a+/\nj: %json {\"type\": \"integer\"}",
        )
        .unwrap();
        assert_eq!(terms["TEXT"], "(?s:.*)");
        assert_eq!(rules["t"].max_tokens, Some(5));
        let Body::Alternatives(alts) = &rules["start"].body else { panic!("start is a sequence") };
        assert_eq!(alts.len(), 1);
        assert_eq!(alts[0].len(), 3);
        assert!(alts[0][0].optional);
        assert_eq!(alts[0][2].atom, Atom::Special("<|open|>".into()));
        let Atom::Group(g) = &alts[0][1].atom else { panic!("group") };
        assert_eq!(g[1][0].atom, Atom::Literal("x\"y".into()));
        for bad in [
            "start: a*",
            "start: \"a\"i",
            "start: /inline/ \"x\"",
            "start: a\n  | b",
            "start: <[1-5]>",
            "%ignore \" \"",
            "start: x\nx[stop=\"a\"]: /b/",
            "start: @sub",
            "start: (a",
            "T[max_tokens=2]: /a/",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
