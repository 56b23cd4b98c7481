//! The `sd2_tpool` merge and the `patchmergerv2` projector (spec `k3-dspark-vision.md` B.3 steps
//! 6–7): each item's 2×2 neighbourhoods become one row (frames averaged), then
//! `RMSNorm(Linear₂(GELU_erf(Linear₁(row))))` gives one text-width embedding per image token.

use kimi_kernels::{Backend, Gelu};

use super::config::VisionConfig;
use super::preprocess::VisionInput;
use crate::model::error::ModelError;
use crate::model::norm::rms_norm;
use crate::model::scratch::Scratch;
use crate::model::weights::{TensorSource, Weight};

/// Per item `[t, h/2, 2, w/2, 2, D]` → `[(h/2)(w/2), 4D]` with `(dy, dx)` in the order (0,0),
/// (0,1), (1,0), (1,1) and channels innermost, averaged over the t frames; items concatenated.
pub fn tpool_merge(encoded: &[f32], items: &[VisionInput], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(items.iter().map(|i| i.tokens() * 4 * d).sum());
    let mut at = 0;
    for it in items {
        let [t, h, w] = it.grid_thw;
        let item = &encoded[at * d..(at + it.patches()) * d];
        for my in 0..h / 2 {
            for mx in 0..w / 2 {
                for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let patch = (2 * my + dy) * w + 2 * mx + dx;
                    if t == 1 {
                        out.extend_from_slice(&item[patch * d..][..d]);
                        continue;
                    }
                    let mut acc = vec![0f32; d];
                    for f in 0..t {
                        acc.iter_mut().zip(&item[(f * h * w + patch) * d..][..d]).for_each(|(a, v)| *a += v);
                    }
                    out.extend(acc.iter().map(|a| a / t as f32));
                }
            }
        }
        at += it.patches();
    }
    out
}

pub struct Projector {
    proj0: Weight,
    proj2: Weight,
    post_norm: Vec<f32>,
    eps: f32,
    text_hidden: usize,
}

impl Projector {
    pub fn build(c: &VisionConfig, src: &mut dyn TensorSource) -> Result<Projector, ModelError> {
        let m = c.merged_width();
        Ok(Projector {
            proj0: src.matrix("mm_projector.proj.0.weight", m, m)?,
            proj2: src.matrix("mm_projector.proj.2.weight", c.text_hidden_size, m)?,
            post_norm: src.vector("mm_projector.post_norm.weight", &[c.text_hidden_size])?,
            eps: c.projector_ln_eps,
            text_hidden: c.text_hidden_size,
        })
    }

    pub fn weights_mut(&mut self) -> impl Iterator<Item = &mut Weight> {
        [&mut self.proj0, &mut self.proj2].into_iter()
    }

    /// `[rows, 4D]` merged rows → `[rows, text_hidden]`.
    pub fn forward(&self, be: &dyn Backend, sc: &Scratch, merged: &[f32], rows: usize) -> Vec<f32> {
        let mut h = self.proj0.matmul(be, sc, merged, rows);
        be.gelu(&mut h, Gelu::Erf);
        let y = self.proj2.matmul(be, sc, &h, rows);
        let out = rms_norm(be, sc, &y, &self.post_norm, self.eps);
        debug_assert_eq!(out.len(), rows * self.text_hidden);
        out.to_vec()
    }
}
