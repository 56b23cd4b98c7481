//! Latent MoE routing and the grouped routed experts (spec §2.7).

use rayon::prelude::*;

use super::elementwise::sigmoid;
use super::kept::KeptBuffers;
use super::simd::axpy;
use crate::backend::{ExpertMatrices, RouterParams, Routing, SituParams};

/// Sigmoid scores; selection by score + bias (ties to the lower id); weights from the unbiased
/// scores, renormalised over the chosen experts when asked, times the scaling factor.
pub fn moe_route(logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing {
    let e = p.bias.len();
    let scores: Vec<f32> = logits.iter().copied().map(sigmoid).collect();
    let mut ids = Vec::with_capacity(tokens * p.top_k);
    let mut weights = Vec::with_capacity(tokens * p.top_k);
    let mut margins = Vec::with_capacity(tokens);
    // Reused by every token of the call.
    let (mut sel, mut order) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for t in 0..tokens {
        let s = &scores[t * e..(t + 1) * e];
        sel.clear();
        sel.extend(s.iter().zip(p.bias).map(|(a, b)| a + b));
        order.clear();
        order.extend(0..e);
        // A total order (ties to the lower id), so the in-place unstable sort gives the stable
        // one's result without its buffer.
        order.sort_unstable_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
        margins.push(if p.top_k < e { sel[order[p.top_k - 1]] - sel[order[p.top_k]] } else { f32::NAN });
        let chosen = &order[..p.top_k.min(e)];
        let sum: f32 = chosen.iter().map(|&i| s[i]).sum::<f32>() + 1e-20;
        for &i in chosen {
            let w = if p.renormalize { s[i] / sum } else { s[i] };
            weights.push(w * p.scaling);
        }
        ids.extend_from_slice(chosen);
    }
    Routing { ids, weights, scores, margins, top_k: p.top_k }
}

/// Tokens grouped by expert so each expert's weights are read once per step; one rayon job per
/// active expert; the weighted sum runs in expert-id order so results do not depend on threading.
///
/// A call makes a fixed handful of allocations whatever the expert count: the grouping is a
/// counting sort into flat arrays, every expert's outputs share one buffer, and each job's
/// inputs and activations come from buffers kept per thread.
pub fn moe_experts(
    experts: &[ExpertMatrices<'_>],
    first: usize,
    routing: &Routing,
    z: &[f32],
    act: SituParams,
    out: &mut [f32],
) {
    out.fill(0.0);
    let Some(e0) = experts.first() else { return };
    let lat = e0.w1.cols();
    let tokens = z.len() / lat.max(1);
    assert_eq!(out.len(), tokens * lat, "moe_experts: out has {} values", out.len());
    // Experts another rank holds (expert parallelism) are its to add.
    let local = |k: usize| routing.ids[k].checked_sub(first).filter(|&e| e < experts.len());
    let picks = tokens * routing.top_k;
    // starts[e]..starts[e + 1]: expert e's (token, weight) rows, in token order.
    let mut starts = vec![0usize; experts.len() + 1];
    for k in 0..picks {
        if let Some(e) = local(k) {
            starts[e + 1] += 1;
        }
    }
    for e in 0..experts.len() {
        starts[e + 1] += starts[e];
    }
    let mut rows = vec![(0usize, 0f32); starts[experts.len()]];
    let mut next = starts.clone();
    for k in 0..picks {
        if let Some(e) = local(k) {
            rows[next[e]] = (k / routing.top_k, routing.weights[k]);
            next[e] += 1;
        }
    }
    // Each active expert's output rows, in one buffer split into disjoint parts (every value is
    // written by its expert's product before it is read), kept per thread: a fresh one of a
    // batch's size would fault in new pages every layer.
    let mut kept = EXPERT_OUTPUTS.with(KeptBuffers::take);
    if kept.len() < rows.len() * lat {
        kept.resize(rows.len() * lat, 0.0);
    }
    let ys = &mut kept[..rows.len() * lat];
    let mut jobs: Vec<(usize, &mut [f32])> = Vec::with_capacity(experts.len());
    let mut rest = &mut ys[..];
    for e in 0..experts.len() {
        let (mine, tail) = rest.split_at_mut((starts[e + 1] - starts[e]) * lat);
        if !mine.is_empty() {
            jobs.push((e, mine));
        }
        rest = tail;
    }
    jobs.into_par_iter().for_each(|(e, y)| {
        let mine = &rows[starts[e]..starts[e + 1]];
        let n = mine.len();
        let ex = &experts[e];
        let inter = ex.w1.rows();
        // Taken, not borrowed: a nested product may run another expert's job on this thread
        // while this one waits.
        let mut bufs = EXPERT_BUFS.with(KeptBuffers::take);
        let [zin, a, u] = &mut bufs;
        zin.clear();
        for &(t, _) in mine {
            zin.extend_from_slice(&z[t * lat..(t + 1) * lat]);
        }
        a.resize(n * inter, 0.0);
        u.resize(n * inter, 0.0);
        super::gemm::matmul_many(&[ex.w1, ex.w3], zin, n, &mut [&mut a[..n * inter], &mut u[..n * inter]]);
        super::situ::situ_rows(&mut a[..n * inter], &u[..n * inter], act.beta, act.linear_beta);
        super::gemm::matmul(&ex.w2, &a[..n * inter], n, y);
        EXPERT_BUFS.with(|b| b.give(bufs));
    });
    // Each token's weighted sum, in expert-id order (rows are grouped by ascending expert), the
    // tokens side by side.
    let mut count = vec![0usize; tokens];
    let mut picked = vec![(0usize, 0f32); tokens * routing.top_k];
    for (row, &(t, w)) in rows.iter().enumerate() {
        picked[t * routing.top_k + count[t]] = (row, w);
        count[t] += 1;
    }
    let ys = &ys[..];
    out.par_chunks_mut(lat.max(1)).with_min_len(TOKENS_PER_TASK).enumerate().for_each(|(t, o)| {
        for &(row, w) in &picked[t * routing.top_k..t * routing.top_k + count[t]] {
            axpy(w, &ys[row * lat..(row + 1) * lat], o);
        }
    });
    EXPERT_OUTPUTS.with(|b| b.give(kept));
}

/// Tokens per rayon task of the weighted sum: a decode token's stays on the calling thread.
const TOKENS_PER_TASK: usize = 4;

thread_local! {
    /// The calling thread's buffer for every active expert's output rows.
    static EXPERT_OUTPUTS: KeptBuffers<Vec<f32>> = const { KeptBuffers::new() };
    /// A routed-expert job's gathered inputs and its two activation buffers, kept per thread.
    static EXPERT_BUFS: KeptBuffers<[Vec<f32>; 3]> = const { KeptBuffers::new() };
}
