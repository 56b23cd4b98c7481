//! A sampler that misbehaves on request, for the host's sandbox tests. The sequence's params are
//! the behaviour: `loop` (never returns), `grow` (allocates until memory runs out), `panic`,
//! `bad-token` (returns an id past the vocabulary), `count` (returns how many rows this instance
//! has sampled — instance-global state, to show tenants never share instances), `residue`
//! (grows memory by 4 pages, returns how many bytes of them are not zero, then fills them — a
//! reused pool slot must come back as fresh as a new one), `log` (one log line), `log-flood`
//! (1000 log lines per row), anything else: the argmax.

use std::cell::Cell;

use kimi_plugin::sampler::exports::kimi::host::sampler_plugin::{Capabilities, Guest, GuestSequence, Row, Sequence};
use kimi_plugin::sampler::kimi::host::log;
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
                "residue" => out.push(Ok(scribble_on_fresh_pages(4))),
                "log" => {
                    log::emit(log::Level::Info, "test-hostile says hello");
                    out.push(Ok(row.stats.argmax));
                }
                "log-flood" => {
                    for i in 0..1000 {
                        log::emit(log::Level::Info, &format!("test-hostile flood line {i}"));
                    }
                    out.push(Ok(row.stats.argmax));
                }
                _ => out.push(Ok(row.stats.argmax)),
            }
        }
        out
    }
}

/// Grows linear memory by `pages` outside the allocator, counts the bytes that are not zero
/// (WebAssembly promises zero), and leaves every byte non-zero for whoever gets the memory next.
fn scribble_on_fresh_pages(pages: usize) -> u32 {
    let old = core::arch::wasm32::memory_grow(0, pages);
    if old == usize::MAX {
        return u32::MAX;
    }
    let base = (old * 65536) as *mut u8;
    let mut dirty = 0u32;
    for i in 0..pages * 65536 {
        // SAFETY: the bytes were just added by `memory.grow`; the allocator never hands them out.
        unsafe {
            let p = base.add(i);
            dirty += (p.read_volatile() != 0) as u32;
            p.write_volatile(0xAB);
        }
    }
    dirty
}

impl GuestSequence for Seq {
    fn create(_req: RequestInfo, params_json: String, _seed: u64) -> Result<Sequence, PluginError> {
        // A bare JSON string is the behaviour; through the server (an object of sampling params)
        // it is `sampler_params.hostile`.
        let mode = mode_in_object(&params_json).unwrap_or_else(|| params_json.trim().trim_matches('"').to_string());
        Ok(Sequence::new(Seq(mode)))
    }

    fn accept(&self, _ids: Vec<u32>) {}

    fn rollback(&self, _n: u32) {}

    fn fork(&self, _seed: u64) -> Sequence {
        Sequence::new(Seq(self.0.clone()))
    }
}

kimi_plugin::sampler::export_sampler!(Hostile);

/// The string value of a `"hostile"` key in a JSON object (a hand scan: this guest has no JSON
/// parser and needs none for one flat key).
fn mode_in_object(json: &str) -> Option<String> {
    let rest = &json[json.find("\"hostile\"")? + "\"hostile\"".len()..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_string())
}
