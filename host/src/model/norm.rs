//! Normalisations (spec §2.2) as the model calls them: allocating wrappers over the backend's
//! row ops (the arithmetic lives in `kimi_kernels`, once per backend).

use kimi_kernels::Backend;

/// y = w ⊙ x / sqrt(mean(x²) + eps) for each `w.len()`-wide row of `x`.
pub fn rms_norm(be: &dyn Backend, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    be.rms_norm(x, w, eps, &mut out);
    out
}

/// y = (x − mean) / sqrt(var + eps) ⊙ w + b for each `w.len()`-wide row of `x`.
pub fn layer_norm(be: &dyn Backend, x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    be.layer_norm(x, w, b, eps, &mut out);
    out
}
