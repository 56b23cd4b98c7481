//! Latent MoE (spec §2.7): a sigmoid router on the full-width input (bias only for selection),
//! routed SiTU experts in the latent space, RMSNorm on the weighted sum, up-projection, plus the
//! shared experts on the full-width input.

use std::ops::Range;

use kimi_kernels::{Backend, Communicator, ExpertMatrices, RouterParams, SeqSpan, SituParams};

pub use kimi_kernels::Routing;

use super::config::TextConfig;
use super::error::ModelError;
use super::mlp::Mlp;
use super::norm::rms_norm;
use super::scratch::{Buf, Scratch};
use super::shard::Shard;
use super::weights::{Part, TensorSource, Weight};

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
    /// The hidden rows of `up` this rank holds (all of them at TP 1).
    up_rows: Range<usize>,
    norm: Option<Vec<f32>>,
    /// The experts this rank holds: `first_expert..first_expert + experts.len()`.
    pub experts: Vec<Expert>,
    first_expert: usize,
    shared: Option<Mlp>,
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    eps: f32,
}

impl MoeLayer {
    /// Loads the layer, or rank `sh`'s part of it. TP mode (ATOM's default): every routed
    /// expert with a contiguous range of its intermediate rows (`w1`, `w3`) and the matching
    /// columns of `w2` (in 32-value blocks when `w2` is MXFP4). Expert parallelism (`ep`): a
    /// contiguous range of whole experts (linear placement). Either way the shared experts' intermediate
    /// is split likewise, and a range of the hidden rows of the latent up-projection; the router and
    /// the latent down-projection are replicated, so every rank routes identically.
    pub fn load(
        src: &mut dyn TensorSource,
        prefix: &str,
        c: &TextConfig,
        sh: Shard,
        ep: bool,
    ) -> Result<MoeLayer, ModelError> {
        let (d, e, lat, inter) = (c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size);
        let n = |s: &str| format!("{prefix}.{s}");
        let unit = if src.expert_is_mxfp4(&n("experts.0.w2")) { 32 } else { 1 };
        let (held, mine) = if ep { (sh.range(e, 1), 0..inter) } else { (0..e, sh.range(inter, unit)) };
        let (rows, cols) =
            if mine.len() == inter { (Part::Whole, Part::Whole) } else { (Part::Rows(mine.clone()), Part::Cols(mine)) };
        let first_expert = held.start;
        let experts = held
            .map(|i| {
                Ok(Expert {
                    w1: src.expert_matrix_part(&n(&format!("experts.{i}.w1")), inter, lat, rows.clone())?,
                    w2: src.expert_matrix_part(&n(&format!("experts.{i}.w2")), lat, inter, cols.clone())?,
                    w3: src.expert_matrix_part(&n(&format!("experts.{i}.w3")), inter, lat, rows.clone())?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let shared = if c.num_shared_experts > 0 {
            Some(Mlp::load(src, &n("shared_experts"), d, inter * c.num_shared_experts, sh)?)
        } else {
            None
        };
        let up_rows = sh.range(d, 1);
        let up_part = if up_rows.len() == d { Part::Whole } else { Part::Rows(up_rows.clone()) };
        Ok(MoeLayer {
            gate: src.matrix(&n("gate.weight"), e, d)?,
            bias: src.vector(&n("gate.e_score_correction_bias"), &[e])?,
            down: src.matrix(&n("routed_expert_down_proj.weight"), lat, d)?,
            up: src.matrix_part(&n("routed_expert_up_proj.weight"), d, lat, up_part)?,
            up_rows,
            norm: if c.latent_moe_norm { Some(src.vector(&n("routed_expert_norm.weight"), &[lat])?) } else { None },
            experts,
            first_expert,
            shared,
            top_k: c.experts_per_token,
            renormalize: c.moe_renormalize,
            scaling: c.routed_scaling_factor,
            eps: c.rms_norm_eps,
        })
    }

    /// The routing of `tokens` tokens from the router's `logits` (`[tokens, experts]`).
    fn route(&self, be: &dyn Backend, logits: &[f32], tokens: usize) -> Routing {
        let p =
            RouterParams { bias: &self.bias, top_k: self.top_k, renormalize: self.renormalize, scaling: self.scaling };
        be.moe_route(logits, tokens, &p)
    }

    /// Every weight the layer keeps.
    pub fn weights(&self) -> Vec<&Weight> {
        let mut v = vec![&self.gate, &self.down, &self.up];
        for e in &self.experts {
            v.extend([&e.w1, &e.w2, &e.w3]);
        }
        if let Some(s) = &self.shared {
            v.extend(s.weights());
        }
        v
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

    /// x: `[tokens, d]` (post `post_attention_layernorm`). Under tensor parallelism each rank's
    /// experts give a partial latent sum, all-reduced before the (nonlinear) latent norm; the
    /// rank's rows of the up-projection then go into its shared experts' partial output, so one
    /// more all-reduce of `[tokens, d]` completes the layer (two per MoE layer, as ATOM's, with
    /// the up-projection split instead of replicated). Returns the whole output on every rank.
    /// `spans`: the step's sequences (`moe_experts` may run a sequence's several tokens at one
    /// expert on other kernels).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'s>(
        &self,
        be: &dyn Backend,
        sc: &'s Scratch,
        comm: &dyn Communicator,
        x: &[f32],
        tokens: usize,
        spans: &[SeqSpan],
        act: SituParams,
    ) -> (Buf<'s>, Routing) {
        // Every projection of x in one op: router, latent down-projection, and the shared
        // experts' gate and up (a rank without shared rows has none to run).
        let shared = self.shared.as_ref().filter(|sh| sh.gate.rows > 0);
        let (logits, z, shared_gu) = match shared {
            Some(sh) => {
                let [logits, z, g, u] =
                    Weight::matmul_many([&self.gate, &self.down, &sh.gate, &sh.up], be, sc, x, tokens);
                (logits, z, Some((sh, g, u)))
            }
            None => {
                let [logits, z] = Weight::matmul_many([&self.gate, &self.down], be, sc, x, tokens);
                (logits, z, None)
            }
        };
        let shared_out = |sc: &'s Scratch| match shared_gu {
            Some((sh, g, u)) => sh.finish(be, sc, g, &u, tokens, act),
            None => sc.zeroed(tokens * self.gate.cols),
        };
        let routing = self.route(be, &logits, tokens);
        let lat = self.down.rows;
        let d = self.gate.cols;
        let mut y_lat = sc.zeroed(tokens * lat);
        if self.experts.first().is_some_and(|e| e.w1.rows > 0 && e.w2.cols > 0) {
            let experts: Vec<ExpertMatrices<'_>> = self
                .experts
                .iter()
                .map(|e| ExpertMatrices { w1: e.w1.for_matmul(), w2: e.w2.for_matmul(), w3: e.w3.for_matmul() })
                .collect();
            be.moe_experts(&experts, self.first_expert, &routing, &z, spans, act, &mut y_lat);
        }
        if comm.size() > 1 {
            comm.all_reduce_sum(&mut y_lat);
        }
        if let Some(nw) = &self.norm {
            y_lat = rms_norm(be, sc, &y_lat, nw, self.eps);
        }
        let up = self.up.matmul(be, sc, &y_lat, tokens);
        if comm.size() == 1 {
            let mut y = up;
            if self.shared.is_some() {
                let s = shared_out(sc);
                be.add(&mut y, &s);
            }
            return (y, routing);
        }
        let mut y = shared_out(sc);
        let w = self.up_rows.len();
        for (row, part) in y.chunks_exact_mut(d).zip(up.chunks_exact(w.max(1))) {
            be.add(&mut row[self.up_rows.clone()], part);
        }
        comm.all_reduce_sum(&mut y);
        (y, routing)
    }
}
