//! Latent MoE (spec §2.7): a sigmoid router on the full-width input (bias only for selection),
//! routed SiTU experts in the latent space, RMSNorm on the weighted sum, up-projection, plus the
//! shared experts on the full-width input.

use kimi_kernels::{Backend, ExpertMatrices, RouterParams, SituParams};

pub use kimi_kernels::Routing;

use super::config::TextConfig;
use super::error::ModelError;
use super::mlp::Mlp;
use super::norm::rms_norm;
use super::scratch::{Buf, Scratch};
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

    pub fn route(&self, be: &dyn Backend, sc: &Scratch, x: &[f32], tokens: usize) -> Routing {
        let logits = self.gate.matmul(be, sc, x, tokens);
        let p =
            RouterParams { bias: &self.bias, top_k: self.top_k, renormalize: self.renormalize, scaling: self.scaling };
        be.moe_route(&logits, tokens, &p)
    }

    /// Every weight the layer multiplies by: router, latent maps, routed and shared experts.
    pub fn matmul_weights(&mut self) -> Vec<&mut Weight> {
        let mut v = vec![&mut self.gate, &mut self.down, &mut self.up];
        for e in &mut self.experts {
            v.extend([&mut e.w1, &mut e.w2, &mut e.w3]);
        }
        if let Some(s) = &mut self.shared {
            v.extend(s.matmul_weights());
        }
        v
    }

    /// x: `[tokens, d]` (post `post_attention_layernorm`).
    pub fn forward<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        x: &[f32],
        tokens: usize,
        act: SituParams,
    ) -> (Buf<'s>, Routing) {
        let routing = self.route(be, sc, x, tokens);
        let lat = self.down.rows;
        let z = self.down.matmul(be, sc, x, tokens);
        let experts: Vec<ExpertMatrices<'_>> = self
            .experts
            .iter()
            .map(|e| ExpertMatrices { w1: e.w1.for_matmul(), w2: e.w2.for_matmul(), w3: e.w3.for_matmul() })
            .collect();
        let mut y_lat = sc.zeroed(tokens * lat);
        be.moe_experts(&experts, &routing, &z, act, &mut y_lat);
        if let Some(nw) = &self.norm {
            y_lat = rms_norm(be, sc, &y_lat, nw, self.eps);
        }
        let mut y = self.up.matmul(be, sc, &y_lat, tokens);
        if let Some(sh) = &self.shared {
            let s = sh.forward(be, sc, x, tokens, act);
            be.add(&mut y, &s);
        }
        (y, routing)
    }
}
