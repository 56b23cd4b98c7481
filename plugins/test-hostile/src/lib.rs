//! A sampler that misbehaves on request, for the host's sandbox tests. The sequence's params are
//! the behaviour: `loop` (never returns), `grow` (allocates until memory runs out), `panic`,
//! `bad-token` (returns an id past the vocabulary), `count` (returns how many rows this instance
//! has sampled — instance-global state, to show tenants never share instances), anything else:
//! the argmax.

use std::cell::Cell;

use kimi_plugin::sampler::exports::kimi::host::sampler_plugin::{Capabilities, Guest, GuestSequence, Row, Sequence};
use kimi_plugin::sampler::kimi::host::logits::StepLogits;
use kimi_plugin::sampler::kimi::host::tokenizer;
use kimi_plugin::sampler::kimi::host::types::{PluginError, RequestInfo};

thread_local! {
    static SAMPLED: Cell<u32> = const { Cell::new(0) };
}

struct Hostile;

struct Seq(String);

impl Guest for Hostile {
    type Sequence = Seq;

    fn describe() -> Capabilities {
        Capabilities { name: "test-hostile".into(), max_candidates: 4, full_logits: false, argmax_invariant: false }
    }

    fn sample(rows: Vec<Row<'_>>, _logits: &StepLogits) -> Vec<Result<u32, PluginError>> {
        let mut out = Vec::new();
        for row in rows {
            let seq: &Seq = row.seq.get();
            match seq.0.as_str() {
                "loop" => {
                    let mut x = 1u64;
                    loop {
                        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                    }
                }
                "grow" => {
                    // Zeroed blocks come straight from `memory.grow` without being written, so the
                    // cap is reached in microseconds even on a loaded machine (not the deadline).
                    let mut hoard: Vec<Vec<u8>> = Vec::new();
                    loop {
                        hoard.push(vec![0u8; 1 << 20]);
                        std::hint::black_box(&hoard);
                    }
                }
                "panic" => panic!("test-hostile was asked to panic"),
                "bad-token" => out.push(Ok(tokenizer::vocab_size() + 5)),
                "count" => {
                    let n = SAMPLED.with(|c| {
                        c.set(c.get() + 1);
                        c.get()
                    });
                    out.push(Ok(n));
                }
                _ => out.push(Ok(row.stats.argmax)),
            }
        }
        out
    }
}

impl GuestSequence for Seq {
    fn create(_req: RequestInfo, params_json: String, _seed: u64) -> Result<Sequence, PluginError> {
        Ok(Sequence::new(Seq(params_json.trim().trim_matches('"').to_string())))
    }

    fn accept(&self, _ids: Vec<u32>) {}

    fn rollback(&self, _n: u32) {}

    fn fork(&self, _seed: u64) -> Sequence {
        Sequence::new(Seq(self.0.clone()))
    }
}

kimi_plugin::sampler::export_sampler!(Hostile);
