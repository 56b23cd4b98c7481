//! [`ProfiledBackend`]: another backend with each op call timed and the weight bytes it read
//! counted, per op and weight shape (`kimi-host bench forward --op-profile`). The model's op-kind
//! shares say which layer kind is slow; this says which op, and how far its product runs from
//! the memory roof.
//!
//! Times are each call's wall time on the calling thread. Calls that run side by side (KDA's
//! convolution beside its gate's second factor, tensor-parallel ranks) overlap, so their sum may
//! exceed the step's time. While switched off the wrapper only forwards (one atomic load a call).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{
    Backend, ExpertMatrices, Gelu, KdaInputs, KdaParams, KdaSlot, Matrix, PackedMatrix, PagedRows, RouterParams,
    Routing, Selection, SeqSpan, SituParams,
};

/// One op label's totals since the last [`ProfiledBackend::reset`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpStat {
    pub calls: u64,
    pub time: Duration,
    /// Weight bytes the calls read (products, routed experts, MLA's head maps, embedding rows);
    /// 0 for ops that read activations and state only.
    pub weight_bytes: u64,
}

/// Wraps `inner`, timing every op while [`ProfiledBackend::set_enabled`] is on.
pub struct ProfiledBackend {
    inner: Arc<dyn Backend>,
    enabled: AtomicBool,
    stats: Mutex<HashMap<String, OpStat>>,
}

impl ProfiledBackend {
    /// A wrapper around `inner`, switched on.
    pub fn new(inner: Arc<dyn Backend>) -> ProfiledBackend {
        ProfiledBackend { inner, enabled: AtomicBool::new(true), stats: Mutex::new(HashMap::new()) }
    }

    /// Switches timing on or off (off: calls are only forwarded).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Forgets every total.
    pub fn reset(&self) {
        self.stats.lock().clear();
    }

    /// Every label's totals, most time first (ties by label).
    pub fn snapshot(&self) -> Vec<(String, OpStat)> {
        let mut v: Vec<(String, OpStat)> = self.stats.lock().iter().map(|(k, s)| (k.clone(), s.clone())).collect();
        v.sort_by(|a, b| b.1.time.cmp(&a.1.time).then_with(|| a.0.cmp(&b.0)));
        v
    }

    /// Runs `f`, adding its time and `bytes` under `label()` when switched on.
    fn timed<R>(&self, label: impl FnOnce() -> String, bytes: impl FnOnce() -> usize, f: impl FnOnce() -> R) -> R {
        if !self.enabled.load(Ordering::Relaxed) {
            return f();
        }
        let t = Instant::now();
        let r = f();
        let took = t.elapsed();
        let (label, bytes) = (label(), bytes() as u64);
        let mut stats = self.stats.lock();
        let s = stats.entry(label).or_default();
        s.calls += 1;
        s.time += took;
        s.weight_bytes += bytes;
        r
    }
}

/// `op format rows×cols`, e.g. `matmul bf16 panels 2048×2048`.
fn product_label(op: &str, w: &Matrix<'_>) -> String {
    format!("{op} {} {}×{}", w.format(), w.rows(), w.cols())
}

/// Bytes of `rows` of `w`'s rows (a head's slice of MLA's `kv_b`).
fn row_bytes(w: &Matrix<'_>, rows: usize) -> usize {
    w.bytes() / w.rows().max(1) * rows
}

impl Backend for ProfiledBackend {
    fn describe(&self) -> String {
        format!("{}, profiled", self.inner.describe())
    }

    fn prepare_matrix(&self, w: &Matrix<'_>) -> Option<PackedMatrix> {
        self.inner.prepare_matrix(w)
    }

    fn matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        self.timed(|| product_label("matmul", w), || w.bytes(), || self.inner.matmul(w, x, tokens, out))
    }

    fn matmul_many(&self, ws: &[Matrix<'_>], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
        let label = || match ws.first() {
            Some(w) => format!("matmul_many ×{} {} (first {}×{})", ws.len(), w.format(), w.rows(), w.cols()),
            None => "matmul_many ×0".to_string(),
        };
        let bytes = || ws.iter().map(Matrix::bytes).sum();
        self.timed(label, bytes, || self.inner.matmul_many(ws, x, tokens, outs))
    }

    fn matmul_transposed(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        let run = || self.inner.matmul_transposed(w, x, tokens, out);
        self.timed(|| product_label("matmul_transposed", w), || w.bytes(), run)
    }

    fn embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) {
        let bytes = || row_bytes(table, ids.len());
        self.timed(|| "embedding".to_string(), bytes, || self.inner.embedding(table, ids, out))
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        self.timed(|| "rms_norm".to_string(), || 0, || self.inner.rms_norm(x, w, eps, out))
    }

    fn layer_norm(&self, x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        self.timed(|| "layer_norm".to_string(), || 0, || self.inner.layer_norm(x, w, b, eps, out))
    }

    fn silu_glu(&self, gate: &mut [f32], up: &[f32]) {
        self.timed(|| "silu_glu".to_string(), || 0, || self.inner.silu_glu(gate, up))
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
        let run = || self.inner.rope_interleaved(x, positions, heads, head_stride, offset, inv_freq, magnitude);
        self.timed(|| "rope_interleaved".to_string(), || 0, run)
    }

    fn rope_cos_sin(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize) {
        let run = || self.inner.rope_cos_sin(x, cos, sin, heads, head_stride);
        self.timed(|| "rope_cos_sin".to_string(), || 0, run)
    }

    fn gelu(&self, x: &mut [f32], kind: Gelu) {
        self.timed(|| "gelu".to_string(), || 0, || self.inner.gelu(x, kind))
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
        let run = || self.inner.attention_varlen(q, k, v, heads, dim, spans, scale, out);
        self.timed(|| "attention_varlen".to_string(), || 0, run)
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        self.timed(|| "add".to_string(), || 0, || self.inner.add(acc, x))
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        self.timed(|| "sigmoid_mul".to_string(), || 0, || self.inner.sigmoid_mul(x, gate))
    }

    fn situ_glu(&self, gate: &mut [f32], up: &[f32], act: SituParams) {
        self.timed(|| "situ_glu".to_string(), || 0, || self.inner.situ_glu(gate, up, act))
    }

    fn attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
        self.timed(|| "attn_res_mix".to_string(), || 0, || self.inner.attn_res_mix(query, eps, cands, out))
    }

    fn kda_conv(&self, x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
        let run = || self.inner.kda_conv(x, spans, frames, taps, kernel);
        self.timed(|| "kda_conv".to_string(), || 0, run)
    }

    fn kda_recurrence(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) {
        let run = || self.inner.kda_recurrence(p, x, spans, slots, out);
        self.timed(|| "kda_recurrence".to_string(), || 0, run)
    }

    fn gated_rms_norm(&self, o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let run = || self.inner.gated_rms_norm(o, gate, w, eps, out);
        self.timed(|| "gated_rms_norm".to_string(), || 0, run)
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
        let run = || self.inner.mla_absorb(w_kv, heads, nope, v_dim, tokens, q, out);
        self.timed(|| product_label("mla_absorb", w_kv), || row_bytes(w_kv, heads * nope), run)
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
        let run = || self.inner.mla_lift(w_kv, heads, nope, v_dim, tokens, ctx, out);
        self.timed(|| product_label("mla_lift", w_kv), || row_bytes(w_kv, heads * v_dim), run)
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
        let run = || self.inner.mla_attention(q, heads, rank, scale, rows, caches, selected, ctx, lse);
        self.timed(|| "mla_attention".to_string(), || 0, run)
    }

    fn attention_merge(&self, parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]) {
        let run = || self.inner.attention_merge(parts, lses, width, out);
        self.timed(|| "attention_merge".to_string(), || 0, run)
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
        let run = || self.inner.indexer_topk(q, w, heads, scale, topk, rows, keys);
        self.timed(|| "indexer_topk".to_string(), || 0, run)
    }

    fn moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing {
        self.timed(|| "moe_route".to_string(), || 0, || self.inner.moe_route(logits, tokens, p))
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
        let label = || match experts.first() {
            Some(e) => format!("moe_experts {} {}×{}", e.w1.format(), e.w1.rows(), e.w1.cols()),
            None => "moe_experts".to_string(),
        };
        // Each expert the step's tokens chose (among those held here) is read once.
        let bytes = || {
            let mut chosen = vec![false; experts.len()];
            for &id in &routing.ids {
                if let Some(c) = id.checked_sub(first).and_then(|e| chosen.get_mut(e)) {
                    *c = true;
                }
            }
            experts
                .iter()
                .zip(&chosen)
                .filter(|(_, c)| **c)
                .map(|(e, _)| e.w1.bytes() + e.w2.bytes() + e.w3.bytes())
                .sum()
        };
        let run = || self.inner.moe_experts(experts, first, routing, z, spans, act, out);
        self.timed(label, bytes, run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bf16Matrix, CpuBackend, f32_to_bf16_bits};

    /// The wrapper forwards (same outputs as the backend it wraps), counts each call under its
    /// op and shape with the weight's bytes, and counts nothing while switched off.
    #[test]
    fn forwards_and_counts_calls() {
        let (rows, cols) = (48, 64);
        let bits: Vec<u16> = (0..rows * cols).map(|i| f32_to_bf16_bits(((i * 7) % 13) as f32 / 8.0 - 0.75)).collect();
        let w = Matrix::Bf16(Bf16Matrix { data: &bits, rows, cols });
        let x: Vec<f32> = (0..2 * cols).map(|i| (i % 5) as f32 - 2.0).collect();
        let cpu = Arc::new(CpuBackend);
        let prof = ProfiledBackend::new(cpu.clone());
        let mut want = vec![0f32; 2 * rows];
        cpu.matmul(&w, &x, 2, &mut want);
        let mut got = vec![0f32; 2 * rows];
        prof.matmul(&w, &x, 2, &mut got);
        prof.matmul(&w, &x, 2, &mut got);
        assert_eq!(got, want);
        let mut y = vec![0f32; 2 * cols];
        prof.rms_norm(&x, &vec![1.0; cols], 1e-6, &mut y);
        let stats = prof.snapshot();
        let matmul = stats.iter().find(|(k, _)| k == "matmul bf16 48×64").expect("the product is counted");
        assert_eq!((matmul.1.calls, matmul.1.weight_bytes), (2, 2 * 2 * (rows * cols) as u64));
        let norm = stats.iter().find(|(k, _)| k == "rms_norm").expect("the norm is counted");
        assert_eq!((norm.1.calls, norm.1.weight_bytes), (1, 0));
        assert_eq!(stats.len(), 2);

        prof.set_enabled(false);
        prof.rms_norm(&x, &vec![1.0; cols], 1e-6, &mut y);
        assert_eq!(prof.snapshot().iter().map(|(_, s)| s.calls).sum::<u64>(), 3, "nothing counted while off");
        prof.reset();
        assert!(prof.snapshot().is_empty());
    }
}
