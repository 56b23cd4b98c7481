//! The CPU backend: [`Backend`] on this crate's CPU kernels (one op per file beside this one).

use crate::backend::{
    Backend, ExpertMatrices, Gelu, KdaInputs, KdaParams, KdaSlot, PagedRows, RouterParams, Routing, Selection, SeqSpan,
    SituParams,
};
use crate::{Matrix, PackedMatrix};

/// Runs every op on the host's cores (rayon's global pool) with the best SIMD level detected.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        use super::packed::Mxfp4Tiles;
        let tiles = match (super::packed_amx::enabled(), super::packed::mxfp4_tiles()) {
            (true, Mxfp4Tiles::Always) => " + AMX tiles, MXFP4 too",
            (true, Mxfp4Tiles::Batched) => " + AMX tiles, MXFP4 from 6 tokens",
            (true, Mxfp4Tiles::PerSequence) => " + AMX tiles, MXFP4 for a sequence's 6+ tokens",
            (true, Mxfp4Tiles::Never) => " + AMX tiles",
            (false, _) => "",
        };
        format!("cpu ({:?}{tiles}, {} threads)", super::simd::simd_level(), rayon::current_num_threads())
    }

    fn prepare_matrix(&self, w: &Matrix<'_>) -> Option<PackedMatrix> {
        PackedMatrix::pack(w)
    }

    fn matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        super::gemm::matmul(w, x, tokens, out)
    }

    fn matmul_many(&self, ws: &[Matrix<'_>], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
        super::gemm::matmul_many(ws, x, tokens, outs)
    }

    fn matmul_transposed(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        super::gemm::matmul_transposed(w, x, tokens, out)
    }

    fn embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) {
        super::embedding::embedding(table, ids, out)
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        super::norm::rms_norm(x, w, eps, out)
    }

    fn layer_norm(&self, x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        super::norm::layer_norm(x, w, b, eps, out)
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        super::elementwise::add(acc, x)
    }

    fn silu_glu(&self, gate: &mut [f32], up: &[f32]) {
        super::elementwise::silu_glu(gate, up)
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
        super::rope::rope_interleaved(x, positions, heads, head_stride, offset, inv_freq, magnitude)
    }

    fn rope_cos_sin(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize) {
        super::rope::rope_cos_sin(x, cos, sin, heads, head_stride)
    }

    fn gelu(&self, x: &mut [f32], kind: Gelu) {
        super::gelu::gelu(x, kind)
    }

    fn attention_varlen(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        dim: usize,
        spans: &[SeqSpan],
        scale: f32,
        out: &mut [f32],
    ) {
        super::attention_varlen::attention_varlen(q, k, v, heads, dim, spans, scale, out)
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        super::elementwise::sigmoid_mul(x, gate)
    }

    fn situ_glu(&self, gate: &mut [f32], up: &[f32], act: SituParams) {
        super::situ::situ_rows(gate, up, act.beta, act.linear_beta)
    }

    fn attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
        super::attn_res::attn_res_mix(query, eps, cands, out)
    }

    fn kda_conv(&self, x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
        super::kda_conv::kda_conv(x, spans, frames, taps, kernel)
    }

    fn kda_recurrence(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) {
        super::kda_recurrence::kda_recurrence(p, x, spans, slots, out)
    }

    fn gated_rms_norm(&self, o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        super::norm::gated_rms_norm(o, gate, w, eps, out)
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
        super::mla_latent::mla_absorb(w_kv, heads, nope, v_dim, tokens, q, out)
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
        super::mla_latent::mla_lift(w_kv, heads, nope, v_dim, tokens, ctx, out)
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
        super::mla_attention::mla_attention(q, heads, rank, scale, rows, caches, selected, ctx, lse)
    }

    fn attention_merge(&self, parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]) {
        super::attention_merge::attention_merge(parts, lses, width, out)
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
        super::indexer::indexer_topk(q, w, heads, scale, topk, rows, keys)
    }

    fn moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing {
        super::moe::moe_route(logits, tokens, p)
    }

    fn moe_experts(
        &self,
        experts: &[ExpertMatrices<'_>],
        first: usize,
        routing: &Routing,
        z: &[f32],
        spans: &[SeqSpan],
        act: SituParams,
        out: &mut [f32],
    ) {
        super::moe::moe_experts(experts, first, routing, z, spans, act, out)
    }
}
