//! Kimi Delta Attention layer (spec §2.4): projections, short convolutions, gates, the delta-rule
//! core (chunked for prefill, recurrent for decode; kernels in `kimi_kernels::cpu::kda`), the
//! sigmoid-gated output norm and `o_proj`.

use rayon::prelude::*;

use kimi_kernels::cpu::kda::{kda_prefill, kda_step};

use super::batch::Span;
use super::config::TextConfig;
use super::error::ModelError;
use super::norm::{inv_rms, l2_norm, sigmoid, silu};
use super::state::KdaState;
use super::weights::{TensorSource, Weight};

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
    pub fn load(src: &mut dyn TensorSource, prefix: &str, c: &TextConfig) -> Result<KdaLayer, ModelError> {
        let d = c.hidden_size;
        let (h, k, w) = (c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel);
        let p = h * k;
        let n = |s: &str| format!("{prefix}.{s}");
        let gate = if c.kda.full_rank_gate {
            OutputGate::Full(src.matrix(&n("g_proj.weight"), p, d)?)
        } else {
            OutputGate::LowRank(src.matrix(&n("g_a_proj.weight"), k, d)?, src.matrix(&n("g_b_proj.weight"), p, k)?)
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
        let mut conv = |s: &str| -> Result<Vec<f32>, ModelError> { src.vector(&n(s), &[p, 1, w]) };
        let conv = [conv("q_conv1d.weight")?, conv("k_conv1d.weight")?, conv("v_conv1d.weight")?];
        Ok(KdaLayer {
            q_proj: src.matrix(&n("q_proj.weight"), p, d)?,
            k_proj: src.matrix(&n("k_proj.weight"), p, d)?,
            v_proj: src.matrix(&n("v_proj.weight"), p, d)?,
            f_a: src.matrix(&n("f_a_proj.weight"), k, d)?,
            f_b: src.matrix(&n("f_b_proj.weight"), p, k)?,
            b_proj: src.matrix(&n("b_proj.weight"), h, d)?,
            gate,
            conv,
            a_exp: a_log[..h].iter().map(|a| a.exp()).collect(),
            dt_bias: src.vector(&n("dt_bias"), &[p])?,
            o_norm: src.vector(&n("o_norm.weight"), &[k])?,
            o_proj: src.matrix(&n("o_proj.weight"), d, p)?,
            heads: h,
            head_dim: k,
            kernel: w,
            lower_bound: c.kda.gate_lower_bound,
            eps: c.rms_norm_eps,
        })
    }

    /// x: `[T, d]` (post `input_layernorm`) for every sequence of the step; `states[s]` belongs to
    /// `spans[s]` and advances by its tokens. Projections run once over all T rows; the short
    /// convolution and the delta-rule core run per sequence (per head), reading that sequence's
    /// state.
    pub fn forward(&self, x: &[f32], spans: &[Span], states: &mut [&mut KdaState]) -> Vec<f32> {
        let (h, k) = (self.heads, self.head_dim);
        let p = h * k;
        let tokens: usize = spans.iter().map(|s| s.len).sum();
        let mut branches =
            [self.q_proj.matmul(x, tokens), self.k_proj.matmul(x, tokens), self.v_proj.matmul(x, tokens)];
        for (b, raw) in branches.iter_mut().enumerate() {
            for (span, state) in spans.iter().zip(states.iter_mut()) {
                let rows = &mut raw[span.start * p..(span.start + span.len) * p];
                self.short_conv(rows, &self.conv[b], state.conv_frames_mut(b));
            }
        }
        let [q, kk, v] = branches;
        let z = self.f_b.matmul(&self.f_a.matmul(x, tokens), tokens);
        let beta_logits = self.b_proj.matmul(x, tokens);
        let r = match &self.gate {
            OutputGate::Full(g) => g.matmul(x, tokens),
            OutputGate::LowRank(a, b) => b.matmul(&a.matmul(x, tokens), tokens),
        };

        // One job per (sequence, head): each owns that head's recurrent matrix.
        let jobs: Vec<(Span, usize, &mut [f32])> = spans
            .iter()
            .zip(states.iter_mut())
            .filter(|(span, _)| span.len > 0)
            .flat_map(|(span, state)| state.recurrent.chunks_mut(k * k).enumerate().map(move |(hh, s)| (*span, hh, s)))
            .collect();
        let scale = 1.0 / (k as f32).sqrt();
        let lb = self.lower_bound;
        let outs: Vec<(Span, usize, Vec<f32>)> = jobs
            .into_par_iter()
            .map(|(span, hh, s)| {
                let n = span.len;
                let mut qh = vec![0f32; n * k];
                let mut kh = vec![0f32; n * k];
                let mut vh = vec![0f32; n * k];
                let mut gh = vec![0f32; n * k];
                let mut bh = vec![0f32; n];
                for i in 0..n {
                    let t = span.start + i;
                    let src = t * p + hh * k..t * p + (hh + 1) * k;
                    let dst = i * k..(i + 1) * k;
                    qh[dst.clone()].copy_from_slice(&q[src.clone()]);
                    l2_norm(&mut qh[dst.clone()], 1e-6);
                    qh[dst.clone()].iter_mut().for_each(|v| *v *= scale);
                    kh[dst.clone()].copy_from_slice(&kk[src.clone()]);
                    l2_norm(&mut kh[dst.clone()], 1e-6);
                    vh[dst.clone()].copy_from_slice(&v[src.clone()]);
                    for j in 0..k {
                        let c = hh * k + j;
                        gh[i * k + j] = lb * sigmoid(self.a_exp[hh] * (z[t * p + c] + self.dt_bias[c]));
                    }
                    bh[i] = sigmoid(beta_logits[t * h + hh]);
                }
                let mut o = vec![0f32; n * k];
                if n == 1 {
                    kda_step(s, &qh, &kh, &vh, &gh, bh[0], &mut o);
                } else {
                    kda_prefill(s, &qh, &kh, &vh, &gh, &bh, &mut o, k, k);
                }
                (span, hh, o)
            })
            .collect();

        // Sigmoid-gated RMSNorm per head, then o_proj.
        let mut y = vec![0f32; tokens * p];
        for (span, hh, o) in &outs {
            for i in 0..span.len {
                let oh = &o[i * k..(i + 1) * k];
                let inv = inv_rms(oh, self.eps);
                let base = (span.start + i) * p + hh * k;
                let (ys, rs) = (&mut y[base..base + k], &r[base..base + k]);
                for (((yv, ov), wv), rv) in ys.iter_mut().zip(oh).zip(&self.o_norm).zip(rs) {
                    *yv = wv * (ov * inv) * sigmoid(*rv);
                }
            }
        }
        self.o_proj.matmul(&y, tokens)
    }

    /// Causal depthwise conv + SiLU over one sequence's `[tokens, P]` rows, in place, continuing
    /// from (and updating) its `frames`.
    fn short_conv(&self, rows: &mut [f32], taps: &[f32], frames: &mut [f32]) {
        let w = self.kernel;
        let p = self.heads * self.head_dim;
        let tokens = rows.len() / p;
        let mut ext = Vec::with_capacity(frames.len() + rows.len());
        ext.extend_from_slice(frames);
        ext.extend_from_slice(rows);
        for t in 0..tokens {
            for c in 0..p {
                let mut acc = 0f32;
                for i in 0..w {
                    acc += taps[c * w + i] * ext[(t + i) * p + c];
                }
                rows[t * p + c] = silu(acc);
            }
        }
        frames.copy_from_slice(&ext[tokens * p..]);
    }
}
