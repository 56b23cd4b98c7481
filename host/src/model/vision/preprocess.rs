//! The release image preprocessing (spec `k3-dspark-vision.md` B.5, the release
//! `navit_resize_image` + `media_utils`): resize plan, Pillow-identical bicubic resize, the
//! chessboard composite of transparent images, zero padding to whole merged patches,
//! normalisation and row-major patchify.

use super::config::MediaProcConfig;
use super::resample::resize_bicubic;

/// A decoded 8-bit image, rows top to bottom, pixels interleaved (RGB or RGBA).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub width: usize,
    pub height: usize,
    /// 3 (RGB) or 4 (RGBA).
    pub channels: usize,
    pub data: Vec<u8>,
}

impl Image {
    pub fn rgb(width: usize, height: usize, data: Vec<u8>) -> Image {
        Image { width, height, channels: 3, data }
    }

    pub fn rgba(width: usize, height: usize, data: Vec<u8>) -> Image {
        Image { width, height, channels: 4, data }
    }
}

/// How an image is brought to the tower's grid: resized to `new_*`, then padded by `pad_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResizePlan {
    pub new_width: usize,
    pub new_height: usize,
    pub pad_width: usize,
    pub pad_height: usize,
    /// Tokens the image becomes: `(h/2)·(w/2)` of the padded grid.
    pub num_tokens: usize,
}

impl ResizePlan {
    /// The release rule, in f64 as the Python computes it: `s = min(1, √(limit / (max(1, W//p) ·
    /// max(1, H//p))), side·p/W, side·p/H)`, `new = min(max(1, int(W·s)), side·p)` (never
    /// upscales), then zero padding to the next multiple of `merge · p`.
    pub fn new(width: usize, height: usize, cfg: &MediaProcConfig) -> ResizePlan {
        let p = cfg.patch_size;
        let side = (cfg.patch_limit_on_one_side * p) as f64;
        let (w, h) = (width.max(1) as f64, height.max(1) as f64);
        let area = ((width / p).max(1) * (height / p).max(1)) as f64;
        let s = 1f64.min((cfg.in_patch_limit as f64 / area).sqrt()).min(side / w).min(side / h);
        let new = |v: f64| ((v * s) as usize).max(1).min(side as usize);
        let (new_width, new_height) = (new(w), new(h));
        let unit = cfg.merge_kernel_size * p;
        let pad = |v: usize| v.div_ceil(unit) * unit - v;
        let (pad_width, pad_height) = (pad(new_width), pad(new_height));
        let grid_h = (new_height + pad_height) / p;
        let grid_w = (new_width + pad_width) / p;
        let m = cfg.merge_kernel_size;
        ResizePlan { new_width, new_height, pad_width, pad_height, num_tokens: (grid_h / m) * (grid_w / m) }
    }

    /// `(t, h, w)` in patches of the padded image.
    pub fn grid_thw(&self, cfg: &MediaProcConfig) -> [usize; 3] {
        let p = cfg.patch_size;
        [1, (self.new_height + self.pad_height) / p, (self.new_width + self.pad_width) / p]
    }
}

/// One tower input item: an image, or a clip of frames processed alike (`t` > 1).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionInput {
    /// `[t·h·w, 3, p, p]`, frames in order, patches row-major within a frame.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [usize; 3],
}

impl VisionInput {
    pub fn patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// Tokens this item becomes after the 2×2 merge (frames pooled).
    pub fn tokens(&self) -> usize {
        (self.grid_thw[1] / 2) * (self.grid_thw[2] / 2)
    }

    /// A clip from processed frames of one size (their patches concatenated frame-major).
    pub fn clip(frames: &[VisionInput]) -> Option<VisionInput> {
        let first = frames.first()?;
        if frames.iter().any(|f| f.grid_thw != first.grid_thw || f.grid_thw[0] != 1) {
            return None;
        }
        Some(VisionInput {
            pixel_values: frames.iter().flat_map(|f| f.pixel_values.iter().copied()).collect(),
            grid_thw: [frames.len(), first.grid_thw[1], first.grid_thw[2]],
        })
    }
}

/// Everything the processor computes for one image (tools and tests read the intermediates).
#[derive(Clone, Debug)]
pub struct Processed {
    pub plan: ResizePlan,
    /// `[H', W', 3]` after resize, composite and padding, before normalisation.
    pub padded: Vec<u8>,
    pub input: VisionInput,
}

/// Runs the release processor on one image.
pub fn preprocess(img: &Image, cfg: &MediaProcConfig) -> Processed {
    let plan = ResizePlan::new(img.width, img.height, cfg);
    let resized = resize_bicubic(&img.data, img.width, img.height, img.channels, plan.new_width, plan.new_height);
    let rgb = if img.channels == 4 { composite(&resized, plan.new_width, cfg) } else { resized };
    let (pw, ph) = (plan.new_width + plan.pad_width, plan.new_height + plan.pad_height);
    let mut padded = vec![0u8; pw * ph * 3];
    for y in 0..plan.new_height {
        padded[y * pw * 3..][..plan.new_width * 3]
            .copy_from_slice(&rgb[y * plan.new_width * 3..][..plan.new_width * 3]);
    }
    let grid_thw = plan.grid_thw(cfg);
    let pixel_values = patchify(&padded, pw, grid_thw, cfg);
    Processed { plan, padded, input: VisionInput { pixel_values, grid_thw } }
}

/// RGBA over the chessboard (squares of `size` pixels, the top-left one white unless the config
/// says gray): `u8(trunc(f32(a/255)·rgb + (1 − a)·bg))` in f32, as the release blends.
fn composite(rgba: &[u8], width: usize, cfg: &MediaProcConfig) -> Vec<u8> {
    let bg = &cfg.transparent_bg_config;
    let (first, second) = if bg.chessboard_square_on_top_left {
        (bg.chessboard_white_value, bg.chessboard_gray_value)
    } else {
        (bg.chessboard_gray_value, bg.chessboard_white_value)
    };
    let sq = bg.chessboard_square_size;
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3);
    for (i, px) in rgba.chunks_exact(4).enumerate() {
        let (x, y) = (i % width, i / width);
        let b = f32::from(if (x / sq + y / sq) % 2 == 1 { second } else { first });
        let a = (f64::from(px[3]) / 255.0) as f32;
        for &c in &px[..3] {
            out.push((a * f32::from(c) + (1.0 - a) * b) as u8);
        }
    }
    out
}

/// `[H', W', 3]` u8 → `[h·w, 3, p, p]` f32 with `x = f32(f32(u8/255) − mean) · f32(1/std)`.
fn patchify(padded: &[u8], pw: usize, grid: [usize; 3], cfg: &MediaProcConfig) -> Vec<f32> {
    let p = cfg.patch_size;
    let (gh, gw) = (grid[1], grid[2]);
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        let inv_std = (1.0 / f64::from(cfg.image_std[c])) as f32;
        for (v, out) in table.iter_mut().enumerate() {
            *out = ((v as f64 / 255.0) as f32 - cfg.image_mean[c]) * inv_std;
        }
    }
    let mut out = Vec::with_capacity(gh * gw * 3 * p * p);
    for py in 0..gh {
        for px in 0..gw {
            for (c, table) in lut.iter().enumerate() {
                for dy in 0..p {
                    let row = (py * p + dy) * pw;
                    out.extend((0..p).map(|dx| table[usize::from(padded[(row + px * p + dx) * 3 + c])]));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_plan_examples() {
        // Spec B.5's worked examples with the release limits.
        let cfg = MediaProcConfig::release();
        for (w, h, tokens) in [(512, 512, 361), (640, 480, 414), (1024, 1024, 1369), (1920, 1080, 2691)] {
            assert_eq!(ResizePlan::new(w, h, &cfg).num_tokens, tokens, "{w}x{h}");
        }
    }
}
