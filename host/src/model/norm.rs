//! Normalisations (spec §2.2), applied row by row in f32.

/// y = w ⊙ x / sqrt(mean(x²) + eps) for each `w.len()`-wide row of `x`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let r = inv_rms(row, eps);
        for ((o, v), w) in o.iter_mut().zip(row).zip(w) {
            *o = w * (v * r);
        }
    }
    out
}

/// 1 / sqrt(mean(x²) + eps).
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// In place: x / sqrt(Σx² + eps) (fla's L2 norm: eps inside the root, on the sum).
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// LayerNorm with weight and bias over `w.len()`-wide rows.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            o[i] = (row[i] - mean) * r * w[i] + b[i];
        }
    }
    out
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}
