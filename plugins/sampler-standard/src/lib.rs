//! `builtin:sampler-standard`: the OpenAI / vLLM sampling parameters over the host's candidate
//! list (see `kimi-sampling-core`), deterministic under the host-supplied seed. It exports
//! `speculation` too (world `speculative-sampler`), so speculative decoding draws drafts from
//! and verifies them against exactly the distribution `sample` draws from.

use std::cell::{Cell, RefCell};

// The bindings of the `speculative-sampler` world, generated here: `kimi-plugin` generates the
// plain `sampler` world, and one crate cannot export the same interface's macros twice.
wit_bindgen::generate!({
    path: "../../wit",
    world: "speculative-sampler",
});

use exports::kimi::host::sampler_plugin::{Capabilities, Guest, GuestSequence, Row, Sequence};
use exports::kimi::host::speculation::{self, Distribution, SpecRow, Tail};
use kimi::host::logits::StepLogits;
use kimi::host::tokenizer;
use kimi::host::types::{PluginError, RequestInfo};
use kimi_sampling_core::{LogitsSource, Params, SeqState};
use kimi_sampling_params::SamplingParams;

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

/// The request's standard sampling parameters (their one definition: `kimi-sampling-params`, which
/// the server checked them with too) resolved to the algorithm's form.
fn parse(params_json: &str) -> Result<Params, PluginError> {
    let w: SamplingParams = if params_json.trim().is_empty() {
        SamplingParams::default()
    } else {
        serde_json::from_str(params_json).map_err(|e| PluginError::BadConfig(format!("sampling parameters: {e}")))?
    };
    w.check(vocab()).map_err(|e| PluginError::BadConfig(e.message))?;
    Ok(Params {
        temperature: w.temperature(),
        top_p: w.top_p(),
        top_k: w.top_k(),
        min_p: w.min_p(),
        presence_penalty: w.presence_penalty(),
        frequency_penalty: w.frequency_penalty(),
        repetition_penalty: w.repetition_penalty(),
        logit_bias: w.logit_bias_ids(vocab()).map_err(|e| PluginError::BadConfig(e.message))?,
    })
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

impl speculation::Guest for Standard {
    fn distributions(
        seq: speculation::SequenceBorrow<'_>,
        drafts: Vec<u32>,
        rows: Vec<SpecRow>,
        logits: &StepLogits,
    ) -> Result<Vec<Distribution>, PluginError> {
        let seq: &Seq = seq.get();
        let mut state = seq.0.borrow_mut();
        // Draft tokens are accepted for the rows after them and rolled back before returning, so
        // the state ends as it began (the penalties count them as output meanwhile).
        let mut applied = 0usize;
        let mut out = Vec::with_capacity(rows.len());
        let mut failure = None;
        for (i, row) in rows.into_iter().enumerate() {
            let before = row.drafts_before as usize;
            if before > drafts.len() {
                failure = Some(PluginError::BadConfig(format!("row {i} follows {before} drafts of {}", drafts.len())));
                break;
            }
            if before >= applied {
                state.accept(&drafts[applied..before]);
            } else {
                state.rollback(applied - before);
            }
            applied = before;
            let c = row.candidates;
            let cands = c.tokens.into_iter().zip(c.logits).collect();
            match state.distribution(&mut HostLogits(logits, i as u32), cands) {
                Ok(d) => out.push(Distribution {
                    tokens: d.tokens,
                    probs: d.probs,
                    tail: d.tail.map(|t| Tail { temperature: t.temperature, log_z: t.log_z }),
                }),
                Err(e) => {
                    failure = Some(PluginError::Internal(e));
                    break;
                }
            }
        }
        state.rollback(applied);
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
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

export!(Standard);
