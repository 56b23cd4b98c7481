//! The forward pass against the release modelling code's goldens (`../shared/golden`, see
//! `K3_GOLDENS.md`). Every tensor listed in a case's `case.json` is compared — the test fails if
//! one is left unchecked — with the case's `suggested_tolerance`; router ids and indexer sets
//! must match exactly.

use crate::common;

use std::collections::BTreeSet;

use common::{Golden, assert_close, max_abs_diff};
use kimi_host::model::forward::{Ffn, Model};
use kimi_host::model::{LogitsFor, SequenceState, Trace};
use kimi_kernels::Matrix;

struct Checker<'a> {
    g: &'a Golden,
    checked: BTreeSet<String>,
    worst_logits: f32,
    worst_state: f32,
}

impl Checker<'_> {
    fn f32(&mut self, name: &str, got: &[f32], tol: f32) {
        let want = self.g.f32(name);
        let d = assert_close(name, got, &want, tol);
        if name.contains("logits") {
            self.worst_logits = self.worst_logits.max(d);
        } else if !name.contains("margin") && !name.contains("scores") {
            self.worst_state = self.worst_state.max(d);
        }
        self.checked.insert(name.to_string());
    }

    fn i64(&mut self, name: &str, got: &[i64]) {
        assert_eq!(got, self.g.i64(name).as_slice(), "{name} differs");
        self.checked.insert(name.to_string());
    }

    fn seen(&mut self, name: &str) {
        self.checked.insert(name.to_string());
    }

    fn state(&mut self, phase: &str, state: &SequenceState, cfg: &kimi_host::model::TextConfig) {
        let p = cfg.kda_projection_dim();
        let w = cfg.kda.conv_kernel;
        let tol = self.g.tol_state();
        for i in 0..cfg.num_layers {
            let pre = format!("state.{phase}.layer{i}");
            if let Some(s) = state.kda(i) {
                self.f32(&format!("{pre}.kda.recurrent_state"), s.recurrent, tol);
                for (b, x) in ["q", "k", "v"].iter().enumerate() {
                    let name = format!("{pre}.kda.conv_state.{x}");
                    let want = self.g.f32(&name);
                    // fla keeps W frames; column 0 is never read again, so only the W−1 frames
                    // the next step reads are state. Compare those.
                    let frames = s.conv_frames(b);
                    let mut got = want.clone();
                    for c in 0..p {
                        for j in 1..w {
                            got[c * w + j] = frames[(j - 1) * p + c];
                        }
                    }
                    self.f32(&name, &got, tol);
                }
            }
            if let Some(cache) = state.mla(i) {
                self.f32(&format!("{pre}.mla.latent_rows"), &cache.rows(), tol);
                let keys = format!("{pre}.indexer.keys");
                if self.g.has(&keys) {
                    self.f32(&keys, &cache.index_keys(), tol);
                }
            }
        }
    }
}

fn lens(g: &Golden, prefix: &str, suffix: &str) -> Vec<usize> {
    let mut v: Vec<usize> =
        g.names().iter().filter_map(|n| n.strip_prefix(prefix)?.strip_suffix(suffix)?.parse().ok()).collect();
    v.sort();
    v
}

fn check_case(name: &str) {
    check_case_on(name, None);
}

/// Every golden tensor of `name`, with the model's ops on `backend` (default: the CPU backend).
fn check_case_on(name: &str, backend: Option<std::sync::Arc<dyn kimi_kernels::Backend>>) {
    let g = Golden::open(name);
    let mut model = Model::load(&g.dir).expect("golden model loads");
    if let Some(be) = backend {
        eprintln!("{name} on {}", be.describe());
        model = model.with_backend(be);
    }
    let cfg = model.text_config().clone();
    let (v, tol_l, tol_s) = (cfg.vocab_size, g.tol_logits(), g.tol_state());
    let mut ck = Checker { g: &g, checked: BTreeSet::new(), worst_logits: 0.0, worst_state: 0.0 };

    // Prefill logits, fresh request, every position.
    for len in lens(&g, "prefill.len", ".input_ids") {
        let ids = g.ids(&format!("prefill.len{len}.input_ids"));
        ck.seen(&format!("prefill.len{len}.input_ids"));
        let mut st = model.new_state();
        let logits = model.forward(&ids, &mut st, LogitsFor::AllTokens, None).expect("forward");
        ck.f32(&format!("prefill.len{len}.logits"), &logits, tol_l);
    }

    // Cached decode after the prompt, with states after prefill and after decode.
    let prompt = g.ids("decode.prompt_input_ids");
    let steps = g.ids("decode.input_ids");
    ck.seen("decode.prompt_input_ids");
    ck.seen("decode.input_ids");
    let mut st = model.new_state();
    model.forward(&prompt, &mut st, LogitsFor::AllTokens, None).expect("prefill");
    ck.state("after_prefill", &st, &cfg);
    let mut decode_logits = Vec::new();
    let mut decode_sel: Vec<Trace> = Vec::new();
    for &id in &steps {
        let mut tr = Trace::default();
        decode_logits.extend(model.forward(&[id], &mut st, LogitsFor::AllTokens, Some(&mut tr)).expect("decode"));
        decode_sel.push(tr);
    }
    ck.f32("decode.logits", &decode_logits, tol_l);
    ck.state("after_decode", &st, &cfg);
    for i in 0..cfg.num_layers {
        let sel_name = format!("index.decode.layer{i}.selected");
        if !g.has(&sel_name) {
            continue;
        }
        let topk = g.shape(&sel_name)[1];
        let mut ids = Vec::new();
        let mut margins = Vec::new();
        for tr in &decode_sel {
            let s = tr.get_i64(&format!("index.layer{i}.selected")).expect("decode selection traced");
            assert_eq!(s.len(), topk);
            ids.extend_from_slice(s);
            margins.extend_from_slice(tr.get_f32(&format!("index.layer{i}.margin")).expect("margin"));
        }
        ck.i64(&sel_name, &ids);
        ck.f32(&format!("index.decode.layer{i}.margin"), &margins, tol_s);
    }

    // prefill(prompt) + decode(rest) == prefill(all), on our own engine.
    let mut all = prompt.clone();
    all.extend_from_slice(&steps);
    let mut fresh = model.new_state();
    let full = model.forward(&all, &mut fresh, LogitsFor::AllTokens, None).expect("full prefill");
    let tail = &full[prompt.len() * v..];
    let d = max_abs_diff(&decode_logits, tail);
    assert!(d <= tol_l, "{name}: prefill+decode vs prefill(all): max |Δ| {d} > {tol_l}");

    // Per-layer trace of one uncached prefill.
    for len in lens(&g, "trace.len", ".input_ids") {
        let pre = format!("trace.len{len}.");
        let ids = g.ids(&format!("{pre}input_ids"));
        ck.seen(&format!("{pre}input_ids"));
        let mut tr = Trace::default();
        model.forward(&ids, &mut model.new_state(), LogitsFor::AllTokens, Some(&mut tr)).expect("trace");
        for gname in g.names().iter().filter(|n| n.starts_with(&pre) && !n.ends_with("input_ids")) {
            let ours = &gname[pre.len()..];
            if let Some(x) = tr.get_i64(ours) {
                ck.i64(gname, x);
            } else {
                let x = tr.get_f32(ours).unwrap_or_else(|| panic!("{ours} not traced")).to_vec();
                let tol = if ours == "logits" { tol_l } else { tol_s };
                ck.f32(gname, &x, tol);
            }
        }
    }

    // K3.1 indexer selections and scores on an uncached prefill.
    for len in lens(&g, "index.len", ".layer3.selected") {
        let pre = format!("index.len{len}.");
        let ids = g.ids(&format!("prefill.len{len}.input_ids"));
        let mut tr = Trace::default();
        model.forward(&ids, &mut model.new_state(), LogitsFor::AllTokens, Some(&mut tr)).expect("index");
        for gname in g.names().iter().filter(|n| n.starts_with(&pre)) {
            let ours = format!("index.{}", &gname[pre.len()..]);
            if gname.ends_with(".selected") {
                ck.i64(gname, tr.get_i64(&ours).expect("selection traced"));
            } else if gname.ends_with(".scores") {
                // Entries s > t are not candidates: keep the golden's values there.
                let mut got = g.f32(gname);
                let ours = tr.get_f32(&ours).expect("scores traced");
                for t in 0..len {
                    got[t * len..t * len + t + 1].copy_from_slice(&ours[t * len..t * len + t + 1]);
                }
                ck.f32(gname, &got, tol_s);
            } else {
                ck.f32(gname, tr.get_f32(&ours).expect("margin traced"), tol_s);
            }
        }
    }

    // Exact MXFP4 dequantisation of stored experts.
    for gname in g.names().iter().filter(|n| n.starts_with("mxfp4.")) {
        let parts: Vec<&str> = gname.split('.').collect(); // mxfp4.layer1.expert0.w1.dequantized
        let layer: usize = parts[1].trim_start_matches("layer").parse().expect("layer");
        let expert: usize = parts[2].trim_start_matches("expert").parse().expect("expert");
        let Ffn::Moe(moe) = &model.layers()[layer].ffn else { panic!("layer {layer} is not MoE") };
        let ex = &moe.experts[expert];
        let w = match parts[3] {
            "w1" => &ex.w1,
            "w2" => &ex.w2,
            _ => &ex.w3,
        };
        let Matrix::Mxfp4(m) = w.m() else { panic!("{gname}: expert is not stored MXFP4") };
        let got = m.to_f32();
        let want = g.f32(gname);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{gname}: not bit-exact");
        ck.seen(gname);
    }

    let missing: Vec<String> = g.names().into_iter().filter(|n| !ck.checked.contains(n)).collect();
    assert!(missing.is_empty(), "{name}: golden tensors not checked: {missing:?}");
    eprintln!(
        "{name}: {} golden tensors checked; worst logits |Δ| {:.2e} (tol {tol_l}), worst hidden/state |Δ| {:.2e} (tol {tol_s}); prefill+decode vs prefill(all) {d:.2e}",
        ck.checked.len(),
        ck.worst_logits,
        ck.worst_state
    );
}

#[test]
fn k3_tiny_matches_release() {
    check_case("k3-tiny");
}

#[test]
fn k3_tiny_mxfp4_matches_release() {
    check_case("k3-tiny-mxfp4");
}

#[test]
fn k31_tiny_indexer_matches_release() {
    check_case("k31-tiny-indexer");
}

/// Re-runs this binary's three golden tests and three batch-invariance tests with `var=value` in
/// the environment (a product path forced on or off), on a CPU with AMX tiles; other machines skip
/// it, saying so.
fn rerun_goldens_with(var: &str, value: &str, what: &str) {
    if std::env::var_os("KIMI_SIMD").is_some() || std::env::var_os("KIMI_MXFP4").is_some() {
        return; // a forced run already
    }
    if !kimi_kernels::amx_enabled() {
        eprintln!("skipped: this CPU has no AMX tiles; the goldens ran on {}", kimi_kernels::simd_level().name());
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let filters = ["golden_model::k3_tiny", "golden_model::k31_tiny", "batch::a_sequence_in_a_mixed_batch"];
    let out = std::process::Command::new(&exe)
        .env(var, value)
        .args(filters)
        .args(["--test-threads", "2"])
        .output()
        .expect("re-run the golden tests");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "goldens fail with {what}:\n{text}");
    assert!(text.contains("6 passed"), "the forced run ran the three goldens and three batch tests:\n{text}");
}

/// On a CPU with AMX tiles the goldens above ran their BF16 products on the tiles (the default).
/// This runs them, and the batch-invariance tests, once more with the tiles off
/// (`KIMI_SIMD=avx512`), so both product paths are held to the goldens on such a machine (the
/// kernels' tests cover the lower SIMD levels).
#[test]
fn goldens_pass_with_the_amx_tiles_and_without() {
    rerun_goldens_with("KIMI_SIMD", "avx512", "the AMX tiles off");
}

/// With `--mxfp4-tiles` (here `KIMI_MXFP4=tiles`, the same switch) the MXFP4 golden's routed
/// experts run on the AMX tiles, widened to BF16 tiles from their codes: the goldens and the
/// batch-invariance tests hold there too.
#[test]
fn goldens_pass_with_mxfp4_on_the_amx_tiles() {
    rerun_goldens_with("KIMI_MXFP4", "tiles", "MXFP4 on the AMX tiles");
}

/// The GPU kernels (`kernels/ops/*.cu`, built for the host through kpl) inside the whole model,
/// on every golden model: the 7-token traced prefill (every traced tensor and the logits) and the
/// cached decode steps (logits, states after decode) run on the GPU backend over the host build
/// (`host_backend`: every op staged through "device" memory as on a GPU) — RMSNorm, KDA's gated
/// norm, SiTU, AttnRes, the embedding, the router, KDA's convolution and decode step on the
/// kernels — at AMD's wave 64, and one model at NVIDIA's wave 32. The decode prompt is prefilled
/// on the CPU backend: each GPU thread is an OS thread here, so long prefills through the kernels
/// would take minutes.
#[test]
fn goldens_pass_through_the_host_built_gpu_kernels() {
    use kimi_kpl_host::host_backend;
    for (name, wave) in [("k3-tiny", 64), ("k3-tiny-mxfp4", 64), ("k31-tiny-indexer", 64), ("k3-tiny-mxfp4", 32)] {
        let g = Golden::open(name);
        let cpu = Model::load(&g.dir).expect("golden model loads");
        let gpu =
            Model::load(&g.dir).expect("golden model loads").with_backend(std::sync::Arc::new(host_backend(wave)));
        let cfg = cpu.text_config().clone();
        let (tol_l, tol_s) = (g.tol_logits(), g.tol_state());
        let mut ck = Checker { g: &g, checked: BTreeSet::new(), worst_logits: 0.0, worst_state: 0.0 };
        let mut tr = Trace::default();
        let ids = g.ids("trace.len7.input_ids");
        gpu.forward(&ids, &mut gpu.new_state(), LogitsFor::AllTokens, Some(&mut tr)).expect("trace");
        for gname in g.names().iter().filter(|n| n.starts_with("trace.len7.") && !n.ends_with("input_ids")) {
            let ours = &gname["trace.len7.".len()..];
            if let Some(x) = tr.get_i64(ours) {
                ck.i64(gname, x);
            } else {
                let x = tr.get_f32(ours).unwrap_or_else(|| panic!("{ours} not traced")).to_vec();
                ck.f32(gname, &x, if ours == "logits" { tol_l } else { tol_s });
            }
        }
        let mut st = cpu.new_state();
        cpu.forward(&g.ids("decode.prompt_input_ids"), &mut st, LogitsFor::AllTokens, None).expect("prefill");
        let mut logits = Vec::new();
        for &id in &g.ids("decode.input_ids") {
            logits.extend(gpu.forward(&[id], &mut st, LogitsFor::AllTokens, None).expect("decode on the kernels"));
        }
        ck.f32("decode.logits", &logits, tol_l);
        ck.state("after_decode", &st, &cfg);
        eprintln!(
            "{name} on {}: {} golden tensors; worst logits |Δ| {:.2e}, worst state |Δ| {:.2e}",
            gpu.backend().describe(),
            ck.checked.len(),
            ck.worst_logits,
            ck.worst_state
        );
    }
}

/// The goldens through the GPU backend with its Triton kernels as well: every BF16 / MXFP4 product
/// and the MLA attention launched exactly as for a GPU and replayed in Triton's interpreter (the
/// kpl kernels on their host build) — the 7-token prefill's logits, then the decode prompt's
/// prefill and cached decode steps' logits, within the goldens' tolerances. This is the device
/// check's own golden check (`kimi-host kernels check --golden`), so what a lent GPU runs is
/// proven here first. Skipped, saying so, only where the GPU tools cannot be installed.
#[test]
fn goldens_pass_through_the_gpu_backend_with_its_triton_kernels() {
    use kimi_kpl_host::HostDevice;
    let Some(python) = common::gpu_tools_python() else { return };
    // Each model with the Triton kernels it must have run on the "device".
    for (name, wave, kernels) in [
        ("k3-tiny", 64, &["triton_matmul_bf16", "triton_mla_decode", "triton_kda_chunk_prefill"][..]),
        (
            "k3-tiny-mxfp4",
            64,
            &["triton_matmul_bf16", "triton_mla_decode", "triton_moe_mxfp4", "triton_kda_chunk_prefill"][..],
        ),
        ("k31-tiny-indexer", 32, &["triton_matmul_bf16", "triton_indexer_scores", "triton_kda_chunk_prefill"][..]),
    ] {
        let dev = std::sync::Arc::new(
            HostDevice::with_triton(wave, std::path::Path::new(&python)).expect("the replay server starts"),
        );
        let r = kimi_host_cli::device_check::golden_check(dev.clone(), &common::golden_dir().join(name)).expect("runs");
        let launches = dev.launches();
        eprintln!("{r} (wave {wave}, Triton replayed; launches {launches:?})");
        assert!(r.passed(), "{r}");
        for k in kernels {
            assert!(launches.get(*k).is_some_and(|&n| n > 0), "{name}: {k} never ran: {launches:?}");
        }
    }
}
