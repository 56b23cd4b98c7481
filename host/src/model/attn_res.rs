//! Block Attention Residuals (spec §2.3): softmax over block snapshots and the running partial
//! sum, scored by a learned query against the weight-less RMS-normalised candidates.

use kimi_kernels::Backend;

use super::error::ModelError;
use super::scratch::{Buf, Scratch};
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
    /// Mixes the candidates (`[tokens, d]` each) for every token of the step.
    pub fn mix<'s>(&self, be: &dyn Backend, sc: &'s Scratch, cands: &[&[f32]], tokens: usize) -> Buf<'s> {
        let mut out = sc.for_overwrite(tokens * self.query.len());
        be.attn_res_mix(&self.query, self.eps, cands, &mut out);
        out
    }
}
