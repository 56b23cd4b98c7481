//! The `kimi-host` binary: inspect, logits, generate, make-tiny, bench forward.

use crate::common;

use std::process::Command;

use common::{Golden, assert_close};
use kimi_host::model::checkpoint::Checkpoint;
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::model::{LogitsFor, Model, Trace};
use kimi_host_cli::inspect::inspect;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kimi-host"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run kimi-host");
    assert!(out.status.success(), "kimi-host failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf8")
}

#[test]
fn inspect_release_config_and_index() {
    let r = inspect(&common::golden_dir().join("k3-release-config"), Some(1 << 20)).expect("inspect");
    assert_eq!((r.num_layers, r.kda_layers, r.mla_layers), (93, 69, 24));
    let total = r.total_params as f64;
    assert!((total / 2.78e12 - 1.0).abs() < 0.005, "total {total}");
    let active = r.activated_params_per_token as f64;
    assert!((active / 104e9 - 1.0).abs() < 0.01, "activated {active}");
    assert_eq!(r.latent_values_per_token_per_mla_layer, 576);
    assert_eq!(r.snapshot_layers, vec![0, 12, 24, 36, 48, 60, 72, 84]);
    // Spec §4: 69 layers × (6 MiB recurrent + 442,368 B f32 conv).
    assert_eq!(r.kda_state_bytes_per_sequence, 464_633_856);
    let nc = r.name_check.as_ref().expect("the shard index is checked");
    assert_eq!(nc.listed, 497_220);
    assert!(nc.missing.is_empty(), "missing: {:?}", &nc.missing[..nc.missing.len().min(5)]);
    assert!(nc.unused.is_empty(), "unused: {:?}", &nc.unused[..nc.unused.len().min(5)]);
    assert_eq!(nc.vision, 168);
    assert!(
        nc.vision_missing.is_empty() && nc.vision_unused.is_empty(),
        "{:?} {:?}",
        nc.vision_missing,
        nc.vision_unused
    );
    // Spec B.2: tower 401,214,464 + projector 46,144,512.
    assert_eq!(r.vision_params, 447_358_976);
    assert!(nc.other.is_empty());
    // Estimated bytes agree with the index's total (which also holds the vision tower) within 0.1%.
    assert!((r.weight_bytes as f64 / 1_560_860_324_864.0 - 1.0).abs() < 1e-3, "{}", r.weight_bytes);

    let text = run_ok(bin().args(["inspect"]).arg(common::golden_dir().join("k3-release-config")));
    assert!(text.contains("93 (69 KDA, 24 MLA)") && text.contains("name map: OK"), "{text}");
}

#[test]
fn inspect_works_on_config_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(common::golden_dir().join("k3-release-config/config.json"), dir.path().join("config.json"))
        .expect("copy");
    let r = inspect(dir.path(), None).expect("inspect");
    assert!(r.name_check.is_none());
    assert_eq!(r.mla_layers, 24);
    assert!(r.bytes_by_dtype.contains_key("U8"), "MXFP4 experts from the quantization_config");
    let out = bin().arg("inspect").arg(dir.path()).arg("--json").output().expect("run");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["num_layers"], 93);
}

#[test]
fn logits_command_reproduces_golden_logits() {
    for case in ["k3-tiny", "k31-tiny-indexer"] {
        let g = Golden::open(case);
        let prompt = g.i64("decode.prompt_input_ids");
        let decode = g.i64("decode.input_ids");
        let out = tempfile::tempdir().expect("tempdir");
        let file = out.path().join("logits.safetensors");
        run_ok(
            bin()
                .args(["logits", "--model"])
                .arg(&g.dir)
                .args(["--prompt-ids", &serde_json::to_string(&prompt).expect("json")])
                .args(["--decode-ids", &serde_json::to_string(&decode).expect("json")])
                .arg("--out")
                .arg(&file),
        );
        let ck = Checkpoint::open_file(&file).expect("output");
        let dec = ck.read_f32(ck.info("decode_logits").expect("decode_logits"));
        assert_eq!(ck.info("decode_logits").expect("info").shape, vec![decode.len(), 256]);
        assert_close(case, &dec, &g.f32("decode.logits"), g.tol_logits());
        // prefill_logits of the decode prompt: compare with the golden prefill of the same prompt.
        let len = prompt.len();
        let pre = ck.read_f32(ck.info("prefill_logits").expect("prefill_logits"));
        assert_close(case, &pre, &g.f32(&format!("prefill.len{len}.logits")), g.tol_logits());
    }
}

#[test]
fn bad_cli_input_is_a_clear_error() {
    let g = common::golden_dir().join("k3-tiny");
    for ids in ["[1, 99999]", "[1, -2]", "not json", "[]"] {
        let out = bin().args(["generate", "--model"]).arg(&g).args(["--prompt-ids", ids]).output().expect("run");
        assert!(!out.status.success(), "{ids} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("Error:") && !err.contains("panicked"), "{ids}: {err}");
    }
}

/// The tiny K3.1 + MXFP4 checkpoint that `make-tiny` writes (the server's embedded default):
/// loads, prefill+decode equals prefill(all) across a chunk boundary with the indexer pruning, and
/// generation is deterministic.
#[test]
fn make_tiny_k31_mxfp4_runs_end_to_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    make_tiny(dir.path(), &TinyOptions { seed: 7, k31: true, mxfp4: true, vision: false }).expect("make-tiny");
    let m = Model::load(dir.path()).expect("load tiny");
    let c = m.text_config().clone();
    assert_eq!(c.indexer.as_ref().map(|i| i.topk), Some(64));
    let ids: Vec<u32> = (0..100u32).map(|i| (i * 37 + 11) % 256).collect();
    let full = m.forward(&ids, &mut m.new_state(), LogitsFor::AllTokens, None).expect("prefill all");
    let mut st = m.new_state();
    let split = 70;
    let mut tr = Trace::default();
    m.forward(&ids[..split], &mut st, LogitsFor::AllTokens, Some(&mut tr)).expect("prefill");
    // The indexer prunes: row 69 keeps 64 of 70 candidates.
    let sel = tr.get_i64("index.layer3.selected").expect("selection");
    assert_eq!(sel.len(), split * 64);
    assert!(sel[69 * 64..].iter().all(|&s| s >= 0) && sel[..64].iter().filter(|&&s| s >= 0).count() == 1);
    for (j, &id) in ids[split..].iter().enumerate() {
        let row = m.forward(&[id], &mut st, LogitsFor::AllTokens, None).expect("decode");
        let want = &full[(split + j) * c.vocab_size..(split + j + 1) * c.vocab_size];
        assert_close("tiny decode vs prefill", &row, want, 2e-3);
    }

    // Chunked prefill continuing a non-empty state: 40 + 60 tokens equal one 100-token prefill.
    let mut st = m.new_state();
    m.forward(&ids[..40], &mut st, LogitsFor::AllTokens, None).expect("chunk 1");
    let rest = m.forward(&ids[40..], &mut st, LogitsFor::AllTokens, None).expect("chunk 2");
    assert_close("chunked prefill", &rest, &full[40 * c.vocab_size..], 2e-3);

    let generate = |d: &std::path::Path| {
        run_ok(bin().args(["generate", "--model"]).arg(d).args([
            "--prompt-ids",
            "[1,2,3]",
            "--max-tokens",
            "5",
            "--ignore-eos",
        ]))
    };
    let a = generate(dir.path());
    assert_eq!(a.lines().count(), 5);
    assert!(a.lines().all(|l| { l.parse::<u32>().is_ok_and(|id| (id as usize) < c.vocab_size) }));
    let again = tempfile::tempdir().expect("tempdir");
    run_ok(bin().args(["make-tiny", "--seed", "7", "--k31", "--mxfp4", "--out"]).arg(again.path()));
    assert_eq!(
        std::fs::read(dir.path().join("model.safetensors")).expect("a"),
        std::fs::read(again.path().join("model.safetensors")).expect("b"),
        "make-tiny is deterministic for a seed"
    );
    assert_eq!(generate(again.path()), a);

    let bench = run_ok(bin().args(["bench", "forward", "--model"]).arg(dir.path()).args([
        "--prompt-len",
        "16",
        "--decode",
        "2",
        "--batch",
        "1,3",
        "--op-profile",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&bench).expect("bench json");
    assert!(v["decode_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0));
    // The op profile decodes the first batch size again with every op timed: per step, one
    // recurrence per KDA layer, one routing per MoE layer, one LM head; routed experts and the
    // LM head read weights, norms do not.
    let profile = &v["op_profile"];
    assert_eq!(profile["batch"].as_u64(), Some(1), "{bench}");
    let ops = profile["ops"].as_array().expect("op rows");
    let row = |prefix: &str| {
        ops.iter()
            .find(|o| o["op"].as_str().is_some_and(|n| n.starts_with(prefix)))
            .unwrap_or_else(|| panic!("no {prefix} row: {bench}"))
    };
    let calls = |prefix: &str| row(prefix)["calls_per_step"].as_f64();
    let moe = (0..c.num_layers).filter(|&i| c.is_moe_layer(i)).count();
    assert_eq!(calls("kda_recurrence"), Some(c.num_kda_layers() as f64), "{bench}");
    assert_eq!(calls("moe_route"), Some(moe as f64), "{bench}");
    let lm_head = format!("×{}", c.hidden_size);
    let head = ops
        .iter()
        .find(|o| {
            o["op"]
                .as_str()
                .is_some_and(|n| n.starts_with("matmul ") && n.ends_with(&format!("{}{lm_head}", c.vocab_size)))
        })
        .unwrap_or_else(|| panic!("no LM head row: {bench}"));
    assert_eq!(head["calls_per_step"].as_f64(), Some(1.0));
    assert!(head["weight_gb_per_s"].as_f64().is_some_and(|x| x > 0.0));
    assert!(row("moe_experts")["weight_mb_per_step"].as_f64().is_some_and(|x| x > 0.0));
    assert_eq!(row("rms_norm")["weight_mb_per_step"].as_f64(), Some(0.0));
    let batches = v["batches"].as_array().expect("one row per batch size");
    assert_eq!(batches.iter().map(|b| b["batch"].as_u64()).collect::<Vec<_>>(), [Some(1), Some(3)]);
    // The bandwidth roof is sampled before and after the prefill and after each batch size, and
    // every ratio divides by the best sample.
    assert_eq!(v["read_bandwidth_samples"].as_u64(), Some(4), "{bench}");
    let roof = v["measured_read_gb_per_s"].as_f64().expect("roof");
    let lowest = v["measured_read_gb_per_s_lowest"].as_f64().expect("lowest sample");
    assert!(lowest > 0.0 && lowest <= roof, "{bench}");
    for b in batches {
        let (eff, ratio) = (b["effective_weight_gb_per_s"].as_f64(), b["bandwidth_ratio"].as_f64());
        let (eff, ratio) = (eff.expect("GB/s"), ratio.expect("÷bandwidth"));
        assert!((ratio * roof - eff).abs() <= 1e-9 * eff.max(1.0), "ratio against the roof: {bench}");
    }
    for b in batches {
        assert!(b["decode_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0));
        assert!(b["peak_ratio"].as_f64().is_some_and(|x| x > 0.0), "compute share of the measured peak");
        let shares = b["op_shares"].as_object().expect("op shares");
        let sum: f64 = shares.values().filter_map(|x| x.as_f64()).sum();
        assert!((sum - 1.0).abs() < 1e-6, "shares add up to the step: {sum}");
        assert!(["kda", "mla", "moe", "lm_head"].iter().all(|k| shares[*k].as_f64().is_some_and(|x| x > 0.0)));
    }

    // Two tensor-parallel ranks: the same greedy tokens, and the collectives of a decode step are
    // ATOM's schedule — the embedding, one per mixer, one per dense MLP, two per latent MoE
    // layer (routed sum before the norm, then the layer's output), and the logits all-gather.
    let tp2 = run_ok(bin().args(["generate", "--model"]).arg(dir.path()).args([
        "--prompt-ids",
        "[1,2,3]",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--tensor-parallel",
        "2",
    ]));
    assert_eq!(tp2, a, "greedy tokens at TP 2");
    let fp8 = run_ok(bin().args(["generate", "--model"]).arg(dir.path()).args([
        "--prompt-ids",
        "[1,2,3]",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--fp8-dense",
        "--tensor-parallel",
        "2",
        "--context-parallel",
        "2",
    ]));
    assert_eq!(fp8.lines().count(), 5, "FP8 dense on two context-parallel ranks generates");
    let bench = run_ok(bin().args(["bench", "forward", "--model"]).arg(dir.path()).args([
        "--prompt-len",
        "16",
        "--decode",
        "2",
        "--batch",
        "2",
        "--tensor-parallel",
        "2",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&bench).expect("bench json");
    assert_eq!(v["tensor_parallel"].as_u64(), Some(2));
    let moe = (0..c.num_layers).filter(|&i| c.is_moe_layer(i)).count();
    let want = 1 + c.num_layers + (c.num_layers - moe) + 2 * moe + 1;
    let run = &v["batches"][0];
    assert_eq!(run["collectives_per_step"].as_f64(), Some(want as f64), "collectives a decode step");
    assert!(run["comm_bytes_per_step"].as_f64().is_some_and(|b| b > 0.0));
}

#[test]
fn tokenize_command_encodes_decodes_and_benches() {
    let kimi = common::golden_dir().join("../tokenizer/kimi");
    let out = run_ok(bin().args(["tokenize", "--tokenizer"]).arg(&kimi).args(["--text", "Hello world", "--json"]));
    assert_eq!(out.trim(), "[19180,2695]");
    let out =
        run_ok(bin().args(["tokenize", "--tokenizer"]).arg(&kimi).args(["--text", "<|open|>", "--allow-special"]));
    assert_eq!(out.trim(), "163587");
    let out = run_ok(bin().args(["tokenize", "--tokenizer"]).arg(&kimi).args(["--decode", "[19180,2695,163587]"]));
    assert_eq!(out, "Hello world<|open|>");
    let bad = bin().args(["tokenize", "--tokenizer"]).arg(&kimi).args(["--decode", "[999999]"]).output().expect("run");
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("999999"));
    // Smoke run only: no timing assertion.
    let out = run_ok(bin().args(["bench", "tokenizer", "--tokenizer"]).arg(&kimi).args(["--mb", "0.2", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v["ids"].as_u64().is_some_and(|n| n > 0));
    if v["tiktoken"].is_object() {
        assert_eq!(v["ids_match_tiktoken"], true, "same ids as Python tiktoken");
    }
}

#[test]
fn plugin_check_and_bench_plugins_smoke() {
    let out = run_ok(bin().args(["plugin", "check", "builtin:sampler-standard"]));
    assert!(out.contains("world:   kimi:host/speculative-sampler@0.1.0") && out.contains("verdict: accepted"), "{out}");
    let dir = tempfile::tempdir().expect("tempdir");
    let evil = dir.path().join("evil.wasm");
    std::fs::write(&evil, wat::parse_str(r#"(component (import "wasi:sockets/tcp@0.2.0" (instance)))"#).expect("wat"))
        .expect("write");
    let o = bin().args(["plugin", "check"]).arg(&evil).output().expect("run");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("wasi:sockets/tcp@0.2.0"));
    // Smoke run only: no timing assertion.
    let out = run_ok(bin().args(["bench", "plugins", "--steps", "3", "--batch", "2", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v.as_array().is_some_and(|a| a.len() >= 5), "{v}");
}

#[test]
fn render_command_matches_the_vendor_verifier_ground_truth() {
    // k3-serving §1.12: Moonshot's 39-id ground truth (thinking disabled, one Chinese message).
    let dir = tempfile::tempdir().expect("tempdir");
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        r#"{"model":"kimi-k3","messages":[{"role":"user","content":"请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。"}],"thinking":{"type":"disabled"}}"#,
    )
    .expect("write");
    let out = run_ok(
        bin()
            .args(["render", "--tokenizer"])
            .arg(common::golden_dir().join("../tokenizer/kimi"))
            .arg("--request")
            .arg(&req),
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let want = [
        163587u32, 2778, 6244, 878, 2482, 1, 163589, 2066, 557, 11419, 220, 23595, 9481, 2648, 3372, 118973, 26476,
        2678, 864, 10726, 1777, 12468, 4160, 10484, 292, 163588, 2778, 163589, 163586, 163587, 2778, 6244, 878, 69702,
        1, 163589, 163587, 12092, 163589,
    ];
    let ids: Vec<u32> = v["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
    assert_eq!(ids, want);
    assert!(v["text"].as_str().is_some_and(|t| t.ends_with("<|open|>response<|sep|>")));
    // A bad request is a clear error.
    std::fs::write(&req, r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"required"}"#).expect("write");
    let o = bin()
        .args(["render", "--tokenizer"])
        .arg(common::golden_dir().join("../tokenizer/kimi"))
        .arg("--request")
        .arg(&req)
        .output()
        .expect("run");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("required"));
}

#[test]
fn a_gpu_backend_without_a_gpu_is_a_clear_start_up_error() {
    // CI machines have no ROCm or CUDA: the message names the libraries looked for. (On a GPU
    // machine it names the one found and says serving on it is not wired yet.)
    for (backend, lib) in [("hip", "libamdhip64"), ("cuda", "libcuda.so")] {
        let out = bin().args(["serve", "--backend", backend, "--listen", "127.0.0.1:0"]).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--backend {backend} without a GPU must not start");
        assert!(err.contains(lib) && err.contains("--backend cpu"), "{backend}: {err}");
    }
    let out = bin().args(["serve", "--backend", "tpu"]).output().expect("run");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cpu, hip, cuda, auto"));
    // The device check too, on either runtime (cudarc dlopens the driver, the HIP launcher the
    // runtime: this binary links neither).
    for (backend, lib) in [("cuda", "libcuda.so"), ("hip", "libamdhip64.so.7")] {
        let out = bin().args(["kernels", "check", "--backend", backend]).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(lib) && err.contains("--backend cpu"), "{backend}: {err}");
    }
}

/// `speculate` writes the DSpark case's tensors; `make-draft` writes a draft for any target;
/// `bench forward --draft` decodes with and without it (greedy: the same tokens); a draft made
/// for another model is refused by name.
#[test]
fn speculate_make_draft_and_bench_with_a_draft() {
    let g = common::golden_dir();
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("spec.safetensors");
    run_ok(
        bin()
            .arg("speculate")
            .arg("--model")
            .arg(g.join("k3-tiny"))
            .arg("--draft")
            .arg(g.join("dspark-tiny"))
            .arg("--case")
            .arg(g.join("dspark-tiny"))
            .arg("--out")
            .arg(&file),
    );
    let written = kimi_host::model::checkpoint::Checkpoint::open_file(&file).expect("safetensors");
    assert!(written.contains("greedy.round2.verify_logits") && written.contains("greedy_draft_t1.final_probs"));

    let target = out.path().join("target");
    let draft = out.path().join("draft");
    run_ok(bin().args(["make-tiny", "--seed", "4", "--out"]).arg(&target));
    run_ok(bin().arg("make-draft").arg("--target").arg(&target).arg("--out").arg(&draft));
    let bench = run_ok(bin().args(["bench", "forward", "--model"]).arg(&target).arg("--draft").arg(&draft).args([
        "--prompt-len",
        "16",
        "--decode",
        "6",
        "--num-speculative-tokens",
        "3",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&bench).expect("bench json");
    assert_eq!(v["speculative"]["same_tokens"].as_bool(), Some(true), "{bench}");
    assert!(v["speculative"]["proposed"].as_u64().is_some_and(|p| p > 0), "{bench}");

    let wrong = bin()
        .arg("speculate")
        .arg("--model")
        .arg(&target)
        .arg("--draft")
        .arg(g.join("dspark-tiny"))
        .arg("--case")
        .arg(g.join("dspark-tiny"))
        .arg("--out")
        .arg(&file)
        .output()
        .expect("run");
    assert!(!wrong.status.success());
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(err.contains("target_hidden_size") || err.contains("vocab_size"), "{err}");
}

/// `vision` writes the vision case's tensors (with `--text-model` naming the text case it plugs
/// into); `make-tiny --vision` writes a tower the server loads; a model without one is refused.
#[test]
fn vision_command_and_make_tiny_vision() {
    let g = common::golden_dir();
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("vision.safetensors");
    run_ok(
        bin()
            .arg("vision")
            .arg("--model")
            .arg(g.join("vision-tiny"))
            .arg("--text-model")
            .arg(g.join("k3-tiny"))
            .arg("--case")
            .arg(g.join("vision-tiny"))
            .arg("--out")
            .arg(&file),
    );
    let written = kimi_host::model::checkpoint::Checkpoint::open_file(&file).expect("safetensors");
    let golden =
        kimi_host::model::checkpoint::Checkpoint::open_file(&g.join("vision-tiny/golden.safetensors")).expect("golden");
    for name in ["projector.out", "e2e.logits", "tower.merged"] {
        let (a, b) = (written.info(name).expect(name), golden.info(name).expect(name));
        let d = common::max_abs_diff(&written.read_f32(a), &golden.read_f32(b));
        assert!(d < 0.013, "{name}: {d}");
    }
    assert!(written.contains("preproc.img3.resized_padded_u8"));

    let model = out.path().join("model");
    run_ok(bin().args(["make-tiny", "--k31", "--vision", "--out"]).arg(&model));
    assert!(model.join("preprocessor_config.json").exists());
    let cfg = kimi_host::model::config::load_config(&model).expect("config");
    let vc = cfg.vision_config.expect("make-tiny --vision writes vision_config");
    let m = kimi_host::model::Model::load(&model).expect("model");
    kimi_host::model::vision::VisionModel::load(&model, &vc, m.backend()).expect("its tower loads");

    let text_only = bin()
        .arg("vision")
        .arg("--model")
        .arg(g.join("k3-tiny"))
        .arg("--case")
        .arg(g.join("vision-tiny"))
        .arg("--out")
        .arg(&file)
        .output()
        .expect("run");
    assert!(!text_only.status.success());
    assert!(String::from_utf8_lossy(&text_only.stderr).contains("vision_config"));
}

/// `bench vision` runs a random release-width tower: it reports throughput beside the product
/// peak measured in the same run, and packed rows equal one-image calls.
#[test]
fn bench_vision_runs_a_release_width_tower() {
    let out = run_ok(bin().args(["bench", "vision", "--layers", "1", "--size", "60x40", "--images", "2", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["batched_equals_one_by_one"], true, "{out}");
    assert_eq!(v["patches_per_image"], 24, "60x40 pads to 84x56: 6x4 patches");
    assert!(v["gflops"].as_f64().is_some_and(|g| g > 0.0) && v["matmul_peak_gflops"].as_f64().is_some_and(|g| g > 0.0));
    let bad = bin().args(["bench", "vision", "--size", "0x5"]).output().expect("run");
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--size"));
}
