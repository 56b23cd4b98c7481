//! `kimi-host bench vision`: the vision tower and projector on synthetic images — images/s,
//! patches/s and the tower's GFLOP/s beside the CPU backend's BF16 product peak measured in the
//! same run. Without `--model`, a random tower of the release width (1024 wide, 12 heads of 128,
//! MLP 4096, projecting to 7168) with `--layers` blocks is written to a temporary directory and
//! run with the release preprocessing limits.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

use kimi_host::model::config::load_config;
use kimi_host::model::tiny::{TinyOptions, tiny_config, write_random_checkpoint};
use kimi_host::model::vision::{Image, VisionInput, VisionModel};

#[derive(Debug, Serialize)]
pub struct VisionBench {
    pub model: String,
    pub layers: usize,
    pub images: usize,
    pub image_size: [usize; 2],
    pub patches_per_image: usize,
    pub tokens_per_image: usize,
    /// Best of three calls over all the images.
    pub seconds_per_call: f64,
    pub images_per_second: f64,
    pub patches_per_second: f64,
    /// Tower + projector floating-point work per call over the best time.
    pub gflops: f64,
    pub matmul_peak_gflops: f64,
    pub ratio_to_matmul_peak: f64,
    /// The rows equal those of the same images encoded one call each.
    pub batched_equals_one_by_one: bool,
}

impl std::fmt::Display for VisionBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "vision tower ({}, {} layers)", self.model, self.layers)?;
        writeln!(
            f,
            "{} images of {}x{}: {} patches, {} tokens each",
            self.images, self.image_size[0], self.image_size[1], self.patches_per_image, self.tokens_per_image
        )?;
        writeln!(
            f,
            "one call: {:.3} s = {:.2} images/s, {:.0} patches/s, {:.1} GFLOP/s ({:.2}x the BF16 product peak of {:.1} GFLOP/s)",
            self.seconds_per_call,
            self.images_per_second,
            self.patches_per_second,
            self.gflops,
            self.ratio_to_matmul_peak,
            self.matmul_peak_gflops
        )?;
        writeln!(f, "batched rows equal one-by-one rows: {}", self.batched_equals_one_by_one)
    }
}

/// A directory removed when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A synthetic `w × h` RGB image (smooth gradients with a checker, so the resize has work).
fn synthetic(w: usize, h: usize, seed: usize) -> Image {
    let mut data = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            data.push(((3 * x + 5 * y + seed) % 256) as u8);
            data.push(((x * y / 7 + seed * 13) % 256) as u8);
            data.push(if (x / 16 + y / 16) % 2 == 0 { 40 } else { 210 });
        }
    }
    Image::rgb(w, h, data)
}

/// Floating-point operations of one tower + projector call over `items`.
fn flops(vm: &VisionModel, items: &[VisionInput]) -> f64 {
    let c = &vm.config;
    let (d, q, i, p) =
        (c.vt_hidden_size as f64, c.qkv_width() as f64, c.vt_intermediate_size as f64, c.patch_values() as f64);
    let l: f64 = items.iter().map(|x| x.patches() as f64).sum();
    let sq: f64 = items.iter().map(|x| (x.patches() as f64).powi(2)).sum();
    let per_layer = 2.0 * l * d * (3.0 * q + q + 2.0 * i) + 4.0 * sq * q;
    let n: f64 = items.iter().map(|x| x.tokens() as f64).sum();
    let m = c.merged_width() as f64;
    2.0 * l * p * d + c.vt_num_hidden_layers as f64 * per_layer + 2.0 * n * m * (m + c.text_hidden_size as f64)
}

pub fn bench_vision(model: Option<&Path>, layers: usize, size: [usize; 2], images: usize) -> Result<VisionBench> {
    let mut tmp = None;
    let (dir, name) = match model {
        Some(d) => (d.to_path_buf(), d.display().to_string()),
        None => {
            let t = TempDir(std::env::temp_dir().join(format!("kimi-bench-vision-{}", std::process::id())));
            let tmp = tmp.insert(t);
            let mut cfg = tiny_config(&TinyOptions { seed: 0, k31: false, mxfp4: false, vision: true });
            let v = &mut cfg["vision_config"];
            for (k, val) in [
                ("vt_hidden_size", 1024),
                ("qkv_hidden_size", 1536),
                ("vt_num_attention_heads", 12),
                ("vt_intermediate_size", 4096),
                ("init_pos_emb_height", 64),
                ("init_pos_emb_width", 64),
                ("mm_hidden_size", 1024),
                ("text_hidden_size", 7168),
            ] {
                v[k] = serde_json::json!(val);
            }
            v["vt_num_hidden_layers"] = serde_json::json!(layers);
            write_random_checkpoint(&tmp.0, &cfg, 1, false)?;
            // The release limits (the tiny model's are smaller).
            std::fs::remove_file(tmp.0.join("preprocessor_config.json")).context("preprocessor config")?;
            (tmp.0.clone(), "random, release width".to_string())
        }
    };
    let vc = load_config(&dir)?.vision_config.context("the model has no vision_config")?;
    let be = kimi_kernels::CpuBackend;
    let vm = VisionModel::load(&dir, &vc, &be)?;
    let items: Vec<VisionInput> =
        (0..images.max(1)).map(|s| vm.preprocess(&synthetic(size[0], size[1], s)).input).collect();
    let batched = vm.encode(&be, &items, None)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        std::hint::black_box(vm.encode(&be, &items, None)?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let one_by_one: Vec<f32> =
        items.iter().map(|it| vm.encode(&be, std::slice::from_ref(it), None)).collect::<Result<Vec<_>, _>>()?.concat();
    let peak = crate::bench::measure_matmul_peak();
    let gflops = flops(&vm, &items) / best / 1e9;
    let first = &items[0];
    Ok(VisionBench {
        model: name,
        layers: vm.config.vt_num_hidden_layers,
        images: items.len(),
        image_size: size,
        patches_per_image: first.patches(),
        tokens_per_image: first.tokens(),
        seconds_per_call: best,
        images_per_second: items.len() as f64 / best,
        patches_per_second: items.iter().map(VisionInput::patches).sum::<usize>() as f64 / best,
        gflops,
        matmul_peak_gflops: peak,
        ratio_to_matmul_peak: if peak > 0.0 { gflops / peak } else { 0.0 },
        batched_equals_one_by_one: batched.len() == one_by_one.len()
            && batched.iter().zip(&one_by_one).all(|(a, b)| (a - b).abs() <= 1e-4 * (1.0 + b.abs())),
    })
}
