//! `builtin:sampler-standard`: the OpenAI / vLLM sampling parameters over the host's candidate
//! list (see `kimi-sampling-core`), deterministic under the host-supplied seed.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use kimi_plugin::sampler::exports::kimi::host::sampler_plugin::{Capabilities, Guest, GuestSequence, Row, Sequence};
use kimi_plugin::sampler::kimi::host::logits::StepLogits;
use kimi_plugin::sampler::kimi::host::tokenizer;
use kimi_plugin::sampler::kimi::host::types::{PluginError, RequestInfo};
use kimi_sampling_core::{LogitsSource, Params, SeqState};
use serde::Deserialize;

/// Candidates requested per row: enough for typical top-p / min-p without a second round trip.
const CANDIDATES: u32 = 256;

thread_local! {
    static VOCAB: Cell<u32> = const { Cell::new(0) };
}

fn vocab() -> u32 {
    VOCAB.with(|v| {
        if v.get() == 0 {
            v.set(tokenizer::vocab_size());
        }
        v.get()
    })
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Wire {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
}

fn parse(params_json: &str) -> Result<Params, PluginError> {
    let w: Wire = if params_json.trim().is_empty() {
        Wire::default()
    } else {
        serde_json::from_str(params_json).map_err(|e| PluginError::BadConfig(format!("sampling parameters: {e}")))?
    };
    let d = Params::default();
    let mut logit_bias = BTreeMap::new();
    for (k, v) in w.logit_bias.unwrap_or_default() {
        let id: u32 =
            k.parse().map_err(|_| PluginError::BadConfig(format!("logit_bias key `{k}` is not a token id")))?;
        if id >= vocab() {
            return Err(PluginError::BadConfig(format!("logit_bias token {id} is outside the vocabulary")));
        }
        logit_bias.insert(id, v);
    }
    let p = Params {
        temperature: w.temperature.unwrap_or(d.temperature),
        top_p: w.top_p.unwrap_or(d.top_p),
        top_k: match w.top_k {
            None => 0,
            Some(k) if k <= 0 => 0,
            Some(k) => k.min(u32::MAX as i64) as u32,
        },
        min_p: w.min_p.unwrap_or(d.min_p),
        presence_penalty: w.presence_penalty.unwrap_or(0.0),
        frequency_penalty: w.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: w.repetition_penalty.unwrap_or(1.0),
        logit_bias,
    };
    p.validate().map_err(PluginError::BadConfig)?;
    Ok(p)
}

/// The host's `step-logits` resource as a logits source.
struct HostLogits<'a>(&'a StepLogits, u32);

impl LogitsSource for HostLogits<'_> {
    fn vocab_size(&self) -> u32 {
        vocab()
    }

    fn top_k(&mut self, k: u32) -> Vec<(u32, f32)> {
        let c = self.0.top_k(self.1, k);
        c.tokens.into_iter().zip(c.logits).collect()
    }

    fn gather(&mut self, ids: &[u32]) -> Vec<f32> {
        if ids.is_empty() { Vec::new() } else { self.0.gather(self.1, ids) }
    }

    fn log_sum_exp(&mut self, t: f32) -> f32 {
        self.0.log_sum_exp(self.1, t)
    }
}

struct Standard;

struct Seq(RefCell<SeqState>);

impl Guest for Standard {
    type Sequence = Seq;

    fn describe() -> Capabilities {
        Capabilities {
            name: "sampler-standard".into(),
            max_candidates: CANDIDATES,
            full_logits: false,
            argmax_invariant: true,
        }
    }

    fn sample(rows: Vec<Row<'_>>, logits: &StepLogits) -> Vec<Result<u32, PluginError>> {
        rows.into_iter()
            .enumerate()
            .map(|(i, row)| {
                let seq: &Seq = row.seq.get();
                let c = row.candidates;
                let cands = c.tokens.into_iter().zip(c.logits).collect();
                seq.0.borrow_mut().sample(&mut HostLogits(logits, i as u32), cands).map_err(PluginError::Internal)
            })
            .collect()
    }
}

impl GuestSequence for Seq {
    fn create(_req: RequestInfo, params_json: String, seed: u64) -> Result<Sequence, PluginError> {
        Ok(Sequence::new(Seq(RefCell::new(SeqState::new(parse(&params_json)?, seed)))))
    }

    fn accept(&self, ids: Vec<u32>) {
        self.0.borrow_mut().accept(&ids);
    }

    fn rollback(&self, n: u32) {
        self.0.borrow_mut().rollback(n as usize);
    }

    fn fork(&self, seed: u64) -> Sequence {
        Sequence::new(Seq(RefCell::new(self.0.borrow().fork(seed))))
    }
}

kimi_plugin::sampler::export_sampler!(Standard);
