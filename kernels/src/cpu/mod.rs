//! CPU backend: SIMD inner loops (`simd`), weight formats (`bf16`, `mxfp4`), threaded matrix
//! products (`gemm`), the SiTU activation (`situ`) and the Kimi Delta Attention core (`kda`).

pub mod bf16;
pub mod gemm;
pub mod kda;
pub mod mxfp4;
pub mod reduce;
pub mod simd;
pub mod situ;
