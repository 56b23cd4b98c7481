//! `config.json` of a Kimi-K3 / K3.1 checkpoint (outer `kimi_k3`, text tower under `text_config`).
//!
//! Every key the engine needs is read by name; a missing or inconsistent key fails with that
//! key's path, and a model we do not implement is refused by name.

use std::path::Path;

use serde_json::{Map, Value};

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

pub fn parse_config(text: &str) -> Result<ModelConfig, ModelError> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| ModelError::config("config.json", format!("not valid JSON: {e}")))?;
    let root = root.as_object().ok_or_else(|| ModelError::config("config.json", "not a JSON object"))?;
    let model_type = get_str(root, "", "model_type")?;
    if model_type != "kimi_k3" {
        return Err(ModelError::Unsupported(format!(
            "model_type \"{model_type}\" is not implemented (supported: \"kimi_k3\" with a \"kimi_linear\" text_config)"
        )));
    }
    let text = root
        .get("text_config")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::config("text_config", "missing (kimi_k3 keeps the text tower under text_config)"))?;
    let tc = parse_text(text)?;
    Ok(ModelConfig {
        text: tc,
        vision_config: root.get("vision_config").cloned(),
        media_placeholder_token_id: opt_u32(root, "", "media_placeholder_token_id")?,
    })
}

fn parse_text(o: &Map<String, Value>) -> Result<TextConfig, ModelError> {
    const P: &str = "text_config.";
    let text_type = get_str(o, P, "model_type")?;
    if text_type != "kimi_linear" {
        return Err(ModelError::Unsupported(format!(
            "text_config.model_type \"{text_type}\" is not implemented (supported: \"kimi_linear\")"
        )));
    }
    let refuse_unless = |key: &str, want: &str| -> Result<(), ModelError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if v.as_str() == Some(want) => Ok(()),
            Some(v) => Err(ModelError::Unsupported(format!("{P}{key} = {v} is not implemented (supported: {want})"))),
        }
    };
    refuse_unless("hidden_act", "situ")?;
    refuse_unless("moe_router_activation_func", "sigmoid")?;
    refuse_unless("topk_method", "noaux_tc")?;
    if get_bool(o, P, "mla_use_nope")? == Some(false) {
        return Err(ModelError::Unsupported(format!("{P}mla_use_nope = false (rotary MLA) is not implemented")));
    }
    if let Some(groups) = opt_usize(o, P, "num_expert_group")?
        && groups > 1
    {
        return Err(ModelError::Unsupported(format!(
            "{P}num_expert_group = {groups}: grouped top-k is not implemented"
        )));
    }

    let num_layers = get_usize(o, P, "num_hidden_layers")?;
    let lac = o
        .get("linear_attn_config")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::config("text_config.linear_attn_config", "missing"))?;
    const L: &str = "text_config.linear_attn_config.";
    let kda_layers = get_index_list(lac, L, "kda_layers")?;
    let full_layers = get_index_list(lac, L, "full_attn_layers")?;
    let mut layer_kinds = vec![None; num_layers];
    for (list, kind, key) in
        [(&kda_layers, MixerKind::Kda, "kda_layers"), (&full_layers, MixerKind::Mla, "full_attn_layers")]
    {
        for &one_based in list {
            if one_based == 0 || one_based > num_layers {
                return Err(ModelError::config(
                    &format!("{L}{key}"),
                    format!("layer {one_based} is outside 1..={num_layers} (the lists are 1-indexed)"),
                ));
            }
            if layer_kinds[one_based - 1].replace(kind).is_some() {
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
        num_heads: get_usize(lac, L, "num_heads")?,
        head_dim: get_usize(lac, L, "head_dim")?,
        conv_kernel: get_usize(lac, L, "short_conv_kernel_size")?,
        gate_lower_bound: get_f32(lac, L, "gate_lower_bound")?,
        full_rank_gate: get_bool(lac, L, "use_full_rank_gate")?.unwrap_or(false),
    };
    if kda.conv_kernel < 1 {
        return Err(ModelError::config(&format!("{L}short_conv_kernel_size"), "must be at least 1"));
    }

    let idx_keys = ["index_n_heads", "index_head_dim", "index_topk"];
    let idx_vals = idx_keys.iter().map(|k| opt_usize(o, P, k)).collect::<Result<Vec<_>, _>>()?;
    let indexer = match (idx_vals[0], idx_vals[1], idx_vals[2]) {
        (None, None, None) => None,
        (Some(n_heads), Some(head_dim), Some(topk)) => Some(IndexerConfig { n_heads, head_dim, topk }),
        _ => {
            let missing =
                idx_keys.iter().zip(&idx_vals).find(|(_, v)| v.is_none()).map(|(k, _)| *k).unwrap_or("index_topk");
            return Err(ModelError::config(
                &format!("{P}{missing}"),
                "missing: the K3.1 indexer needs index_n_heads, index_head_dim and index_topk together",
            ));
        }
    };

    let situ_beta = opt_f32(o, P, "activation_situ_beta")?.unwrap_or(1.0);
    let situ_linear_beta = opt_f32(o, P, "activation_situ_linear_beta")?;
    let tc = TextConfig {
        vocab_size: get_usize(o, P, "vocab_size")?,
        hidden_size: get_usize(o, P, "hidden_size")?,
        num_layers,
        layer_kinds,
        kda,
        mla_heads: get_usize(o, P, "num_attention_heads")?,
        q_lora_rank: get_usize(o, P, "q_lora_rank")?,
        kv_lora_rank: get_usize(o, P, "kv_lora_rank")?,
        qk_nope_head_dim: get_usize(o, P, "qk_nope_head_dim")?,
        qk_rope_head_dim: get_usize(o, P, "qk_rope_head_dim")?,
        v_head_dim: get_usize(o, P, "v_head_dim")?,
        mla_output_gate: get_bool(o, P, "mla_use_output_gate")?.unwrap_or(false),
        indexer,
        intermediate_size: get_usize(o, P, "intermediate_size")?,
        first_k_dense_replace: opt_usize(o, P, "first_k_dense_replace")?.unwrap_or(0),
        moe_layer_freq: opt_usize(o, P, "moe_layer_freq")?.unwrap_or(1).max(1),
        num_experts: get_usize(o, P, "num_experts")?,
        experts_per_token: get_usize(o, P, "num_experts_per_token")?,
        num_shared_experts: opt_usize(o, P, "num_shared_experts")?.unwrap_or(0),
        moe_intermediate_size: get_usize(o, P, "moe_intermediate_size")?,
        routed_expert_hidden_size: get_usize(o, P, "routed_expert_hidden_size")?,
        latent_moe_norm: get_bool(o, P, "latent_moe_use_norm")?.unwrap_or(false),
        moe_renormalize: get_bool(o, P, "moe_renormalize")?.unwrap_or(true),
        routed_scaling_factor: opt_f32(o, P, "routed_scaling_factor")?.unwrap_or(1.0),
        situ_beta,
        situ_linear_beta,
        rms_norm_eps: get_f32(o, P, "rms_norm_eps")?,
        attn_res_block_size: get_usize(o, P, "attn_res_block_size")?,
        bos_token_id: opt_u32(o, P, "bos_token_id")?,
        eos_token_id: opt_u32(o, P, "eos_token_id")?,
        pad_token_id: opt_u32(o, P, "pad_token_id")?,
        max_position_embeddings: opt_usize(o, P, "max_position_embeddings")?.unwrap_or(usize::MAX),
        mxfp4_declared: o
            .get("quantization_config")
            .and_then(|q| q.get("format"))
            .and_then(Value::as_str)
            .is_some_and(|f| f == "mxfp4-pack-quantized"),
    };
    if get_bool(o, P, "tie_word_embeddings")? == Some(true) {
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

fn get<'a>(o: &'a Map<String, Value>, p: &str, key: &str) -> Result<&'a Value, ModelError> {
    match o.get(key) {
        None | Some(Value::Null) => Err(ModelError::config(&format!("{p}{key}"), "missing")),
        Some(v) => Ok(v),
    }
}

fn get_str<'a>(o: &'a Map<String, Value>, p: &str, key: &str) -> Result<&'a str, ModelError> {
    get(o, p, key)?.as_str().ok_or_else(|| ModelError::config(&format!("{p}{key}"), "must be a string"))
}

fn get_usize(o: &Map<String, Value>, p: &str, key: &str) -> Result<usize, ModelError> {
    let v = get(o, p, key)?;
    let n = v.as_u64().ok_or_else(|| {
        ModelError::config(&format!("{p}{key}"), format!("must be a non-negative integer, found {v}"))
    })?;
    let cap = size_cap(key);
    if n > cap {
        return Err(ModelError::config(&format!("{p}{key}"), format!("{n} is larger than the supported {cap}")));
    }
    Ok(n as usize)
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

fn opt_usize(o: &Map<String, Value>, p: &str, key: &str) -> Result<Option<usize>, ModelError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => get_usize(o, p, key).map(Some),
    }
}

fn opt_u32(o: &Map<String, Value>, p: &str, key: &str) -> Result<Option<u32>, ModelError> {
    match opt_usize(o, p, key)? {
        None => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| ModelError::config(&format!("{p}{key}"), "out of range")),
    }
}

fn get_f32(o: &Map<String, Value>, p: &str, key: &str) -> Result<f32, ModelError> {
    let v = get(o, p, key)?;
    v.as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| ModelError::config(&format!("{p}{key}"), format!("must be a number, found {v}")))
}

fn opt_f32(o: &Map<String, Value>, p: &str, key: &str) -> Result<Option<f32>, ModelError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => get_f32(o, p, key).map(Some),
    }
}

fn get_bool(o: &Map<String, Value>, p: &str, key: &str) -> Result<Option<bool>, ModelError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| ModelError::config(&format!("{p}{key}"), format!("must be true or false, found {v}"))),
    }
}

fn get_index_list(o: &Map<String, Value>, p: &str, key: &str) -> Result<Vec<usize>, ModelError> {
    let v = get(o, p, key)?;
    let arr = v
        .as_array()
        .ok_or_else(|| ModelError::config(&format!("{p}{key}"), "must be a list of 1-indexed layer numbers"))?;
    arr.iter()
        .map(|x| {
            x.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| ModelError::config(&format!("{p}{key}"), format!("{x} is not a layer number")))
        })
        .collect()
}
