//! JSON Schema → grammar rules on a `RuleBuilder`, for the schemas tool arguments usually have:
//! objects (properties in order, required / optional, additional properties), arrays with item
//! counts, strings with lengths, integers and integer-bounded numbers, booleans, null, enum,
//! const and anyOf. Output is compact (no whitespace), as the Kimi verifier wants. Anything else
//! (`$ref`, `pattern`, `format`, `oneOf`, fractional bounds, …) is `Unsupported`, and the whole
//! constraint goes to llguidance's own JSON compiler instead.
//!
//! The languages are subsets of the valid JSON for each schema (numbers never use exponents;
//! no `-0`), never supersets: every accepted text validates.

use llguidance::derivre::RegexAst;
use llguidance::earley::SymIdx;
use llguidance::toktrie::TokTrie;
use serde_json::{Map, Value};

use super::rules::{Built, BuiltGrammar, RuleBuilder, json_quoted, unsupported};

/// Keywords this compiler understands (annotations included). Any other keyword sends the
/// schema to llguidance.
const KNOWN: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "anyOf",
    "description",
    "title",
    "default",
    "examples",
    "$schema",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
];

const ANNOTATIONS: &[&str] =
    &["description", "title", "default", "examples", "$schema", "$comment", "deprecated", "readOnly", "writeOnly"];

/// Deepest schema nesting compiled here.
const MAX_DEPTH: usize = 32;
/// Longest bounded string / most array items written out as counted repetitions.
const MAX_LENGTH: u64 = 10_000;
const MAX_OPTIONAL_ITEMS: u64 = 64;

const UNBOUNDED_INTEGER: &str = "-?(0|[1-9][0-9]*)";
const UNBOUNDED_NUMBER: &str = "-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?";

/// A whole constraint that is one JSON value under `schema`, in llguidance's internal form.
pub fn compile_schema(schema: &Value, trie: &TokTrie) -> Built<BuiltGrammar> {
    let mut b = RuleBuilder::new(trie)?;
    let value = JsonRules::default().compile(&mut b, schema)?;
    let start = b.start();
    b.rule(start, vec![value])?;
    b.finish()
}

/// Symbols shared by every schema of one grammar.
#[derive(Default)]
pub struct JsonRules {
    any: Option<SymIdx>,
}

impl JsonRules {
    /// A value under `schema` (a `%json` body: llguidance's `x-guidance` key may only ask for
    /// compact output, which is what this compiler writes).
    pub fn compile(&mut self, b: &mut RuleBuilder, schema: &Value) -> Built<SymIdx> {
        let mut schema = schema.clone();
        if let Some(o) = schema.as_object_mut()
            && let Some(g) = o.remove("x-guidance")
            && g != serde_json::json!({"whitespace_flexible": false})
        {
            return unsupported(format!("x-guidance {g}"));
        }
        self.value(b, &schema, 0)
    }

    fn value(&mut self, b: &mut RuleBuilder, schema: &Value, depth: usize) -> Built<SymIdx> {
        if depth > MAX_DEPTH {
            return unsupported("schema nesting too deep");
        }
        let o = match schema {
            Value::Bool(true) => return self.any(b),
            Value::Object(o) => o,
            _ => return unsupported("schema is not an object or true"),
        };
        if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return unsupported(format!("keyword {k}"));
        }
        let validating: Vec<&str> =
            o.keys().map(String::as_str).filter(|k| !ANNOTATIONS.contains(k) && *k != "type").collect();
        if o.contains_key("enum") || o.contains_key("const") {
            if validating.len() > 1 {
                return unsupported("enum / const with other keywords");
            }
            let values: Vec<Value> = match (o.get("enum"), o.get("const")) {
                (Some(Value::Array(v)), None) => v.clone(),
                (None, Some(c)) => vec![c.clone()],
                _ => return unsupported("enum is not an array"),
            };
            let types = types_of(o)?;
            let mut alts = Vec::new();
            for v in values.iter().filter(|v| types.as_ref().is_none_or(|t| t.iter().any(|t| has_type(v, t)))) {
                let text = serde_json::to_string(v).map_err(|e| super::rules::Unsupported(e.to_string()))?;
                alts.push(vec![b.literal(&text)?]);
            }
            if alts.is_empty() {
                return unsupported("no enum value has the schema's type");
            }
            return b.alt(alts);
        }
        if let Some(any_of) = o.get("anyOf") {
            if validating.len() > 1 || o.contains_key("type") {
                return unsupported("anyOf with other keywords");
            }
            let Some(options) = any_of.as_array().filter(|a| !a.is_empty()) else {
                return unsupported("anyOf is not a non-empty array");
            };
            let mut alts = Vec::new();
            for s in options {
                alts.push(vec![self.value(b, s, depth + 1)?]);
            }
            return b.alt(alts);
        }
        match types_of(o)? {
            None if validating.is_empty() => self.any(b),
            None => unsupported("validation keywords without a type"),
            Some(types) => {
                let mut alts = Vec::new();
                for t in &types {
                    alts.push(vec![self.typed(b, o, t, depth)?]);
                }
                if alts.len() == 1 { Ok(alts[0][0]) } else { b.alt(alts) }
            }
        }
    }

    fn typed(&mut self, b: &mut RuleBuilder, o: &Map<String, Value>, ty: &str, depth: usize) -> Built<SymIdx> {
        match ty {
            "null" => b.literal("null"),
            "boolean" => b.lexeme(RegexAst::Regex("true|false".into()), None),
            "integer" => {
                let (lo, hi) = integer_bounds(o)?;
                b.lexeme(RegexAst::Regex(integer_rx(lo, hi)?), None)
            }
            "number" => b.lexeme(RegexAst::Regex(number_rx(o)?), None),
            "string" => {
                let min = count(o, "minLength")?.unwrap_or(0);
                let max = count(o, "maxLength")?;
                if max.is_some_and(|m| m < min || m > MAX_LENGTH) || min > MAX_LENGTH {
                    return unsupported("string length bounds");
                }
                b.json_string(min, max)
            }
            "array" => self.array(b, o, depth),
            "object" => self.object(b, o, depth),
            other => unsupported(format!("type {other}")),
        }
    }

    fn array(&mut self, b: &mut RuleBuilder, o: &Map<String, Value>, depth: usize) -> Built<SymIdx> {
        let item = match o.get("items") {
            None => self.any(b)?,
            Some(s @ (Value::Object(_) | Value::Bool(true))) => self.value(b, s, depth + 1)?,
            Some(_) => return unsupported("items is not one schema"),
        };
        let min = count(o, "minItems")?.unwrap_or(0);
        let max = count(o, "maxItems")?;
        if max.is_some_and(|m| m < min) || min > MAX_OPTIONAL_ITEMS {
            return unsupported("array item bounds");
        }
        let open = b.literal("[")?;
        let close = b.literal("]")?;
        if max == Some(0) {
            return b.seq(vec![open, close]);
        }
        let comma = b.literal(",")?;
        let comma_item = b.seq(vec![comma, item])?;
        // item (, item){min-1} then the optional rest.
        let mut list = vec![item];
        for _ in 1..min.max(1) {
            list.push(comma_item);
        }
        match max {
            None => list.push(b.star(comma_item)?),
            Some(max) => {
                let extra = max - min.max(1);
                if extra > MAX_OPTIONAL_ITEMS {
                    return unsupported("too many optional array items");
                }
                let mut chain: Option<SymIdx> = None;
                for _ in 0..extra {
                    let inner = match chain {
                        Some(c) => b.seq(vec![comma_item, c])?,
                        None => comma_item,
                    };
                    chain = Some(b.optional(inner)?);
                }
                list.extend(chain);
            }
        }
        let list = b.seq(list)?;
        let body = if min == 0 { b.optional(list)? } else { list };
        b.seq(vec![open, body, close])
    }

    fn object(&mut self, b: &mut RuleBuilder, o: &Map<String, Value>, depth: usize) -> Built<SymIdx> {
        let empty = Map::new();
        let props = match o.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return unsupported("properties is not an object"),
        };
        let required: Vec<&str> = match o.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => r
                .iter()
                .map(|k| k.as_str().ok_or(()))
                .collect::<Result<_, _>>()
                .or(unsupported("required is not a list of names"))?,
            Some(_) => return unsupported("required is not a list"),
        };
        if let Some(k) = required.iter().find(|k| !props.contains_key(**k)) {
            return unsupported(format!("required property {k} is not declared"));
        }
        let comma = b.literal(",")?;
        let mut pairs = Vec::with_capacity(props.len());
        let mut taken = Vec::with_capacity(props.len());
        for (key, schema) in props {
            let quoted = serde_json::to_string(key).map_err(|e| super::rules::Unsupported(e.to_string()))?;
            let name = b.literal(&format!("{quoted}:"))?;
            let value = self.value(b, schema, depth + 1)?;
            pairs.push((b.seq(vec![name, value])?, required.contains(&key.as_str())));
            taken.push(RegexAst::Literal(quoted));
        }
        // Additional properties (allowed unless `false`), after the declared ones, never
        // repeating a declared name.
        let extra = match o.get("additionalProperties") {
            Some(Value::Bool(false)) => None,
            None | Some(Value::Bool(true)) => Some(self.any(b)?),
            Some(s @ Value::Object(_)) => Some(self.value(b, s, depth + 1)?),
            Some(_) => return unsupported("additionalProperties"),
        };
        let tail = match extra {
            None => [b.empty()?, b.empty()?],
            Some(value) => {
                let any_key = json_quoted(RegexAst::Regex("(?s:.*)".into()));
                let key_rx = if taken.is_empty() {
                    any_key
                } else {
                    RegexAst::And(vec![any_key, RegexAst::Not(Box::new(RegexAst::Or(taken)))])
                };
                let key = b.lexeme(key_rx, None)?;
                let colon = b.literal(":")?;
                let pair = b.seq(vec![key, colon, value])?;
                let more = b.seq(vec![comma, pair])?;
                let more = b.star(more)?;
                let first = b.seq(vec![pair, more])?;
                [b.optional(first)?, more]
            }
        };
        // rest[e]: the properties from i on, e = whether one was written before (needs a comma).
        let mut rest = tail;
        for &(pair, is_required) in pairs.iter().rev() {
            let mut next = [b.empty()?; 2];
            for (e, slot) in next.iter_mut().enumerate() {
                let mut with = if e == 1 { vec![comma] } else { vec![] };
                with.extend([pair, rest[1]]);
                *slot = if is_required { b.seq(with)? } else { b.alt(vec![with, vec![rest[e]]])? };
            }
            rest = next;
        }
        let open = b.literal("{")?;
        let close = b.literal("}")?;
        b.seq(vec![open, rest[0], close])
    }

    /// Any JSON value (compact).
    fn any(&mut self, b: &mut RuleBuilder) -> Built<SymIdx> {
        if let Some(a) = self.any {
            return Ok(a);
        }
        let any = b.symbol("any_json");
        self.any = Some(any);
        let string = b.json_string(0, None)?;
        let number = b.lexeme(RegexAst::Regex(UNBOUNDED_NUMBER.into()), None)?;
        let literal = b.lexeme(RegexAst::Regex("true|false|null".into()), None)?;
        let (open_o, close_o) = (b.literal("{")?, b.literal("}")?);
        let (open_a, close_a) = (b.literal("[")?, b.literal("]")?);
        let (colon, comma) = (b.literal(":")?, b.literal(",")?);
        let member = b.seq(vec![string, colon, any])?;
        let more_members = b.seq(vec![comma, member])?;
        let more_members = b.star(more_members)?;
        let object = b.alt(vec![vec![open_o, close_o], vec![open_o, member, more_members, close_o]])?;
        let more_items = b.seq(vec![comma, any])?;
        let more_items = b.star(more_items)?;
        let array = b.alt(vec![vec![open_a, close_a], vec![open_a, any, more_items, close_a]])?;
        for v in [object, array, string, number, literal] {
            b.rule(any, vec![v])?;
        }
        Ok(any)
    }
}

/// The schema's `type` as a list (None: not given).
fn types_of(o: &Map<String, Value>) -> Built<Option<Vec<String>>> {
    match o.get("type") {
        None => Ok(None),
        Some(Value::String(t)) => Ok(Some(vec![t.clone()])),
        Some(Value::Array(ts)) if !ts.is_empty() => ts
            .iter()
            .map(|t| t.as_str().map(str::to_string).ok_or(()))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .or(unsupported("type list")),
        Some(_) => unsupported("type"),
    }
}

fn has_type(v: &Value, ty: &str) -> bool {
    match ty {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        _ => false,
    }
}

/// A non-negative count keyword (`minLength`, `maxItems`, …).
fn count(o: &Map<String, Value>, key: &str) -> Built<Option<u64>> {
    match o.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n)),
            None => unsupported(format!("{key} is not a count")),
        },
    }
}

/// Largest magnitude handled exactly (beyond it bounds go to llguidance).
const MAX_BOUND: f64 = 9_007_199_254_740_992.0;

fn bound(o: &Map<String, Value>, key: &str) -> Built<Option<f64>> {
    match o.get(key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(f) if f.is_finite() && f.abs() <= MAX_BOUND => Ok(Some(f)),
            _ => unsupported(format!("{key} bound")),
        },
    }
}

fn integer_bounds(o: &Map<String, Value>) -> Built<(Option<i64>, Option<i64>)> {
    let mut lo = bound(o, "minimum")?.map(|f| f.ceil() as i64);
    let mut hi = bound(o, "maximum")?.map(|f| f.floor() as i64);
    if let Some(x) = bound(o, "exclusiveMinimum")? {
        let x = x.floor() as i64 + 1;
        lo = Some(lo.map_or(x, |l| l.max(x)));
    }
    if let Some(x) = bound(o, "exclusiveMaximum")? {
        let x = x.ceil() as i64 - 1;
        hi = Some(hi.map_or(x, |h| h.min(x)));
    }
    if let (Some(l), Some(h)) = (lo, hi)
        && l > h
    {
        return unsupported("empty integer range");
    }
    Ok((lo, hi))
}

/// Canonical decimal integers in [lo, hi] (no leading zeros, no `-0`).
fn integer_rx(lo: Option<i64>, hi: Option<i64>) -> Built<String> {
    if lo.is_none() && hi.is_none() {
        return Ok(UNBOUNDED_INTEGER.to_string());
    }
    let (lo, hi) = (lo.map(i128::from), hi.map(i128::from));
    let mut alts = Vec::new();
    // Non-negative part.
    if hi.is_none_or(|h| h >= 0) {
        alts.push(naturals(lo.map_or(0, |l| l.max(0)) as u128, hi.map(|h| h as u128)));
    }
    // Negative part: "-" and a magnitude in [max(1, -hi), -lo].
    if lo.is_none_or(|l| l < 0) {
        let m_lo = hi.map_or(1, |h| (-h).max(1)) as u128;
        alts.push(format!("-({})", naturals(m_lo, lo.map(|l| (-l) as u128))));
    }
    Ok(alts.into_iter().map(|a| format!("({a})")).collect::<Vec<_>>().join("|"))
}

/// Numbers in [minimum, maximum] for integer bounds: integer part and fraction (no exponent).
fn number_rx(o: &Map<String, Value>) -> Built<String> {
    let lo = bound(o, "minimum")?;
    let hi = bound(o, "maximum")?;
    if o.contains_key("exclusiveMinimum") || o.contains_key("exclusiveMaximum") {
        return unsupported("exclusive number bounds");
    }
    if lo.is_none() && hi.is_none() {
        return Ok(UNBOUNDED_NUMBER.to_string());
    }
    if lo.is_some_and(|l| l.fract() != 0.0) || hi.is_some_and(|h| h.fract() != 0.0) {
        return unsupported("fractional number bounds");
    }
    let (lo, hi) = (lo.map(|l| l as i128), hi.map(|h| h as i128));
    if let (Some(l), Some(h)) = (lo, hi)
        && l > h
    {
        return unsupported("empty number range");
    }
    const FRACTION: &str = "(\\.[0-9]+)?";
    const ZERO_FRACTION: &str = "(\\.0+)?";
    let mut alts = Vec::new();
    // x ≥ 0: an integer part in [a, hi-1] with any fraction, or exactly hi.
    if hi.is_none_or(|h| h >= 0) {
        let a = lo.map_or(0, |l| l.max(0)) as u128;
        match hi {
            None => alts.push(format!("({}){FRACTION}", naturals(a, None))),
            Some(h) => {
                let h = h as u128;
                if a < h {
                    alts.push(format!("({}){FRACTION}", naturals(a, Some(h - 1))));
                }
                alts.push(format!("{h}{ZERO_FRACTION}"));
            }
        }
    }
    // x < 0: "-" and a magnitude m.f with m ≥ -hi (so x ≤ hi) and m.f ≤ -lo.
    if lo.is_none_or(|l| l < 0) {
        let m_lo = hi.map_or(0, |h| (-h).max(0)) as u128;
        match lo {
            None => alts.push(format!("-({}){FRACTION}", naturals(m_lo, None))),
            Some(l) => {
                let big = (-l) as u128;
                if m_lo < big {
                    alts.push(format!("-({}){FRACTION}", naturals(m_lo, Some(big - 1))));
                }
                alts.push(format!("-{big}{ZERO_FRACTION}"));
            }
        }
    }
    Ok(alts.into_iter().map(|a| format!("({a})")).collect::<Vec<_>>().join("|"))
}

/// Canonical naturals in [lo, hi] (hi None: unbounded).
fn naturals(lo: u128, hi: Option<u128>) -> String {
    let digits = |n: u128| n.to_string().len();
    let mut alts = Vec::new();
    let top = hi.map_or(digits(lo), digits);
    for d in digits(lo)..=top {
        let first = if d == 1 { 0 } else { 10u128.pow(d as u32 - 1) };
        let last = 10u128.pow(d as u32) - 1;
        let a = lo.max(first);
        let b = hi.map_or(last, |h| h.min(last));
        if a <= b {
            alts.push(same_width(&a.to_string(), &b.to_string()));
        }
    }
    if hi.is_none() {
        // Every longer natural.
        alts.push(format!("[1-9][0-9]{{{},}}", top));
    }
    alts.join("|")
}

/// Digit strings of one width between `a` and `b` (inclusive; leading zeros as given).
fn same_width(a: &str, b: &str) -> String {
    if a.is_empty() {
        return String::new();
    }
    if a == b {
        return a.to_string();
    }
    let (fa, fb) = (a.as_bytes()[0] - b'0', b.as_bytes()[0] - b'0');
    let (ra, rb) = (&a[1..], &b[1..]);
    let n = ra.len();
    let any = |n: usize| if n == 0 { String::new() } else { format!("[0-9]{{{n}}}") };
    if fa == fb {
        return format!("{fa}({})", same_width(ra, rb));
    }
    if ra.bytes().all(|c| c == b'0') && rb.bytes().all(|c| c == b'9') {
        return format!("[{fa}-{fb}]{}", any(n));
    }
    let mut alts = vec![format!("{fa}({})", same_width(ra, &"9".repeat(n)))];
    if fa + 1 < fb {
        alts.push(format!("[{}-{}]{}", fa + 1, fb - 1, any(n)));
    }
    alts.push(format!("{fb}({})", same_width(&"0".repeat(n), rb)));
    alts.join("|")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(rx: &str, s: &str) -> bool {
        regex::Regex::new(&format!("^(?:{rx})$")).map(|r| r.is_match(s)).unwrap_or(false)
    }

    #[test]
    fn integer_ranges_are_exact() {
        for (lo, hi) in [
            (Some(1), Some(7)),
            (Some(0), Some(120)),
            (Some(-5), Some(5)),
            (Some(-130), Some(-7)),
            (Some(13), None),
            (None, Some(-3)),
            (Some(99), Some(1001)),
            (None, Some(42)),
        ] {
            let rx = integer_rx(lo, hi).unwrap();
            for n in -1500i64..=1500 {
                let want = lo.is_none_or(|l| n >= l) && hi.is_none_or(|h| n <= h);
                assert_eq!(matches(&rx, &n.to_string()), want, "{n} in {lo:?}..={hi:?}: {rx}");
            }
            for bad in ["01", "-0", "+1", "", "1.0"] {
                assert!(!matches(&rx, bad), "{bad} for {rx}");
            }
        }
    }

    #[test]
    fn bounded_numbers_stay_in_range() {
        for (lo, hi) in [
            (Some(0.0), Some(1.0)),
            (Some(-2.0), Some(3.0)),
            (Some(-9.0), Some(-4.0)),
            (Some(5.0), None),
            (None, Some(-1.0)),
        ] {
            let mut o = Map::new();
            if let Some(l) = lo {
                o.insert("minimum".into(), l.into());
            }
            if let Some(h) = hi {
                o.insert("maximum".into(), h.into());
            }
            let rx = number_rx(&o).unwrap();
            let mut accepted = 0;
            for i in -1200i64..=1200 {
                for text in [format!("{}", i as f64 / 100.0), format!("{}", i / 100), format!("{}.0", i / 100)] {
                    let x: f64 = text.parse().unwrap();
                    let ok = matches(&rx, &text);
                    if ok {
                        accepted += 1;
                        assert!(lo.is_none_or(|l| x >= l) && hi.is_none_or(|h| x <= h), "{text} accepted by {rx}");
                    } else if lo.is_none_or(|l| x >= l) && hi.is_none_or(|h| x <= h) && !text.starts_with("-0") {
                        panic!("{text} in range but refused by {rx}");
                    }
                }
            }
            assert!(accepted > 0);
        }
    }
}
