//! The standard sampler: repetition / frequency / presence penalties, logit bias, temperature,
//! top-k, top-p, min-p — computed exactly over a *candidate list* (the largest logits) plus the
//! few tokens penalties and biases touch, asking the logits source for more candidates only when
//! a token outside the list could still be chosen. The full row is never copied.
//!
//! Pure Rust with no dependencies: the `sampler-standard` plugin runs it inside Wasm against the
//! host's `step-logits` resource; the host runs the same code natively as its fallback sampler.

use std::collections::BTreeMap;

/// Where logits come from (the host resource inside a plugin; a slice natively).
pub trait LogitsSource {
    fn vocab_size(&self) -> u32;
    /// The `k` largest logits, descending (ties: lower id first).
    fn top_k(&mut self, k: u32) -> Vec<(u32, f32)>;
    fn gather(&mut self, ids: &[u32]) -> Vec<f32>;
    /// log Σ exp(logit / t) over the whole row.
    fn log_sum_exp(&mut self, t: f32) -> f32;
}

/// Sampling parameters (OpenAI / vLLM names and meanings).
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

impl Params {
    /// Checks ranges; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature must be ≥ 0, got {t}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (id, b) in &self.logit_bias {
            if !(-100.0..=100.0).contains(b) {
                return Err(format!("logit_bias[{id}] must be in [-100, 100], got {b}"));
            }
        }
        Ok(())
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

/// Per-sequence state: token counts for the penalties, and the RNG.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub params: Params,
    pub rng: Rng,
    tokens: Vec<u32>,
    prompt_len: Option<usize>,
}

impl SeqState {
    pub fn new(params: Params, seed: u64) -> SeqState {
        SeqState { params, rng: Rng::new(seed), tokens: Vec::new(), prompt_len: None }
    }

    /// Appends tokens (before the first `sample`, they are the prompt).
    pub fn accept(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// Forgets the last `n` generated tokens (never the prompt).
    pub fn rollback(&mut self, n: usize) {
        let floor = self.prompt_len.unwrap_or(0);
        let keep = self.tokens.len().saturating_sub(n).max(floor);
        self.tokens.truncate(keep);
    }

    pub fn fork(&self, seed: u64) -> SeqState {
        SeqState { rng: Rng::new(seed), ..self.clone() }
    }

    fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len.unwrap_or(self.tokens.len())..]
    }

    /// The tokens whose logits this step changes, with their adjustment applied to a raw logit.
    fn adjustments(&self) -> BTreeMap<u32, (u32, bool)> {
        // token → (output count, occurs in prompt or output)
        let mut m: BTreeMap<u32, (u32, bool)> = BTreeMap::new();
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.tokens {
                m.entry(t).or_default().1 = true;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for &t in self.output() {
                m.entry(t).or_default().0 += 1;
            }
        }
        for &t in p.logit_bias.keys() {
            m.entry(t).or_default();
        }
        m
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
        if self.prompt_len.is_none() {
            self.prompt_len = Some(self.tokens.len());
        }
        let vocab = src.vocab_size();
        if vocab == 0 {
            return Err("empty vocabulary".into());
        }
        let adj = self.adjustments();
        let adj_ids: Vec<u32> = adj.keys().copied().filter(|&t| t < vocab).collect();
        let adj_raw = src.gather(&adj_ids);
        let adj_val: Vec<f32> = adj_ids
            .iter()
            .zip(&adj_raw)
            .map(|(&id, &raw)| {
                let (count, seen) = adj[&id];
                self.adjust(id, raw, count, seen)
            })
            .collect();
        let mut cands = candidates;
        let mut k = (cands.len() as u32).max(64.min(vocab));
        if cands.len() < k as usize {
            cands = src.top_k(k);
        }
        let greedy = self.params.temperature < 1e-5;
        let t = if greedy { 1.0 } else { self.params.temperature };
        let (log_z, u) = if greedy {
            (0.0, 0.0)
        } else {
            // Z = Z_full − Σ_adj e^{raw/t} + Σ_adj e^{adj/t}, relative to e^{lse_full}.
            let lse_full = src.log_sum_exp(t) as f64;
            let mut z_rel = 1.0f64;
            for (raw, a) in adj_raw.iter().zip(&adj_val) {
                if !raw.is_nan() {
                    z_rel += ((a / t) as f64 - lse_full).exp() - ((raw / t) as f64 - lse_full).exp();
                }
            }
            (lse_full + z_rel.max(f64::MIN_POSITIVE).ln(), self.rng.next_f64())
        };
        let p = self.params.clone();
        loop {
            let complete = k >= vocab;
            let mut list: Vec<(u32, f32)> = Vec::with_capacity(cands.len() + adj_ids.len());
            list.extend(cands.iter().copied().filter(|c| !adj.contains_key(&c.0)));
            list.extend(adj_ids.iter().copied().zip(adj_val.iter().copied()));
            list.retain(|c| !c.1.is_nan());
            if !adj_ids.is_empty() {
                // Candidates arrive sorted; only the adjusted tokens need placing.
                list.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            }
            if list.is_empty() {
                return Err("no finite logits".into());
            }
            let outside_max = if complete { f32::NEG_INFINITY } else { cands.last().map_or(f32::INFINITY, |c| c.1) };
            // The canonical-order prefix this list is sure of.
            let walk = if complete { list.len() } else { list.iter().take_while(|c| c.1 >= outside_max).count() };
            let grow = |k: u32| (k.saturating_mul(4)).min(vocab);
            if greedy {
                if walk > 0 {
                    return Ok(list[0].0);
                }
                k = grow(k);
                cands = src.top_k(k);
                continue;
            }
            // Probabilities are computed lazily: most steps stop after a handful of tokens.
            let mut lazy = LazyProbs { list: &list[..walk], t, log_z, probs: Vec::new() };
            let mut keep = walk;
            let mut truncated = false;
            let mut need_more = false;
            if p.top_k > 0 && p.top_k < vocab {
                if (p.top_k as usize) <= walk {
                    keep = p.top_k as usize;
                    truncated = true;
                } else if !complete {
                    need_more = true;
                }
            }
            if !need_more && p.top_p < 1.0 {
                let norm: f64 = if truncated { lazy.sum(keep) } else { 1.0 };
                let mut cum = 0.0;
                let mut cut = None;
                for i in 0..keep {
                    cum += lazy.get(i) / norm;
                    if cum >= p.top_p as f64 {
                        cut = Some(i + 1);
                        break;
                    }
                }
                match cut {
                    Some(c) => {
                        keep = c;
                        truncated = true;
                    }
                    None if !truncated && !complete => need_more = true,
                    None => {}
                }
            }
            if !need_more && p.min_p > 0.0 && keep > 0 {
                let floor = p.min_p as f64 * lazy.get(0);
                let outside_p = if complete { 0.0 } else { ((outside_max / t) as f64 - log_z).exp() };
                if !truncated && !complete && outside_p >= floor {
                    need_more = true;
                } else {
                    let mut c = 1;
                    while c < keep && lazy.get(c) >= floor {
                        c += 1;
                    }
                    keep = c;
                    truncated = true;
                }
            }
            if need_more || keep == 0 {
                k = grow(k.max(p.top_k));
                cands = src.top_k(k);
                continue;
            }
            let target = if truncated { u * lazy.sum(keep) } else { u };
            let mut acc = 0.0;
            for (i, c) in list[..keep].iter().enumerate() {
                acc += lazy.get(i);
                if target < acc {
                    return Ok(c.0);
                }
            }
            if truncated || complete {
                // Rounding left the draw just past the last kept token.
                return Ok(list[keep - 1].0);
            }
            k = grow(k);
            cands = src.top_k(k);
        }
    }
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
