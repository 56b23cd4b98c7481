//! Row norms: RMSNorm, LayerNorm, the per-head gated RMSNorm of KDA's output, and the helpers
//! other CPU ops share (`inv_rms`, `l2_normalize`).

use rayon::prelude::*;

/// `1 / sqrt(mean(x²) + eps)`.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// `x ← x / sqrt(Σ x² + eps)`.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// Rows per rayon task: a decode step's few rows stay on the calling thread.
const ROWS_PER_TASK: usize = 16;

/// `out = w · x / rms(x)` per row of `w.len()` values.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    out.par_chunks_exact_mut(d).zip(x.par_chunks_exact(d)).with_min_len(ROWS_PER_TASK).for_each(|(o, row)| {
        let r = inv_rms(row, eps);
        for ((o, v), w) in o.iter_mut().zip(row).zip(w) {
            *o = w * (v * r);
        }
    });
}

/// `out = (x − mean) / std · w + b` per row of `w.len()` values.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len(), out.len(), "layer_norm: x and out differ in length");
    for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            o[i] = (row[i] - mean) * r * w[i] + b[i];
        }
    }
}

/// Per head of `w.len()` values: `out = w · o / rms(o) · σ(gate)`.
pub fn gated_rms_norm(o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let k = w.len();
    assert!(o.len() == out.len() && gate.len() == out.len(), "gated_rms_norm: lengths differ");
    for ((ys, oh), rs) in out.chunks_exact_mut(k).zip(o.chunks_exact(k)).zip(gate.chunks_exact(k)) {
        let inv = inv_rms(oh, eps);
        // σ(gate) into the output row first (all of a row's exponentials at once), then scaled.
        ys.copy_from_slice(rs);
        super::elementwise::sigmoid_in_place(ys);
        for ((yv, ov), wv) in ys.iter_mut().zip(oh).zip(w) {
            *yv *= wv * (ov * inv);
        }
    }
}
