//! AttnRes block mixing (spec §2.3): per token, a softmax over candidate blocks of
//! `query · cand / rms(cand)`, then the weighted sum of the candidates.

use rayon::prelude::*;

use super::norm::inv_rms;
use super::simd::{axpy, dot};

/// Rows per rayon task: a decode step's few rows stay on the calling thread.
const ROWS_PER_TASK: usize = 8;

pub fn attn_res_mix(query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
    let d = query.len();
    assert!(cands.iter().all(|c| c.len() == out.len()), "attn_res_mix: a candidate differs in length");
    out.par_chunks_mut(d).with_min_len(ROWS_PER_TASK).enumerate().for_each(|(t, o)| {
        let mut scores = [0f32; 16];
        let mut heap = Vec::new();
        let scores: &mut [f32] = if cands.len() <= scores.len() {
            &mut scores[..cands.len()]
        } else {
            heap.resize(cands.len(), 0f32);
            &mut heap
        };
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
        o.fill(0.0);
        for (s, v) in scores.iter().zip(cands) {
            axpy(s / z, &v[t * d..(t + 1) * d], o);
        }
    });
}
