//! The GPU kernels run on the host: `kernels/ops/*.cu` built with kpl's CPU runtime (each GPU
//! thread a std::thread, the wave size a launch parameter). Tests check them against the Rust
//! CPU backend at wave 32 and 64, the two wave sizes of the targets (sm_90, gfx950).

use std::sync::mpsc;
use std::time::Duration;

pub mod device;

pub use device::HostDevice;
use kimi_kernels::gpu::backend::GpuBackend;

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

/// The model's GPU backend ([`GpuBackend`]) over the host build at `wave` lanes a wave: its ops
/// with a kernel in `kernels/ops/` run that kernel here, staged through "device" memory exactly
/// as on a GPU, and its other ops are the CPU backend's. The goldens run through it end to end,
/// so the kernels and the backend's op mapping are checked inside the real model.
pub fn host_backend(wave: u32) -> GpuBackend {
    GpuBackend::new(std::sync::Arc::new(HostDevice::new(wave)))
}
