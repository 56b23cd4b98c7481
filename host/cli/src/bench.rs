//! `kimi-host bench forward`: prefill and decode speed of the CPU engine, with this machine's
//! measured memory read bandwidth in the same run as the baseline (decode is bandwidth-bound, so
//! "effective weight bandwidth ÷ measured bandwidth" is the figure of merit).

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use kimi_host::model::checkpoint::Checkpoint;
use kimi_host::model::{LogitsFor, Model, ModelError};

#[derive(Debug, Serialize)]
pub struct ForwardBench {
    pub simd: &'static str,
    pub threads: usize,
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub prefill_seconds: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_seconds: f64,
    pub decode_tokens_per_s: f64,
    /// Weight bytes one decode token reads (non-routed weights except the embedding table, plus
    /// top-k/E of the routed experts).
    pub weight_bytes_per_decode_token: u64,
    pub effective_weight_gb_per_s: f64,
    pub measured_read_gb_per_s: f64,
    pub decode_bandwidth_ratio: f64,
}

/// Best-of-3 multithreaded read bandwidth over a buffer of `bytes`.
pub fn measure_read_bandwidth(bytes: usize) -> f64 {
    let words = vec![1u64; bytes / 8];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = words.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max(bytes as f64 / secs / 1e9);
    }
    best
}

fn decode_bytes_per_token(dir: &Path, model: &Model) -> Result<u64, ModelError> {
    let ck = Checkpoint::open(dir)?;
    let c = model.text_config();
    let mut total = 0u64;
    let mut routed = 0u64;
    for (name, info) in ck.tensors() {
        if name.contains("embed_tokens") {
            continue;
        }
        if name.contains(".experts.") {
            routed += info.nbytes() as u64;
        } else {
            total += info.nbytes() as u64;
        }
    }
    let share = if c.num_experts > 0 { routed * c.experts_per_token as u64 / c.num_experts as u64 } else { 0 };
    Ok(total + share)
}

pub fn bench_forward(dir: &Path, prompt_len: usize, decode: usize) -> Result<ForwardBench, ModelError> {
    let model = Model::load(dir)?;
    let c = model.text_config();
    // Deterministic pseudo-random prompt over the ordinary (non-special) ids.
    let ordinary = c.vocab_size.saturating_sub(256).max(1) as u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let prompt: Vec<u32> = (0..prompt_len.max(1))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % ordinary) as u32
        })
        .collect();
    let mut state = model.new_state();
    let t = Instant::now();
    let mut logits = model.forward(&prompt, &mut state, LogitsFor::LastToken, None)?;
    let prefill = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..decode {
        let next = argmax(&logits) as u32;
        logits = model.forward(&[next], &mut state, LogitsFor::LastToken, None)?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let bytes = decode_bytes_per_token(dir, &model)?;
    let decode_tps = if decode > 0 { decode as f64 / decode_s } else { 0.0 };
    let eff = bytes as f64 * decode_tps / 1e9;
    let bw = measure_read_bandwidth(1 << 29);
    Ok(ForwardBench {
        simd: kimi_kernels::simd_level().name(),
        threads: rayon::current_num_threads(),
        prompt_len: prompt.len(),
        decode_steps: decode,
        prefill_seconds: prefill,
        prefill_tokens_per_s: prompt.len() as f64 / prefill,
        decode_seconds: decode_s,
        decode_tokens_per_s: decode_tps,
        weight_bytes_per_decode_token: bytes,
        effective_weight_gb_per_s: eff,
        measured_read_gb_per_s: bw,
        decode_bandwidth_ratio: eff / bw,
    })
}

/// Index of the largest value (first on ties; NaN never wins).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] || v[best].is_nan() {
            best = i;
        }
    }
    best
}

impl std::fmt::Display for ForwardBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simd {} · {} threads", self.simd, self.threads)?;
        writeln!(
            f,
            "prefill {:>6} tokens: {:>10.1} tokens/s ({:.3} s)",
            self.prompt_len, self.prefill_tokens_per_s, self.prefill_seconds
        )?;
        writeln!(
            f,
            "decode  {:>6} steps:  {:>10.2} tokens/s ({:.2} ms/token)",
            self.decode_steps,
            self.decode_tokens_per_s,
            1e3 / self.decode_tokens_per_s.max(1e-12)
        )?;
        writeln!(
            f,
            "decode reads {:.2} MB of weights per token → {:.2} GB/s effective; measured read bandwidth {:.2} GB/s; ratio {:.3}",
            self.weight_bytes_per_decode_token as f64 / 1e6,
            self.effective_weight_gb_per_s,
            self.measured_read_gb_per_s,
            self.decode_bandwidth_ratio
        )
    }
}
