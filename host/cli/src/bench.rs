//! `kimi-host bench forward`: prefill and decode speed of the CPU engine, with this machine's
//! measured memory read bandwidth and f32 matrix-product peak in the same run as baselines: small
//! batches are bandwidth-bound ("effective weight bandwidth ÷ measured bandwidth"), large ones
//! compute-bound ("matrix-product GFLOP/s ÷ measured peak").

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use kimi_host::model::checkpoint::Checkpoint;
use kimi_host::model::plan::fp8_dense_target;
use kimi_host::model::profile::OpTimes;
use kimi_host::model::{LogitsFor, Model, ModelError, Parallelism, SeqInput, SequenceState, WeightFormat};
use kimi_kernels::{CpuBackend, ProfiledBackend};

#[derive(Debug, Serialize)]
pub struct ForwardBench {
    pub simd: &'static str,
    pub threads: usize,
    /// Tensor-parallel ranks (threads sharing `threads`).
    pub tensor_parallel: usize,
    /// Ranks of each context-parallel group (1: none); their collectives count in the totals.
    pub context_parallel: usize,
    pub prompt_len: usize,
    pub decode_steps: usize,
    /// One prompt alone.
    pub prefill_seconds: f64,
    pub prefill_tokens_per_s: f64,
    /// Share of the prefill's wall time per kind of op.
    pub prefill_op_shares: BTreeMap<&'static str, f64>,
    /// Decode of the first batch size (batch 1 by default), kept at the top for comparisons.
    pub decode_seconds: f64,
    pub decode_tokens_per_s: f64,
    /// Weight bytes one decode token reads alone (non-routed weights except the embedding table,
    /// plus top-k/E of the routed experts).
    pub weight_bytes_per_decode_token: u64,
    pub effective_weight_gb_per_s: f64,
    /// The best of [`ReadBandwidth`]'s samples across the run: every `÷bandwidth` divides by it.
    pub measured_read_gb_per_s: f64,
    /// The lowest of those samples, and how many there were.
    pub measured_read_gb_per_s_lowest: f64,
    pub read_bandwidth_samples: usize,
    pub decode_bandwidth_ratio: f64,
    /// f32 GFLOP/s of the CPU backend's own product on a 1024 × 2048 BF16 weight and 64 tokens
    /// (best of three): the compute roof a large batch meets.
    pub measured_matmul_gflop_per_s: f64,
    /// One core's measured multiply-adds per ns: f32 FMA, and AVX-512-BF16's `vdpbf16ps` where
    /// the CPU has it (`kimi_kernels::cpu::unit_rates`: why products stay on FMA without AMX).
    pub fma_macs_per_ns: Option<f64>,
    pub bf16_dot_macs_per_ns: Option<f64>,
    /// The pool's hand-off cost per op, µs: workers spinning (back-to-back splits) and parked.
    pub handoff_us_spinning: f64,
    pub handoff_us_parked: f64,
    /// 2 × the multiply-adds of one token's matrix products (every weight but the embedding
    /// table, top-k/E of the routed experts); attention and the KDA recurrence are not counted.
    pub matmul_flops_per_token: f64,
    /// One row per `--batch` size, all in this run.
    pub batches: Vec<BatchRun>,
    /// With `--op-profile`: one more decode of the first batch size with every op timed.
    pub op_profile: Option<OpProfile>,
}

/// A decode run with every backend op timed ([`ProfiledBackend`]), after the measured runs.
#[derive(Debug, Serialize)]
pub struct OpProfile {
    pub batch: usize,
    pub decode_steps: usize,
    /// This run's wall time per step (the timing adds a little to it).
    pub ms_per_step: f64,
    /// One row per op and weight shape, most time first.
    pub ops: Vec<OpRow>,
}

/// One op label's share of a decode step.
#[derive(Debug, Serialize)]
pub struct OpRow {
    /// The op, and for products its weight format and shape (`matmul bf16 panels 2048×2048`).
    pub op: String,
    pub calls_per_step: f64,
    pub us_per_call: f64,
    /// Its time over the step's (ops that run side by side overlap, so shares may sum past 1).
    pub share_of_step: f64,
    /// Weight bytes its calls read in a step, and the rate they read them at while running:
    /// against `measured_read_gb_per_s` it says how far that op is from the memory roof.
    pub weight_mb_per_step: f64,
    pub weight_gb_per_s: f64,
}

/// Decode of `batch` sequences stepped together: one batched forward per step.
#[derive(Debug, Serialize)]
pub struct BatchRun {
    pub batch: usize,
    pub decode_seconds: f64,
    /// Tokens of all sequences per second.
    pub decode_tokens_per_s: f64,
    /// Weight bytes one step reads: the non-routed weights once, plus the routed experts the
    /// batch's tokens are expected to touch (`E · (1 − (1 − k/E)^batch)`, uniform routing).
    pub weight_bytes_per_step: u64,
    pub effective_weight_gb_per_s: f64,
    pub bandwidth_ratio: f64,
    /// Matrix-product GFLOP/s of the step (`matmul_flops_per_token` × tokens/s) and its share of
    /// the measured peak.
    pub matmul_gflop_per_s: f64,
    pub peak_ratio: f64,
    /// Aggregate decode tokens/s over the first batch size's.
    pub speedup: f64,
    /// Share of the decode steps' wall time per kind of op (`kda`, `moe`, `lm_head`, …).
    pub op_shares: BTreeMap<&'static str, f64>,
    /// Collectives one rank makes in a decode step (0 at TP 1) and the bytes it sends in them.
    pub collectives_per_step: f64,
    pub comm_bytes_per_step: f64,
    /// Heap allocations per decode step (the `kimi-host` binary counts them; `None` elsewhere).
    pub allocations_per_step: Option<f64>,
}

/// This machine's read bandwidth, sampled at several points of a run: a shared VM's bandwidth
/// moves with its neighbours' load (15–30 GB/s within minutes on the race machine), and one
/// sample taken in a busy moment makes every ratio against it look better than it is. The roof
/// is the best sample; the lowest says how much the machine varied meanwhile.
pub struct ReadBandwidth {
    /// An `AlignedVec`, as the packed weights are: the same page size (2 MB where Linux offers
    /// them), so the probe reads as the products do.
    words: kimi_kernels::AlignedVec<u64>,
    samples: Vec<f64>,
}

impl ReadBandwidth {
    /// A probe over a buffer of `bytes` (well beyond the caches), touched once here.
    pub fn new(bytes: usize) -> ReadBandwidth {
        ReadBandwidth { words: kimi_kernels::AlignedVec::from_elem(1u64, bytes / 8), samples: Vec::new() }
    }

    /// Best of three multithreaded passes now, GB/s; kept as one sample.
    pub fn sample(&mut self) -> f64 {
        let bytes = self.words.len() * 8;
        let mut best = 0f64;
        for _ in 0..3 {
            let t = Instant::now();
            // Each thread streams one contiguous part.
            let part = self.words.len().div_ceil(rayon::current_num_threads());
            let s: u64 = self.words.par_chunks(part.max(1)).map(kimi_kernels::read_sum).sum();
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(s);
            best = best.max(bytes as f64 / secs / 1e9);
        }
        self.samples.push(best);
        best
    }

    /// The best sample so far (0 before any).
    pub fn best(&self) -> f64 {
        self.samples.iter().copied().fold(0.0, f64::max)
    }

    /// The lowest sample so far (0 before any).
    pub fn lowest(&self) -> f64 {
        self.samples.iter().copied().reduce(f64::min).unwrap_or(0.0)
    }
}

/// Best-of-3 f32 GFLOP/s of the CPU backend's product over a packed 1024 × 2048 BF16 weight and
/// 64 tokens.
pub fn measure_matmul_peak() -> f64 {
    use kimi_kernels::{Backend, Bf16Matrix, CpuBackend, Matrix};
    let (rows, cols, tokens) = (1024, 2048, 64);
    let w: Vec<u16> = (0..rows * cols).map(|i| 0x3c00 + (i * 7919 % 1024) as u16).collect();
    let Some(packed) = CpuBackend.prepare_matrix(&Matrix::Bf16(Bf16Matrix::new(&w, rows, cols))) else {
        return 0.0;
    };
    let m = Matrix::Packed(&packed);
    let x: Vec<f32> = (0..tokens * cols).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
    let mut out = vec![0f32; tokens * rows];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..8 {
            CpuBackend.matmul(&m, &x, tokens, &mut out);
        }
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(&out);
        best = best.max(8.0 * 2.0 * (rows * cols * tokens) as f64 / secs / 1e9);
    }
    best
}

/// The thread pool's cost of handing one op's work to the other threads and waiting for it, as
/// an op inside a forward step pays it (the step runs on a pool thread): microseconds per empty
/// parallel split, back to back (the other threads still spinning after the last split) and
/// after a 2 ms pause (they have parked and must be woken). rayon's workers spin, then park.
pub fn measure_handoff() -> (f64, f64) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    let split = || (0..threads).into_par_iter().for_each(|i| std::hint::black_box(i).hash_cost());
    rayon::scope(|_| {
        let n = 2000;
        let t = Instant::now();
        for _ in 0..n {
            split();
        }
        let hot = t.elapsed().as_secs_f64() / n as f64 * 1e6;
        let mut parked = 0f64;
        let m = 50;
        for _ in 0..m {
            std::thread::sleep(std::time::Duration::from_millis(2));
            let t = Instant::now();
            split();
            parked += t.elapsed().as_secs_f64();
        }
        (hot, parked / m as f64 * 1e6)
    })
}

/// A stand-in for an op's smallest work item.
trait HashCost {
    fn hash_cost(self);
}

impl HashCost for usize {
    fn hash_cost(self) {
        std::hint::black_box(self.wrapping_mul(0x9e37_79b9));
    }
}

/// (non-routed, routed-expert) values multiplied per token's pass over every matrix (the
/// embedding table and 1-D tensors left out; an MXFP4 byte holds two values, its scales none).
fn matmul_params(dir: &Path) -> Result<(u64, u64), ModelError> {
    let ck = Checkpoint::open(dir)?;
    let (mut dense, mut routed) = (0u64, 0u64);
    for (name, info) in ck.tensors() {
        if name.contains("embed_tokens") || info.shape.len() != 2 || name.ends_with("weight_scale") {
            continue;
        }
        let values = if name.ends_with("weight_packed") {
            2 * info.nbytes() as u64
        } else {
            info.shape.iter().product::<usize>() as u64
        };
        if name.contains(".experts.") {
            routed += values;
        } else {
            dense += values;
        }
    }
    Ok((dense, routed))
}

/// (non-routed weight bytes without the embedding table, routed expert bytes), as the model
/// holds them: `--fp8-dense` kinds at a byte a value plus an f32 scale per row.
fn weight_bytes(dir: &Path, fmt: WeightFormat) -> Result<(u64, u64), ModelError> {
    let ck = Checkpoint::open(dir)?;
    let mut dense = 0u64;
    let mut routed = 0u64;
    for (name, info) in ck.tensors() {
        if name.contains("embed_tokens") {
            continue;
        }
        let bytes = match info.shape[..] {
            [rows, cols] if fmt.fp8_dense && fp8_dense_target(name) => (rows * cols + 4 * rows) as u64,
            _ => info.nbytes() as u64,
        };
        if name.contains(".experts.") {
            routed += bytes;
        } else {
            dense += bytes;
        }
    }
    Ok((dense, routed))
}

/// Expected share of the routed experts that `batch` tokens touch, each picking `k` of `e`.
fn routed_share(k: usize, e: usize, batch: usize) -> f64 {
    if e == 0 {
        return 0.0;
    }
    1.0 - (1.0 - k as f64 / e as f64).powi(batch as i32)
}

/// A deterministic pseudo-random prompt over the ordinary (non-special) ids.
fn prompt(vocab: usize, len: usize, seed: u64) -> Vec<u32> {
    let ordinary = vocab.saturating_sub(256).max(1) as u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0xd1b5_4a32_d192_ed03);
    (0..len.max(1))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % ordinary) as u32
        })
        .collect()
}

/// Prefills `batch` different prompts (one batched step each chunk of sequences), then times
/// `decode` steps of all of them together.
/// Decode timing of `batch` sequences: seconds, op times and the collectives made meanwhile.
fn decode_batch(
    model: &Model,
    prompt_len: usize,
    batch: usize,
    decode: usize,
    profiler: Option<&ProfiledBackend>,
) -> Result<(f64, OpTimes, kimi_kernels::CommStats, Option<f64>), ModelError> {
    let c = model.text_config();
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(c.vocab_size, prompt_len, i as u64)).collect();
    let mut states: Vec<SequenceState> = (0..batch).map(|_| model.new_state()).collect();
    // Prefill in groups, so one step's batch stays near the engine's token budget.
    let group = (2048 / prompt_len.max(1)).max(1);
    let mut next: Vec<u32> = Vec::with_capacity(batch);
    for (ps, ss) in prompts.chunks(group).zip(states.chunks_mut(group)) {
        let mut inputs: Vec<SeqInput<'_>> =
            ps.iter().zip(ss.iter_mut()).map(|(ids, state)| SeqInput::new(ids, state, LogitsFor::LastToken)).collect();
        next.extend(model.forward_batch(&mut inputs, None)?.iter().map(|l| argmax(l) as u32));
    }
    let mut times = OpTimes::default();
    let comm_before = model.comm_stats();
    crate::alloc_count::start_counting();
    let allocs_before = crate::alloc_count::allocations();
    // Only the decode steps are profiled (not the prompts' prefill above).
    if let Some(p) = profiler {
        p.reset();
        p.set_enabled(true);
    }
    let t = Instant::now();
    for _ in 0..decode {
        let ids: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut inputs: Vec<SeqInput<'_>> = ids
            .iter()
            .zip(states.iter_mut())
            .map(|(ids, state)| SeqInput::new(ids, state, LogitsFor::LastToken))
            .collect();
        next = model.forward_batch_profiled(&mut inputs, &mut times)?.iter().map(|l| argmax(l) as u32).collect();
    }
    let secs = t.elapsed().as_secs_f64();
    if let Some(p) = profiler {
        p.set_enabled(false);
    }
    // The step's own allocations and the bench's per-step id vectors (two a step).
    // None where nothing was counted (the allocator is not installed): the bench's own id
    // vectors alone allocate every step.
    let counted = crate::alloc_count::allocations() - allocs_before;
    let allocs = (counted > 0 && decode > 0).then(|| counted as f64 / decode as f64);
    Ok((secs, times, model.comm_stats().since(&comm_before), allocs))
}

pub fn bench_forward(
    dir: &Path,
    prompt_len: usize,
    decode: usize,
    batches: &[usize],
    par: Parallelism,
    fmt: WeightFormat,
    op_profile: bool,
) -> Result<ForwardBench, ModelError> {
    let mut model = Model::load_as(dir, par, fmt)?;
    // Timing stays off until the profiled run, so the measured runs forward only.
    let profiler = op_profile.then(|| Arc::new(ProfiledBackend::new(Arc::new(CpuBackend))));
    if let Some(p) = &profiler {
        p.set_enabled(false);
        model = model.with_backend(p.clone());
    }
    let mut bw = ReadBandwidth::new(1 << 29);
    bw.sample();
    let c = model.text_config();
    let prompt = prompt(c.vocab_size, prompt_len, 0);
    // An untimed warm-up prefill of another prompt, as llama-bench does: the first step touches
    // the repacked weights' pages and fills the step-buffer pool.
    let warm = self::prompt(c.vocab_size, prompt_len, u64::MAX);
    let mut warm_state = model.new_state();
    model.forward_batch(&mut [SeqInput::new(&warm, &mut warm_state, LogitsFor::LastToken)], None)?;
    drop(warm_state);
    let mut state = model.new_state();
    let mut prefill_times = OpTimes::default();
    let t = Instant::now();
    model
        .forward_batch_profiled(&mut [SeqInput::new(&prompt, &mut state, LogitsFor::LastToken)], &mut prefill_times)?;
    let prefill = t.elapsed().as_secs_f64();
    bw.sample();
    let (dense, routed) = weight_bytes(dir, fmt)?;
    let peak = measure_matmul_peak();
    let handoff = measure_handoff();
    let units = kimi_kernels::measure_unit_rates();
    let (dense_values, routed_values) = matmul_params(dir)?;
    let per_token_values =
        dense_values as f64 + routed_values as f64 * c.experts_per_token as f64 / c.num_experts.max(1) as f64;
    let flops_per_token = 2.0 * per_token_values;
    let batches = if batches.is_empty() { &[1][..] } else { batches };
    let mut runs: Vec<BatchRun> = Vec::new();
    for &b in batches {
        let b = b.max(1);
        let (secs, times, comm, allocs) = decode_batch(&model, prompt.len(), b, decode, None)?;
        bw.sample();
        let per_step = |x: u64| if decode > 0 && par.tensor > 1 { x as f64 / decode as f64 } else { 0.0 };
        let tps = if decode > 0 { (b * decode) as f64 / secs } else { 0.0 };
        let bytes = dense + (routed as f64 * routed_share(c.experts_per_token, c.num_experts, b)) as u64;
        let steps_per_s = if decode > 0 { decode as f64 / secs } else { 0.0 };
        let eff = bytes as f64 * steps_per_s / 1e9;
        let speedup = runs.first().map_or(1.0, |f| tps / f.decode_tokens_per_s.max(1e-12));
        let gflops = flops_per_token * tps / 1e9;
        runs.push(BatchRun {
            batch: b,
            decode_seconds: secs,
            decode_tokens_per_s: tps,
            weight_bytes_per_step: bytes,
            effective_weight_gb_per_s: eff,
            // Set below, against the best of every sample.
            bandwidth_ratio: 0.0,
            matmul_gflop_per_s: gflops,
            peak_ratio: if peak > 0.0 { gflops / peak } else { 0.0 },
            speedup,
            op_shares: times.shares().into_iter().map(|(k, v)| (k.name(), v)).collect(),
            collectives_per_step: per_step(comm.collectives()),
            comm_bytes_per_step: per_step(comm.bytes_sent),
            allocations_per_step: allocs,
        });
    }
    let op_profile = match &profiler {
        Some(p) => {
            let b = runs[0].batch;
            let (secs, ..) = decode_batch(&model, prompt.len(), b, decode, Some(p))?;
            Some(op_profile_of(p, b, decode, secs))
        }
        None => None,
    };
    let roof = bw.best();
    for r in &mut runs {
        r.bandwidth_ratio = r.effective_weight_gb_per_s / roof;
    }
    let first = &runs[0];
    let per_token = dense + (routed as f64 * routed_share(c.experts_per_token, c.num_experts, 1)) as u64;
    let first_eff = per_token as f64 * first.decode_tokens_per_s / first.batch as f64 / 1e9;
    Ok(ForwardBench {
        simd: match (kimi_kernels::amx_enabled(), kimi_kernels::mxfp4_tiles()) {
            (true, kimi_kernels::Mxfp4Tiles::Always) => "avx512f + amx-bf16 tiles (MXFP4 too)",
            (true, kimi_kernels::Mxfp4Tiles::Batched) => "avx512f + amx-bf16 tiles (MXFP4 from 6 tokens)",
            (true, kimi_kernels::Mxfp4Tiles::PerSequence) => {
                "avx512f + amx-bf16 tiles (MXFP4 for a sequence's 6+ tokens)"
            }
            (true, kimi_kernels::Mxfp4Tiles::Never) => "avx512f + amx-bf16 tiles",
            (false, _) => kimi_kernels::simd_level().name(),
        },
        threads: rayon::current_num_threads(),
        tensor_parallel: par.tensor,
        context_parallel: par.context,
        prompt_len: prompt.len(),
        decode_steps: decode,
        prefill_seconds: prefill,
        prefill_tokens_per_s: prompt.len() as f64 / prefill,
        prefill_op_shares: prefill_times.shares().into_iter().map(|(k, v)| (k.name(), v)).collect(),
        decode_seconds: first.decode_seconds,
        decode_tokens_per_s: first.decode_tokens_per_s,
        weight_bytes_per_decode_token: per_token,
        effective_weight_gb_per_s: first_eff,
        measured_read_gb_per_s: roof,
        measured_read_gb_per_s_lowest: bw.lowest(),
        read_bandwidth_samples: bw.samples.len(),
        decode_bandwidth_ratio: first_eff / roof,
        measured_matmul_gflop_per_s: peak,
        fma_macs_per_ns: units.map(|u| u.fma_macs_per_ns),
        bf16_dot_macs_per_ns: units.and_then(|u| u.bf16_dot_macs_per_ns),
        handoff_us_spinning: handoff.0,
        handoff_us_parked: handoff.1,
        matmul_flops_per_token: flops_per_token,
        batches: runs,
        op_profile,
    })
}

/// The profiler's totals over `steps` decode steps that took `secs`, per step.
fn op_profile_of(p: &ProfiledBackend, batch: usize, steps: usize, secs: f64) -> OpProfile {
    let steps_f = steps.max(1) as f64;
    let step_s = secs / steps_f;
    let ops = p
        .snapshot()
        .into_iter()
        .map(|(op, s)| {
            let t = s.time.as_secs_f64();
            OpRow {
                op,
                calls_per_step: s.calls as f64 / steps_f,
                us_per_call: 1e6 * t / s.calls.max(1) as f64,
                share_of_step: if step_s > 0.0 { t / steps_f / step_s } else { 0.0 },
                weight_mb_per_step: s.weight_bytes as f64 / steps_f / 1e6,
                weight_gb_per_s: if t > 0.0 { s.weight_bytes as f64 / t / 1e9 } else { 0.0 },
            }
        })
        .collect();
    OpProfile { batch, decode_steps: steps, ms_per_step: 1e3 * step_s, ops }
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
        writeln!(
            f,
            "simd {} · {} threads · measured read bandwidth {:.2} GB/s (best of {} samples across the run, lowest {:.2}) · measured f32 matmul peak {:.1} GFLOP/s · {:.2} GFLOP a token",
            self.simd,
            self.threads,
            self.measured_read_gb_per_s,
            self.read_bandwidth_samples,
            self.measured_read_gb_per_s_lowest,
            self.measured_matmul_gflop_per_s,
            self.matmul_flops_per_token / 1e9
        )?;
        if let Some(fma) = self.fma_macs_per_ns {
            match self.bf16_dot_macs_per_ns {
                // Two BF16 parts per activation for the goldens' precision: half the rate is useful.
                Some(b) => writeln!(
                    f,
                    "one core: f32 FMA {fma:.1} multiply-adds/ns · AVX-512-BF16 vdpbf16ps {b:.1} ({:.1} with the two BF16 activation parts the goldens need: ×{:.2} of FMA)",
                    b / 2.0,
                    b / 2.0 / fma
                )?,
                None => writeln!(f, "one core: f32 FMA {fma:.1} multiply-adds/ns · no AVX-512-BF16")?,
            }
        }
        writeln!(
            f,
            "pool hand-off per op: {:.2} µs while the workers spin, {:.2} µs once they have parked",
            self.handoff_us_spinning, self.handoff_us_parked
        )?;
        writeln!(
            f,
            "prefill {:>6} tokens: {:>10.1} tokens/s ({:.3} s)",
            self.prompt_len, self.prefill_tokens_per_s, self.prefill_seconds
        )?;
        writeln!(f, "  prefill time shares: {}", shares_text(&self.prefill_op_shares))?;
        writeln!(
            f,
            "decode {} steps after a {}-token prompt, every batch size in this run:",
            self.decode_steps, self.prompt_len
        )?;
        writeln!(f, "  batch   tokens/s   ms/step   weights/step   GB/s   ÷bandwidth   GFLOP/s   ÷peak   ×first")?;
        for r in &self.batches {
            writeln!(
                f,
                "  {:>5} {:>10.2} {:>9.2} {:>11.2} MB {:>6.2} {:>11.3} {:>9.1} {:>7.3} {:>8.2}",
                r.batch,
                r.decode_tokens_per_s,
                1e3 * r.decode_seconds / self.decode_steps.max(1) as f64,
                r.weight_bytes_per_step as f64 / 1e6,
                r.effective_weight_gb_per_s,
                r.bandwidth_ratio,
                r.matmul_gflop_per_s,
                r.peak_ratio,
                r.speedup
            )?;
        }
        for r in &self.batches {
            writeln!(f, "  batch {:>3} time shares: {}", r.batch, shares_text(&r.op_shares))?;
        }
        for r in &self.batches {
            if let Some(a) = r.allocations_per_step {
                writeln!(f, "  batch {:>3}: {a:.0} heap allocations a decode step", r.batch)?;
            }
        }
        if self.tensor_parallel > 1 {
            let cp = match self.context_parallel {
                1 => String::new(),
                c => format!(" with context-parallel groups of {c}"),
            };
            writeln!(f, "tensor parallel {}{cp}: per rank and decode step", self.tensor_parallel)?;
            for r in &self.batches {
                writeln!(
                    f,
                    "  batch {:>3}: {:.0} collectives, {:.1} KB sent",
                    r.batch,
                    r.collectives_per_step,
                    r.comm_bytes_per_step / 1e3
                )?;
            }
        }
        if let Some(p) = &self.op_profile {
            writeln!(
                f,
                "op profile: batch {}, {} decode steps, {:.2} ms a step (timed); weight GB/s against the measured {:.2}:",
                p.batch, p.decode_steps, p.ms_per_step, self.measured_read_gb_per_s
            )?;
            writeln!(
                f,
                "  {:<52} {:>7} {:>10} {:>7} {:>10} {:>8} {:>7}",
                "op", "calls", "µs/call", "share", "MB/step", "GB/s", "÷roof"
            )?;
            for o in &p.ops {
                let (gb, roof) = if o.weight_mb_per_step > 0.0 {
                    (
                        format!("{:.2}", o.weight_gb_per_s),
                        format!("{:.3}", o.weight_gb_per_s / self.measured_read_gb_per_s),
                    )
                } else {
                    ("-".to_string(), "-".to_string())
                };
                writeln!(
                    f,
                    "  {:<52} {:>7.1} {:>10.1} {:>7.3} {:>10.2} {gb:>8} {roof:>7}",
                    o.op, o.calls_per_step, o.us_per_call, o.share_of_step, o.weight_mb_per_step
                )?;
            }
        }
        Ok(())
    }
}

/// `moe 41% · kda 33% · …`, largest first.
fn shares_text(shares: &BTreeMap<&'static str, f64>) -> String {
    let mut v: Vec<(&str, f64)> = shares.iter().map(|(k, v)| (*k, *v)).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.iter().map(|(k, v)| format!("{k} {:.0}%", 100.0 * v)).collect::<Vec<_>>().join(" · ")
}

/// `bench forward --draft`: one sequence decoded greedily with and without speculative decoding
/// on the same prompt, in this run.
#[derive(Debug, Serialize)]
pub struct SpeculativeRun {
    pub speculative_tokens: usize,
    pub decode_tokens: usize,
    pub plain_tokens_per_s: f64,
    pub speculative_tokens_per_s: f64,
    pub speedup: f64,
    /// Verify steps, drafts proposed and accepted; mean accepted drafts per verify.
    pub verify_steps: usize,
    pub proposed: usize,
    pub accepted: usize,
    pub mean_accepted: f64,
    /// Whether both runs emitted the same tokens (they must: greedy verification is exact).
    pub same_tokens: bool,
}

impl std::fmt::Display for SpeculativeRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "speculative decoding (T = {}, {} tokens, batch 1, greedy): plain {:.1} tok/s · with the draft {:.1} tok/s · ×{:.2} · {} verify steps, {} of {} drafts accepted ({:.2} a step) · same tokens: {}",
            self.speculative_tokens,
            self.decode_tokens,
            self.plain_tokens_per_s,
            self.speculative_tokens_per_s,
            self.speedup,
            self.verify_steps,
            self.accepted,
            self.proposed,
            self.mean_accepted,
            if self.same_tokens { "yes" } else { "NO" }
        )
    }
}

/// Greedy decode of `decode` tokens after a `prompt_len` prompt, plain and then with `draft`
/// proposing `t` tokens a step (verified in one forward with KDA snapshots, kept prefix
/// committed by `accept`).
pub fn bench_speculative(
    model: &Model,
    draft: &kimi_host::model::dspark::DsparkDraft,
    prompt_len: usize,
    decode: usize,
    t: usize,
) -> Result<SpeculativeRun, ModelError> {
    use kimi_host::model::batch::AuxTap;
    let c = model.text_config();
    let v = c.vocab_size;
    let prompt = prompt(c.vocab_size, prompt_len, 7);
    // Plain.
    let mut state = model.new_state();
    let first = argmax(&model.forward(&prompt, &mut state, LogitsFor::LastToken, None)?) as u32;
    let started = Instant::now();
    let mut plain = vec![first];
    while plain.len() < decode {
        let last = plain[plain.len() - 1];
        plain.push(argmax(&model.forward(&[last], &mut state, LogitsFor::LastToken, None)?) as u32);
    }
    let plain_secs = started.elapsed().as_secs_f64();
    // Speculative.
    let mut state = model.new_state();
    let mut cache = draft.new_cache(&model.default_arenas().pages)?;
    let mut pending = Vec::new();
    let mut input = SeqInput::new(&prompt, &mut state, LogitsFor::LastToken);
    input.aux = Some(AuxTap { layers: draft.taps(), rows: &mut pending });
    let first = argmax(&model.forward_batch(&mut [input], None)?.remove(0)) as u32;
    let started = Instant::now();
    let mut out = vec![first];
    let (mut steps, mut proposed, mut accepted) = (0, 0, 0);
    while out.len() < decode {
        let next = out[out.len() - 1];
        let room = (decode - out.len()).saturating_sub(1).min(t);
        let drafts = draft.propose(model, &mut [&mut cache], &[&pending], &[next], &[room])?.remove(0);
        pending.clear();
        let ids: Vec<u32> = std::iter::once(next).chain(drafts.iter().copied()).collect();
        state.begin_verify(if drafts.is_empty() { 0 } else { ids.len() })?;
        let mut aux = Vec::new();
        let mut input = SeqInput::new(&ids, &mut state, LogitsFor::AllTokens);
        input.aux = Some(AuxTap { layers: draft.taps(), rows: &mut aux });
        let logits = model.forward_batch(&mut [input], None)?.remove(0);
        let verdict = kimi_host::engine::speculative::verify_greedy(&drafts, &logits, v);
        let kept = verdict.accepted + 1;
        if !drafts.is_empty() {
            state.accept(ids.len(), kept)?;
            steps += 1;
            proposed += drafts.len();
            accepted += verdict.accepted;
        }
        pending.extend_from_slice(&aux[..kept * (aux.len() / ids.len())]);
        out.extend_from_slice(&drafts[..verdict.accepted]);
        out.push(verdict.next);
    }
    out.truncate(decode);
    let spec_secs = started.elapsed().as_secs_f64();
    let tps = |secs: f64| (decode.saturating_sub(1)) as f64 / secs.max(1e-12);
    Ok(SpeculativeRun {
        speculative_tokens: t,
        decode_tokens: decode,
        plain_tokens_per_s: tps(plain_secs),
        speculative_tokens_per_s: tps(spec_secs),
        speedup: plain_secs / spec_secs.max(1e-12),
        verify_steps: steps,
        proposed,
        accepted,
        mean_accepted: accepted as f64 / steps.max(1) as f64,
        same_tokens: out == plain,
    })
}
