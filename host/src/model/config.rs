//! `config.json` of a Kimi-K3 / K3.1 checkpoint (outer `kimi_k3`, text tower under `text_config`).
//!
//! Every key the engine needs is read by name; a missing or inconsistent key fails with that
//! key's path, and a model we do not implement is refused by name.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::error::ModelError;

/// Which token mixer a decoder layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    Kda,
    Mla,
}

#[derive(Clone, Debug)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: f32,
    pub full_rank_gate: bool,
}

/// K3.1 lightning indexer (present when `index_n_heads` / `index_head_dim` / `index_topk` are set).
#[derive(Clone, Debug)]
pub struct IndexerConfig {
    pub n_heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

#[derive(Clone, Debug)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// 0-indexed mixer kind per layer (the config's lists are 1-indexed).
    pub layer_kinds: Vec<MixerKind>,
    pub kda: KdaConfig,
    pub mla_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub mla_output_gate: bool,
    pub indexer: Option<IndexerConfig>,
    pub intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub latent_moe_norm: bool,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f32,
    /// SiTU gate soft-cap β (1 when the key is null).
    pub situ_beta: f32,
    /// SiTU up-branch soft-cap (None: uncapped).
    pub situ_linear_beta: Option<f32>,
    pub rms_norm_eps: f32,
    pub attn_res_block_size: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub max_position_embeddings: usize,
    /// The checkpoint declares compressed-tensors MXFP4 (which tensors are packed is decided by
    /// the `weight_packed` suffix, as in the release).
    pub mxfp4_declared: bool,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub text: TextConfig,
    /// Kept verbatim for the vision tower (not used by the text engine).
    pub vision_config: Option<Value>,
    pub media_placeholder_token_id: Option<u32>,
}

impl TextConfig {
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.num_experts > 0 && i >= self.first_k_dense_replace && i.is_multiple_of(self.moe_layer_freq)
    }

    pub fn mla_qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values per token per MLA layer in the latent cache: [c (kv_lora_rank) | k_pe].
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    pub fn kda_projection_dim(&self) -> usize {
        self.kda.num_heads * self.kda.head_dim
    }

    pub fn num_kda_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == MixerKind::Kda).count()
    }

    pub fn num_mla_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == MixerKind::Mla).count()
    }
}

/// Reads `<dir>/config.json`.
pub fn load_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| ModelError::Io { path: path.display().to_string(), source: e })?;
    parse_config(&text)
}

/// The top of `config.json`, read first so a model we do not implement is refused by name
/// before its other keys are judged against our shapes.
#[derive(Deserialize)]
struct HeadWire {
    model_type: Option<String>,
    text_config: Option<TextHeadWire>,
}

#[derive(Deserialize)]
struct TextHeadWire {
    model_type: Option<String>,
    hidden_act: Option<Value>,
    moe_router_activation_func: Option<Value>,
    topk_method: Option<Value>,
}

#[derive(Deserialize)]
struct RootWire {
    text_config: TextWire,
    vision_config: Option<Value>,
    media_placeholder_token_id: Option<u32>,
}

/// `text_config`, every key the engine reads (the rest of the file is ignored). Sizes are `u64`
/// here and capped by [`size_cap`] after parsing.
#[derive(Deserialize)]
struct TextWire {
    mla_use_nope: Option<bool>,
    num_expert_group: Option<u64>,
    num_hidden_layers: Option<u64>,
    linear_attn_config: Option<LinearAttnWire>,
    index_n_heads: Option<u64>,
    index_head_dim: Option<u64>,
    index_topk: Option<u64>,
    activation_situ_beta: Option<f32>,
    activation_situ_linear_beta: Option<f32>,
    vocab_size: Option<u64>,
    hidden_size: Option<u64>,
    num_attention_heads: Option<u64>,
    q_lora_rank: Option<u64>,
    kv_lora_rank: Option<u64>,
    qk_nope_head_dim: Option<u64>,
    qk_rope_head_dim: Option<u64>,
    v_head_dim: Option<u64>,
    mla_use_output_gate: Option<bool>,
    intermediate_size: Option<u64>,
    first_k_dense_replace: Option<u64>,
    moe_layer_freq: Option<u64>,
    num_experts: Option<u64>,
    num_experts_per_token: Option<u64>,
    num_shared_experts: Option<u64>,
    moe_intermediate_size: Option<u64>,
    routed_expert_hidden_size: Option<u64>,
    latent_moe_use_norm: Option<bool>,
    moe_renormalize: Option<bool>,
    routed_scaling_factor: Option<f32>,
    rms_norm_eps: Option<f32>,
    attn_res_block_size: Option<u64>,
    bos_token_id: Option<u64>,
    eos_token_id: Option<u64>,
    pad_token_id: Option<u64>,
    max_position_embeddings: Option<u64>,
    quantization_config: Option<QuantizationWire>,
    tie_word_embeddings: Option<bool>,
}

#[derive(Deserialize)]
struct LinearAttnWire {
    kda_layers: Option<Vec<u64>>,
    full_attn_layers: Option<Vec<u64>>,
    num_heads: Option<u64>,
    head_dim: Option<u64>,
    short_conv_kernel_size: Option<u64>,
    gate_lower_bound: Option<f32>,
    use_full_rank_gate: Option<bool>,
}

#[derive(Deserialize)]
struct QuantizationWire {
    format: Option<Value>,
}

/// Deserializes `v` into `T`; a wrong type or shape fails with the key's path.
fn typed<'a, T: Deserialize<'a>>(v: &'a Value) -> Result<T, ModelError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        ModelError::config(if path == "." { "config.json" } else { &path }, e.inner().to_string())
    })
}

pub fn parse_config(text: &str) -> Result<ModelConfig, ModelError> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| ModelError::config("config.json", format!("not valid JSON: {e}")))?;
    if !root.is_object() {
        return Err(ModelError::config("config.json", "not a JSON object"));
    }
    let head: HeadWire = typed(&root)?;
    let model_type = head.model_type.ok_or_else(|| ModelError::config("model_type", "missing"))?;
    if model_type != "kimi_k3" {
        return Err(ModelError::Unsupported(format!(
            "model_type \"{model_type}\" is not implemented (supported: \"kimi_k3\" with a \"kimi_linear\" text_config)"
        )));
    }
    let th = head
        .text_config
        .ok_or_else(|| ModelError::config("text_config", "missing (kimi_k3 keeps the text tower under text_config)"))?;
    const P: &str = "text_config.";
    let text_type = th.model_type.ok_or_else(|| ModelError::config(&format!("{P}model_type"), "missing"))?;
    if text_type != "kimi_linear" {
        return Err(ModelError::Unsupported(format!(
            "text_config.model_type \"{text_type}\" is not implemented (supported: \"kimi_linear\")"
        )));
    }
    for (key, v, want) in [
        ("hidden_act", &th.hidden_act, "situ"),
        ("moe_router_activation_func", &th.moe_router_activation_func, "sigmoid"),
        ("topk_method", &th.topk_method, "noaux_tc"),
    ] {
        match v {
            None | Some(Value::Null) => {}
            Some(v) if v.as_str() == Some(want) => {}
            Some(v) => {
                return Err(ModelError::Unsupported(format!("{P}{key} = {v} is not implemented (supported: {want})")));
            }
        }
    }
    let r: RootWire = typed(&root)?;
    Ok(ModelConfig {
        text: parse_text(r.text_config)?,
        vision_config: r.vision_config,
        media_placeholder_token_id: r.media_placeholder_token_id,
    })
}

/// A required size: present and within [`size_cap`].
fn need(p: &str, key: &str, v: Option<u64>) -> Result<usize, ModelError> {
    opt(p, key, v)?.ok_or_else(|| ModelError::config(&format!("{p}{key}"), "missing"))
}

/// An optional size, within [`size_cap`] when present.
fn opt(p: &str, key: &str, v: Option<u64>) -> Result<Option<usize>, ModelError> {
    let Some(n) = v else { return Ok(None) };
    let cap = size_cap(key);
    if n > cap {
        return Err(ModelError::config(&format!("{p}{key}"), format!("{n} is larger than the supported {cap}")));
    }
    Ok(Some(n as usize))
}

fn opt_id(p: &str, key: &str, v: Option<u64>) -> Result<Option<u32>, ModelError> {
    Ok(opt(p, key, v)?.map(|n| n as u32))
}

fn parse_text(o: TextWire) -> Result<TextConfig, ModelError> {
    const P: &str = "text_config.";
    if o.mla_use_nope == Some(false) {
        return Err(ModelError::Unsupported(format!("{P}mla_use_nope = false (rotary MLA) is not implemented")));
    }
    if let Some(groups) = opt(P, "num_expert_group", o.num_expert_group)?
        && groups > 1
    {
        return Err(ModelError::Unsupported(format!(
            "{P}num_expert_group = {groups}: grouped top-k is not implemented"
        )));
    }

    let num_layers = need(P, "num_hidden_layers", o.num_hidden_layers)?;
    let lac = o.linear_attn_config.ok_or_else(|| ModelError::config("text_config.linear_attn_config", "missing"))?;
    const L: &str = "text_config.linear_attn_config.";
    let missing = |key: &str| ModelError::config(&format!("{L}{key}"), "missing");
    let kda_layers = lac.kda_layers.ok_or_else(|| missing("kda_layers"))?;
    let full_layers = lac.full_attn_layers.ok_or_else(|| missing("full_attn_layers"))?;
    let mut layer_kinds = vec![None; num_layers];
    for (list, kind, key) in
        [(&kda_layers, MixerKind::Kda, "kda_layers"), (&full_layers, MixerKind::Mla, "full_attn_layers")]
    {
        for &one_based in list {
            if one_based == 0 || one_based > num_layers as u64 {
                return Err(ModelError::config(
                    &format!("{L}{key}"),
                    format!("layer {one_based} is outside 1..={num_layers} (the lists are 1-indexed)"),
                ));
            }
            if layer_kinds[one_based as usize - 1].replace(kind).is_some() {
                return Err(ModelError::config(
                    &format!("{L}{key}"),
                    format!("layer {one_based} is listed twice (or in both kda_layers and full_attn_layers)"),
                ));
            }
        }
    }
    let layer_kinds = layer_kinds
        .iter()
        .enumerate()
        .map(|(i, k)| {
            k.ok_or_else(|| {
                ModelError::config(
                    &format!("{L}kda_layers"),
                    format!("layer {} (1-indexed) is in neither kda_layers nor full_attn_layers", i + 1),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;

    let kda = KdaConfig {
        num_heads: need(L, "num_heads", lac.num_heads)?,
        head_dim: need(L, "head_dim", lac.head_dim)?,
        conv_kernel: need(L, "short_conv_kernel_size", lac.short_conv_kernel_size)?,
        gate_lower_bound: lac.gate_lower_bound.ok_or_else(|| missing("gate_lower_bound"))?,
        full_rank_gate: lac.use_full_rank_gate.unwrap_or(false),
    };
    if kda.conv_kernel < 1 {
        return Err(ModelError::config(&format!("{L}short_conv_kernel_size"), "must be at least 1"));
    }

    let indexer = match (
        opt(P, "index_n_heads", o.index_n_heads)?,
        opt(P, "index_head_dim", o.index_head_dim)?,
        opt(P, "index_topk", o.index_topk)?,
    ) {
        (None, None, None) => None,
        (Some(n_heads), Some(head_dim), Some(topk)) => Some(IndexerConfig { n_heads, head_dim, topk }),
        (n_heads, head_dim, _) => {
            let missing = if n_heads.is_none() {
                "index_n_heads"
            } else if head_dim.is_none() {
                "index_head_dim"
            } else {
                "index_topk"
            };
            return Err(ModelError::config(
                &format!("{P}{missing}"),
                "missing: the K3.1 indexer needs index_n_heads, index_head_dim and index_topk together",
            ));
        }
    };

    let tc = TextConfig {
        vocab_size: need(P, "vocab_size", o.vocab_size)?,
        hidden_size: need(P, "hidden_size", o.hidden_size)?,
        num_layers,
        layer_kinds,
        kda,
        mla_heads: need(P, "num_attention_heads", o.num_attention_heads)?,
        q_lora_rank: need(P, "q_lora_rank", o.q_lora_rank)?,
        kv_lora_rank: need(P, "kv_lora_rank", o.kv_lora_rank)?,
        qk_nope_head_dim: need(P, "qk_nope_head_dim", o.qk_nope_head_dim)?,
        qk_rope_head_dim: need(P, "qk_rope_head_dim", o.qk_rope_head_dim)?,
        v_head_dim: need(P, "v_head_dim", o.v_head_dim)?,
        mla_output_gate: o.mla_use_output_gate.unwrap_or(false),
        indexer,
        intermediate_size: need(P, "intermediate_size", o.intermediate_size)?,
        first_k_dense_replace: opt(P, "first_k_dense_replace", o.first_k_dense_replace)?.unwrap_or(0),
        moe_layer_freq: opt(P, "moe_layer_freq", o.moe_layer_freq)?.unwrap_or(1).max(1),
        num_experts: need(P, "num_experts", o.num_experts)?,
        experts_per_token: need(P, "num_experts_per_token", o.num_experts_per_token)?,
        num_shared_experts: opt(P, "num_shared_experts", o.num_shared_experts)?.unwrap_or(0),
        moe_intermediate_size: need(P, "moe_intermediate_size", o.moe_intermediate_size)?,
        routed_expert_hidden_size: need(P, "routed_expert_hidden_size", o.routed_expert_hidden_size)?,
        latent_moe_norm: o.latent_moe_use_norm.unwrap_or(false),
        moe_renormalize: o.moe_renormalize.unwrap_or(true),
        routed_scaling_factor: o.routed_scaling_factor.unwrap_or(1.0),
        situ_beta: o.activation_situ_beta.unwrap_or(1.0),
        situ_linear_beta: o.activation_situ_linear_beta,
        rms_norm_eps: o.rms_norm_eps.ok_or_else(|| ModelError::config(&format!("{P}rms_norm_eps"), "missing"))?,
        attn_res_block_size: need(P, "attn_res_block_size", o.attn_res_block_size)?,
        bos_token_id: opt_id(P, "bos_token_id", o.bos_token_id)?,
        eos_token_id: opt_id(P, "eos_token_id", o.eos_token_id)?,
        pad_token_id: opt_id(P, "pad_token_id", o.pad_token_id)?,
        max_position_embeddings: opt(P, "max_position_embeddings", o.max_position_embeddings)?.unwrap_or(usize::MAX),
        mxfp4_declared: o
            .quantization_config
            .and_then(|q| q.format)
            .is_some_and(|f| f.as_str() == Some("mxfp4-pack-quantized")),
    };
    if o.tie_word_embeddings == Some(true) {
        return Err(ModelError::Unsupported(format!(
            "{P}tie_word_embeddings = true is not implemented (K3 has an untied lm_head)"
        )));
    }
    check_consistency(&tc)?;
    Ok(tc)
}

fn check_consistency(c: &TextConfig) -> Result<(), ModelError> {
    let nonzero = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_layers),
        ("attn_res_block_size", c.attn_res_block_size),
        ("linear_attn_config.num_heads", c.kda.num_heads),
        ("linear_attn_config.head_dim", c.kda.head_dim),
    ];
    for (k, v) in nonzero {
        if v == 0 {
            return Err(ModelError::config(&format!("text_config.{k}"), "must be positive"));
        }
    }
    if c.num_mla_layers() > 0 {
        for (k, v) in [
            ("num_attention_heads", c.mla_heads),
            ("q_lora_rank", c.q_lora_rank),
            ("kv_lora_rank", c.kv_lora_rank),
            ("v_head_dim", c.v_head_dim),
        ] {
            if v == 0 {
                return Err(ModelError::config(&format!("text_config.{k}"), "must be positive"));
            }
        }
    }
    if c.num_experts > 0 && (c.experts_per_token == 0 || c.experts_per_token > c.num_experts) {
        return Err(ModelError::config(
            "text_config.num_experts_per_token",
            format!("{} is not in 1..={} (num_experts)", c.experts_per_token, c.num_experts),
        ));
    }
    if let Some(ix) = &c.indexer
        && (ix.n_heads == 0 || ix.head_dim == 0 || ix.topk == 0)
    {
        return Err(ModelError::config("text_config.index_topk", "indexer sizes must be positive"));
    }
    for (k, v) in [("bos_token_id", c.bos_token_id), ("eos_token_id", c.eos_token_id), ("pad_token_id", c.pad_token_id)]
    {
        if let Some(id) = v
            && id as usize >= c.vocab_size
        {
            return Err(ModelError::config(
                &format!("text_config.{k}"),
                format!("{id} is not below vocab_size {}", c.vocab_size),
            ));
        }
    }
    Ok(())
}

/// The largest value a key may take: far above any Kimi model, and low enough that products of
/// sizes (weight shapes, per-sequence state over all layers) cannot overflow `usize`.
fn size_cap(key: &str) -> u64 {
    match key {
        "num_hidden_layers" | "first_k_dense_replace" | "moe_layer_freq" => 1 << 10,
        "num_heads"
        | "head_dim"
        | "num_attention_heads"
        | "qk_nope_head_dim"
        | "qk_rope_head_dim"
        | "v_head_dim"
        | "index_n_heads"
        | "index_head_dim"
        | "short_conv_kernel_size"
        | "num_experts_per_token"
        | "num_shared_experts"
        | "num_expert_group" => 1 << 12,
        "num_experts" => 1 << 14,
        "vocab_size" => 1 << 22,
        "max_position_embeddings" | "index_topk" => 1 << 32,
        k if k.ends_with("token_id") => u32::MAX as u64,
        // Hidden, intermediate and LoRA sizes, AttnRes block size.
        _ => 1 << 18,
    }
}
