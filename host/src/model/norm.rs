//! Normalisations (spec §2.2) as the model calls them: wrappers over the backend's row ops that
//! write into step buffers (the arithmetic lives in `kimi_kernels`, once per backend).

use kimi_kernels::Backend;

use super::scratch::{Buf, Scratch};

/// y = w ⊙ x / sqrt(mean(x²) + eps) for each `w.len()`-wide row of `x`.
pub fn rms_norm<'s>(be: &dyn Backend, sc: &'s Scratch, x: &[f32], w: &[f32], eps: f32) -> Buf<'s> {
    let mut out = sc.for_overwrite(x.len());
    be.rms_norm(x, w, eps, &mut out);
    out
}

/// y = (x − mean) / sqrt(var + eps) ⊙ w + b for each `w.len()`-wide row of `x`.
pub fn layer_norm<'s>(be: &dyn Backend, sc: &'s Scratch, x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Buf<'s> {
    let mut out = sc.for_overwrite(x.len());
    be.layer_norm(x, w, b, eps, &mut out);
    out
}
