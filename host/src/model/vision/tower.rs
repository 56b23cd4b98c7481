//! The MoonViT3d tower (spec `k3-dspark-vision.md` B.3 steps 1–5): patch embedding, the
//! "divided_fixed" position terms, pre-norm blocks with 2-D RoPE attention inside each item, and
//! the final RMSNorm. Every item (an image, or a clip of up to `init_pos_emb_time` frames) is
//! packed into one batch of patches; attention never crosses items.

use kimi_kernels::{Backend, Gelu, SeqSpan};

use super::config::{MAX_GRID_SIDE, TOWER_NORM_EPS, VisionConfig};
use super::preprocess::VisionInput;
use crate::model::error::ModelError;
use crate::model::norm::rms_norm;
use crate::model::scratch::Scratch;
use crate::model::trace::Trace;
use crate::model::weights::{TensorSource, Weight};

struct Block {
    norm0: Vec<f32>,
    norm1: Vec<f32>,
    wqkv: Weight,
    wo: Weight,
    fc0: Weight,
    fc1: Weight,
}

pub struct Tower {
    pub config: VisionConfig,
    patch_proj: Weight,
    /// `[Hpos, Wpos, D]`.
    pos_emb: Vec<f32>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
}

impl Tower {
    pub fn build(config: VisionConfig, src: &mut dyn TensorSource) -> Result<Tower, ModelError> {
        let c = &config;
        let (d, q, p) = (c.vt_hidden_size, c.qkv_width(), c.patch_size);
        let pre = "vision_tower";
        let blocks = (0..c.vt_num_hidden_layers)
            .map(|i| {
                let n = |s: &str| format!("{pre}.encoder.blocks.{i}.{s}");
                Ok(Block {
                    norm0: src.vector(&n("norm0.weight"), &[d])?,
                    norm1: src.vector(&n("norm1.weight"), &[d])?,
                    wqkv: src.matrix(&n("wqkv.weight"), 3 * q, d)?,
                    wo: src.matrix(&n("wo.weight"), d, q)?,
                    fc0: src.matrix(&n("mlp.fc0.weight"), c.vt_intermediate_size, d)?,
                    fc1: src.matrix(&n("mlp.fc1.weight"), d, c.vt_intermediate_size)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Tower {
            patch_proj: src.matrix_shaped(&format!("{pre}.patch_embed.proj.weight"), &[d, 3, p, p])?,
            pos_emb: src.vector(
                &format!("{pre}.patch_embed.pos_emb.weight"),
                &[c.init_pos_emb_height, c.init_pos_emb_width, d],
            )?,
            final_norm: src.vector(&format!("{pre}.encoder.final_layernorm.weight"), &[d])?,
            blocks,
            config,
        })
    }

    pub fn weights_mut(&mut self) -> impl Iterator<Item = &mut Weight> {
        std::iter::once(&mut self.patch_proj)
            .chain(self.blocks.iter_mut().flat_map(|b| [&mut b.wqkv, &mut b.wo, &mut b.fc0, &mut b.fc1]))
    }

    /// Checks an item's grid before any work: the patch values it carries, even sides (for the
    /// 2×2 merge), the RoPE table's reach and the clip length the time table covers.
    pub fn check(&self, item: &VisionInput) -> Result<(), ModelError> {
        let c = &self.config;
        let [t, h, w] = item.grid_thw;
        let bad = |msg: String| Err(ModelError::config("grid_thw", msg));
        if t == 0 || h == 0 || w == 0 || !h.is_multiple_of(2) || !w.is_multiple_of(2) {
            return bad(format!("{:?}: every side must be positive and h, w even", item.grid_thw));
        }
        if h > MAX_GRID_SIDE || w > MAX_GRID_SIDE {
            return bad(format!("{:?}: the 2-D RoPE covers grids up to {MAX_GRID_SIDE} patches a side", item.grid_thw));
        }
        if t > c.init_pos_emb_time {
            return bad(format!("a clip of {t} frames: at most {} frames form one item", c.init_pos_emb_time));
        }
        if item.pixel_values.len() != t * h * w * c.patch_values() {
            return bad(format!(
                "{:?} needs {} pixel values, the item has {}",
                item.grid_thw,
                t * h * w * c.patch_values(),
                item.pixel_values.len()
            ));
        }
        Ok(())
    }

    /// The tower over a packed batch of items: `[Σ t·h·w, D]` after `final_layernorm`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        sc: &Scratch,
        items: &[VisionInput],
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ModelError> {
        for it in items {
            self.check(it)?;
        }
        let c = &self.config;
        let (d, heads, hd) = (c.vt_hidden_size, c.vt_num_attention_heads, c.head_dim());
        let qw = heads * hd;
        let rows: usize = items.iter().map(VisionInput::patches).sum();
        let pixels: Vec<f32> = items.iter().flat_map(|i| i.pixel_values.iter().copied()).collect();
        let mut spans = Vec::with_capacity(items.len());
        for it in items {
            let start = spans.last().map_or(0, |s: &SeqSpan| s.start + s.len);
            spans.push(SeqSpan { start, len: it.patches(), pos: 0 });
        }
        // 1. Patch embedding: the stride-p convolution is a product with the flattened kernel.
        let proj = self.patch_proj.matmul(be, sc, &pixels, rows);
        // 2. Position terms (host-computed tables, added on the backend).
        let pos = self.position_terms(items);
        let mut x = sc.copy_of(&proj);
        be.add(&mut x, &pos);
        let (cos, sin) = rope_tables(items, hd);
        if let Some(tr) = trace.as_deref_mut() {
            tr.f32("tower.patch_proj", &[rows, d], &proj);
            tr.f32("tower.patch_embed", &[rows, d], &x);
            tr.f32("tower.rope.cos", &[rows, hd / 2], &cos);
            tr.f32("tower.rope.sin", &[rows, hd / 2], &sin);
        }
        drop(proj);
        // 3. Pre-norm blocks.
        let scale = (hd as f32).powf(-0.5);
        for (j, b) in self.blocks.iter().enumerate() {
            let n0 = rms_norm(be, sc, &x, &b.norm0, TOWER_NORM_EPS);
            let qkv = b.wqkv.matmul(be, sc, &n0, rows);
            let (mut q, mut k, mut v) =
                (sc.for_overwrite(rows * qw), sc.for_overwrite(rows * qw), sc.for_overwrite(rows * qw));
            for (t, r) in qkv.chunks_exact(3 * qw).enumerate() {
                q[t * qw..][..qw].copy_from_slice(&r[..qw]);
                k[t * qw..][..qw].copy_from_slice(&r[qw..2 * qw]);
                v[t * qw..][..qw].copy_from_slice(&r[2 * qw..]);
            }
            be.rope_cos_sin(&mut q, &cos, &sin, heads, hd);
            be.rope_cos_sin(&mut k, &cos, &sin, heads, hd);
            let mut o = sc.for_overwrite(rows * qw);
            be.attention_varlen(&q, &k, &v, heads, hd, &spans, scale, &mut o);
            be.add(&mut x, &b.wo.matmul(be, sc, &o, rows));
            let n1 = rms_norm(be, sc, &x, &b.norm1, TOWER_NORM_EPS);
            let mut hmid = b.fc0.matmul(be, sc, &n1, rows);
            be.gelu(&mut hmid, Gelu::Tanh);
            be.add(&mut x, &b.fc1.matmul(be, sc, &hmid, rows));
            if let Some(tr) = trace.as_deref_mut() {
                tr.f32(format!("tower.block{j}.out"), &[rows, d], &x);
            }
        }
        // 5. Final norm.
        let out = rms_norm(be, sc, &x, &self.final_norm, TOWER_NORM_EPS);
        if let Some(tr) = trace {
            tr.f32("tower.encoder_out", &[rows, d], &out);
        }
        Ok(out.to_vec())
    }

    /// Per patch: the learned table resampled to the item's (h, w) with bilinear, half-pixel
    /// centres and no antialias (as is when the sizes match), plus for a clip of t > 1 frames the
    /// fixed sin-cos row of the frame index (a single image gets none).
    fn position_terms(&self, items: &[VisionInput]) -> Vec<f32> {
        let c = &self.config;
        let d = c.vt_hidden_size;
        let mut out = Vec::with_capacity(items.iter().map(|i| i.patches() * d).sum());
        for it in items {
            let [t, h, w] = it.grid_thw;
            let spatial = resample_bilinear(&self.pos_emb, c.init_pos_emb_height, c.init_pos_emb_width, d, h, w);
            for frame in 0..t {
                let time = (t > 1).then(|| sincos_row(frame, d));
                for row in spatial.chunks_exact(d) {
                    match &time {
                        Some(tr) => out.extend(row.iter().zip(tr).map(|(a, b)| a + b)),
                        None => out.extend_from_slice(row),
                    }
                }
            }
        }
        out
    }
}

/// PyTorch's `F.interpolate(mode="bilinear", align_corners=False)` of a `[H, W, D]` table to
/// `[h, w, D]` (identity when the sizes match).
fn resample_bilinear(table: &[f32], th: usize, tw: usize, d: usize, h: usize, w: usize) -> Vec<f32> {
    if (th, tw) == (h, w) {
        return table.to_vec();
    }
    // Source coordinate and the two neighbours' weights along one axis, in f32 as torch.
    let axis = |src: usize, dst: usize, i: usize| {
        let scale = src as f32 / dst as f32;
        let x = (scale * (i as f32 + 0.5) - 0.5).max(0.0);
        let i0 = (x as usize).min(src - 1);
        let i1 = if i0 < src - 1 { i0 + 1 } else { i0 };
        let l1 = x - i0 as f32;
        (i0, i1, 1.0 - l1, l1)
    };
    let mut out = Vec::with_capacity(h * w * d);
    for y in 0..h {
        let (y0, y1, a0, a1) = axis(th, h, y);
        for x in 0..w {
            let (x0, x1, b0, b1) = axis(tw, w, x);
            let at = |yy: usize, xx: usize| &table[(yy * tw + xx) * d..][..d];
            let (p00, p01, p10, p11) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
            out.extend((0..d).map(|e| a0 * (b0 * p00[e] + b1 * p01[e]) + a1 * (b0 * p10[e] + b1 * p11[e])));
        }
    }
    out
}

/// `[sin(t·ω_0..), cos(t·ω_0..)]`, `ω_j = 10000^(−j/(D/2))` (computed in f64, as the release's
/// numpy table).
fn sincos_row(t: usize, d: usize) -> Vec<f32> {
    let half = d / 2;
    let omega = |j: usize| 10000f64.powf(-(j as f64) / half as f64);
    let mut row: Vec<f32> = (0..half).map(|j| (t as f64 * omega(j)).sin() as f32).collect();
    row.extend((0..half).map(|j| (t as f64 * omega(j)).cos() as f32));
    row.resize(d, 0.0);
    row
}

/// The 2-D RoPE's cos and sin per patch, `[rows, hd/2]`: pair 2i turns by `x · f_i` (column),
/// pair 2i+1 by `y · f_i` (row), `f_i = 10000^(−4i/hd)`; frames of a clip repeat the table.
/// Built in f32 as the release builds its `freqs_cis`.
pub fn rope_tables(items: &[VisionInput], hd: usize) -> (Vec<f32>, Vec<f32>) {
    let freqs: Vec<f32> = (0..hd / 4).map(|i| 1.0 / 10000f32.powf((4 * i) as f32 / hd as f32)).collect();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for it in items {
        let [t, h, w] = it.grid_thw;
        for _ in 0..t {
            for y in 0..h {
                for x in 0..w {
                    for f in &freqs {
                        for a in [x as f32 * f, y as f32 * f] {
                            cos.push((a as f64).cos() as f32);
                            sin.push((a as f64).sin() as f32);
                        }
                    }
                }
            }
        }
    }
    (cos, sin)
}
