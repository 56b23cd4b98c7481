//! Locally typical sampling (Meister et al., 2022) as a kimi-host sampler plugin.
//!
//! For each step: take the candidates the host sends (the largest logits), compute their
//! probabilities at the requested temperature with the host's exact normaliser, measure each
//! token's surprisal distance from the distribution's entropy |−log p − H|, keep the closest
//! tokens until their mass reaches `typical_p`, and draw from those with the sequence's seeded RNG.
//!
//! Parameters (JSON): `{"temperature": 1.0, "typical_p": 0.9}`.

use std::cell::RefCell;

use kimi_plugin::sampler::exports::kimi::host::sampler_plugin::{Capabilities, Guest, GuestSequence, Row, Sequence};
use kimi_plugin::sampler::kimi::host::logits::StepLogits;
use kimi_plugin::sampler::kimi::host::types::{PluginError, RequestInfo};

/// Candidates per row: the tail beyond these holds negligible mass for any useful temperature.
const CANDIDATES: u32 = 512;

struct Typical;

struct State {
    temperature: f32,
    typical_p: f64,
    rng: u64,
}

struct Seq(RefCell<State>);

/// Reads one number field from a flat JSON object (keeps the example dependency-free).
fn field(json: &str, key: &str) -> Option<f64> {
    let at = json.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest.find([',', '}', ' ', '\n']).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn next_f64(state: &mut u64) -> f64 {
    // splitmix64
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

impl Guest for Typical {
    type Sequence = Seq;

    fn describe() -> Capabilities {
        Capabilities { name: "typical-sampler".into(), max_candidates: CANDIDATES, full_logits: false, argmax_invariant: true }
    }

    fn sample(rows: Vec<Row<'_>>, logits: &StepLogits) -> Vec<Result<u32, PluginError>> {
        rows.into_iter()
            .enumerate()
            .map(|(i, row)| {
                let seq: &Seq = row.seq.get();
                let mut st = seq.0.borrow_mut();
                if row.candidates.tokens.is_empty() {
                    return Err(PluginError::Internal("no candidates".into()));
                }
                if st.temperature <= 0.0 {
                    return Ok(row.stats.argmax);
                }
                let t = st.temperature;
                // Exact log-normaliser over the whole row, computed by the host.
                let log_z = logits.log_sum_exp(i as u32, t) as f64;
                let c = &row.candidates;
                let probs: Vec<(u32, f64)> =
                    c.tokens.iter().zip(&c.logits).map(|(&tok, &l)| (tok, ((l / t) as f64 - log_z).exp())).collect();
                let entropy: f64 = probs.iter().filter(|p| p.1 > 0.0).map(|p| -p.1 * p.1.ln()).sum();
                let mut by_typicality: Vec<(u32, f64, f64)> =
                    probs.iter().map(|&(tok, p)| (tok, p, (-p.ln() - entropy).abs())).collect();
                by_typicality.sort_by(|a, b| a.2.total_cmp(&b.2).then(a.0.cmp(&b.0)));
                let mut kept = Vec::new();
                let mut mass = 0.0;
                for (tok, p, _) in by_typicality {
                    kept.push((tok, p));
                    mass += p;
                    if mass >= st.typical_p {
                        break;
                    }
                }
                let u = next_f64(&mut st.rng) * mass;
                let mut acc = 0.0;
                for &(tok, p) in &kept {
                    acc += p;
                    if u < acc {
                        return Ok(tok);
                    }
                }
                Ok(kept[kept.len() - 1].0)
            })
            .collect()
    }
}

impl GuestSequence for Seq {
    fn create(_req: RequestInfo, params_json: String, seed: u64) -> Result<Sequence, PluginError> {
        let temperature = field(&params_json, "temperature").unwrap_or(1.0) as f32;
        let typical_p = field(&params_json, "typical_p").unwrap_or(0.9);
        if !(typical_p > 0.0 && typical_p <= 1.0) {
            return Err(PluginError::BadConfig(format!("typical_p must be in (0, 1], got {typical_p}")));
        }
        Ok(Sequence::new(Seq(RefCell::new(State { temperature, typical_p, rng: seed }))))
    }

    fn accept(&self, _ids: Vec<u32>) {}

    fn rollback(&self, _n: u32) {}

    fn fork(&self, seed: u64) -> Sequence {
        let s = self.0.borrow();
        Sequence::new(Seq(RefCell::new(State { temperature: s.temperature, typical_p: s.typical_p, rng: seed })))
    }
}

kimi_plugin::sampler::export_sampler!(Typical);
