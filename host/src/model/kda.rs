//! Kimi Delta Attention layer (spec §2.4): projections, short convolutions, gates, the delta-rule
//! core (chunked for prefill, recurrent for decode; the backend's `kda_recurrence`), the
//! sigmoid-gated output norm and `o_proj`.

use std::ops::Range;

use kimi_kernels::{Backend, KdaInputs, KdaParams, KdaSlot, SeqSpan};

use super::config::TextConfig;
use super::error::ModelError;
use super::scratch::{Buf, Scratch};
use super::shard::Shard;
use super::state::KdaStateMut;
use super::weights::{Part, TensorSource, Weight};

/// The output-gate projection: full rank (K3) or low rank `g_b(g_a x)`.
enum OutputGate {
    Full(Weight),
    LowRank(Weight, Weight),
}

pub struct KdaLayer {
    q_proj: Weight,
    k_proj: Weight,
    v_proj: Weight,
    f_a: Weight,
    f_b: Weight,
    b_proj: Weight,
    gate: OutputGate,
    /// Depthwise conv taps `[P, W]`, oldest → newest, for q, k, v.
    conv: [Vec<f32>; 3],
    /// exp(A_log[h]) per head (first H stored values).
    a_exp: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
    o_proj: Weight,
    heads: usize,
    head_dim: usize,
    kernel: usize,
    lower_bound: f32,
    eps: f32,
}

impl KdaLayer {
    /// Loads the layer, or rank `sh`'s part of it: its heads of q/k/v, `f_b`, β, the output gate,
    /// the convolutions, `A_log` and `dt_bias`, and the matching input columns of `o_proj` (whose
    /// partial output the caller all-reduces); `f_a`, a low-rank gate's `g_a` and the output norm
    /// are replicated.
    pub fn load(src: &mut dyn TensorSource, prefix: &str, c: &TextConfig, sh: Shard) -> Result<KdaLayer, ModelError> {
        let d = c.hidden_size;
        let (h, k, w) = (c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel);
        let p = h * k;
        let heads = sh.heads(h);
        let chans = heads.start * k..heads.end * k;
        let rows = |r: &Range<usize>, n: usize| if r.len() == n { Part::Whole } else { Part::Rows(r.clone()) };
        let cols = |r: &Range<usize>, n: usize| if r.len() == n { Part::Whole } else { Part::Cols(r.clone()) };
        let n = |s: &str| format!("{prefix}.{s}");
        let gate = if c.kda.full_rank_gate {
            OutputGate::Full(src.matrix_part(&n("g_proj.weight"), p, d, rows(&chans, p))?)
        } else {
            OutputGate::LowRank(
                src.matrix(&n("g_a_proj.weight"), k, d)?,
                src.matrix_part(&n("g_b_proj.weight"), p, k, rows(&chans, p))?,
            )
        };
        // A_log ships padded to max(H, head_dim) entries (the release: [128] for 96 heads); the
        // gate is per head, so the padding must be exactly zero.
        let a_name = n("A_log");
        let a_log = match src.vector(&a_name, &[h.max(k)]) {
            Err(ModelError::Shape { .. }) if k > h => src.vector(&a_name, &[h])?,
            r => r?,
        };
        if a_log[h..].iter().any(|v| *v != 0.0) {
            return Err(ModelError::config(
                &a_name,
                format!("entries {h}.. must be zero padding (A_log is per head, {h} heads)"),
            ));
        }
        let mut conv = |s: &str| -> Result<Vec<f32>, ModelError> { src.vector_part(&n(s), &[p, 1, w], chans.clone()) };
        let conv = [conv("q_conv1d.weight")?, conv("k_conv1d.weight")?, conv("v_conv1d.weight")?];
        Ok(KdaLayer {
            q_proj: src.matrix_part(&n("q_proj.weight"), p, d, rows(&chans, p))?,
            k_proj: src.matrix_part(&n("k_proj.weight"), p, d, rows(&chans, p))?,
            v_proj: src.matrix_part(&n("v_proj.weight"), p, d, rows(&chans, p))?,
            f_a: src.matrix(&n("f_a_proj.weight"), k, d)?,
            f_b: src.matrix_part(&n("f_b_proj.weight"), p, k, rows(&chans, p))?,
            b_proj: src.matrix_part(&n("b_proj.weight"), h, d, rows(&heads, h))?,
            gate,
            conv,
            a_exp: a_log[heads.clone()].iter().map(|a| a.exp()).collect(),
            dt_bias: src.vector_part(&n("dt_bias"), &[p], chans.clone())?,
            o_norm: src.vector(&n("o_norm.weight"), &[k])?,
            o_proj: src.matrix_part(&n("o_proj.weight"), d, p, cols(&chans, p))?,
            heads: heads.len(),
            head_dim: k,
            kernel: w,
            lower_bound: c.kda.gate_lower_bound,
            eps: c.rms_norm_eps,
        })
    }

    /// Every weight the layer keeps.
    pub fn weights(&self) -> Vec<&Weight> {
        let mut v = vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.f_a, &self.f_b, &self.b_proj, &self.o_proj];
        match &self.gate {
            OutputGate::Full(g) => v.push(g),
            OutputGate::LowRank(a, b) => v.extend([a, b]),
        }
        v
    }

    /// Every weight the layer multiplies by.
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        let mut v = vec![&mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.f_a, &mut self.f_b];
        v.extend([&mut self.b_proj, &mut self.o_proj]);
        match &mut self.gate {
            OutputGate::Full(g) => v.push(g),
            OutputGate::LowRank(a, b) => v.extend([a, b]),
        }
        v
    }

    /// x: `[T, d]` (post `input_layernorm`) for every sequence of the step; `states[s]` belongs to
    /// `spans[s]` and advances by its tokens. Projections run once over all T rows; the short
    /// convolution and the delta-rule core run per sequence, reading that sequence's state. A
    /// state with per-token snapshots (a speculative verify) gets every token's state in them.
    pub fn forward<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        x: &[f32],
        spans: &[SeqSpan],
        states: &mut [KdaStateMut<'_>],
    ) -> Buf<'s> {
        let (h, k) = (self.heads, self.head_dim);
        let p = h * k;
        let tokens: usize = spans.iter().map(|s| s.len).sum();
        // Every projection of x in one op; the low-rank gates' second factors follow.
        let [q, kk, v, fa, beta_logits, gate_x] = match &self.gate {
            OutputGate::Full(g) => Weight::matmul_many(
                [&self.q_proj, &self.k_proj, &self.v_proj, &self.f_a, &self.b_proj, g],
                be,
                sc,
                x,
                tokens,
            ),
            OutputGate::LowRank(a, _) => Weight::matmul_many(
                [&self.q_proj, &self.k_proj, &self.v_proj, &self.f_a, &self.b_proj, a],
                be,
                sc,
                x,
                tokens,
            ),
        };
        let mut branches = [q, kk, v];
        // The convolutions (a decode token's are serial and read cold state) and the gate's
        // second factor are independent: they run side by side.
        let convolve = || {
            for (b, raw) in branches.iter_mut().enumerate() {
                for (st, span) in states.iter_mut().zip(spans) {
                    if !st.after_token.is_empty() {
                        st.snapshot_conv(b, &raw[span.start * p..(span.start + span.len) * p]);
                    }
                }
                let mut frames: Vec<&mut [f32]> = states.iter_mut().map(|s| s.conv_frames_mut(b)).collect();
                be.kda_conv(raw, spans, &mut frames, &self.conv[b], self.kernel);
            }
        };
        let ((), z) = rayon::join(convolve, || self.f_b.matmul(be, sc, &fa, tokens));
        let [q, kk, v] = branches;
        let r = match &self.gate {
            OutputGate::Full(_) => gate_x,
            OutputGate::LowRank(_, b) => b.matmul(be, sc, &gate_x, tokens),
        };
        let params = KdaParams {
            heads: h,
            head_dim: k,
            a_exp: &self.a_exp,
            dt_bias: &self.dt_bias,
            lower_bound: self.lower_bound,
        };
        let inputs = KdaInputs { q: &q, k: &kk, v: &v, z: &z, beta_logits: &beta_logits };
        let mut slots: Vec<KdaSlot<'_>> = states
            .iter_mut()
            .map(|s| KdaSlot {
                state: &mut *s.recurrent,
                after_token: s.after_token.iter_mut().map(|a| &mut *a.recurrent).collect(),
            })
            .collect();
        let mut o = sc.zeroed(tokens * p);
        be.kda_recurrence(&params, &inputs, spans, &mut slots, &mut o);
        // Sigmoid-gated RMSNorm per head, then o_proj.
        let mut y = sc.for_overwrite(tokens * p);
        be.gated_rms_norm(&o, &r, &self.o_norm, self.eps, &mut y);
        self.o_proj.matmul(be, sc, &y, tokens)
    }
}
