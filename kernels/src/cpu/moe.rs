//! Latent MoE routing and the grouped routed experts (spec §2.7).

use rayon::prelude::*;

use super::elementwise::sigmoid;
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
    for t in 0..tokens {
        let s = &scores[t * e..(t + 1) * e];
        let sel: Vec<f32> = s.iter().zip(p.bias).map(|(a, b)| a + b).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
        margins.push(if p.top_k < e { sel[order[p.top_k - 1]] - sel[order[p.top_k]] } else { f32::NAN });
        order.truncate(p.top_k);
        let sum: f32 = order.iter().map(|&i| s[i]).sum::<f32>() + 1e-20;
        for &i in &order {
            let w = if p.renormalize { s[i] / sum } else { s[i] };
            weights.push(w * p.scaling);
        }
        ids.extend(order);
    }
    Routing { ids, weights, scores, margins, top_k: p.top_k }
}

/// Tokens grouped by expert so each expert's weights are read once per step; one rayon job per
/// active expert; the weighted sum runs in expert-id order so results do not depend on threading.
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
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
    for t in 0..tokens {
        for j in 0..routing.top_k {
            let k = t * routing.top_k + j;
            // Experts another rank holds (expert parallelism) are its to add.
            if let Some(e) = routing.ids[k].checked_sub(first).filter(|&e| e < experts.len()) {
                by_expert[e].push((t, routing.weights[k]));
            }
        }
    }
    let active: Vec<usize> = (0..experts.len()).filter(|&e| !by_expert[e].is_empty()).collect();
    let partials: Vec<(usize, Vec<f32>)> = active
        .par_iter()
        .map(|&e| {
            let rows = &by_expert[e];
            let n = rows.len();
            let mut zin = Vec::with_capacity(n * lat);
            for &(t, _) in rows {
                zin.extend_from_slice(&z[t * lat..(t + 1) * lat]);
            }
            let ex = &experts[e];
            let inter = ex.w1.rows();
            let mut a = vec![0f32; n * inter];
            let mut u = vec![0f32; n * inter];
            super::gemm::matmul(&ex.w1, &zin, n, &mut a);
            super::gemm::matmul(&ex.w3, &zin, n, &mut u);
            super::situ::situ_rows(&mut a, &u, act.beta, act.linear_beta);
            let mut y = vec![0f32; n * ex.w2.rows()];
            super::gemm::matmul(&ex.w2, &a, n, &mut y);
            (e, y)
        })
        .collect();
    for (e, y) in &partials {
        for (i, &(t, w)) in by_expert[*e].iter().enumerate() {
            axpy(w, &y[i * lat..(i + 1) * lat], &mut out[t * lat..(t + 1) * lat]);
        }
    }
}
