//! `kimi-host kernels check --backend cuda|hip`: the built kernels on the GPU against the CPU
//! backend, then memory bandwidth as a fraction of the device's HBM (`scripts/device-check.sh`
//! runs it on a lent H200). Every check prints one line; any mismatch makes the command fail.
//! The same checks run on either runtime through [`GpuDevice`]: launch shapes follow the
//! device's wave (32 on NVIDIA, 64 on AMD CDNA).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::model::{LogitsFor, Model};
use kimi_kernels::gpu::abi::{
    EmbeddingParams, GluParams, KdaDecodeParams, LogitsStatsParams, MmaGemmParams, RmsnormParams, TopkParams,
};
use kimi_kernels::gpu::backend::GpuBackend;
use kimi_kernels::gpu::device::{GpuBuffer, GpuDevice, KernelArg, launch_kpl, launch_triton};
use kimi_kernels::{
    Backend, Bf16Matrix, CpuBackend, KdaInputs, KdaParams, KdaSlot, Matrix, Mxfp4Matrix, SeqSpan, f32_to_bf16_bits,
};

/// The device's HBM bandwidth in GB/s, from its name (H100 3.35 TB/s, H200 4.8, MI300X 5.3,
/// MI355X 8); `None` for a device this table does not know.
fn hbm_gbs(dev: &dyn GpuDevice) -> Option<f64> {
    let name = dev.describe();
    [("H100", 3350.0), ("H200", 4800.0), ("MI300X", 5300.0), ("MI325X", 6000.0), ("MI355X", 8000.0)]
        .into_iter()
        .find(|(n, _)| name.contains(n))
        .map(|(_, g)| g)
        .or(match dev.arch() {
            "gfx950" => Some(8000.0),
            "gfx942" => Some(5300.0),
            _ => None,
        })
}

/// Values in about [-scale, scale], reproducible.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| f32_to_bf16_bits(x)).collect()
}

fn widen(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect()
}

/// Prints a check's line; false when `got` is further than `tol · (1 + |want|)` from `want`.
fn report(name: &str, got: &[f32], want: &[f32], tol: f32) -> bool {
    let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs() / (1.0 + w.abs())).fold(0f32, f32::max);
    let ok = got.len() == want.len() && worst <= tol && got.iter().all(|g| !g.is_nan());
    println!("{} {name}: max |Δ|/(1+|want|) {worst:.2e} (bound {tol:.0e})", if ok { "ok  " } else { "FAIL" });
    ok
}

/// The text goldens the device check runs when given their directory (`--golden`).
pub const GOLDEN_MODELS: [&str; 3] = ["k3-tiny", "k3-tiny-mxfp4", "k31-tiny-indexer"];

/// Runs every check on `dev` (`kernels check` opens it from the manifest's directory), and the
/// text goldens of `golden` (a copy of `../shared/golden`) when given.
pub fn run(dev: Arc<dyn GpuDevice>, golden: Option<&Path>) -> Result<()> {
    let k = &*dev;
    println!("device: {}", k.describe());
    let mut ok = true;
    ok &= kpl_checks(k)?;
    ok &= triton_checks(k)?;
    ok &= collectives();
    ok &= model_check(dev.clone())?;
    if let Some(dir) = golden {
        for name in GOLDEN_MODELS {
            let r = golden_check(dev.clone(), &dir.join(name)).with_context(|| format!("golden {name}"))?;
            println!("{} {r}", if r.passed() { "ok  " } else { "FAIL" });
            ok &= r.passed();
        }
    }
    bandwidth(k)?;
    if !ok {
        bail!("some kernels disagree with the CPU backend");
    }
    println!("every kernel checked matches the CPU backend");
    Ok(())
}

fn kpl_checks(k: &dyn GpuDevice) -> Result<bool> {
    let mut ok = true;
    // RMSNorm: 3 rows of 1000.
    let (rows, cols) = (3usize, 1000usize);
    let (x, w) = (values(1, rows * cols, 2.0), values(2, cols, 1.0));
    let mut want = vec![0f32; rows * cols];
    CpuBackend.rms_norm(&x, &w, 1e-5, &mut want);
    let (dx, dw, dout) =
        (GpuBuffer::upload(k, &x)?, GpuBuffer::upload(k, &w)?, GpuBuffer::<f32>::zeros(k, rows * cols)?);
    let p = RmsnormParams {
        x: dx.addr(),
        w: dw.addr(),
        out: dout.addr(),
        rows: rows as u32,
        cols: cols as u32,
        eps: 1e-5,
        pad_: 0,
    };
    // SAFETY: the buffers hold the sizes in `p` and live until the stream has run.
    unsafe { launch_kpl(k, "kpl_rmsnorm_f32", rows as u32, 256, &p)? };
    ok &= report("kpl_rmsnorm_f32", &dout.download()?, &want, 1e-5);

    // SiLU GLU over 4096 values.
    let n = 4096;
    let (gate, up) = (values(3, n, 4.0), values(4, n, 4.0));
    let mut want = gate.clone();
    CpuBackend.silu_glu(&mut want, &up);
    let (dg, du) = (GpuBuffer::upload(k, &gate)?, GpuBuffer::upload(k, &up)?);
    let p = GluParams { gate: dg.addr(), up: du.addr(), n: n as u32, pad_: 0 };
    // SAFETY: as above.
    unsafe { launch_kpl(k, "kpl_silu_glu_f32", 8, 256, &p)? };
    ok &= report("kpl_silu_glu_f32", &dg.download()?, &want, 1e-5);

    // Embedding gather: 5 ids of a 50 × 300 BF16 table (exact).
    let table = bf16(&values(5, 50 * 300, 1.0));
    let ids = [3u32, 49, 0, 3, 17];
    let mut want = vec![0f32; ids.len() * 300];
    CpuBackend.embedding(&Matrix::Bf16(Bf16Matrix::new(&table, 50, 300)), &ids, &mut want);
    let (dt, di, dout) =
        (GpuBuffer::upload(k, &table)?, GpuBuffer::upload(k, &ids)?, GpuBuffer::<f32>::zeros(k, ids.len() * 300)?);
    let p = EmbeddingParams { table: dt.addr(), ids: di.addr(), out: dout.addr(), tokens: 5, cols: 300 };
    // SAFETY: as above.
    unsafe { launch_kpl(k, "kpl_embedding_bf16", 4, 256, &p)? };
    ok &= report("kpl_embedding_bf16", &dout.download()?, &want, 0.0);

    // KDA decode: 3 sequences × 4 heads of 128, from random states.
    let (seqs, heads, dim) = (3usize, 4usize, 128usize);
    let width = heads * dim;
    let (q, kk, v, z) = (
        values(6, seqs * width, 2.0),
        values(7, seqs * width, 2.0),
        values(8, seqs * width, 2.0),
        values(9, seqs * width, 2.0),
    );
    let beta = values(10, seqs * heads, 3.0);
    let a_exp: Vec<f32> = (0..heads).map(|i| 1.0 + i as f32).collect();
    let dt_bias = values(11, width, 0.5);
    let states: Vec<Vec<f32>> = (0..seqs).map(|s| values(12 + s as u64, heads * dim * dim, 1.0)).collect();
    let mut want_states = states.clone();
    let mut want = vec![0f32; seqs * width];
    {
        let p = KdaParams { heads, head_dim: dim, a_exp: &a_exp, dt_bias: &dt_bias, lower_bound: -5.0 };
        let x = KdaInputs { q: &q, k: &kk, v: &v, z: &z, beta_logits: &beta };
        let spans: Vec<SeqSpan> = (0..seqs).map(|i| SeqSpan { start: i, len: 1, pos: 9 }).collect();
        let mut slots: Vec<KdaSlot<'_>> = want_states.iter_mut().map(|s| KdaSlot::new(s)).collect();
        CpuBackend.kda_recurrence(&p, &x, &spans, &mut slots, &mut want);
    }
    let dstates: Vec<_> = states.iter().map(|s| GpuBuffer::upload(k, s)).collect::<Result<_, _>>()?;
    let d = KdaDecode::upload(k, [&q, &kk, &v, &z], &beta, &a_exp, &dt_bias, &dstates)?;
    let p = d.params(seqs, heads, dim);
    // SAFETY: as above; each sequence's slot is its own buffer.
    unsafe { launch_kpl(k, "kpl_kda_decode_f32", (seqs * heads) as u32, k.wave(), &p)? };
    ok &= report("kpl_kda_decode_f32 output", &d.out.download()?, &want, 1e-4);
    let got_states: Vec<f32> = dstates.iter().map(|d| d.download()).collect::<Result<Vec<_>, _>>()?.concat();
    ok &= report("kpl_kda_decode_f32 state", &got_states, &want_states.concat(), 1e-4);

    // The matrix cores: a 40 × 24 × 96 BF16 product on mma.sync (sm_90, 16×8 tiles) or the
    // MFMA (CDNA, 16×16 tiles), four waves a block.
    let (m, n, kd) = (40usize, 24usize, 96usize);
    let (a, b) = (bf16(&values(20, m * kd, 1.0)), bf16(&values(21, n * kd, 1.0)));
    let mut want = vec![0f32; m * n];
    CpuBackend.matmul(&Matrix::Bf16(Bf16Matrix::new(&b, n, kd)), &widen(&a), m, &mut want);
    let (da, db, dc) = (GpuBuffer::upload(k, &a)?, GpuBuffer::upload(k, &b)?, GpuBuffer::<f32>::zeros(k, m * n)?);
    let p = MmaGemmParams { a: da.addr(), b: db.addr(), c: dc.addr(), m: m as u32, n: n as u32, k: kd as u32, pad_: 0 };
    let tile_n = if k.wave() == 64 { 16 } else { 8 };
    let tiles = m.div_ceil(16) * n.div_ceil(tile_n);
    // SAFETY: as above.
    unsafe { launch_kpl(k, "kpl_mma_gemm_bf16", tiles.div_ceil(4) as u32, 4 * k.wave(), &p)? };
    ok &= report("kpl_mma_gemm_bf16 (the matrix cores' lane tables)", &dc.download()?, &want, 1e-4);

    // Top-k: 2 rows of 3000 scores, top 64.
    let (rows, n, topk) = (2usize, 3000usize, 64usize);
    let scores = values(30, rows * n, 1.0);
    let mut want = Vec::new();
    for r in 0..rows {
        let row = &scores[r * n..(r + 1) * n];
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut top: Vec<f32> = order[..topk].iter().map(|&i| i as f32).collect();
        top.sort_by(f32::total_cmp);
        want.extend(top);
    }
    let (ds, dout, dcount) =
        (GpuBuffer::upload(k, &scores)?, GpuBuffer::<u32>::zeros(k, rows * topk)?, GpuBuffer::<u32>::zeros(k, rows)?);
    let p = TopkParams {
        scores: ds.addr(),
        out: dout.addr(),
        count: dcount.addr(),
        rows: rows as u32,
        n: n as u32,
        k: topk as u32,
        pad_: 0,
    };
    // SAFETY: as above.
    unsafe { launch_kpl(k, "kpl_topk_select_f32", rows as u32, 256, &p)? };
    let got: Vec<f32> = dout.download()?.into_iter().map(|i| i as f32).collect();
    ok &= report("kpl_topk_select_f32", &got, &want, 0.0);

    // Logits statistics over a release-size row (163,840) at temperature 0.7.
    let cols = 163_840usize;
    let row = values(31, cols, 8.0);
    let (i, m) = kimi_kernels::cpu::reduce::argmax(&row);
    let want = [m, i as f32, kimi_kernels::cpu::reduce::log_sum_exp(&row, 0.7)];
    let (dr, dmax, dam, dlse) = (
        GpuBuffer::upload(k, &row)?,
        GpuBuffer::<f32>::zeros(k, 1)?,
        GpuBuffer::<u32>::zeros(k, 1)?,
        GpuBuffer::<f32>::zeros(k, 1)?,
    );
    let p = LogitsStatsParams {
        logits: dr.addr(),
        max: dmax.addr(),
        argmax: dam.addr(),
        lse: dlse.addr(),
        rows: 1,
        cols: cols as u32,
        inv_temperature: 1.0 / 0.7,
        pad_: 0,
    };
    // SAFETY: as above.
    unsafe { launch_kpl(k, "kpl_logits_stats_f32", 1, 1024, &p)? };
    let got = [dmax.download()?[0], dam.download()?[0] as f32, dlse.download()?[0]];
    ok &= report("kpl_logits_stats_f32 (max, argmax, lse)", &got, &want, 1e-5);
    Ok(ok)
}

/// NCCL (or RCCL) behind the `Communicator` trait on this machine's first GPU: a one-rank group
/// runs every collective (identity on one rank, but every call goes through the library).
fn collectives() -> bool {
    use kimi_kernels::Communicator;
    use kimi_kernels::gpu::nccl::{NcclComm, probe};
    match probe() {
        Err(e) => {
            println!("skip collectives: {e}");
            true
        }
        Ok((version, library)) => {
            let run = std::panic::catch_unwind(|| -> Result<bool, kimi_kernels::gpu::nccl::NcclError> {
                let comms = NcclComm::group(1)?;
                let c = &comms[0];
                let x = values(70, 1000, 1.0);
                let mut buf = x.clone();
                c.all_reduce_sum(&mut buf);
                let mut gathered = vec![0f32; x.len()];
                c.all_gather(&x, &mut gathered);
                let mut scattered = vec![0f32; x.len()];
                c.reduce_scatter_sum(&x, &[x.len()], &mut scattered);
                let mut b = x.clone();
                c.broadcast(&mut b, 0);
                c.barrier();
                Ok(buf == x && gathered == x && scattered == x && b == x)
            });
            let ok = matches!(run, Ok(Ok(true)));
            println!(
                "{} collectives through {library} (API {version}), one rank: {:?}",
                if ok { "ok  " } else { "FAIL" },
                run.map(|r| r.map_err(|e| e.to_string()))
            );
            ok
        }
    }
}

/// Logits may differ from the CPU backend's by this much (absolute) through the device, on a
/// random model whose logits are O(1): the products multiply activations as BF16 hi + lo
/// (relative error ≤ 2⁻¹⁷), and the device's `exp` and FMA contraction differ from the CPU's in
/// the last bits. The goldens' tolerances against their references are 3.3e-3 to 1.3e-2; on the
/// CPU, through the same launches replayed in Triton's interpreter, the goldens' models stay
/// within 2.2e-3 (the suite's `goldens_pass_through_the_gpu_backend_with_its_triton_kernels`).
const MODEL_TOLERANCE: f32 = 5e-3;

/// The whole model on the device (`GpuBackend`: each op staged through device memory, the ops
/// without a device path on the CPU) against the CPU backend: a random K3.1 model of the embedded
/// size (indexer, MXFP4 experts), a 12-token prefill with every position's logits, then 6 decode
/// steps on the CPU's greedy tokens. Prints the worst |Δ logits| and whether greedy tokens agree.
fn model_check(dev: Arc<dyn GpuDevice>) -> Result<bool> {
    let dir = std::env::temp_dir().join(format!("kimi-device-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    make_tiny(&dir, &TinyOptions { seed: 0x4b33, k31: true, mxfp4: true, vision: false })
        .context("writing the random check model")?;
    let result = (|| -> Result<(f32, usize, usize)> {
        let cpu = Model::load(&dir)?;
        let gpu = Model::load(&dir)?.with_backend(Arc::new(GpuBackend::new(dev)));
        let vocab = cpu.text_config().vocab_size;
        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 7919 + 11) % vocab as u32).collect();
        let (mut sc, mut sg) = (cpu.new_state(), gpu.new_state());
        let want = cpu.forward(&prompt, &mut sc, LogitsFor::AllTokens, None)?;
        let got = gpu.forward(&prompt, &mut sg, LogitsFor::AllTokens, None)?;
        let mut worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        let (mut agree, mut steps) = (0, 0);
        let mut next = kimi_kernels::cpu::reduce::argmax(&want[want.len() - vocab..]).0;
        for _ in 0..6 {
            let want = cpu.forward(&[next], &mut sc, LogitsFor::AllTokens, None)?;
            let got = gpu.forward(&[next], &mut sg, LogitsFor::AllTokens, None)?;
            worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(worst, f32::max);
            let (wi, gi) = (kimi_kernels::cpu::reduce::argmax(&want).0, kimi_kernels::cpu::reduce::argmax(&got).0);
            agree += (wi == gi) as usize;
            steps += 1;
            next = wi;
        }
        Ok((worst, agree, steps))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let (worst, agree, steps) = result?;
    let ok = worst <= MODEL_TOLERANCE && !worst.is_nan();
    println!(
        "{} model (random K3.1, MXFP4 experts) through GpuBackend: 12-token prefill + {steps} decode steps, worst |Δ logits| {worst:.2e} (bound {MODEL_TOLERANCE:.0e}); greedy tokens agree {agree}/{steps}",
        if ok { "ok  " } else { "FAIL" }
    );
    Ok(ok)
}

/// One golden model through the GPU backend.
#[derive(Clone, Debug)]
pub struct GoldenReport {
    pub name: String,
    /// The worst |Δ| of the 7-token prefill's logits and of the cached decode steps' logits.
    pub worst_logits: f32,
    /// The golden's own logits tolerance (`case.json`).
    pub tolerance: f32,
    pub decode_steps: usize,
}

impl GoldenReport {
    pub fn passed(&self) -> bool {
        self.worst_logits <= self.tolerance
    }
}

impl std::fmt::Display for GoldenReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "golden {} through GpuBackend: 7-token prefill + {} cached decode steps, worst |Δ logits| {:.2e} (tolerance {})",
            self.name, self.decode_steps, self.worst_logits, self.tolerance
        )
    }
}

/// Golden model `dir` (`config.json`, `model.safetensors`, `golden.safetensors`, `case.json`) on
/// the GPU backend over `dev`: the traced 7-token prefill's logits, then the decode prompt's
/// prefill and its cached decode steps' logits, against the golden tensors.
pub fn golden_check(dev: Arc<dyn GpuDevice>, dir: &Path) -> Result<GoldenReport> {
    use kimi_host::model::checkpoint::Checkpoint;
    let case: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("case.json"))?)?;
    let tolerance =
        case["suggested_tolerance"]["logits_max_abs"].as_f64().context("case.json: logits tolerance")? as f32;
    let ck = Checkpoint::open_file(&dir.join("golden.safetensors"))?;
    let info = |name: &str| ck.info(name).with_context(|| format!("golden tensor {name} missing"));
    let ids = |name: &str| -> Result<Vec<u32>> { Ok(ck.read_i64(info(name)?).into_iter().map(|x| x as u32).collect()) };
    let want = |name: &str| -> Result<Vec<f32>> { Ok(ck.read_f32(info(name)?)) };
    let worst = |got: &[f32], want: &[f32]| -> Result<f32> {
        if got.len() != want.len() {
            bail!("{} logits computed, {} in the golden", got.len(), want.len());
        }
        Ok(got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f32, |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) }))
    };
    let gpu = Model::load(dir)?.with_backend(Arc::new(GpuBackend::new(dev)));
    let trace = gpu.forward(&ids("trace.len7.input_ids")?, &mut gpu.new_state(), LogitsFor::AllTokens, None)?;
    let mut worst_logits = worst(&trace, &want("trace.len7.logits")?)?;
    let mut st = gpu.new_state();
    gpu.forward(&ids("decode.prompt_input_ids")?, &mut st, LogitsFor::AllTokens, None)?;
    let steps = ids("decode.input_ids")?;
    let mut logits = Vec::new();
    for &id in &steps {
        logits.extend(gpu.forward(&[id], &mut st, LogitsFor::AllTokens, None)?);
    }
    worst_logits = worst_logits.max(worst(&logits, &want("decode.logits")?)?);
    let name = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(GoldenReport { name, worst_logits, tolerance, decode_steps: steps.len() })
}

/// One KDA decode step's device buffers (q, k, v and z, β logits, the per-head constants, the slot
/// table of the states, the output).
struct KdaDecode<'d> {
    inputs: Vec<GpuBuffer<'d, f32>>,
    table: GpuBuffer<'d, u64>,
    out: GpuBuffer<'d, f32>,
}

impl<'d> KdaDecode<'d> {
    fn upload(
        k: &'d dyn GpuDevice,
        qkvz: [&[f32]; 4],
        beta: &[f32],
        a_exp: &[f32],
        dt_bias: &[f32],
        states: &[GpuBuffer<'d, f32>],
    ) -> Result<KdaDecode<'d>> {
        let inputs = qkvz
            .iter()
            .chain([&beta, &a_exp, &dt_bias])
            .map(|x| GpuBuffer::upload(k, x))
            .collect::<Result<Vec<_>, _>>()?;
        let table = GpuBuffer::upload(k, &states.iter().map(|s| s.addr()).collect::<Vec<u64>>())?;
        let out = GpuBuffer::<f32>::zeros(k, qkvz[0].len())?;
        Ok(KdaDecode { inputs, table, out })
    }

    fn params(&self, seqs: usize, heads: usize, dim: usize) -> KdaDecodeParams {
        let at = |i: usize| self.inputs[i].addr();
        KdaDecodeParams {
            q: at(0),
            k: at(1),
            v: at(2),
            z: at(3),
            beta_logits: at(4),
            a_exp: at(5),
            dt_bias: at(6),
            slots: self.table.addr(),
            out: self.out.addr(),
            seqs: seqs as u32,
            heads: heads as u32,
            dim: dim as u32,
            lower_bound: -5.0,
            q_scale: 1.0 / (dim as f32).sqrt(),
            pad_: 0,
        }
    }
}

/// An MXFP4 matrix from values (E2M1 codes, an E8M0 scale per 32).
fn mxfp4(seed: u64, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    kimi_kernels::mxfp4_quantize_rows(&values(seed, rows * cols, 1.0), rows, cols)
}

/// The arguments of `matmul_bf16` / `matmul_mxfp4`: x, the weight's buffers, y, then M, N, K and
/// the row strides of x and y (contiguous rows).
fn matmul_args(x: u64, weight: &[u64], y: u64, m: usize, n: usize, k: usize) -> Vec<KernelArg<'static>> {
    let mut args = vec![KernelArg::Ptr(x)];
    args.extend(weight.iter().map(|&w| KernelArg::Ptr(w)));
    args.push(KernelArg::Ptr(y));
    args.extend([m, n, k, k, n].map(|v| KernelArg::I32(v as i32)));
    args
}

fn triton_checks(k: &dyn GpuDevice) -> Result<bool> {
    let mut ok = true;
    let (m, n, kd) = (3usize, 1000usize, 512usize);
    let x = values(40, m * kd, 1.0);
    // The products multiply activations as BF16 hi + lo (kernels/triton/kimi_triton/gemm.py).
    let hi = widen(&bf16(&x));
    let lo: Vec<f32> = x.iter().zip(&hi).map(|(v, h)| v - h).collect();
    let xr: Vec<f32> = hi.iter().zip(widen(&bf16(&lo))).map(|(h, l)| h + l).collect();
    let dx = GpuBuffer::upload(k, &x)?;
    // BF16.
    let w = bf16(&values(41, n * kd, 1.0));
    let mut want = vec![0f32; m * n];
    CpuBackend.matmul(&Matrix::Bf16(Bf16Matrix::new(&w, n, kd)), &xr, m, &mut want);
    let (dw, dy) = (GpuBuffer::upload(k, &w)?, GpuBuffer::<f32>::zeros(k, m * n)?);
    let args = matmul_args(dx.addr(), &[dw.addr()], dy.addr(), m, n, kd);
    // SAFETY: the buffers hold the sizes in the arguments and live until the stream has run.
    unsafe { launch_triton(k, "triton_matmul_bf16", (1, n.div_ceil(64) as u32, 1), &args)? };
    ok &= report("triton_matmul_bf16", &dy.download()?, &want, 1e-4);
    // MXFP4.
    let (q, s) = mxfp4(42, n, kd);
    let mut want = vec![0f32; m * n];
    CpuBackend.matmul(&Matrix::Mxfp4(Mxfp4Matrix::new(&q, &s, n, kd)), &xr, m, &mut want);
    let (dq, ds, dy) = (GpuBuffer::upload(k, &q)?, GpuBuffer::upload(k, &s)?, GpuBuffer::<f32>::zeros(k, m * n)?);
    let args = matmul_args(dx.addr(), &[dq.addr(), ds.addr()], dy.addr(), m, n, kd);
    // SAFETY: as above.
    unsafe { launch_triton(k, "triton_matmul_mxfp4", (1, n.div_ceil(64) as u32, 1), &args)? };
    ok &= report("triton_matmul_mxfp4", &dy.download()?, &want, 1e-4);
    Ok(ok)
}

/// Times `f` (launches on the stream) over `reps` runs after one warm-up: seconds a run.
fn time(k: &dyn GpuDevice, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    k.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    k.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

fn bandwidth(k: &dyn GpuDevice) -> Result<()> {
    let reps = 20;
    let hbm = hbm_gbs(k);
    let line = |name: &str, bytes: f64, secs: f64| {
        let gbs = bytes / secs / 1e9;
        match hbm {
            Some(h) => println!("{name}: {:.1} µs, {gbs:.0} GB/s = {:.2} of HBM ({h:.0} GB/s)", secs * 1e6, gbs / h),
            None => println!("{name}: {:.1} µs, {gbs:.0} GB/s (HBM bandwidth of this device unknown)", secs * 1e6),
        }
    };
    // GEMV (one token) over an 8192 × 8192 BF16 matrix and a 16384 × 8192 MXFP4 one.
    let kd = 8192usize;
    let x = GpuBuffer::upload(k, &values(50, kd, 1.0))?;
    let n = 8192usize;
    let w = GpuBuffer::upload(k, &bf16(&values(51, n * kd, 1.0)))?;
    let y = GpuBuffer::<f32>::zeros(k, n)?;
    let args = matmul_args(x.addr(), &[w.addr()], y.addr(), 1, n, kd);
    // SAFETY: the buffers hold the sizes in the arguments and outlive the timed launches.
    let secs =
        time(k, reps, || unsafe { Ok(launch_triton(k, "triton_matmul_bf16", (1, (n / 64) as u32, 1), &args)?) })?;
    line("GEMV BF16 8192×8192", (n * kd * 2) as f64, secs);
    let n = 16384usize;
    let (q, s) = mxfp4(52, n, kd);
    let (dq, ds, y) = (GpuBuffer::upload(k, &q)?, GpuBuffer::upload(k, &s)?, GpuBuffer::<f32>::zeros(k, n)?);
    let args = matmul_args(x.addr(), &[dq.addr(), ds.addr()], y.addr(), 1, n, kd);
    // SAFETY: as above.
    let secs =
        time(k, reps, || unsafe { Ok(launch_triton(k, "triton_matmul_mxfp4", (1, (n / 64) as u32, 1), &args)?) })?;
    line("GEMV MXFP4 16384×8192", (q.len() + s.len()) as f64, secs);
    // KDA decode: 64 sequences × 32 heads of 128 (128 MiB of f32 state read and written).
    let (seqs, heads, dim) = (64usize, 32usize, 128usize);
    let width = heads * dim;
    let inputs: Vec<Vec<f32>> = (0..4).map(|i| values(60 + i, seqs * width, 1.0)).collect();
    let states: Vec<_> = (0..seqs).map(|_| GpuBuffer::<f32>::zeros(k, heads * dim * dim)).collect::<Result<_, _>>()?;
    let (beta, a_exp, dt) = (values(64, seqs * heads, 1.0), vec![1.0f32; heads], vec![0.0f32; width]);
    let d = KdaDecode::upload(k, [&inputs[0], &inputs[1], &inputs[2], &inputs[3]], &beta, &a_exp, &dt, &states)?;
    let p = d.params(seqs, heads, dim);
    // SAFETY: as above.
    let secs =
        time(k, reps, || unsafe { Ok(launch_kpl(k, "kpl_kda_decode_f32", (seqs * heads) as u32, k.wave(), &p)?) })?;
    line("KDA decode 64 seq × 32 heads × 128²", (2 * seqs * heads * dim * dim * 4) as f64, secs);
    Ok(())
}
