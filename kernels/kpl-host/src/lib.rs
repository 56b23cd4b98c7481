//! The GPU kernels run on the host: `kernels/ops/*.cu` built with kpl's CPU runtime (each GPU
//! thread a std::thread, the wave size a launch parameter). Tests check them against the Rust
//! CPU backend at wave 32 and 64, the two wave sizes of the targets (sm_90, gfx950).

use std::sync::mpsc;
use std::time::Duration;

use kimi_kernels::gpu::abi::{EmbeddingParams, GatedRmsnormParams, RmsnormParams, SituParams};

unsafe extern "C" {
    fn kpl_cpu_launch_kpl_rmsnorm_f32(grid: u32, block: u32, wave: u32, p: *const RmsnormParams);
    fn kpl_cpu_launch_kpl_gated_rmsnorm_f32(grid: u32, block: u32, wave: u32, p: *const GatedRmsnormParams);
    fn kpl_cpu_launch_kpl_situ_glu_f32(grid: u32, block: u32, wave: u32, p: *const SituParams);
    fn kpl_cpu_launch_kpl_embedding_bf16(grid: u32, block: u32, wave: u32, p: *const EmbeddingParams);
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

/// A host address as the kernels' `u64` device-pointer fields carry it.
pub fn addr<T>(p: *const T) -> u64 {
    p as usize as u64
}
