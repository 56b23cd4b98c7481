//! KDA's delta rule over a step's batch (spec §2.4): gates, β and the normalised q / k per
//! (sequence, head), then the recurrent step (one token) or the chunked form (a prefill chunk) on
//! that sequence's recurrent slot. One rayon job per (sequence, head): each owns its head's matrix.

use rayon::prelude::*;

use super::elementwise::sigmoid;
use super::kda::{kda_prefill, kda_step};
use super::norm::l2_normalize;
use crate::backend::{KdaInputs, KdaParams, SeqSpan};

pub fn kda_recurrence(
    p: &KdaParams<'_>,
    x: &KdaInputs<'_>,
    spans: &[SeqSpan],
    slots: &mut [&mut [f32]],
    out: &mut [f32],
) {
    let (h, k) = (p.heads, p.head_dim);
    let width = h * k;
    let jobs: Vec<(SeqSpan, usize, &mut [f32])> = spans
        .iter()
        .zip(slots.iter_mut())
        .filter(|(span, _)| span.len > 0)
        .flat_map(|(span, slot)| slot.chunks_mut(k * k).enumerate().map(move |(hh, s)| (*span, hh, s)))
        .collect();
    let scale = 1.0 / (k as f32).sqrt();
    let lb = p.lower_bound;
    let outs: Vec<(SeqSpan, usize, Vec<f32>)> = jobs
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
                let src = t * width + hh * k..t * width + (hh + 1) * k;
                let dst = i * k..(i + 1) * k;
                qh[dst.clone()].copy_from_slice(&x.q[src.clone()]);
                l2_normalize(&mut qh[dst.clone()], 1e-6);
                qh[dst.clone()].iter_mut().for_each(|v| *v *= scale);
                kh[dst.clone()].copy_from_slice(&x.k[src.clone()]);
                l2_normalize(&mut kh[dst.clone()], 1e-6);
                vh[dst.clone()].copy_from_slice(&x.v[src.clone()]);
                for j in 0..k {
                    let c = hh * k + j;
                    gh[i * k + j] = lb * sigmoid(p.a_exp[hh] * (x.z[t * width + c] + p.dt_bias[c]));
                }
                bh[i] = sigmoid(x.beta_logits[t * h + hh]);
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
    for (span, hh, o) in &outs {
        for i in 0..span.len {
            let base = (span.start + i) * width + hh * k;
            out[base..base + k].copy_from_slice(&o[i * k..(i + 1) * k]);
        }
    }
}
