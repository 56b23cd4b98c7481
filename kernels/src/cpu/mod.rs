//! CPU backend ([`backend::CpuBackend`]): one op per file — matrix products (`gemm`, over the
//! weight formats in `bf16` and `mxfp4`), `embedding`, norms (`norm`), `elementwise`, `situ`,
//! `attn_res`, the KDA convolution, core and recurrence (`kda_conv`, `kda`, `kda_recurrence`),
//! MLA's latent maps and attention (`mla_latent`, `mla_attention`), the K3.1 `indexer`, the MoE
//! router and grouped experts (`moe`), and the vision tower's `gelu`, `attention_varlen` and
//! table-driven `rope` — on SIMD inner loops (`simd`) and reductions (`reduce`). `unit_rates`
//! measures the core's FMA and AVX-512-BF16 multiply-add rates (why products stay on FMA without AMX).

pub mod aligned;
pub mod attention_merge;
pub mod attention_varlen;
pub mod attn_res;
pub mod backend;
pub mod bf16;
pub mod disjoint;
pub mod elementwise;
pub mod embedding;
pub mod fp8;
pub mod gelu;
pub mod gemm;
pub mod indexer;
pub mod kda;
pub mod kda_conv;
pub mod kda_recurrence;
pub mod kept;
pub mod mla_attention;
pub mod mla_latent;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod packed;
pub mod packed_amx;
pub mod reduce;
pub mod rope;
pub mod simd;
pub mod situ;
pub mod unit_rates;

/// Test inputs: a xorshift stream of values uniform in [−0.5, 0.5) from a non-zero seed.
#[cfg(test)]
pub(crate) fn uniform_stream(mut s: u32) -> impl FnMut() -> f32 {
    move || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    }
}
