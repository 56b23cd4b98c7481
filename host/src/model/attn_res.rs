//! Block Attention Residuals (spec §2.3): softmax over block snapshots and the running partial
//! sum, scored by a learned query against the weight-less RMS-normalised candidates.

use super::error::ModelError;
use super::norm::inv_rms;
use super::weights::TensorSource;

/// One mixing site (`self_attention_res`, `mlp_res` or `output_attn_res`).
pub struct ResMix {
    /// `*_res_norm.weight ⊙ *_res_proj.weight[0]`, folded once at load.
    query: Vec<f32>,
    eps: f32,
}

impl ResMix {
    pub fn load(src: &mut dyn TensorSource, prefix: &str, hidden: usize, eps: f32) -> Result<ResMix, ModelError> {
        let norm = src.vector(&format!("{prefix}_norm.weight"), &[hidden])?;
        let proj = src.vector(&format!("{prefix}_proj.weight"), &[1, hidden])?;
        Ok(ResMix { query: norm.iter().zip(&proj).map(|(a, b)| a * b).collect(), eps })
    }

    /// Mixes candidates (each `[tokens, d]`), per token: Σᵢ softmaxᵢ(⟨Vᵢ/rms(Vᵢ), query⟩) · Vᵢ.
    pub fn mix(&self, cands: &[&[f32]], tokens: usize) -> Vec<f32> {
        let d = self.query.len();
        let mut out = vec![0f32; tokens * d];
        let mut scores = vec![0f32; cands.len()];
        for t in 0..tokens {
            for (s, v) in scores.iter_mut().zip(cands) {
                let row = &v[t * d..(t + 1) * d];
                *s = kimi_kernels::cpu::simd::dot(row, &self.query) * inv_rms(row, self.eps);
            }
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - m).exp();
                z += *s;
            }
            let o = &mut out[t * d..(t + 1) * d];
            for (s, v) in scores.iter().zip(cands) {
                kimi_kernels::cpu::simd::axpy(s / z, &v[t * d..(t + 1) * d], o);
            }
        }
        out
    }
}
