//! The standard sampler: repetition / frequency / presence penalties, logit bias, temperature,
//! top-k, top-p, min-p — computed exactly over a *candidate list* (the largest logits) plus the
//! few tokens penalties and biases touch, asking the logits source for more candidates only when
//! a token outside the list could still be chosen. The full row is never copied.
//!
//! Pure Rust with no dependencies: the `sampler-standard` plugin runs it inside Wasm against the
//! host's `step-logits` resource; the host runs the same code natively as its fallback sampler.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;

/// Where logits come from (the host resource inside a plugin; a slice natively).
pub trait LogitsSource {
    fn vocab_size(&self) -> u32;
    /// The `k` largest logits, descending (ties: lower id first).
    fn top_k(&mut self, k: u32) -> Vec<(u32, f32)>;
    fn gather(&mut self, ids: &[u32]) -> Vec<f32>;
    /// log Σ exp(logit / t) over the whole row.
    fn log_sum_exp(&mut self, t: f32) -> f32;
}

/// Sampling parameters resolved (defaults applied, ranges checked by `kimi-sampling-params`,
/// their one definition; OpenAI / vLLM names and meanings).
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// 0 → greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 → off.
    pub top_k: u32,
    pub min_p: f32,
    /// Subtracted once from tokens that occur in the output.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output.
    pub frequency_penalty: f32,
    /// > 1 discourages tokens of prompt and output (positive logits divided, negative multiplied).
    pub repetition_penalty: f32,
    /// Added to the logit of a token.
    pub logit_bias: BTreeMap<u32, f32>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: BTreeMap::new(),
        }
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible everywhere.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// How often a token occurs: in the output (frequency / presence penalties) and anywhere in the
/// prompt or output (repetition penalty).
#[derive(Clone, Copy, Debug, Default)]
struct Occurrences {
    output: u32,
    any: u32,
}

/// A hasher for token ids: ids are small distinct integers, so one multiply spreads them well,
/// and it needs no random seed (a Wasm guest has no entropy source).
#[derive(Clone, Copy, Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, x: u32) {
        self.0 = (x as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// A row's sampling distribution (see [`SeqState::distribution`]): `tokens[i]` has probability
/// `probs[i]`; every other token has the tail's probability, or 0 without a tail.
#[derive(Clone, Debug, PartialEq)]
pub struct Distribution {
    pub tokens: Vec<u32>,
    pub probs: Vec<f32>,
    pub tail: Option<Tail>,
}

/// Tokens outside a distribution's list: probability exp(raw logit / temperature − log_z).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tail {
    pub temperature: f32,
    pub log_z: f64,
}

impl Distribution {
    /// The whole row's probabilities, given the row the distribution was computed over.
    pub fn dense(&self, logits: &[f32]) -> Vec<f32> {
        let mut out: Vec<f32> = match self.tail {
            Some(Tail { temperature, log_z }) => logits
                .iter()
                .map(|&l| {
                    let p = ((l / temperature) as f64 - log_z).exp() as f32;
                    if p.is_finite() { p } else { 0.0 }
                })
                .collect(),
            None => vec![0.0; logits.len()],
        };
        for (&id, &p) in self.tokens.iter().zip(&self.probs) {
            if let Some(o) = out.get_mut(id as usize) {
                *o = p;
            }
        }
        out
    }
}

/// A step's common start (see `SeqState::begin`).
struct Step {
    vocab: u32,
    adj_ids: Vec<u32>,
    marks: IdMarks,
    changed: Vec<(u32, f32, f32)>,
    adjusted: Vec<(u32, f32)>,
    cands: Vec<(u32, f32)>,
    k: u32,
    greedy: bool,
    t: f32,
    log_z: f64,
}

/// Per-sequence state: token occurrences for the penalties (kept up to date on every accept and
/// rollback, so a step costs time in the number of distinct tokens, not the sequence length),
/// and the RNG.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub params: Params,
    pub rng: Rng,
    tokens: Vec<u32>,
    prompt_len: Option<usize>,
    occurrences: IdMap<Occurrences>,
}

impl SeqState {
    pub fn new(params: Params, seed: u64) -> SeqState {
        SeqState { params, rng: Rng::new(seed), tokens: Vec::new(), prompt_len: None, occurrences: IdMap::default() }
    }

    /// Appends tokens (before the first `sample`, they are the prompt).
    pub fn accept(&mut self, ids: &[u32]) {
        let output = self.prompt_len.is_some();
        for &t in ids {
            let o = self.occurrences.entry(t).or_default();
            o.any += 1;
            o.output += output as u32;
        }
        self.tokens.extend_from_slice(ids);
    }

    /// Forgets the last `n` generated tokens (never the prompt).
    pub fn rollback(&mut self, n: usize) {
        let floor = self.prompt_len.unwrap_or(0);
        let keep = self.tokens.len().saturating_sub(n).max(floor);
        for &t in &self.tokens[keep..] {
            if let Some(o) = self.occurrences.get_mut(&t) {
                o.any -= 1;
                o.output = o.output.saturating_sub(1);
                if o.any == 0 {
                    self.occurrences.remove(&t);
                }
            }
        }
        self.tokens.truncate(keep);
    }

    pub fn fork(&self, seed: u64) -> SeqState {
        SeqState { rng: Rng::new(seed), ..self.clone() }
    }

    /// The tokens whose logits this step changes, sorted by id, with (output count, occurs in
    /// prompt or output).
    fn adjusted_tokens(&self, vocab: u32) -> Vec<(u32, u32, bool)> {
        let p = &self.params;
        let repetition = p.repetition_penalty != 1.0;
        let counted = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let mut v: Vec<(u32, u32, bool)> = Vec::new();
        if repetition || counted {
            v.extend(
                self.occurrences
                    .iter()
                    .filter(|(_, o)| repetition || o.output > 0)
                    .map(|(&t, o)| (t, if counted { o.output } else { 0 }, o.any > 0)),
            );
        }
        for &t in p.logit_bias.keys() {
            let o = self.occurrences.get(&t).copied().unwrap_or_default();
            v.push((t, if counted { o.output } else { 0 }, o.any > 0));
        }
        v.retain(|a| a.0 < vocab);
        v.sort_unstable_by_key(|a| a.0);
        v.dedup_by_key(|a| a.0);
        v
    }

    fn adjust(&self, token: u32, raw: f32, count: u32, seen: bool) -> f32 {
        let p = &self.params;
        let mut l = raw;
        if seen && p.repetition_penalty != 1.0 {
            l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
        }
        if count > 0 {
            l -= p.frequency_penalty * count as f32 + p.presence_penalty;
        }
        if let Some(b) = p.logit_bias.get(&token) {
            l += b;
        }
        l
    }

    /// Chooses the next token. `candidates`: the source's largest logits, descending (may be
    /// empty; more are fetched when needed).
    ///
    /// Exactness: the distribution is defined over the whole vocabulary in canonical order
    /// (adjusted logit descending, then id). Tokens outside the candidate list are unadjusted and
    /// no larger than the list's last raw logit, so the list's tokens at or above that bound are a
    /// prefix of the canonical order; every filter and the final draw (one uniform number per
    /// step, reused when the list grows) work on that prefix and fetch more candidates whenever
    /// the answer could lie beyond it.
    pub fn sample(&mut self, src: &mut dyn LogitsSource, candidates: Vec<(u32, f32)>) -> Result<u32, String> {
        let step = self.begin(src, candidates)?;
        let u = if step.greedy { 0.0 } else { self.rng.next_f64() };
        let r = self.draw(
            src,
            &step.marks,
            &step.adjusted,
            step.cands,
            step.k,
            step.t,
            step.log_z,
            u,
            step.vocab,
            step.greedy,
        );
        step.marks.finish(&step.adj_ids);
        r
    }

    /// What `sample` would draw from, without drawing (the RNG is untouched): the kept tokens
    /// with their probabilities, or — when no filter cuts the vocabulary (no top-k, top-p or
    /// min-p) — the tokens this step adjusts with theirs and a tail rule for all the others.
    /// Token for token the same probabilities `sample` draws with.
    pub fn distribution(
        &mut self,
        src: &mut dyn LogitsSource,
        candidates: Vec<(u32, f32)>,
    ) -> Result<Distribution, String> {
        let step = self.begin(src, candidates)?;
        let r = self.describe(src, &step);
        step.marks.finish(&step.adj_ids);
        r
    }

    /// The part of a step both `sample` and `distribution` start with: the adjusted tokens and
    /// their logits, the first candidate list and the normaliser.
    fn begin(&mut self, src: &mut dyn LogitsSource, candidates: Vec<(u32, f32)>) -> Result<Step, String> {
        if self.prompt_len.is_none() {
            self.prompt_len = Some(self.tokens.len());
        }
        let vocab = src.vocab_size();
        if vocab == 0 {
            return Err("empty vocabulary".into());
        }
        let adj = self.adjusted_tokens(vocab);
        let adj_ids: Vec<u32> = adj.iter().map(|a| a.0).collect();
        let mut marks = ADJUSTED_MARKS.with(|m| m.take());
        marks.set(&adj_ids, vocab);
        let adj_raw = src.gather(&adj_ids);
        // (id, raw, adjusted) for every token this step changes.
        let changed: Vec<(u32, f32, f32)> = adj
            .iter()
            .zip(&adj_raw)
            .map(|(&(id, count, seen), &raw)| (id, raw, self.adjust(id, raw, count, seen)))
            .collect();
        // The adjusted tokens in canonical order (adjusted logit descending, then id).
        let mut adjusted: Vec<(u32, f32)> =
            changed.iter().map(|&(id, _, a)| (id, a)).filter(|c| !c.1.is_nan()).collect();
        adjusted.sort_unstable_by(canonical);
        let mut cands = candidates;
        let k = (cands.len() as u32).max(64.min(vocab));
        if cands.len() < k as usize {
            cands = src.top_k(k);
        }
        let greedy = self.params.temperature < 1e-5;
        let t = if greedy { 1.0 } else { self.params.temperature };
        let log_z = if greedy {
            0.0
        } else {
            // Z = Z_full − Σ_adj e^{raw/t} + Σ_adj e^{adj/t}, relative to e^{lse_full}.
            let lse_full = src.log_sum_exp(t) as f64;
            let mut z_rel = 1.0f64;
            for &(_, raw, a) in &changed {
                if !raw.is_nan() {
                    z_rel += ((a / t) as f64 - lse_full).exp() - ((raw / t) as f64 - lse_full).exp();
                }
            }
            lse_full + z_rel.max(f64::MIN_POSITIVE).ln()
        };
        Ok(Step { vocab, adj_ids, marks, changed, adjusted, cands, k, greedy, t, log_z })
    }

    /// `distribution`'s walk: the canonical-order list grows until the kept set is known.
    fn describe(&self, src: &mut dyn LogitsSource, step: &Step) -> Result<Distribution, String> {
        let (vocab, t, log_z) = (step.vocab, step.t, step.log_z);
        let mut cands = step.cands.clone();
        let mut k = step.k;
        let p = &self.params;
        let unfiltered = !(p.top_k > 0 && p.top_k < vocab) && p.top_p >= 1.0 && p.min_p <= 0.0;
        loop {
            let Known { list, outside_max, sure: walk, complete } =
                known(&mut cands, k, vocab, &step.marks, &step.adjusted)?;
            if walk == 0 {
                k = grow(k, vocab);
                cands = src.top_k(k);
                continue;
            }
            if step.greedy {
                return Ok(Distribution { tokens: vec![list[0].0], probs: vec![1.0], tail: None });
            }
            if unfiltered && !complete {
                // Every token is kept: the changed tokens explicitly (a NaN one with 0), the
                // rest by the tail rule, which is how `sample` weighs them too.
                let (tokens, probs) = step
                    .changed
                    .iter()
                    .map(|&(id, _, a)| (id, if a.is_nan() { 0.0 } else { ((a / t) as f64 - log_z).exp() as f32 }))
                    .unzip();
                return Ok(Distribution { tokens, probs, tail: Some(Tail { temperature: t, log_z }) });
            }
            let mut lazy = LazyProbs { list: &list[..walk], t, log_z, probs: Vec::new() };
            let (kept, exact) = self.kept_set(&mut lazy, complete, vocab, outside_max);
            if exact {
                let z = lazy.sum(kept);
                let probs = (0..kept).map(|i| (lazy.get(i) / z) as f32).collect();
                return Ok(Distribution { tokens: list[..kept].iter().map(|c| c.0).collect(), probs, tail: None });
            }
            k = grow(k.max(p.top_k), vocab);
            cands = src.top_k(k);
        }
    }

    /// The draw of `sample` over the growing candidate list (`marks`: the adjusted tokens).
    #[allow(clippy::too_many_arguments)]
    fn draw(
        &mut self,
        src: &mut dyn LogitsSource,
        marks: &IdMarks,
        adjusted: &[(u32, f32)],
        mut cands: Vec<(u32, f32)>,
        mut k: u32,
        t: f32,
        log_z: f64,
        mut u: f64,
        vocab: u32,
        greedy: bool,
    ) -> Result<u32, String> {
        // Set once a draw has been read in whole-vocabulary probability units (see below).
        let mut full_units = false;
        loop {
            let Known { list, outside_max, sure: walk, complete } = known(&mut cands, k, vocab, marks, adjusted)?;
            if walk == 0 {
                k = grow(k, vocab);
                cands = src.top_k(k);
                continue;
            }
            if greedy {
                return Ok(list[0].0);
            }
            // Probabilities are computed lazily: most steps stop after a handful of tokens.
            let mut lazy = LazyProbs { list: &list[..walk], t, log_z, probs: Vec::new() };
            let (kept, exact) = self.kept_set(&mut lazy, complete, vocab, outside_max);
            if exact && !full_units {
                // The kept set is known: draw within it.
                let target = u * lazy.sum(kept);
                // Past the end only by rounding: the last kept token.
                return Ok(list[lazy.pick(kept, target).unwrap_or(kept - 1)].0);
            }
            // The kept set may reach past the list (or the draw started that way): read the draw
            // in whole-vocabulary units, where each token's interval is fixed by the canonical
            // order alone. A draw inside a token surely kept picks it; one past the kept set is
            // rejected and redrawn — so token i comes out with probability p_i / P(kept), exactly,
            // without fetching more candidates unless the draw lands beyond what is known.
            full_units = true;
            if let Some(i) = lazy.pick(kept, u) {
                return Ok(list[i].0);
            }
            if exact {
                u = self.rng.next_f64();
                full_units = false;
                continue;
            }
            k = grow(k.max(self.params.top_k), vocab);
            cands = src.top_k(k);
        }
    }

    /// How many leading tokens of `list` (the canonical-order prefix known so far) the filters
    /// keep, and whether that is the whole kept set (`true`) or only the part of it known to be
    /// kept while it may reach past the list (`false`). Filters: top-k, then top-p over the top-k
    /// renormalised mass, then min-p relative to the top token.
    fn kept_set(&self, lazy: &mut LazyProbs<'_>, complete: bool, vocab: u32, outside_max: f32) -> (usize, bool) {
        let p = &self.params;
        let len = lazy.list.len();
        let mut bound = len;
        let mut exact = complete;
        let top_k_on = p.top_k > 0 && p.top_k < vocab;
        if top_k_on && (p.top_k as usize) <= bound {
            bound = p.top_k as usize;
            exact = true;
        }
        if p.top_p < 1.0 {
            // The top-k mass is exact once its cut is known, else at least the known part.
            let norm: f64 = if top_k_on { lazy.sum(bound) } else { 1.0 };
            let norm_exact = exact || !top_k_on;
            let mut cum = 0.0;
            let target = p.top_p as f64 * norm;
            let cut = (0..bound).find(|&i| {
                cum += lazy.get(i);
                cum >= target
            });
            if let Some(i) = cut {
                // With only a lower bound on the mass, the cut could lie further on.
                bound = i + 1;
                exact |= norm_exact;
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p as f64 * lazy.get(0);
            let c = (1..bound).find(|&i| lazy.get(i) < floor).unwrap_or(bound);
            if c < bound {
                bound = c;
                exact = true;
            } else if !exact && bound == len && ((outside_max / lazy.t) as f64 - lazy.log_z).exp() < floor {
                // Nothing past the list can pass min-p.
                exact = true;
            }
        }
        (bound, exact)
    }
}

/// A set of token ids as one bit per vocabulary entry, kept per thread and reused: `sample`
/// marks the step's adjusted tokens, tests every candidate against them, and clears them again
/// (a binary search per candidate was about a quarter of a step).
#[derive(Default)]
struct IdMarks(Vec<u64>);

impl IdMarks {
    fn set(&mut self, ids: &[u32], vocab: u32) {
        let words = (vocab as usize).div_ceil(64);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        for &id in ids {
            if let Some(w) = self.0.get_mut(id as usize / 64) {
                *w |= 1 << (id % 64);
            }
        }
    }

    fn contains(&self, id: u32) -> bool {
        self.0.get(id as usize / 64).is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    /// Clears the marks of `ids` and hands the set back to this thread's slot.
    fn finish(mut self, ids: &[u32]) {
        self.clear(ids);
        ADJUSTED_MARKS.with(|m| m.replace(self));
    }

    /// Clears the bits of `ids` (those `set` marked), leaving every word zero.
    fn clear(&mut self, ids: &[u32]) {
        for &id in ids {
            if let Some(w) = self.0.get_mut(id as usize / 64) {
                *w = 0;
            }
        }
    }
}

thread_local! {
    static ADJUSTED_MARKS: std::cell::Cell<IdMarks> = const { std::cell::Cell::new(IdMarks(Vec::new())) };
}

/// What a candidate list tells of the canonical order (see `SeqState::sample`).
struct Known {
    /// The candidates without the adjusted tokens, merged with the adjusted ones.
    list: Vec<(u32, f32)>,
    /// No token outside the list has a larger logit (−∞ once the list is the whole row).
    outside_max: f32,
    /// How many leading tokens of `list` are surely the canonical order's first.
    sure: usize,
    /// The candidates are the whole row.
    complete: bool,
}

/// Sorts the `k` candidates (if the source did not) and reads them as [`Known`].
fn known(
    cands: &mut [(u32, f32)],
    k: u32,
    vocab: u32,
    marks: &IdMarks,
    adjusted: &[(u32, f32)],
) -> Result<Known, String> {
    let complete = k >= vocab;
    if !cands.is_sorted_by(|a, b| canonical(a, b).is_le()) {
        cands.sort_unstable_by(canonical);
    }
    let list = merge_canonical(
        cands.iter().copied().filter(|c| !c.1.is_nan() && !marks.contains(c.0)),
        adjusted,
        cands.len() + adjusted.len(),
    );
    if list.is_empty() {
        return Err("no finite logits".into());
    }
    let outside_max = if complete { f32::NEG_INFINITY } else { cands.last().map_or(f32::INFINITY, |c| c.1) };
    let sure = if complete { list.len() } else { list.iter().take_while(|c| c.1 >= outside_max).count() };
    Ok(Known { list, outside_max, sure, complete })
}

/// The next candidate count when the list is too short.
fn grow(k: u32, vocab: u32) -> u32 {
    k.saturating_mul(4).min(vocab)
}

/// Canonical order: logit descending, then id ascending.
fn canonical(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Merges two lists that are each in canonical order.
fn merge_canonical(a: impl Iterator<Item = (u32, f32)>, b: &[(u32, f32)], capacity: usize) -> Vec<(u32, f32)> {
    let mut out = Vec::with_capacity(capacity);
    let mut b = b.iter().copied().peekable();
    for x in a {
        while let Some(y) = b.next_if(|y| canonical(y, &x).is_lt()) {
            out.push(y);
        }
        out.push(x);
    }
    out.extend(b);
    out
}

/// Probabilities of a sorted candidate prefix, computed on first use.
struct LazyProbs<'a> {
    list: &'a [(u32, f32)],
    t: f32,
    log_z: f64,
    probs: Vec<f64>,
}

impl LazyProbs<'_> {
    fn get(&mut self, i: usize) -> f64 {
        while self.probs.len() <= i {
            let c = self.list[self.probs.len()];
            self.probs.push(((c.1 / self.t) as f64 - self.log_z).exp());
        }
        self.probs[i]
    }

    /// The first of the leading `n` tokens whose cumulative probability exceeds `target`.
    fn pick(&mut self, n: usize, target: f64) -> Option<usize> {
        let mut acc = 0.0;
        (0..n).find(|&i| {
            acc += self.get(i);
            target < acc
        })
    }

    fn sum(&mut self, n: usize) -> f64 {
        if n > 0 {
            self.get(n - 1);
        }
        self.probs[..n].iter().sum()
    }
}

/// A plain slice as a logits source (the host's native path and tests).
pub struct SliceLogits<'a>(pub &'a [f32]);

impl LogitsSource for SliceLogits<'_> {
    fn vocab_size(&self) -> u32 {
        self.0.len() as u32
    }

    fn top_k(&mut self, k: u32) -> Vec<(u32, f32)> {
        top_k(self.0, k as usize)
    }

    fn gather(&mut self, ids: &[u32]) -> Vec<f32> {
        ids.iter().map(|&i| self.0.get(i as usize).copied().unwrap_or(f32::NAN)).collect()
    }

    fn log_sum_exp(&mut self, t: f32) -> f32 {
        log_sum_exp(self.0, t)
    }
}

/// The `k` largest values with their indices, descending (ties: lower index first). One pass
/// with a size-k min-heap: almost every element fails the threshold test, so a 163,840-entry row
/// costs about one comparison per entry.
pub fn top_k(v: &[f32], k: usize) -> Vec<(u32, f32)> {
    use std::cmp::{Ordering, Reverse};
    use std::collections::BinaryHeap;

    /// Orders by value, then by lower index first (so the heap's minimum is the entry to evict).
    #[derive(PartialEq)]
    struct Entry(f32, u32);
    impl Eq for Entry {}
    impl PartialOrd for Entry {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Entry {
        fn cmp(&self, o: &Self) -> Ordering {
            self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
        }
    }

    let k = k.min(v.len());
    if k == 0 {
        return Vec::new();
    }
    let mut heap: BinaryHeap<Reverse<Entry>> = BinaryHeap::with_capacity(k + 1);
    let mut floor = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x.is_nan() || (heap.len() == k && x <= floor) {
            continue;
        }
        heap.push(Reverse(Entry(x, i as u32)));
        if heap.len() > k {
            heap.pop();
        }
        if heap.len() == k {
            floor = heap.peek().map_or(f32::NEG_INFINITY, |e| e.0.0);
        }
    }
    let mut out: Vec<(u32, f32)> = heap.into_iter().map(|Reverse(Entry(x, i))| (i, x)).collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

/// log Σ exp(v / t).
pub fn log_sum_exp(v: &[f32], t: f32) -> f32 {
    let m = v.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = v.iter().filter(|x| !x.is_nan()).map(|&x| (((x - m) / t) as f64).exp()).sum();
    (m / t) + s.ln() as f32
}
