//! The memory plan of a deployment (`kimi-host plan`): per GPU (one tensor-parallel rank), the
//! weight bytes by kind from the loader's own shard arithmetic
//! ([`Model::record_shard`] on rank 0, which takes the larger part of every uneven split), the
//! per-sequence KDA state and per-token latent / indexer bytes from the same functions the state
//! arenas are sized with, an activation estimate, and how many sequences of a context fit.

use std::collections::BTreeMap;

use serde::Serialize;

use super::config::TextConfig;
use super::error::ModelError;
use super::forward::Model;
use super::shard::{Shard, rank_config};
use super::state::kda_slot_floats;
use super::weights::{NameRecorder, RecordedTensor};

/// Storage of the MLA latent rows (and indexer keys) in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    /// This CPU engine's pages.
    F32,
    Bf16,
    /// ATOM's `--kv_cache_dtype fp8`.
    Fp8,
}

impl CacheDtype {
    pub fn bytes(self) -> u64 {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::Bf16 => 2,
            CacheDtype::Fp8 => 1,
        }
    }

    pub fn parse(s: &str) -> Option<CacheDtype> {
        match s {
            "f32" | "fp32" => Some(CacheDtype::F32),
            "bf16" => Some(CacheDtype::Bf16),
            "fp8" => Some(CacheDtype::Fp8),
            _ => None,
        }
    }
}

/// What to plan for.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub gpus: usize,
    /// Bytes of memory per GPU.
    pub gpu_memory: u64,
    /// Tokens of the context each sequence is planned for.
    pub context: usize,
    /// Default: `gpus`.
    pub tensor_parallel: Option<usize>,
    /// Ranks of a tensor-parallel group that split a sequence's latent cache by tokens (instead
    /// of each holding all of it); divides `tensor_parallel`.
    pub context_parallel: usize,
    /// Attention, dense and shared-expert linears requantised to FP8 (ATOM's `ptpc_fp8`).
    pub fp8_dense: bool,
    /// Whole routed experts per GPU instead of a slice of every expert.
    pub expert_parallel: bool,
    pub cache: CacheDtype,
    /// Tokens of the largest step (a prefill chunk), for the activation estimate.
    pub step_tokens: usize,
}

/// Per GPU.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub gpus: usize,
    pub tensor_parallel: usize,
    pub context_parallel: usize,
    /// Independent copies of the model (`gpus / tensor_parallel`).
    pub replicas: usize,
    pub gpu_memory: u64,
    pub context: usize,
    pub fp8_dense: bool,
    pub cache: CacheDtype,
    pub weight_bytes_by_kind: BTreeMap<String, u64>,
    pub weight_bytes: u64,
    /// One sequence's KDA recurrent and convolution state (f32; this GPU's heads).
    pub kda_state_bytes_per_sequence: u64,
    /// Latent rows of every MLA layer, one token (replicated over tensor-parallel ranks).
    pub latent_bytes_per_token: u64,
    /// Indexer keys of every MLA layer, one token (K3.1).
    pub indexer_bytes_per_token: u64,
    /// Tokens of a sequence's cache this GPU holds (`context / context_parallel`, rounded up).
    pub tokens_per_gpu: u64,
    /// KDA state + this GPU's tokens of latent rows and indexer keys.
    pub bytes_per_sequence: u64,
    /// Step activations and scratch for `step_tokens` tokens (an f32 estimate, see `plan`).
    pub activation_bytes: u64,
    pub step_tokens: usize,
    /// Weights + activations + one sequence.
    pub total_for_one_sequence: u64,
    /// Sequences of `context` tokens that fit beside the weights and activations.
    pub sequences: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("bad plan request: {0}")]
    Request(String),
    #[error("does not fit: {term} needs {need} B per GPU, {have} B are left ({plan_summary})")]
    DoesNotFit { term: String, need: u64, have: u64, plan_summary: String },
}

/// One sequence's KDA state on one rank (rank-local config `rc`), bytes: f32 recurrent matrices
/// and convolution windows of every KDA layer — what an engine slot holds.
pub fn kda_state_bytes(rc: &TextConfig) -> u64 {
    4 * kda_slot_floats(rc) as u64
}

/// Latent rows and indexer keys of every MLA layer for one token, bytes, in `cache`'s dtype.
pub fn cache_bytes_per_token(c: &TextConfig, cache: CacheDtype) -> (u64, u64) {
    let mla = c.num_mla_layers() as u64;
    let latent = c.latent_width() as u64 * mla * cache.bytes();
    let index = c.indexer.as_ref().map_or(0, |ix| ix.head_dim as u64 * mla * cache.bytes());
    (latent, index)
}

/// Which linears `--fp8-dense` requantises (ATOM's `ptpc_fp8` recipe, k3-architecture §3.3):
/// the KDA and MLA projections, the dense MLP and the shared experts; not the embedding, the LM
/// head, the router, the latent MoE maps, the routed experts (MXFP4), the convolutions or the
/// indexer (kept unquantised here, as DSV3.2 keeps `weights_proj`).
pub fn fp8_dense_target(name: &str) -> bool {
    let matrix = name.ends_with("_proj.weight") || name.ends_with("_proj_with_mqa.weight");
    let attention = name.contains(".self_attn.") && !name.contains(".indexer.") && !name.contains("_res_proj");
    let dense = name.contains(".mlp.") || name.contains(".shared_experts.");
    matrix && (attention || dense)
}

/// The kind a tensor is counted under (`inspect`, `plan`).
pub fn weight_kind(t: &RecordedTensor, c: &TextConfig) -> &'static str {
    let n = &t.name;
    let layer = n
        .strip_prefix("language_model.model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|i| i.parse::<usize>().ok());
    if n.contains("embed_tokens") {
        "embedding"
    } else if n.contains("lm_head") {
        "lm_head"
    } else if n.contains(".experts.") {
        "routed_experts"
    } else if n.contains("shared_experts") {
        "shared_experts"
    } else if n.contains("block_sparse_moe.") {
        "moe_router_latent_norm"
    } else if n.contains(".mlp.") {
        "dense_mlp"
    } else if n.contains(".self_attn.indexer.") {
        "indexer"
    } else if n.contains(".self_attn.") {
        match layer.and_then(|i| c.layer_kinds.get(i)) {
            Some(super::config::MixerKind::Kda) => "kda_mixer",
            _ => "mla_mixer",
        }
    } else {
        "norms_and_attn_res"
    }
}

/// Plans `req` for the model of config `c`; `packed(base)` says whether an expert matrix is
/// stored MXFP4. Refuses a plan that leaves no room for one sequence, naming the term.
pub fn plan(c: &TextConfig, packed: impl Fn(&str) -> bool, req: &PlanRequest) -> Result<Plan, PlanError> {
    // Caps before any arithmetic: every product below then fits in u64.
    const MAX_GPUS: usize = 4096;
    const MAX_CONTEXT: usize = 1 << 34;
    const MAX_STEP_TOKENS: usize = 1 << 24;
    if req.gpus > MAX_GPUS || req.context > MAX_CONTEXT || req.step_tokens > MAX_STEP_TOKENS {
        return Err(PlanError::Request(format!(
            "--gpus at most {MAX_GPUS}, --context at most {MAX_CONTEXT}, --step-tokens at most {MAX_STEP_TOKENS}"
        )));
    }
    // Context parallelism as vLLM's decode context parallelism: the ranks of a tensor-parallel
    // group, which would each hold the same replicated latent cache, hold a token range of it
    // instead; so it needs no GPUs of its own and must divide the tensor-parallel size.
    let cp = req.context_parallel.max(1);
    let tp = req.tensor_parallel.unwrap_or(req.gpus);
    if tp == 0 || req.gpus == 0 || !req.gpus.is_multiple_of(tp) {
        return Err(PlanError::Request(format!("--tensor-parallel {tp} must divide --gpus {}", req.gpus)));
    }
    if !tp.is_multiple_of(cp) {
        return Err(PlanError::Request(format!(
            "--context-parallel {cp} must divide --tensor-parallel {tp} (its ranks split the latent cache)"
        )));
    }
    let rc = rank_config(c, tp)?;

    // Weights: what rank 0 maps (the larger part of every uneven split).
    let mut rec = NameRecorder::new(&packed);
    Model::record_shard(c, &mut rec, Shard { rank: 0, size: tp }, req.expert_parallel)?;
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for t in &rec.tensors {
        let bytes = if req.fp8_dense && fp8_dense_target(&t.name) {
            // One byte a value plus an f32 scale per output row.
            t.kept / t.dtype.size().max(1) as u64 + 4 * t.kept_rows
        } else {
            t.kept
        };
        *by_kind.entry(weight_kind(t, c).to_string()).or_default() += bytes;
    }
    let weight_bytes: u64 = by_kind.values().sum();

    // State, from the arenas' own sizes (f32 KDA state; the cache in the chosen dtype).
    let kda_state = kda_state_bytes(&rc);
    let (latent_per_token, index_per_token) = cache_bytes_per_token(c, req.cache);
    let tokens_per_gpu = (req.context as u64).div_ceil(cp as u64);
    let per_sequence = kda_state + tokens_per_gpu * (latent_per_token + index_per_token);
    let activation = activation_bytes(&rc, tp, req.step_tokens);

    let mut plan = Plan {
        gpus: req.gpus,
        tensor_parallel: tp,
        context_parallel: cp,
        replicas: req.gpus / tp,
        gpu_memory: req.gpu_memory,
        context: req.context,
        fp8_dense: req.fp8_dense,
        cache: req.cache,
        weight_bytes_by_kind: by_kind,
        weight_bytes,
        kda_state_bytes_per_sequence: kda_state,
        latent_bytes_per_token: latent_per_token,
        indexer_bytes_per_token: index_per_token,
        tokens_per_gpu,
        bytes_per_sequence: per_sequence,
        activation_bytes: activation,
        step_tokens: req.step_tokens,
        total_for_one_sequence: weight_bytes + activation + per_sequence,
        sequences: 0,
    };
    let summary = || format!("TP {tp} × CP {cp}, {} tokens", req.context);
    let mem = req.gpu_memory;
    if weight_bytes > mem {
        return Err(PlanError::DoesNotFit {
            term: "weights".into(),
            need: weight_bytes,
            have: mem,
            plan_summary: summary(),
        });
    }
    if weight_bytes + activation > mem {
        return Err(PlanError::DoesNotFit {
            term: format!("activations of a {}-token step", req.step_tokens),
            need: activation,
            have: mem - weight_bytes,
            plan_summary: summary(),
        });
    }
    let left = mem - weight_bytes - activation;
    plan.sequences = left / per_sequence.max(1);
    if plan.sequences == 0 {
        let term = if tokens_per_gpu * (latent_per_token + index_per_token) > kda_state {
            format!("one sequence's latent cache ({tokens_per_gpu} tokens on this GPU) and KDA state")
        } else {
            "one sequence's KDA state".to_string()
        };
        return Err(PlanError::DoesNotFit { term, need: per_sequence, have: left, plan_summary: summary() });
    }
    Ok(plan)
}

/// Activations of one step of `tokens` tokens on one rank, f32 (this engine's activations),
/// as the largest set alive at once: the AttnRes snapshots and running sums (`[tokens, d]`
/// each, one per block plus three), plus the largest mixer or FFN transient — KDA's seven
/// `[tokens, P/TP]` projections and outputs, MLA's queries, absorbed queries, contexts and
/// values, or the MoE's gathered expert rows (top-k copies of `[tokens, inter/TP]`, three of
/// them) — plus the logits of every token (`[tokens, V/TP]`, then gathered `[tokens, V]`).
fn activation_bytes(rc: &TextConfig, tp: usize, tokens: usize) -> u64 {
    let t = tokens as u64;
    let d = rc.hidden_size as u64;
    let blocks = (rc.num_layers.div_ceil(rc.attn_res_block_size.max(1)) + 3) as u64;
    let kda = 7 * (rc.kda.num_heads * rc.kda.head_dim) as u64;
    let h = rc.mla_heads as u64;
    let (dn, dr, dv, r) =
        (rc.qk_nope_head_dim as u64, rc.qk_rope_head_dim as u64, rc.v_head_dim as u64, rc.kv_lora_rank as u64);
    let mla = h * (dn + dr) + h * (r + dr) + h * r + 2 * h * dv + rc.q_lora_rank as u64 + r + dr;
    let inter = (rc.moe_intermediate_size as u64).div_ceil(tp as u64);
    let moe = 3 * rc.experts_per_token as u64 * inter + 2 * rc.routed_expert_hidden_size as u64 + rc.num_experts as u64;
    let dense = 2 * (rc.intermediate_size as u64).div_ceil(tp as u64);
    let widest = kda.max(mla).max(moe).max(dense) + 2 * d;
    let vocab = rc.vocab_size as u64;
    4 * t * (blocks * d + widest + vocab.div_ceil(tp as u64) + vocab)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_targets_follow_the_recipe() {
        let l = "language_model.model.layers.3";
        for yes in [
            "self_attn.q_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.f_b_proj.weight",
            "mlp.down_proj.weight",
            "block_sparse_moe.shared_experts.up_proj.weight",
        ] {
            assert!(fp8_dense_target(&format!("{l}.{yes}")), "{yes}");
        }
        for no in [
            "self_attn.q_conv1d.weight",
            "block_sparse_moe.experts.1.w1.weight_packed",
            "block_sparse_moe.routed_expert_up_proj.weight",
            "block_sparse_moe.gate.weight",
            "self_attn.indexer.wq_b.weight",
            "self_attention_res_proj.weight",
            "self_attn.dt_bias",
        ] {
            assert!(!fp8_dense_target(&format!("{l}.{no}")), "{no}");
        }
        assert!(!fp8_dense_target("language_model.lm_head.weight"));
        assert!(!fp8_dense_target("language_model.model.embed_tokens.weight"));
    }
}
