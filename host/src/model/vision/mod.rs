//! Kimi-K3's vision path (spec `k3-dspark-vision.md` part B): the release preprocessing
//! (`preprocess`, with a Pillow-identical bicubic `resample`), the MoonViT3d `tower` and the
//! `sd2_tpool` merge + `patchmergerv2` `projector`, whose rows replace the prompt's
//! `<|media_pad|>` embeddings. Weights are read in their stored BF16 through the backend seam.

pub mod config;
pub mod preprocess;
pub mod projector;
pub mod resample;
pub mod tower;

use std::path::Path;

use kimi_kernels::Backend;
use serde_json::Value;

pub use config::{MediaProcConfig, VisionConfig};
pub use preprocess::{Image, Processed, ResizePlan, VisionInput, preprocess};

use super::checkpoint::Checkpoint;
use super::error::ModelError;
use super::scratch::Scratch;
use super::trace::Trace;
use super::weights::{CheckpointSource, TensorSource};
use projector::{Projector, tpool_merge};
use tower::Tower;

/// Most patches one tower call takes (the release's single-image maximum is 65,536; a call packs
/// several requests' items). Attention is quadratic in an item's patches, so this also bounds a
/// call's memory.
pub const MAX_PATCHES_PER_CALL: usize = 1 << 17;

/// The tower and projector of a checkpoint, plus its preprocessing config.
pub struct VisionModel {
    pub config: VisionConfig,
    pub media: MediaProcConfig,
    tower: Tower,
    projector: Projector,
    scratch: Scratch,
    _checkpoint: Option<Checkpoint>,
}

impl std::fmt::Debug for VisionModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionModel")
            .field("layers", &self.config.vt_num_hidden_layers)
            .field("hidden", &self.config.vt_hidden_size)
            .finish()
    }
}

impl VisionModel {
    /// Loads `vision_config` (from the model's `config.json`), the `vision_tower.*` and
    /// `mm_projector.*` tensors of `dir`'s checkpoint and `preprocessor_config.json`, and lays the
    /// weights out for `be`.
    pub fn load(dir: &Path, vision_config: &Value, be: &dyn Backend) -> Result<VisionModel, ModelError> {
        let config = VisionConfig::parse(vision_config)?;
        let media = MediaProcConfig::load(dir)?;
        if media.patch_size != config.patch_size {
            return Err(ModelError::config(
                "media_proc_cfg.patch_size",
                format!("{} but the tower's patch_size is {}", media.patch_size, config.patch_size),
            ));
        }
        let ck = Checkpoint::open(dir)?;
        let mut m = VisionModel::build(config, media, &mut CheckpointSource::new(&ck))?;
        m._checkpoint = Some(ck);
        for w in m.tower.weights_mut().chain(m.projector.weights_mut()) {
            w.prepare(be);
        }
        Ok(m)
    }

    /// From any tensor source (a checkpoint, or a name recorder).
    pub fn build(
        config: VisionConfig,
        media: MediaProcConfig,
        src: &mut dyn TensorSource,
    ) -> Result<VisionModel, ModelError> {
        let projector = Projector::build(&config, src)?;
        let tower = Tower::build(config.clone(), src)?;
        Ok(VisionModel { config, media, tower, projector, scratch: Scratch::new(), _checkpoint: None })
    }

    /// The release resize plan of a `width × height` image.
    pub fn plan(&self, width: usize, height: usize) -> ResizePlan {
        ResizePlan::new(width, height, &self.media)
    }

    /// The release processor on one image.
    pub fn preprocess(&self, img: &Image) -> Processed {
        preprocess(img, &self.media)
    }

    /// Checks an item before any work (grid shape, values, clip length).
    pub fn check(&self, item: &VisionInput) -> Result<(), ModelError> {
        self.tower.check(item)
    }

    /// Tower, merge and projector over a packed batch of items (any number of requests'):
    /// `[Σ tokens, text_hidden]`, items in order. With a trace, every intermediate under the
    /// golden's names (`tower.*`, `projector.out`).
    pub fn encode(
        &self,
        be: &dyn Backend,
        items: &[VisionInput],
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        let patches: usize = items.iter().map(VisionInput::patches).sum();
        if patches > MAX_PATCHES_PER_CALL {
            return Err(ModelError::config(
                "grid_thw",
                format!("{patches} patches in one tower call (at most {MAX_PATCHES_PER_CALL})"),
            ));
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let d = self.config.vt_hidden_size;
        let encoded = self.tower.forward(be, &self.scratch, items, trace.as_deref_mut())?;
        let merged = tpool_merge(&encoded, items, d);
        let rows: usize = items.iter().map(VisionInput::tokens).sum();
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("tower.merged", &[rows, 4 * d], &merged);
        }
        let out = self.projector.forward(be, &self.scratch, &merged, rows);
        if let Some(tr) = trace {
            tr.f32("projector.out", &[rows, self.config.text_hidden_size], &out);
        }
        Ok(out)
    }
}

/// Records the names and shapes a tower of `config` reads (for `make-tiny --vision`).
pub fn record(config: &VisionConfig, src: &mut dyn TensorSource) -> Result<(), ModelError> {
    Projector::build(config, src)?;
    Tower::build(config.clone(), src)?;
    Ok(())
}

/// Expands each `<|media_pad|>` of `ids` into its item's token count (`tokens[i]` for the i-th
/// pad), as the server and ATOM's `expand_media_placeholders` do, so positions, pages and usage
/// see the true length. Returns the expanded ids and the positions of the image rows, in order.
pub fn expand_media_pads(ids: &[u32], pad: u32, tokens: &[usize]) -> Result<(Vec<u32>, Vec<usize>), ModelError> {
    let pads = ids.iter().filter(|&&t| t == pad).count();
    if pads != tokens.len() {
        return Err(ModelError::config(
            "media_placeholder_token_id",
            format!("the prompt has {pads} media placeholders for {} images", tokens.len()),
        ));
    }
    let extra: usize = tokens.iter().sum::<usize>().saturating_sub(pads);
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut at = Vec::with_capacity(tokens.iter().sum());
    let mut next = tokens.iter();
    for &t in ids {
        if t == pad {
            let n = next.next().copied().unwrap_or(0);
            at.extend(out.len()..out.len() + n);
            out.extend(std::iter::repeat_n(pad, n));
        } else {
            out.push(t);
        }
    }
    Ok((out, at))
}
