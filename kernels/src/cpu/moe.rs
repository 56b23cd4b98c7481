//! Latent MoE routing and the grouped routed experts (spec §2.7).

use rayon::prelude::*;

use super::elementwise::sigmoid;
use super::kept::KeptBuffers;
use super::packed::BATCHED_TILE_TOKENS;
use super::simd::axpy;
use crate::Matrix;
use crate::backend::{ExpertMatrices, RouterParams, Routing, SeqSpan, SituParams};

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
/// Where one sequence (of `spans`) brings [`BATCHED_TILE_TOKENS`] or more tokens to an expert
/// packed for it (`Mxfp4Tiles::PerSequence`), those tokens run as one group on the AMX tiles
/// and the expert's other tokens in registers: a token's path depends on its own sequence's
/// tokens only, so a sequence's results do not depend on its batch.
///
/// A call makes a fixed handful of allocations whatever the expert count: the grouping is a
/// counting sort into flat arrays, every expert's outputs share one buffer, and each job's
/// inputs and activations come from buffers kept per thread.
pub fn moe_experts(
    experts: &[ExpertMatrices<'_>],
    first: usize,
    routing: &Routing,
    z: &[f32],
    spans: &[SeqSpan],
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
    // tiled[e]: expert e's rows that are sequences' runs for the tiles, moved to the front of its
    // rows (each part keeps token order).
    let mut tiled = vec![0usize; experts.len()];
    let runs = |ex: &ExpertMatrices<'_>| matches!(ex.w1, Matrix::Packed(p) if p.takes_sequence_runs());
    if experts.iter().any(runs) {
        // A token outside every span is a sequence of its own.
        let mut seq: Vec<usize> = (0..tokens).map(|t| spans.len() + t).collect();
        for (s, span) in spans.iter().enumerate() {
            for t in span.rows().filter(|&t| t < tokens) {
                seq[t] = s;
            }
        }
        let most = (0..experts.len()).map(|e| starts[e + 1] - starts[e]).max().unwrap_or(0);
        let mut others = Vec::with_capacity(most);
        for e in (0..experts.len()).filter(|&e| runs(&experts[e])) {
            let mine = &mut rows[starts[e]..starts[e + 1]];
            others.clear();
            let (mut kept, mut i) = (0, 0);
            while i < mine.len() {
                // A sequence's tokens are contiguous in the batch, so its rows here are a run.
                let run = mine[i..].iter().take_while(|&&(t, _)| seq[t] == seq[mine[i].0]).count();
                if run >= BATCHED_TILE_TOKENS {
                    mine.copy_within(i..i + run, kept);
                    kept += run;
                } else {
                    others.extend_from_slice(&mine[i..i + run]);
                }
                i += run;
            }
            mine[kept..].copy_from_slice(&others);
            tiled[e] = kept;
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
        // Rows ..k are sequences' runs for the tiles, rows k.. the rest.
        let k = tiled[e];
        let (a, u) = (&mut a[..n * inter], &mut u[..n * inter]);
        {
            let (a_runs, a_rest) = a.split_at_mut(k * inter);
            let (u_runs, u_rest) = u.split_at_mut(k * inter);
            if k > 0 {
                super::gemm::matmul_many_runs(&[ex.w1, ex.w3], &zin[..k * lat], k, &mut [a_runs, u_runs]);
            }
            if n > k {
                super::gemm::matmul_many(&[ex.w1, ex.w3], &zin[k * lat..], n - k, &mut [a_rest, u_rest]);
            }
        }
        super::situ::situ_rows(a, u, act.beta, act.linear_beta);
        let (y_runs, y_rest) = y.split_at_mut(k * lat);
        if k > 0 {
            super::gemm::matmul_many_runs(&[ex.w2], &a[..k * inter], k, &mut [y_runs]);
        }
        if n > k {
            super::gemm::matmul(&ex.w2, &a[k * inter..], n - k, y_rest);
        }
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
