//! The GPU kernels' side of the seam: the Rust mirrors of their parameter structs
//! (`kernels/include/kpl/abi.h`) and the manifest the ahead-of-time build writes. The kernels
//! themselves are `kernels/ops/*.cu` on the portability layer `kernels/include/kpl/`; they are
//! checked on the host by the `kimi-kpl-host` crate and compiled for gfx950 / gfx942 / sm_90 by
//! `scripts/build-gpu-kernels.sh`. `cuda` (feature `cuda`) loads and launches the built kernels
//! on an NVIDIA GPU for the device check; the model's device backends (HIP, CUDA) are not built
//! yet.

pub mod abi;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod manifest;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod runtime;
