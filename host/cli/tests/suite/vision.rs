//! The vision path against the `vision-tiny` goldens (release processor, MoonViT3d tower,
//! patchmergerv2 projector, `<|media_pad|>` merge into the k3-tiny text model) and the
//! `vision-preproc` goldens (the release preprocessing with the real limits on 16 sizes).

use crate::common;

use common::{Golden, max_abs_diff};
use kimi_host::model::Model;
use kimi_host::model::config::load_config;
use kimi_host::model::vision::{Image, MediaProcConfig, VisionModel, preprocess};
use sha2::{Digest, Sha256};

fn vision_tiny() -> (Golden, Model, VisionModel) {
    let g = Golden::open("vision-tiny");
    let text = Model::load(&common::golden_dir().join("k3-tiny")).expect("the text case loads");
    let vc = load_config(&g.dir).expect("config").vision_config.expect("vision_config");
    let vm = VisionModel::load(&g.dir, &vc, text.backend()).expect("the tower loads");
    (g, text, vm)
}

#[test]
fn vision_reproduces_the_vision_tiny_goldens() {
    let (g, text, vm) = vision_tiny();
    let tr = kimi_host_cli::vision::run_case(&vm, Some(&text), &g.dir).expect("the case runs");
    let tol = &g.case["suggested_tolerance"];
    let tower_tol = tol["tower_and_projector_max_abs"].as_f64().expect("tower tolerance") as f32;
    let logits_tol = tol["e2e_logits_max_abs"].as_f64().expect("logits tolerance") as f32;
    let mut worst = std::collections::BTreeMap::<&str, f32>::new();
    let mut checked = 0;
    for name in g.names() {
        if name.starts_with("input.") {
            continue;
        }
        checked += 1;
        match g.case["golden_tensors"][&name]["dtype"].as_str() {
            Some("int64") => {
                assert_eq!(tr.get_i64(&name).unwrap_or_else(|| panic!("{name} not computed")), g.i64(&name), "{name}")
            }
            Some("uint8") => {
                assert_eq!(tr.get_u8(&name).unwrap_or_else(|| panic!("{name} not computed")), g.u8(&name), "{name}")
            }
            _ => {
                let got = tr.get_f32(&name).unwrap_or_else(|| panic!("{name} was not computed"));
                let want = g.f32(&name);
                assert_eq!(got.len(), want.len(), "{name}: shape");
                let (class, bound) = if name.contains("pixel_values") {
                    // Exact, given the Pillow-identical resize the u8 tensors check.
                    ("pixels", 0.0)
                } else if name == "e2e.logits" {
                    ("logits", logits_tol)
                } else {
                    ("tower", tower_tol)
                };
                let d = max_abs_diff(got, &want);
                assert!(d <= bound, "{name}: max |Δ| {d} > {bound}");
                let e = worst.entry(class).or_default();
                *e = e.max(d);
            }
        }
    }
    assert!(checked >= 35, "only {checked} golden tensors checked");
    eprintln!("vision-tiny worst |Δ| by class: {worst:?}");
}

/// Items never see each other: the projector rows of each item alone equal its rows in the
/// packed call, and the packed call in reverse order gives the same rows per item.
#[test]
fn tower_items_are_isolated_in_a_packed_call() {
    let (g, _text, vm) = vision_tiny();
    let be = kimi_kernels::CpuBackend;
    let mut items = Vec::new();
    for name in ["img0", "img1", "img3"] {
        items.push(vm.preprocess(&g.image(&format!("input.{name}")).expect("image")).input);
    }
    let d = vm.config.text_hidden_size;
    let packed = vm.encode(&be, &items, None).expect("packed");
    let mut at = 0;
    for it in &items {
        let alone = vm.encode(&be, std::slice::from_ref(it), None).expect("alone");
        let d_alone = max_abs_diff(&alone, &packed[at * d..(at + it.tokens()) * d]);
        assert!(d_alone < 1e-5, "an item's rows moved by {d_alone} when packed with others");
        at += it.tokens();
    }
    let reversed: Vec<_> = items.iter().rev().cloned().collect();
    let rev = vm.encode(&be, &reversed, None).expect("reversed");
    let last = items.last().expect("items").tokens() * d;
    assert!(max_abs_diff(&rev[..last], &packed[packed.len() - last..]) < 1e-5);
}

/// `image_formula` of the vision-preproc case.
fn formula_image(w: usize, h: usize, rgba: bool) -> Image {
    let ch = if rgba { 4 } else { 3 };
    let mut data = Vec::with_capacity(w * h * ch);
    for y in 0..h {
        for x in 0..w {
            data.push(((3 * x + 5 * y) % 256) as u8);
            data.push(((x * y + 7 * x) % 256) as u8);
            data.push((20 + 200 * ((x / 8 + y / 8) % 2)) as u8);
            if rgba {
                data.push(if x < w / 5 { 0 } else { (255 * y / (h - 1).max(1)).min(255) as u8 });
            }
        }
    }
    Image { width: w, height: h, channels: ch, data }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn release_preprocessing_matches_vision_preproc_on_all_sizes() {
    let dir = common::golden_dir().join("vision-preproc");
    let case: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json")).expect("json");
    let cfg = MediaProcConfig::parse(&serde_json::json!({ "media_proc_cfg": case["media_proc_cfg"] }).to_string())
        .expect("media_proc_cfg");
    assert_eq!(cfg, MediaProcConfig::release(), "the case carries the release limits");
    let rows = case["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 16);
    for r in rows {
        let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
        let (w, h) = (n("width"), n("height"));
        let img = formula_image(w, h, r["mode"] == "RGBA");
        let out = preprocess(&img, &cfg);
        let what = format!("{w}x{h} {}", r["mode"]);
        let p = out.plan;
        assert_eq!(
            [p.new_width, p.new_height, p.pad_width, p.pad_height, p.num_tokens],
            [n("new_width"), n("new_height"), n("pad_width"), n("pad_height"), n("num_tokens")],
            "{what}: plan"
        );
        let grid: Vec<usize> =
            r["grid_thw"].as_array().expect("grid").iter().map(|v| v.as_u64().unwrap_or(0) as usize).collect();
        assert_eq!(out.input.grid_thw.to_vec(), grid, "{what}: grid");
        assert_eq!(out.input.tokens(), n("num_tokens"), "{what}: tokens");
        assert_eq!(sha256_hex(&out.padded), r["resized_padded_u8_sha256"], "{what}: resized and padded pixels");
        let f32le: Vec<u8> = out.input.pixel_values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(sha256_hex(&f32le), r["pixel_values_f32le_sha256"], "{what}: pixel values");
    }
}

/// The tower and projector on the GPU backend over the host build (`host_backend`: the GPU
/// kernels run on the host, staged as on a device: GELU in both forms and the table-driven RoPE, the rest the CPU backend's) at both wave sizes: the golden's
/// projector rows within its tolerance.
#[test]
fn vision_tower_on_the_gpu_kernels_matches_the_goldens() {
    use kimi_kpl_host::host_backend;
    let (g, _text, vm) = vision_tiny();
    let tol = g.case["suggested_tolerance"]["tower_and_projector_max_abs"].as_f64().expect("tolerance") as f32;
    let mut items = Vec::new();
    for it in g.case["items"].as_array().expect("items") {
        let name = it["name"].as_str().expect("name");
        let input = match g.image(&format!("input.{name}")) {
            Some(img) => vm.preprocess(&img).input,
            None => {
                // A clip: its frames, processed one by one.
                let frames: Vec<_> = (0..)
                    .map_while(|k| g.image(&format!("input.{name}.frame{k}")))
                    .map(|f| vm.preprocess(&f).input)
                    .collect();
                kimi_host::model::vision::VisionInput::clip(&frames).expect("clip")
            }
        };
        items.push(input);
    }
    for wave in [32, 64] {
        let out = vm.encode(&host_backend(wave), &items, None).expect("encodes");
        let d = max_abs_diff(&out, &g.f32("projector.out"));
        assert!(d <= tol, "wave {wave}: projector.out differs by {d}");
    }
}
