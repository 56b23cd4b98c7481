//! AttnRes block mixing (spec §2.3): per token, a softmax over candidate blocks of
//! `query · cand / rms(cand)`, then the weighted sum of the candidates.

use super::norm::inv_rms;
use super::simd::{axpy, dot};

pub fn attn_res_mix(query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
    let d = query.len();
    let tokens = out.len() / d;
    assert!(cands.iter().all(|c| c.len() == out.len()), "attn_res_mix: a candidate differs in length");
    out.fill(0.0);
    let mut scores = vec![0f32; cands.len()];
    for t in 0..tokens {
        for (s, v) in scores.iter_mut().zip(cands) {
            let row = &v[t * d..(t + 1) * d];
            *s = dot(row, query) * inv_rms(row, eps);
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            z += *s;
        }
        let o = &mut out[t * d..(t + 1) * d];
        for (s, v) in scores.iter().zip(cands) {
            axpy(s / z, &v[t * d..(t + 1) * d], o);
        }
    }
}
