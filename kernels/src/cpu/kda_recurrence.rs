//! KDA's delta rule over a step's batch (spec §2.4): gates, β and the normalised q / k per
//! (sequence, head), then the recurrent step (one token) or the chunked form (a prefill chunk) on
//! that sequence's recurrent slot. One rayon job per (sequence, head): each owns its head's matrix
//! and writes its own (token, head) slices of the output; its gathered inputs live in buffers the
//! worker thread keeps from job to job. A sequence with per-token snapshot buffers (a speculative
//! verify) runs its tokens one recurrent step at a time and copies the head's state after each.

use std::cell::RefCell;

use rayon::prelude::*;

use super::disjoint::DisjointOut;
use super::elementwise::{sigmoid, sigmoid_in_place};
use super::kda::{kda_prefill, kda_step};
use super::norm::l2_normalize;
use crate::backend::{KdaInputs, KdaParams, KdaSlot, SeqSpan};

/// One job's gathered head inputs (`[n, K]` each, β `[n]`) and output `[n, V]`.
#[derive(Default)]
struct HeadBuffers {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    o: Vec<f32>,
}

thread_local! {
    static HEAD: RefCell<HeadBuffers> = RefCell::new(HeadBuffers::default());
}

fn resized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

pub fn kda_recurrence(
    p: &KdaParams<'_>,
    x: &KdaInputs<'_>,
    spans: &[SeqSpan],
    slots: &mut [KdaSlot<'_>],
    out: &mut [f32],
) {
    let (h, k) = (p.heads, p.head_dim);
    let width = h * k;
    let tokens: usize = spans.iter().map(|s| s.len).sum();
    assert!(out.len() >= tokens * width, "kda_recurrence: out has {} values", out.len());
    // One job per (sequence, head): the head's matrix and its part of every snapshot.
    type Job<'a> = (SeqSpan, usize, &'a mut [f32], Vec<&'a mut [f32]>);
    let mut jobs: Vec<Job<'_>> = Vec::with_capacity(spans.len() * h);
    for (span, slot) in spans.iter().zip(slots.iter_mut()).filter(|(span, _)| span.len > 0) {
        let snaps = &mut slot.after_token;
        assert!(
            snaps.is_empty() || snaps.len() == span.len,
            "kda_recurrence: {} snapshot buffers for {} tokens",
            snaps.len(),
            span.len
        );
        let mut per_head: Vec<Vec<&mut [f32]>> = (0..h).map(|_| Vec::with_capacity(snaps.len())).collect();
        for snap in snaps.iter_mut() {
            for (hh, part) in snap.chunks_mut(k * k).enumerate().take(h) {
                per_head[hh].push(part);
            }
        }
        for ((hh, s), snaps) in slot.state.chunks_mut(k * k).enumerate().take(h).zip(per_head) {
            jobs.push((*span, hh, s, snaps));
        }
    }
    let scale = 1.0 / (k as f32).sqrt();
    let lb = p.lower_bound;
    // Every job writes only its own (token, head) slices of the output.
    let ptr = DisjointOut::new(out);
    jobs.into_par_iter().for_each(|(span, hh, s, mut snaps)| {
        HEAD.with(|b| {
            let b = &mut *b.borrow_mut();
            let n = span.len;
            let (qh, kh, vh, gh) = (
                resized(&mut b.q, n * k),
                resized(&mut b.k, n * k),
                resized(&mut b.v, n * k),
                resized(&mut b.g, n * k),
            );
            let bh = resized(&mut b.beta, n);
            for (i, bi) in bh.iter_mut().enumerate() {
                let t = span.start + i;
                let src = t * width + hh * k..t * width + (hh + 1) * k;
                let dst = i * k..(i + 1) * k;
                qh[dst.clone()].copy_from_slice(&x.q[src.clone()]);
                l2_normalize(&mut qh[dst.clone()], 1e-6);
                qh[dst.clone()].iter_mut().for_each(|v| *v *= scale);
                kh[dst.clone()].copy_from_slice(&x.k[src.clone()]);
                l2_normalize(&mut kh[dst.clone()], 1e-6);
                vh[dst.clone()].copy_from_slice(&x.v[src.clone()]);
                let gi = &mut gh[dst.clone()];
                for (j, gv) in gi.iter_mut().enumerate() {
                    let c = hh * k + j;
                    *gv = p.a_exp[hh] * (x.z[t * width + c] + p.dt_bias[c]);
                }
                sigmoid_in_place(gi);
                gi.iter_mut().for_each(|gv| *gv *= lb);
                *bi = sigmoid(x.beta_logits[t * h + hh]);
            }
            let o = resized(&mut b.o, n * k);
            if !snaps.is_empty() {
                for (i, snap) in snaps.iter_mut().enumerate() {
                    let r = i * k..(i + 1) * k;
                    kda_step(s, &qh[r.clone()], &kh[r.clone()], &vh[r.clone()], &gh[r.clone()], bh[i], &mut o[r]);
                    snap.copy_from_slice(s);
                }
            } else if n == 1 {
                kda_step(s, qh, kh, vh, gh, bh[0], o);
            } else {
                kda_prefill(s, qh, kh, vh, gh, bh, o, k, k);
            }
            for i in 0..n {
                let at = (span.start + i) * width + hh * k;
                // SAFETY: span.start + i < tokens and the assert above gives out ≥ tokens × width
                // values; this job alone writes head hh of its sequence's tokens.
                unsafe { std::ptr::copy_nonoverlapping(o[i * k..(i + 1) * k].as_ptr(), ptr.at(at), k) };
            }
        });
    });
}
