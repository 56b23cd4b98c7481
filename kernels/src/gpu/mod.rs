//! The GPU kernels' side of the seam: the Rust mirrors of their parameter structs
//! (`kernels/include/kpl/abi.h`) and the manifest the ahead-of-time build writes. The kernels
//! themselves are `kernels/ops/*.cu` on the portability layer `kernels/include/kpl/`; they are
//! checked on the host by the `kimi-kpl-host` crate and compiled for gfx950 / gfx942 / sm_90 by
//! `scripts/build-gpu-kernels.sh`. [`device::GpuDevice`] is one interface over a runtime with
//! the built kernels loaded — `cuda` (feature `cuda`, cudarc) and `hip` (dlopened) — and
//! [`backend::GpuBackend`] runs the model's ops on any of them (staged through device memory,
//! the ops without a device path on the CPU); `kimi-kpl-host`'s host device runs it in CI.

pub mod abi;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod hip;
pub mod manifest;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod runtime;
