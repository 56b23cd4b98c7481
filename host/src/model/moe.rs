//! Latent MoE (spec §2.7): a sigmoid router on the full-width input (bias only for selection),
//! routed SiTU experts in the latent space, RMSNorm on the weighted sum, up-projection, plus the
//! shared experts on the full-width input.

use rayon::prelude::*;

use super::config::TextConfig;
use super::error::ModelError;
use super::mlp::{Mlp, Situ};
use super::norm::{rms_norm, sigmoid};
use super::weights::{TensorSource, Weight};

pub struct Expert {
    pub w1: Weight,
    pub w2: Weight,
    pub w3: Weight,
}

pub struct MoeLayer {
    gate: Weight,
    bias: Vec<f32>,
    down: Weight,
    up: Weight,
    norm: Option<Vec<f32>>,
    pub experts: Vec<Expert>,
    shared: Option<Mlp>,
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    eps: f32,
}

/// The router's decision for each token: experts by descending selection score and their weights.
pub struct Routing {
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
    /// σ(logits) for all experts, `[tokens, E]`.
    pub scores: Vec<f32>,
    /// k-th minus (k+1)-th biased selection score per token (NaN when every expert is chosen).
    pub margins: Vec<f32>,
    pub top_k: usize,
}

impl MoeLayer {
    pub fn load(src: &mut dyn TensorSource, prefix: &str, c: &TextConfig) -> Result<MoeLayer, ModelError> {
        let (d, e, lat, inter) = (c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size);
        let n = |s: &str| format!("{prefix}.{s}");
        let experts = (0..e)
            .map(|i| {
                Ok(Expert {
                    w1: src.expert_matrix(&n(&format!("experts.{i}.w1")), inter, lat)?,
                    w2: src.expert_matrix(&n(&format!("experts.{i}.w2")), lat, inter)?,
                    w3: src.expert_matrix(&n(&format!("experts.{i}.w3")), inter, lat)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let shared = if c.num_shared_experts > 0 {
            Some(Mlp::load(src, &n("shared_experts"), d, inter * c.num_shared_experts)?)
        } else {
            None
        };
        Ok(MoeLayer {
            gate: src.matrix(&n("gate.weight"), e, d)?,
            bias: src.vector(&n("gate.e_score_correction_bias"), &[e])?,
            down: src.matrix(&n("routed_expert_down_proj.weight"), lat, d)?,
            up: src.matrix(&n("routed_expert_up_proj.weight"), d, lat)?,
            norm: if c.latent_moe_norm { Some(src.vector(&n("routed_expert_norm.weight"), &[lat])?) } else { None },
            experts,
            shared,
            top_k: c.experts_per_token,
            renormalize: c.moe_renormalize,
            scaling: c.routed_scaling_factor,
            eps: c.rms_norm_eps,
        })
    }

    pub fn route(&self, x: &[f32], tokens: usize) -> Routing {
        let e = self.bias.len();
        let scores: Vec<f32> = self.gate.matmul(x, tokens).into_iter().map(sigmoid).collect();
        let mut ids = Vec::with_capacity(tokens * self.top_k);
        let mut weights = Vec::with_capacity(tokens * self.top_k);
        let mut margins = Vec::with_capacity(tokens);
        for t in 0..tokens {
            let s = &scores[t * e..(t + 1) * e];
            let sel: Vec<f32> = s.iter().zip(&self.bias).map(|(a, b)| a + b).collect();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
            margins.push(if self.top_k < e { sel[order[self.top_k - 1]] - sel[order[self.top_k]] } else { f32::NAN });
            order.truncate(self.top_k);
            let sum: f32 = order.iter().map(|&i| s[i]).sum::<f32>() + 1e-20;
            for &i in &order {
                let w = if self.renormalize { s[i] / sum } else { s[i] };
                weights.push(w * self.scaling);
            }
            ids.extend(order);
        }
        Routing { ids, weights, scores, margins, top_k: self.top_k }
    }

    /// x: `[tokens, d]` (post `post_attention_layernorm`).
    pub fn forward(&self, x: &[f32], tokens: usize, situ: Situ) -> (Vec<f32>, Routing) {
        let routing = self.route(x, tokens);
        let lat = self.down.rows;
        let z = self.down.matmul(x, tokens);

        // Group tokens by expert so each expert's weights are read once per call.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for t in 0..tokens {
            for j in 0..self.top_k {
                let k = t * self.top_k + j;
                by_expert[routing.ids[k]].push((t, routing.weights[k]));
            }
        }
        let active: Vec<usize> = (0..self.experts.len()).filter(|&e| !by_expert[e].is_empty()).collect();
        let partials: Vec<(usize, Vec<f32>)> = active
            .par_iter()
            .map(|&e| {
                let rows = &by_expert[e];
                let n = rows.len();
                let mut zin = Vec::with_capacity(n * lat);
                for &(t, _) in rows {
                    zin.extend_from_slice(&z[t * lat..(t + 1) * lat]);
                }
                let ex = &self.experts[e];
                let mut a = ex.w1.matmul(&zin, n);
                let u = ex.w3.matmul(&zin, n);
                situ.apply_rows(&mut a, &u);
                (e, ex.w2.matmul(&a, n))
            })
            .collect();
        // Weighted sum in a fixed (expert id) order, so results do not depend on threading.
        let mut y_lat = vec![0f32; tokens * lat];
        for (e, out) in &partials {
            for (i, &(t, w)) in by_expert[*e].iter().enumerate() {
                kimi_kernels::cpu::simd::axpy(w, &out[i * lat..(i + 1) * lat], &mut y_lat[t * lat..(t + 1) * lat]);
            }
        }
        if let Some(nw) = &self.norm {
            y_lat = rms_norm(&y_lat, nw, self.eps);
        }
        let mut y = self.up.matmul(&y_lat, tokens);
        if let Some(sh) = &self.shared {
            let s = sh.forward(x, tokens, situ);
            y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
        }
        (y, routing)
    }
}
