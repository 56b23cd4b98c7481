//! `#[repr(C)]` mirrors of `kernels/include/kpl/abi.h`, one per kernel entry point. Device
//! pointers are `u64` here (a device address is not a host pointer); the host-mode build passes
//! host addresses through the same fields. `kimi-kpl-host` checks every size against the C side;
//! deriving `Pod` checks at compile time that no struct has implicit padding.

/// `kpl_rmsnorm_f32`: one block per row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RmsnormParams {
    pub x: u64,
    pub w: u64,
    pub out: u64,
    pub rows: u32,
    pub cols: u32,
    pub eps: f32,
    pub pad_: u32,
}

/// `kpl_gated_rmsnorm_f32`: one block per (row, head) group of `dim` values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GatedRmsnormParams {
    pub o: u64,
    pub gate: u64,
    pub w: u64,
    pub out: u64,
    pub groups: u32,
    pub dim: u32,
    pub eps: f32,
    pub pad_: u32,
}

/// `kpl_situ_glu_f32`: grid-stride over `n` values, in place over `gate`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SituParams {
    pub gate: u64,
    pub up: u64,
    pub n: u32,
    pub beta: f32,
    pub linear_beta: f32,
    pub has_linear_beta: u32,
}

/// `kpl_silu_glu_f32`: grid-stride over `n` values, in place over `gate`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GluParams {
    pub gate: u64,
    pub up: u64,
    pub n: u32,
    pub pad_: u32,
}

/// `kpl_gelu_f32`: grid-stride over `n` values in place; `erf` 1 for the exact form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GeluParams {
    pub x: u64,
    pub n: u32,
    pub erf: u32,
}

/// `kpl_rope_table_f32`: grid-stride over `rows · heads · pairs` lane pairs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeTableParams {
    pub x: u64,
    pub cos: u64,
    pub sin: u64,
    pub rows: u32,
    pub heads: u32,
    pub head_stride: u32,
    pub offset: u32,
    pub pairs: u32,
    pub pad_: u32,
}

/// `kpl_embedding_bf16`: grid-stride over `tokens · cols` values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbeddingParams {
    pub table: u64,
    pub ids: u64,
    pub out: u64,
    pub tokens: u32,
    pub cols: u32,
}

/// `kpl_kda_decode_f32`: one block per (sequence, head); `slots` is a device array of each
/// sequence's state address (the slot table).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KdaDecodeParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub z: u64,
    pub beta_logits: u64,
    pub a_exp: u64,
    pub dt_bias: u64,
    pub slots: u64,
    pub out: u64,
    pub seqs: u32,
    pub heads: u32,
    pub dim: u32,
    pub lower_bound: f32,
    pub q_scale: f32,
    pub pad_: u32,
}

/// `kpl_attn_res_mix_f32`: one block per token; `cands` is a device table of `n_cands` (≤ 32)
/// block addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnResParams {
    pub query: u64,
    pub cands: u64,
    pub out: u64,
    pub tokens: u32,
    pub dim: u32,
    pub n_cands: u32,
    pub eps: f32,
}

/// `kpl_moe_route_f32`: one block per token; `ids` are u32 expert ids, `[tokens, top_k]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MoeRouteParams {
    pub logits: u64,
    pub bias: u64,
    pub scores: u64,
    pub ids: u64,
    pub weights: u64,
    pub margins: u64,
    pub tokens: u32,
    pub experts: u32,
    pub top_k: u32,
    pub renormalize: u32,
    pub scaling: f32,
    pub pad_: u32,
}

/// `kpl_kda_conv_f32`: grid `seqs × ceil(channels / block)`; `starts` / `lens` are u32 per
/// sequence and `frames` a device table of each sequence's window.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KdaConvParams {
    pub x: u64,
    pub taps: u64,
    pub starts: u64,
    pub lens: u64,
    pub frames: u64,
    pub seqs: u32,
    pub channels: u32,
    pub kernel: u32,
    pub pad_: u32,
}

/// `kpl_mma_gemm_bf16`: `c = a · bᵀ` on the matrix cores, a wave per output tile.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MmaGemmParams {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub pad_: u32,
}

/// `kpl_topk_select_f32`: per row of `n` scores, the top `k` positions (ascending) and their count.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TopkParams {
    pub scores: u64,
    pub out: u64,
    pub count: u64,
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    pub pad_: u32,
}

/// `kpl_logits_stats_f32`: per row, max, argmax (lowest index) and log-sum-exp at a temperature.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LogitsStatsParams {
    pub logits: u64,
    pub max: u64,
    pub argmax: u64,
    pub lse: u64,
    pub rows: u32,
    pub cols: u32,
    pub inv_temperature: f32,
    pub pad_: u32,
}

/// `kpl_fp8_quantize_f32`: per token row, the ptpc_fp8 scale and the E4M3 codes of x / scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Fp8QuantizeParams {
    pub x: u64,
    pub codes: u64,
    pub scales: u64,
    pub rows: u32,
    pub cols: u32,
}
