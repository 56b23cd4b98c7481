//! `make-tiny`: a small random checkpoint in the real Kimi-K3 layout (outer `kimi_k3` config with
//! `text_config`, `language_model.*` names, optional MXFP4 experts and K3.1 indexer). The tensor
//! list comes from the model's own loader (through [`NameRecorder`]), so whatever this writes, the
//! engine loads. A byte-level tokenizer (256 byte ranks + the K3 special names) is written beside
//! it. Random weights: it speaks nonsense, but every code path is real.

use std::collections::HashMap;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::StandardNormal;
use safetensors::{Dtype as StDtype, tensor::TensorView};
use serde_json::{Value, json};

use kimi_kernels::{f32_to_bf16_bits, mxfp4_quantize_rows};

use super::checkpoint::Dtype;
use super::config::{TextConfig, parse_config};
use super::dspark::{DsparkConfig, DsparkDraft};
use super::error::ModelError;
use super::forward::Model;
use super::weights::NameRecorder;

#[derive(Clone, Debug)]
pub struct TinyOptions {
    pub seed: u64,
    /// Add the K3.1 lightning indexer to every MLA layer.
    pub k31: bool,
    /// Store routed experts as MXFP4 (`weight_packed` / `weight_scale`).
    pub mxfp4: bool,
    /// Add a tiny MoonViT3d tower and patchmergerv2 projector (`vision_config`, `vision_tower.*`,
    /// `mm_projector.*`, `preprocessor_config.json`), so the model sees images.
    pub vision: bool,
}

/// The tiny tower's `vision_config`: every release key, small shapes (4 heads of 24, so the
/// 2-D RoPE's quarter-head split holds), projecting to `text_hidden` values.
pub fn tiny_vision_config(text_hidden: usize) -> Value {
    json!({
        "_attn_implementation": "flash_attention_2",
        "activation_func": "gelu_pytorch_tanh",
        "attn_bias": false,
        "init_pos_emb_height": 16,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": 16,
        "linear_bias": false,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "mm_hidden_size": 64,
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "patch_embed_proj_bias": false,
        "patch_size": 14,
        "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "qkv_hidden_size": 96,
        "text_hidden_size": text_hidden,
        "vt_hidden_size": 64,
        "vt_intermediate_size": 128,
        "vt_num_attention_heads": 4,
        "vt_num_hidden_layers": 2
    })
}

/// The tiny model's `preprocessor_config.json`: the release processor with smaller limits (at most
/// 1,024 patches, 64 a side: 256 tokens an image), so images stay cheap on a CPU.
pub fn tiny_preprocessor_config() -> Value {
    json!({"media_proc_cfg": {
        "in_patch_limit": 1024,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": null,
        "patch_limit_on_one_side": 64,
        "in_patch_limit_each_frame": 1024,
        "sample_fps": 8.0,
        "temporal_merge_kernel_size": 4,
        "transparent_bg_config": {
            "pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": true,
            "chessboard_white_value": 255, "chessboard_gray_value": 180
        },
        "transparent_bg_fill_stage": "after_resize",
        "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig"
    }})
}

/// Byte-level vocabulary (256) plus the 256 reserved K3 special ids on top.
pub const TINY_VOCAB: usize = 512;

/// The tiny config: every key of the release `text_config`, small shapes.
pub fn tiny_config(opts: &TinyOptions) -> Value {
    let v = TINY_VOCAB as u64;
    let mut text = json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 4,
        "bos_token_id": v - 256,
        "eos_token_id": v - 254,
        "pad_token_id": v - 1,
        "dtype": "bfloat16",
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": 256,
        "intermediate_size": 512,
        "kv_lora_rank": 32,
        "latent_moe_use_norm": true,
        "linear_attn_config": {
            "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": true, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]
        },
        "max_position_embeddings": 1048576,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "moe_intermediate_size": 64,
        "moe_layer_freq": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 4,
        "num_expert_group": 1,
        "num_experts": 16,
        "num_experts_per_token": 4,
        "num_hidden_layers": 8,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 1,
        "q_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "rms_norm_eps": 1e-5,
        "routed_expert_hidden_size": 128,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_grouped_topk": true,
        "v_head_dim": 32,
        "vocab_size": v,
    });
    if opts.k31 {
        text["index_n_heads"] = json!(4);
        text["index_head_dim"] = json!(32);
        text["index_topk"] = json!(64);
    }
    if opts.mxfp4 {
        text["quantization_config"] = json!({
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                "weights": {"group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8", "strategy": "group",
                            "symmetric": true, "type": "float", "dynamic": false}}},
            "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed"
        });
    }
    let hidden = text["hidden_size"].as_u64().unwrap_or(0) as usize;
    let mut outer = json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": v - 256,
        "eos_token_id": v - 254,
        "pad_token_id": v - 1,
        "media_placeholder_token_id": v - 256 + 21,
        "tie_word_embeddings": false,
        "text_config": text,
    });
    if opts.vision {
        outer["vision_config"] = tiny_vision_config(hidden);
    }
    outer
}

/// Writes `config.json` and `model.safetensors` into `out`.
pub fn make_tiny(out: &Path, opts: &TinyOptions) -> Result<(), ModelError> {
    write_random_checkpoint(out, &tiny_config(opts), opts.seed, opts.mxfp4)
}

/// Writes a random checkpoint for any config in the release layout (`config_json`, e.g. a
/// [`tiny_config`] with other shapes), routed experts MXFP4 when `mxfp4`.
pub fn write_random_checkpoint(out: &Path, config_json: &Value, seed: u64, mxfp4: bool) -> Result<(), ModelError> {
    let config = parse_config(&config_json.to_string())?;
    let kda_heads = config.text.kda.num_heads;
    let mut rec = NameRecorder::new(|_| mxfp4);
    let vision = config.vision_config.clone();
    Model::build(config, &mut rec)?;
    if let Some(vc) = &vision {
        super::vision::record(&super::vision::VisionConfig::parse(vc)?, &mut rec)?;
    }

    // Draw tensors in sorted order of their logical names (packed experts: the dense `.weight`),
    // so the same seed gives the same model whatever the recording order.
    let mut logical: Vec<(String, Vec<usize>, bool)> = Vec::new();
    for t in &rec.tensors {
        if let Some(base) = t.name.strip_suffix(".weight_packed") {
            logical.push((format!("{base}.weight"), vec![t.shape[0], t.shape[1] * 2], true));
        } else if !t.name.ends_with(".weight_scale") {
            logical.push((t.name.clone(), t.shape.clone(), false));
        }
    }
    logical.sort();
    let dtypes: HashMap<&str, Dtype> = rec.tensors.iter().map(|t| (t.name.as_str(), t.dtype)).collect();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buffers: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape, packed) in &logical {
        let values = init_values(&mut rng, name, shape, kda_heads);
        if *packed {
            let (rows, cols) = (shape[0], shape[1]);
            let (p, s) = mxfp4_quantize_rows(&values, rows, cols);
            let base = name.trim_end_matches(".weight");
            buffers.push((format!("{base}.weight_packed"), StDtype::U8, vec![rows, cols / 2], p));
            buffers.push((format!("{base}.weight_scale"), StDtype::U8, vec![rows, cols / 32], s));
        } else if dtypes.get(name.as_str()) == Some(&Dtype::F32) {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            buffers.push((name.clone(), StDtype::F32, shape.clone(), bytes));
        } else {
            let bytes = values.iter().flat_map(|v| f32_to_bf16_bits(*v).to_le_bytes()).collect();
            buffers.push((name.clone(), StDtype::BF16, shape.clone(), bytes));
        }
    }
    write_checkpoint(out, &buffers, config_json)?;
    if vision.is_some() {
        let path = out.join("preprocessor_config.json");
        let text = serde_json::to_string_pretty(&tiny_preprocessor_config()).unwrap_or_default();
        std::fs::write(&path, text).map_err(|e| io(&path, e))?;
    }
    crate::tokenizer::Tokenizer::write_byte_level(out).map_err(|e| io(out, e))
}

/// Writes `model.safetensors` from `(name, dtype, shape, bytes)` tensors and `config.json` into
/// `out` (created if missing).
fn write_checkpoint(
    out: &Path,
    buffers: &[(String, StDtype, Vec<usize>, Vec<u8>)],
    config_json: &Value,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let views: Vec<(String, TensorView<'_>)> = buffers
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::Header { path: out.display().to_string(), msg: format!("{n}: {e}") })
        })
        .collect::<Result<_, _>>()?;
    let path = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| ModelError::Header { path: path.display().to_string(), msg: e.to_string() })?;
    let cfg_path = out.join("config.json");
    let text = serde_json::to_string_pretty(config_json).unwrap_or_default();
    std::fs::write(&cfg_path, text).map_err(|e| io(&cfg_path, e))
}

/// The config of a random DSpark draft for a target of config `t`: the release draft's keys and
/// YaRN values, tiny shapes, rows as wide as the target's latent rows (so they share its pages),
/// up to five tapped layers spread below the target's last.
pub fn tiny_draft_config(t: &TextConfig, layers: usize) -> Value {
    let last = t.num_layers.saturating_sub(1).max(1);
    let mut taps: Vec<usize> = (0..5).map(|i| 1 + i * last.saturating_sub(1) / 5).filter(|&l| l < last).collect();
    taps.dedup();
    let v = t.vocab_size as u64;
    json!({
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "hidden_size": t.hidden_size,
        "intermediate_size": 2 * t.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": t.kv_lora_rank,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": t.qk_rope_head_dim,
        "v_head_dim": 16,
        "mla_use_nope": false,
        "mla_use_output_gate": false,
        "vocab_size": v,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "rope_theta": 50000.0,
        "num_target_layers": taps.len(),
        "target_hidden_size": t.hidden_size,
        "target_num_hidden_layers": t.num_layers,
        "target_layer_ids": taps,
        "mask_token_id": v.saturating_sub(3),
        "bos_token_id": v.saturating_sub(256),
        "eos_token_id": v.saturating_sub(254),
        "pad_token_id": v.saturating_sub(1),
        "markov_rank": 16,
        "markov_head_type": "vanilla",
        "enable_confidence_head": true,
        "confidence_head_with_markov": true,
        "tie_word_embeddings": false,
        "draft_vocab_size": v,
        "torch_dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
            "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0
        }
    })
}

/// `make-draft`: a random DSpark draft for the target in `target_dir`, in the Inferact layout
/// (BF16, no `lm_head`), written to `out`. The tensor list comes from the draft's own loader.
/// Random weights propose almost nothing the target accepts; every code path is real.
pub fn make_draft(target_dir: &Path, out: &Path, seed: u64, layers: usize) -> Result<(), ModelError> {
    let target = super::config::load_config(target_dir)?;
    let config_json = tiny_draft_config(&target.text, layers);
    let config = DsparkConfig::parse(&config_json.to_string())?;
    config.check_target(&target.text)?;
    let mut rec = NameRecorder::new(|_| false);
    DsparkDraft::build(config.clone(), &mut rec)?;
    let mut tensors: Vec<(String, Vec<usize>)> =
        rec.tensors.iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
    tensors.sort();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buffers: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        let mut normal = |scale: f32, shift: f32| -> Vec<f32> {
            (0..n).map(|_| shift + scale * rng.sample::<f32, _>(StandardNormal)).collect()
        };
        // The dspark-tiny case's recipe (its case.json → weights.init).
        let values = if name.ends_with("norm.weight") {
            normal(0.05, 1.0)
        } else if name == "markov_head.markov_w1.weight" {
            normal(0.5, 0.0)
        } else if name == "markov_head.markov_w2.weight" {
            normal(1.0 / (config.markov_rank as f32).sqrt(), 0.0)
        } else if name == "confidence_head.proj.bias" {
            normal(0.1, 0.0)
        } else {
            normal(1.0 / (shape.get(1).copied().unwrap_or(1).max(1) as f32).sqrt(), 0.0)
        };
        let bytes = values.iter().flat_map(|v| f32_to_bf16_bits(*v).to_le_bytes()).collect();
        buffers.push((name, StDtype::BF16, shape, bytes));
    }
    write_checkpoint(out, &buffers, &config_json)
}

/// The goldens' init recipe (K3_GOLDENS / spec §7 step 5).
fn init_values(rng: &mut StdRng, name: &str, shape: &[usize], kda_heads: usize) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut normal = |scale: f32, shift: f32| -> Vec<f32> {
        (0..n).map(|_| shift + scale * rng.sample::<f32, _>(StandardNormal)).collect()
    };
    if name.ends_with("A_log") {
        // log U(1, 16) per head; the padding stays zero.
        return (0..n).map(|i| if i < kda_heads { rng.random_range(1.0f32..16.0).ln() } else { 0.0 }).collect();
    }
    if name.ends_with("dt_bias") {
        return normal(0.5, 0.0);
    }
    if name.ends_with("e_score_correction_bias") {
        return normal(0.1, 0.0);
    }
    if name.ends_with("norm.weight") {
        return normal(0.05, 1.0);
    }
    if name.ends_with("norm.bias") {
        return normal(0.05, 0.0);
    }
    if name.ends_with("_conv1d.weight") {
        return normal(0.5, 0.0);
    }
    if name.ends_with("embed_tokens.weight") {
        return normal(0.05, 0.0);
    }
    if shape.len() == 1 && name.starts_with("vision_tower.") || name == "mm_projector.post_norm.weight" {
        // The tower's norms (`norm0`, `norm1`, `final_layernorm`) and the projector's.
        return normal(0.05, 1.0);
    }
    if name.ends_with("pos_emb.weight") {
        return normal(0.5, 0.0);
    }
    // A convolution kernel's fan-in is everything after its output channels.
    let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
    normal(1.0 / fan_in.sqrt(), 0.0)
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Io { path: path.display().to_string(), source: e }
}
