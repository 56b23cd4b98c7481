//! The GPU kernels run on the host: `kernels/ops/*.cu` built with kpl's CPU runtime (each GPU
//! thread a std::thread, the wave size a launch parameter). Tests check them against the Rust
//! CPU backend at wave 32 and 64, the two wave sizes of the targets (sm_90, gfx950).

use std::sync::mpsc;
use std::time::Duration;

use kimi_kernels::gpu::abi::{
    AttnResParams, EmbeddingParams, Fp8QuantizeParams, GatedRmsnormParams, GeluParams, GluParams, KdaConvParams,
    KdaDecodeParams, LogitsStatsParams, MmaGemmParams, MoeRouteParams, RmsnormParams, RopeTableParams, SituParams,
    TopkParams,
};

unsafe extern "C" {
    fn kpl_cpu_launch_kpl_rmsnorm_f32(grid: u32, block: u32, wave: u32, p: *const RmsnormParams);
    fn kpl_cpu_launch_kpl_gated_rmsnorm_f32(grid: u32, block: u32, wave: u32, p: *const GatedRmsnormParams);
    fn kpl_cpu_launch_kpl_situ_glu_f32(grid: u32, block: u32, wave: u32, p: *const SituParams);
    fn kpl_cpu_launch_kpl_embedding_bf16(grid: u32, block: u32, wave: u32, p: *const EmbeddingParams);
    fn kpl_cpu_launch_kpl_kda_decode_f32(grid: u32, block: u32, wave: u32, p: *const KdaDecodeParams);
    fn kpl_cpu_launch_kpl_attn_res_mix_f32(grid: u32, block: u32, wave: u32, p: *const AttnResParams);
    fn kpl_cpu_launch_kpl_moe_route_f32(grid: u32, block: u32, wave: u32, p: *const MoeRouteParams);
    fn kpl_cpu_launch_kpl_kda_conv_f32(grid: u32, block: u32, wave: u32, p: *const KdaConvParams);
    fn kpl_cpu_launch_kpl_silu_glu_f32(grid: u32, block: u32, wave: u32, p: *const GluParams);
    fn kpl_cpu_launch_kpl_gelu_f32(grid: u32, block: u32, wave: u32, p: *const GeluParams);
    fn kpl_cpu_launch_kpl_rope_table_f32(grid: u32, block: u32, wave: u32, p: *const RopeTableParams);
    fn kpl_cpu_launch_kpl_mma_gemm_bf16(grid: u32, block: u32, wave: u32, p: *const MmaGemmParams);
    pub fn kpl_abi_size_kpl_mma_gemm_bf16() -> std::ffi::c_ulong;
    fn kpl_cpu_launch_kpl_topk_select_f32(grid: u32, block: u32, wave: u32, p: *const TopkParams);
    pub fn kpl_abi_size_kpl_topk_select_f32() -> std::ffi::c_ulong;
    fn kpl_cpu_launch_kpl_logits_stats_f32(grid: u32, block: u32, wave: u32, p: *const LogitsStatsParams);
    pub fn kpl_abi_size_kpl_logits_stats_f32() -> std::ffi::c_ulong;
    fn kpl_cpu_launch_kpl_fp8_quantize_f32(grid: u32, block: u32, wave: u32, p: *const Fp8QuantizeParams);
    pub fn kpl_abi_size_kpl_fp8_quantize_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_silu_glu_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_gelu_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_rope_table_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_kda_conv_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_moe_route_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_attn_res_mix_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_kda_decode_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_rmsnorm_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_gated_rmsnorm_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_situ_glu_f32() -> std::ffi::c_ulong;
    pub fn kpl_abi_size_kpl_embedding_bf16() -> std::ffi::c_ulong;
}

/// A launch shape: blocks, threads a block, lanes a wave (`block` a multiple of `wave`).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    pub wave: u32,
}

/// A barrier or shuffle in divergent code deadlocks the host runtime (it is undefined behaviour
/// on the GPU too), so every launch runs under a deadline.
const DEADLINE: Duration = Duration::from_secs(60);

/// Runs `f` on a thread and waits at most [`DEADLINE`]; past it the process aborts, naming the
/// kernel (the stuck threads still hold the caller's buffers, so returning is not safe).
fn with_deadline(name: &'static str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    if rx.recv_timeout(DEADLINE).is_err() {
        eprintln!("kernel {name} did not finish in {DEADLINE:?}: a barrier or shuffle in divergent code?");
        std::process::abort();
    }
}

macro_rules! launcher {
    ($fn_name:ident, $ffi:ident, $params:ty, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// Every pointer in `p` must address memory valid for the kernel's reads and writes (as
        /// its struct in `abi.h` says), alive and unaliased until this returns.
        pub unsafe fn $fn_name(l: Launch, p: $params) {
            assert!(l.wave > 0 && l.block % l.wave == 0, "a block is whole waves");
            with_deadline(stringify!($fn_name), move || {
                // SAFETY: the caller vouches for the pointers; the params live in this closure.
                unsafe { $ffi(l.grid, l.block, l.wave, &p) }
            })
        }
    };
}

launcher!(rmsnorm_f32, kpl_cpu_launch_kpl_rmsnorm_f32, RmsnormParams, "`kpl_rmsnorm_f32` on the host.");
launcher!(
    gated_rmsnorm_f32,
    kpl_cpu_launch_kpl_gated_rmsnorm_f32,
    GatedRmsnormParams,
    "`kpl_gated_rmsnorm_f32` on the host."
);
launcher!(situ_glu_f32, kpl_cpu_launch_kpl_situ_glu_f32, SituParams, "`kpl_situ_glu_f32` on the host.");
launcher!(embedding_bf16, kpl_cpu_launch_kpl_embedding_bf16, EmbeddingParams, "`kpl_embedding_bf16` on the host.");
launcher!(kda_decode_f32, kpl_cpu_launch_kpl_kda_decode_f32, KdaDecodeParams, "`kpl_kda_decode_f32` on the host.");
launcher!(attn_res_mix_f32, kpl_cpu_launch_kpl_attn_res_mix_f32, AttnResParams, "`kpl_attn_res_mix_f32` on the host.");
launcher!(moe_route_f32, kpl_cpu_launch_kpl_moe_route_f32, MoeRouteParams, "`kpl_moe_route_f32` on the host.");
launcher!(kda_conv_f32, kpl_cpu_launch_kpl_kda_conv_f32, KdaConvParams, "`kpl_kda_conv_f32` on the host.");
launcher!(silu_glu_f32, kpl_cpu_launch_kpl_silu_glu_f32, GluParams, "`kpl_silu_glu_f32` on the host.");
launcher!(gelu_f32, kpl_cpu_launch_kpl_gelu_f32, GeluParams, "`kpl_gelu_f32` on the host.");
launcher!(rope_table_f32, kpl_cpu_launch_kpl_rope_table_f32, RopeTableParams, "`kpl_rope_table_f32` on the host.");
launcher!(
    logits_stats_f32,
    kpl_cpu_launch_kpl_logits_stats_f32,
    LogitsStatsParams,
    "`kpl_logits_stats_f32` on the host."
);
launcher!(
    fp8_quantize_f32,
    kpl_cpu_launch_kpl_fp8_quantize_f32,
    Fp8QuantizeParams,
    "`kpl_fp8_quantize_f32` on the host."
);
launcher!(topk_select_f32, kpl_cpu_launch_kpl_topk_select_f32, TopkParams, "`kpl_topk_select_f32` on the host.");
launcher!(
    mma_gemm_bf16,
    kpl_cpu_launch_kpl_mma_gemm_bf16,
    MmaGemmParams,
    "`kpl_mma_gemm_bf16` on the host: at wave 64 the emulated gfx950 MFMA, at wave 32 the emulated sm_90 mma."
);

/// A host address as the kernels' `u64` device-pointer fields carry it.
pub fn addr<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// A [`Backend`] whose ops with a kernel in `kernels/ops/` run that kernel on the host (through
/// kpl's CPU runtime, at the given wave size) and whose other ops are the CPU backend's: the
/// goldens run through it end to end, so the kernels are checked inside the real model.
pub struct KplHostBackend {
    pub wave: u32,
    cpu: kimi_kernels::CpuBackend,
}

impl KplHostBackend {
    pub fn new(wave: u32) -> KplHostBackend {
        KplHostBackend { wave, cpu: kimi_kernels::CpuBackend }
    }

    /// `kpl_rope_table_f32` over `x` (`[rows, heads, head_stride]`) with tables `[rows, pairs]`.
    fn rope_table(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize, offset: usize) {
        let row = heads * head_stride;
        let rows = x.len() / row.max(1);
        let pairs = cos.len() / rows.max(1);
        assert!(
            x.len() == rows * row
                && cos.len() == rows * pairs
                && sin.len() == cos.len()
                && offset + 2 * pairs <= head_stride,
            "rope: shapes"
        );
        let p = RopeTableParams {
            x: addr(x.as_mut_ptr()),
            cos: addr(cos.as_ptr()),
            sin: addr(sin.as_ptr()),
            rows: rows as u32,
            heads: heads as u32,
            head_stride: head_stride as u32,
            offset: offset as u32,
            pairs: pairs as u32,
            pad_: 0,
        };
        let l = Launch { grid: self.stride_grid(rows * heads * pairs), block: self.wave, wave: self.wave };
        // SAFETY: x holds rows × heads × head_stride values and every turned lane lies inside its
        // head; cos and sin hold rows × pairs (checked); all outlive the launch.
        unsafe { rope_table_f32(l, p) }
    }

    /// Blocks for a grid-stride kernel over `n` values: enough to cover them, at most 8.
    fn stride_grid(&self, n: usize) -> u32 {
        (n.div_ceil(self.wave as usize) as u32).clamp(1, 8)
    }
}

use kimi_kernels::{
    Backend, ExpertMatrices, KdaInputs, KdaParams, KdaSlot, Matrix, PackedMatrix, PagedRows, RouterParams, Routing,
    Selection, SeqSpan, SituParams as Situ,
};

impl Backend for KplHostBackend {
    fn describe(&self) -> String {
        format!("kpl host kernels (wave {}) over {}", self.wave, self.cpu.describe())
    }

    fn prepare_matrix(&self, w: &Matrix<'_>) -> Option<PackedMatrix> {
        self.cpu.prepare_matrix(w)
    }

    fn matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        self.cpu.matmul(w, x, tokens, out)
    }

    fn matmul_transposed(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        self.cpu.matmul_transposed(w, x, tokens, out)
    }

    fn embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) {
        let Matrix::Bf16(t) = table else { return self.cpu.embedding(table, ids, out) };
        assert_eq!(out.len(), ids.len() * t.cols, "embedding: out has {} values", out.len());
        assert!(ids.iter().all(|&i| (i as usize) < t.rows), "embedding: an id past the table");
        let p = EmbeddingParams {
            table: addr(t.data.as_ptr()),
            ids: addr(ids.as_ptr()),
            out: addr(out.as_mut_ptr()),
            tokens: ids.len() as u32,
            cols: t.cols as u32,
        };
        let l = Launch { grid: self.stride_grid(out.len()), block: self.wave, wave: self.wave };
        // SAFETY: the table holds rows × cols values and every id is below rows (checked); out
        // holds tokens × cols (checked); all outlive the launch.
        unsafe { embedding_bf16(l, p) }
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let cols = w.len();
        assert!(x.len() == out.len() && cols > 0 && x.len().is_multiple_of(cols), "rms_norm: shapes");
        let rows = x.len() / cols;
        let p = RmsnormParams {
            x: addr(x.as_ptr()),
            w: addr(w.as_ptr()),
            out: addr(out.as_mut_ptr()),
            rows: rows as u32,
            cols: cols as u32,
            eps,
            pad_: 0,
        };
        // SAFETY: x and out hold rows × cols values, w cols (checked); all outlive the launch.
        unsafe { rmsnorm_f32(Launch { grid: rows as u32, block: self.wave, wave: self.wave }, p) }
    }

    fn layer_norm(&self, x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        self.cpu.layer_norm(x, w, b, eps, out)
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        self.cpu.add(acc, x)
    }

    fn silu_glu(&self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "silu_glu: shapes");
        let p = GluParams { gate: addr(gate.as_mut_ptr()), up: addr(up.as_ptr()), n: gate.len() as u32, pad_: 0 };
        let l = Launch { grid: self.stride_grid(gate.len()), block: self.wave, wave: self.wave };
        // SAFETY: gate and up hold n values (checked) and outlive the launch.
        unsafe { silu_glu_f32(l, p) }
    }

    fn rope_interleaved(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        head_stride: usize,
        offset: usize,
        inv_freq: &[f32],
        magnitude: f32,
    ) {
        // The angles' tables on the host (the device has no math library; a GPU backend builds
        // them once per step the same way), the rotation in the kernel.
        let pairs = inv_freq.len();
        let (mut cos, mut sin) =
            (Vec::with_capacity(positions.len() * pairs), Vec::with_capacity(positions.len() * pairs));
        for &pos in positions {
            for &f in inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * magnitude);
                sin.push(angle.sin() * magnitude);
            }
        }
        self.rope_table(x, &cos, &sin, heads, head_stride, offset)
    }

    fn rope_cos_sin(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize) {
        self.rope_table(x, cos, sin, heads, head_stride, 0)
    }

    fn gelu(&self, x: &mut [f32], kind: kimi_kernels::Gelu) {
        let p =
            GeluParams { x: addr(x.as_mut_ptr()), n: x.len() as u32, erf: (kind == kimi_kernels::Gelu::Erf) as u32 };
        let l = Launch { grid: self.stride_grid(x.len()), block: self.wave, wave: self.wave };
        // SAFETY: x holds n values and outlives the launch.
        unsafe { gelu_f32(l, p) }
    }

    fn attention_varlen(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        dim: usize,
        spans: &[kimi_kernels::SeqSpan],
        scale: f32,
        out: &mut [f32],
    ) {
        self.cpu.attention_varlen(q, k, v, heads, dim, spans, scale, out)
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        self.cpu.sigmoid_mul(x, gate)
    }

    fn situ_glu(&self, gate: &mut [f32], up: &[f32], act: Situ) {
        assert_eq!(gate.len(), up.len(), "situ_glu: shapes");
        let p = SituParams {
            gate: addr(gate.as_mut_ptr()),
            up: addr(up.as_ptr()),
            n: gate.len() as u32,
            beta: act.beta,
            linear_beta: act.linear_beta.unwrap_or(0.0),
            has_linear_beta: act.linear_beta.is_some() as u32,
        };
        let l = Launch { grid: self.stride_grid(gate.len()), block: self.wave, wave: self.wave };
        // SAFETY: gate and up hold n values (checked) and outlive the launch.
        unsafe { situ_glu_f32(l, p) }
    }

    fn attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
        let dim = query.len();
        if cands.is_empty() || cands.len() > 32 || dim == 0 {
            return self.cpu.attn_res_mix(query, eps, cands, out);
        }
        assert!(out.len().is_multiple_of(dim) && cands.iter().all(|c| c.len() == out.len()), "attn_res_mix: shapes");
        let tokens = out.len() / dim;
        let table: Vec<u64> = cands.iter().map(|c| addr(c.as_ptr())).collect();
        let p = AttnResParams {
            query: addr(query.as_ptr()),
            cands: addr(table.as_ptr()),
            out: addr(out.as_mut_ptr()),
            tokens: tokens as u32,
            dim: dim as u32,
            n_cands: cands.len() as u32,
            eps,
        };
        // SAFETY: every candidate and out hold tokens × dim values, the query dim, the table one
        // address per candidate (checked); all outlive the launch.
        unsafe { attn_res_mix_f32(Launch { grid: tokens as u32, block: self.wave, wave: self.wave }, p) }
    }

    fn kda_conv(&self, x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
        let channels = taps.len() / kernel.max(1);
        if kernel == 0 || kernel > 8 || channels == 0 || spans.is_empty() {
            return self.cpu.kda_conv(x, spans, frames, taps, kernel);
        }
        assert!(
            spans.len() == frames.len()
                && frames.iter().all(|f| f.len() >= (kernel - 1) * channels)
                && spans.iter().all(|s| (s.start + s.len) * channels <= x.len()),
            "kda_conv: shapes"
        );
        let starts: Vec<u32> = spans.iter().map(|s| s.start as u32).collect();
        let lens: Vec<u32> = spans.iter().map(|s| s.len as u32).collect();
        let table: Vec<u64> = frames.iter_mut().map(|f| addr(f.as_mut_ptr())).collect();
        let p = KdaConvParams {
            x: addr(x.as_mut_ptr()),
            taps: addr(taps.as_ptr()),
            starts: addr(starts.as_ptr()),
            lens: addr(lens.as_ptr()),
            frames: addr(table.as_ptr()),
            seqs: spans.len() as u32,
            channels: channels as u32,
            kernel: kernel as u32,
            pad_: 0,
        };
        let chunks = channels.div_ceil(self.wave as usize);
        let l = Launch { grid: (spans.len() * chunks) as u32, block: self.wave, wave: self.wave };
        // SAFETY: every span's rows lie in x and every window holds (kernel − 1) × channels
        // values (checked); the tables were built here; each sequence's rows and window are its
        // own, and a thread touches one channel of one sequence; all outlive the launch.
        unsafe { kda_conv_f32(l, p) }
    }

    fn kda_recurrence(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) {
        // The decode kernel takes one token a sequence and keeps no snapshots; prefill chunks and
        // speculative verifies stay on the CPU backend.
        let (h, n) = (p.heads, p.head_dim);
        let decode = !spans.is_empty() && spans.iter().enumerate().all(|(i, s)| s.len == 1 && s.start == i);
        if !decode || n > 256 || slots.iter().any(|s| s.state.len() < h * n * n || !s.after_token.is_empty()) {
            return self.cpu.kda_recurrence(p, x, spans, slots, out);
        }
        let seqs = spans.len();
        let width = h * n;
        assert!(
            [x.q, x.k, x.v, x.z].iter().all(|a| a.len() >= seqs * width)
                && x.beta_logits.len() >= seqs * h
                && out.len() >= seqs * width
                && p.a_exp.len() >= h
                && p.dt_bias.len() >= width,
            "kda_recurrence: shapes"
        );
        let table: Vec<u64> = slots.iter_mut().map(|s| addr(s.state.as_mut_ptr())).collect();
        let params = KdaDecodeParams {
            q: addr(x.q.as_ptr()),
            k: addr(x.k.as_ptr()),
            v: addr(x.v.as_ptr()),
            z: addr(x.z.as_ptr()),
            beta_logits: addr(x.beta_logits.as_ptr()),
            a_exp: addr(p.a_exp.as_ptr()),
            dt_bias: addr(p.dt_bias.as_ptr()),
            slots: addr(table.as_ptr()),
            out: addr(out.as_mut_ptr()),
            seqs: seqs as u32,
            heads: h as u32,
            dim: n as u32,
            lower_bound: p.lower_bound,
            q_scale: 1.0 / (n as f32).sqrt(),
            pad_: 0,
        };
        let l = Launch { grid: (seqs * h) as u32, block: self.wave, wave: self.wave };
        // SAFETY: every input holds seqs rows (checked), every slot heads × dim × dim values
        // (checked), the table one address per sequence; all outlive the launch, and each
        // sequence's slot is its own (`&mut`), so blocks never share state.
        unsafe { kda_decode_f32(l, params) }
    }

    fn gated_rms_norm(&self, o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let dim = w.len();
        assert!(
            o.len() == gate.len() && o.len() == out.len() && dim > 0 && o.len().is_multiple_of(dim),
            "gated_rms_norm"
        );
        let groups = o.len() / dim;
        let p = GatedRmsnormParams {
            o: addr(o.as_ptr()),
            gate: addr(gate.as_ptr()),
            w: addr(w.as_ptr()),
            out: addr(out.as_mut_ptr()),
            groups: groups as u32,
            dim: dim as u32,
            eps,
            pad_: 0,
        };
        // SAFETY: o, gate and out hold groups × dim values, w dim (checked); all outlive the launch.
        unsafe { gated_rmsnorm_f32(Launch { grid: groups as u32, block: self.wave, wave: self.wave }, p) }
    }

    fn mla_absorb(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        q: &[f32],
        out: &mut [f32],
    ) {
        self.cpu.mla_absorb(w_kv, heads, nope, v_dim, tokens, q, out)
    }

    fn mla_lift(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        ctx: &[f32],
        out: &mut [f32],
    ) {
        self.cpu.mla_lift(w_kv, heads, nope, v_dim, tokens, ctx, out)
    }

    fn mla_attention(
        &self,
        q: &[f32],
        heads: usize,
        rank: usize,
        scale: f32,
        rows: &[(usize, usize)],
        caches: &[PagedRows<'_>],
        selected: Option<&[Selection]>,
        ctx: &mut [f32],
        lse: Option<&mut [f32]>,
    ) {
        self.cpu.mla_attention(q, heads, rank, scale, rows, caches, selected, ctx, lse)
    }

    fn attention_merge(&self, parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]) {
        self.cpu.attention_merge(parts, lses, width, out)
    }

    fn indexer_topk(
        &self,
        q: &[f32],
        w: &[f32],
        heads: usize,
        scale: f32,
        topk: usize,
        rows: &[(usize, usize)],
        keys: &[PagedRows<'_>],
    ) -> Vec<Selection> {
        self.cpu.indexer_topk(q, w, heads, scale, topk, rows, keys)
    }

    fn moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing {
        let e = p.bias.len();
        if e == 0 || e > 1024 || p.top_k == 0 || p.top_k > e || tokens == 0 {
            return self.cpu.moe_route(logits, tokens, p);
        }
        assert_eq!(logits.len(), tokens * e, "moe_route: logits are [tokens, experts]");
        let mut scores = vec![0f32; tokens * e];
        let mut ids = vec![0u32; tokens * p.top_k];
        let mut weights = vec![0f32; tokens * p.top_k];
        let mut margins = vec![0f32; tokens];
        let params = MoeRouteParams {
            logits: addr(logits.as_ptr()),
            bias: addr(p.bias.as_ptr()),
            scores: addr(scores.as_mut_ptr()),
            ids: addr(ids.as_mut_ptr()),
            weights: addr(weights.as_mut_ptr()),
            margins: addr(margins.as_mut_ptr()),
            tokens: tokens as u32,
            experts: e as u32,
            top_k: p.top_k as u32,
            renormalize: p.renormalize as u32,
            scaling: p.scaling,
            pad_: 0,
        };
        // SAFETY: logits hold tokens × experts (checked), bias experts; every output was sized
        // here; all outlive the launch.
        unsafe { moe_route_f32(Launch { grid: tokens as u32, block: self.wave, wave: self.wave }, params) };
        Routing { ids: ids.into_iter().map(|i| i as usize).collect(), weights, scores, margins, top_k: p.top_k }
    }

    fn moe_experts(
        &self,
        experts: &[ExpertMatrices<'_>],
        first: usize,
        routing: &Routing,
        z: &[f32],
        act: Situ,
        out: &mut [f32],
    ) {
        self.cpu.moe_experts(experts, first, routing, z, act, out)
    }
}
