//! The vision tower's two configs: `vision_config` of the checkpoint's `config.json` (the tower
//! and projector shapes, spec `k3-dspark-vision.md` B.1) and `media_proc_cfg` of
//! `preprocessor_config.json` (the resize limits and normalisation, B.5).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::model::error::ModelError;

/// `vision_config`: every key the tower reads. The string-valued keys name the variant; only the
/// K3 release's (`rmsnorm`, `mlp2`, `divided_fixed`, `bilinear`, `sd2_tpool`, `patchmergerv2`)
/// is implemented, and another is refused by name at load.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    pub vt_num_hidden_layers: usize,
    pub vt_hidden_size: usize,
    /// Attention width (heads × head_dim), decoupled from the residual width in K3.
    #[serde(default)]
    pub qkv_hidden_size: Option<usize>,
    pub vt_num_attention_heads: usize,
    pub vt_intermediate_size: usize,
    pub patch_size: usize,
    pub init_pos_emb_height: usize,
    pub init_pos_emb_width: usize,
    pub init_pos_emb_time: usize,
    pub merge_kernel_size: [usize; 2],
    pub mm_hidden_size: usize,
    pub text_hidden_size: usize,
    pub projector_ln_eps: f32,
    #[serde(default)]
    pub norm_type: Option<String>,
    #[serde(default)]
    pub mlp_type: Option<String>,
    #[serde(default)]
    pub activation_func: Option<String>,
    #[serde(default)]
    pub pos_emb_type: Option<String>,
    #[serde(default)]
    pub pos_emb_interpolation_mode: Option<String>,
    #[serde(default)]
    pub merge_type: Option<String>,
    #[serde(default)]
    pub mm_projector_type: Option<String>,
    #[serde(default)]
    pub projector_hidden_act: Option<String>,
    #[serde(default)]
    pub patch_embed_proj_bias: bool,
    #[serde(default)]
    pub attn_bias: bool,
    #[serde(default)]
    pub linear_bias: bool,
}

/// The tower's RMSNorm epsilon. The release builds `nn.RMSNorm(dim)` without one, so torch uses
/// the running dtype's epsilon, and the released tower runs in bf16: 2⁻⁷, as every serving port
/// pins it (an f32 epsilon moves the projector output by ~0.06).
pub const TOWER_NORM_EPS: f32 = 0.0078125;

/// Largest grid side the 2-D RoPE covers (patches), as the release's table.
pub const MAX_GRID_SIDE: usize = 512;

impl VisionConfig {
    /// Parses `vision_config` and checks it is the implemented variant with usable shapes.
    pub fn parse(v: &Value) -> Result<VisionConfig, ModelError> {
        let c: VisionConfig = serde_path_to_error::deserialize(v)
            .map_err(|e| ModelError::config(&format!("vision_config.{}", e.path()), e.inner().to_string()))?;
        c.check()?;
        Ok(c)
    }

    pub fn qkv_width(&self) -> usize {
        self.qkv_hidden_size.unwrap_or(self.vt_hidden_size)
    }

    pub fn head_dim(&self) -> usize {
        self.qkv_width() / self.vt_num_attention_heads.max(1)
    }

    /// Values per patch: `3 · p · p`.
    pub fn patch_values(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// Width of a merged row: `kh · kw · hidden`.
    pub fn merged_width(&self) -> usize {
        self.merge_kernel_size[0] * self.merge_kernel_size[1] * self.vt_hidden_size
    }

    fn check(&self) -> Result<(), ModelError> {
        let key = |k: &str| format!("vision_config.{k}");
        let want = |k: &str, got: &Option<String>, implemented: &str| match got.as_deref() {
            None => Ok(()),
            Some(v) if v == implemented => Ok(()),
            Some(v) => Err(ModelError::config(&key(k), format!("`{v}` is not implemented (`{implemented}` is)"))),
        };
        want("norm_type", &self.norm_type, "rmsnorm")?;
        want("mlp_type", &self.mlp_type, "mlp2")?;
        want("activation_func", &self.activation_func, "gelu_pytorch_tanh")?;
        want("pos_emb_type", &self.pos_emb_type, "divided_fixed")?;
        want("pos_emb_interpolation_mode", &self.pos_emb_interpolation_mode, "bilinear")?;
        want("merge_type", &self.merge_type, "sd2_tpool")?;
        want("mm_projector_type", &self.mm_projector_type, "patchmergerv2")?;
        want("projector_hidden_act", &self.projector_hidden_act, "gelu")?;
        for (k, on) in [
            ("patch_embed_proj_bias", self.patch_embed_proj_bias),
            ("attn_bias", self.attn_bias),
            ("linear_bias", self.linear_bias),
        ] {
            if on {
                return Err(ModelError::config(&key(k), "biases are not implemented (the K3 tower has none)"));
            }
        }
        let caps = [
            ("vt_num_hidden_layers", self.vt_num_hidden_layers, 256),
            ("vt_hidden_size", self.vt_hidden_size, 1 << 14),
            ("qkv_hidden_size", self.qkv_width(), 1 << 14),
            ("vt_num_attention_heads", self.vt_num_attention_heads, 1024),
            ("vt_intermediate_size", self.vt_intermediate_size, 1 << 16),
            ("patch_size", self.patch_size, 64),
            ("init_pos_emb_height", self.init_pos_emb_height, 1024),
            ("init_pos_emb_width", self.init_pos_emb_width, 1024),
            ("init_pos_emb_time", self.init_pos_emb_time, 64),
            ("mm_hidden_size", self.mm_hidden_size, 1 << 14),
            ("text_hidden_size", self.text_hidden_size, 1 << 16),
        ];
        for (k, v, cap) in caps {
            if v == 0 || v > cap {
                return Err(ModelError::config(&key(k), format!("{v} is outside 1..={cap}")));
            }
        }
        let hd = self.head_dim();
        if !self.qkv_width().is_multiple_of(self.vt_num_attention_heads) || !hd.is_multiple_of(4) {
            return Err(ModelError::config(
                &key("qkv_hidden_size"),
                format!(
                    "{} over {} heads: the 2-D RoPE needs a head width divisible by 4",
                    self.qkv_width(),
                    self.vt_num_attention_heads
                ),
            ));
        }
        if self.merge_kernel_size != [2, 2] {
            return Err(ModelError::config(
                &key("merge_kernel_size"),
                format!("{:?}: only the 2×2 merge is implemented", self.merge_kernel_size),
            ));
        }
        if self.mm_hidden_size != self.vt_hidden_size {
            return Err(ModelError::config(
                &key("mm_hidden_size"),
                format!("{} but the tower's width is {}", self.mm_hidden_size, self.vt_hidden_size),
            ));
        }
        if self.projector_ln_eps.is_nan() || self.projector_ln_eps <= 0.0 || self.projector_ln_eps.is_infinite() {
            return Err(ModelError::config(&key("projector_ln_eps"), "must be a positive number"));
        }
        Ok(())
    }
}

/// `transparent_bg_config`: what a transparent image is composited over.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct TransparentBackground {
    pub pattern: String,
    pub chessboard_square_size: usize,
    #[serde(default = "yes")]
    pub chessboard_square_on_top_left: bool,
    pub chessboard_white_value: u8,
    pub chessboard_gray_value: u8,
}

fn yes() -> bool {
    true
}

/// `media_proc_cfg` of `preprocessor_config.json` (the keys read; the file has more).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct MediaProcConfig {
    pub patch_size: usize,
    pub merge_kernel_size: usize,
    pub in_patch_limit: usize,
    pub patch_limit_on_one_side: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    #[serde(default)]
    pub fixed_output_tokens: Option<usize>,
    pub transparent_bg_config: TransparentBackground,
    #[serde(default = "after_resize")]
    pub transparent_bg_fill_stage: String,
}

fn after_resize() -> String {
    "after_resize".into()
}

#[derive(Deserialize)]
struct PreprocessorWire {
    media_proc_cfg: MediaProcConfig,
}

impl MediaProcConfig {
    /// The release resize plan of a `width × height` image under these limits.
    pub fn plan(&self, width: usize, height: usize) -> super::preprocess::ResizePlan {
        super::preprocess::ResizePlan::new(width, height, self)
    }

    /// The Kimi-K3 release values.
    pub fn release() -> MediaProcConfig {
        MediaProcConfig {
            patch_size: 14,
            merge_kernel_size: 2,
            in_patch_limit: 65536,
            patch_limit_on_one_side: 512,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            fixed_output_tokens: None,
            transparent_bg_config: TransparentBackground {
                pattern: "chessboard".into(),
                chessboard_square_size: 8,
                chessboard_square_on_top_left: true,
                chessboard_white_value: 255,
                chessboard_gray_value: 180,
            },
            transparent_bg_fill_stage: after_resize(),
        }
    }

    /// `<dir>/preprocessor_config.json`, or the release values when the checkpoint has none.
    pub fn load(dir: &Path) -> Result<MediaProcConfig, ModelError> {
        let path = dir.join("preprocessor_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => MediaProcConfig::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(MediaProcConfig::release()),
            Err(e) => Err(ModelError::Io { path: path.display().to_string(), source: e }),
        }
    }

    pub fn parse(text: &str) -> Result<MediaProcConfig, ModelError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let w: PreprocessorWire = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| ModelError::config(&format!("preprocessor_config {}", e.path()), e.inner().to_string()))?;
        w.media_proc_cfg.check()?;
        Ok(w.media_proc_cfg)
    }

    fn check(&self) -> Result<(), ModelError> {
        let key = |k: &str| format!("media_proc_cfg.{k}");
        if self.fixed_output_tokens.is_some() {
            return Err(ModelError::config(&key("fixed_output_tokens"), "is not implemented (the release has null)"));
        }
        if self.transparent_bg_config.pattern != "chessboard" || self.transparent_bg_config.chessboard_square_size == 0
        {
            return Err(ModelError::config(
                &key("transparent_bg_config"),
                "only a chessboard of squares of at least 1 pixel is implemented",
            ));
        }
        if self.transparent_bg_fill_stage != "after_resize" {
            return Err(ModelError::config(
                &key("transparent_bg_fill_stage"),
                format!("`{}` is not implemented (after_resize is)", self.transparent_bg_fill_stage),
            ));
        }
        if self.merge_kernel_size != 2 || self.patch_size == 0 || self.patch_size > 64 {
            return Err(ModelError::config(&key("patch_size"), "patches of 1..=64 pixels merged 2×2 are implemented"));
        }
        if self.in_patch_limit == 0 || self.patch_limit_on_one_side == 0 || self.patch_limit_on_one_side > 4096 {
            return Err(ModelError::config(
                &key("in_patch_limit"),
                "limits must be positive (and a side at most 4096)",
            ));
        }
        if self.image_std.iter().any(|s| s.is_nan() || *s <= 0.0) {
            return Err(ModelError::config(&key("image_std"), "must be positive"));
        }
        Ok(())
    }
}
