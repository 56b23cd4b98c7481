//! `kimi-host plan` on the release config: its terms against the config's own numbers and the
//! spec's (k3-architecture §4), the eight-GPU 1 M-token fit, and refusals that name the term.

use crate::common;

use std::process::Command;

use kimi_host::model::plan::{CacheDtype, PlanError, PlanRequest};
use kimi_host_cli::plan::plan_dir;

fn release() -> std::path::PathBuf {
    common::golden_dir().join("k3-release-config")
}

fn request(gpus: usize, memory_gb: u64, fp8: bool) -> PlanRequest {
    PlanRequest {
        gpus,
        gpu_memory: memory_gb * 1_000_000_000,
        context: 1_000_000,
        tensor_parallel: None,
        context_parallel: 1,
        fp8_dense: fp8,
        expert_parallel: false,
        cache: CacheDtype::Bf16,
        step_tokens: 8192,
    }
}

#[test]
fn release_plan_terms_match_the_config_and_the_spec() {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(release().join("config.json")).expect("config")).expect("json");
    let t = &cfg["text_config"];
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} in the release config"));
    let layers = n("num_hidden_layers");
    let moe_layers = layers - n("first_k_dense_replace");
    let (experts, inter, lat) = (n("num_experts"), n("moe_intermediate_size"), n("routed_expert_hidden_size"));

    let one = plan_dir(&release(), &request(1, 4000, false)).expect("TP 1 plan");
    // Every text tensor of the 1.56 TB checkpoint, less the vision tower (under 1 GB).
    let total: u64 = 1_560_860_324_864;
    assert!(one.weight_bytes < total && total - one.weight_bytes < 1_000_000_000, "{}", one.weight_bytes);
    // MXFP4 experts: half a byte a value plus one E8M0 scale per 32 values, w1, w2 and w3.
    let experts_bytes = moe_layers * experts * 3 * (inter * lat / 2 + inter * lat / 32);
    assert_eq!(one.weight_bytes_by_kind["routed_experts"], experts_bytes);
    // k3-architecture §4: the KDA state of all 69 layers is 464,633,856 B (f32 conv); a latent
    // row is 576 values in each of 24 MLA layers, 27,648 B a token in bf16.
    assert_eq!(one.kda_state_bytes_per_sequence, 464_633_856);
    assert_eq!(one.latent_bytes_per_token, 27_648);

    let p = plan_dir(&release(), &request(8, 288, true)).expect("the seed's deployment fits");
    assert_eq!((p.tensor_parallel, p.context_parallel, p.replicas), (8, 1, 1));
    assert_eq!(p.weight_bytes_by_kind["routed_experts"] * 8, experts_bytes, "experts split evenly over 8");
    assert_eq!(p.kda_state_bytes_per_sequence * 8, 464_633_856, "12 of 96 KDA heads a GPU");
    assert_eq!(p.latent_bytes_per_token, 27_648, "the latent cache is replicated");
    assert!(p.sequences >= 1);
    assert_eq!(p.total_for_one_sequence, p.weight_bytes + p.activation_bytes + p.bytes_per_sequence);
    assert_eq!(p.bytes_per_sequence, p.kda_state_bytes_per_sequence + 1_000_000 * 27_648);
    // FP8 dense halves the requantised kinds (plus an f32 scale a row).
    let bf16 = plan_dir(&release(), &request(8, 288, false)).expect("plan");
    for kind in ["kda_mixer", "mla_mixer", "shared_experts", "dense_mlp"] {
        let (a, b) = (p.weight_bytes_by_kind[kind], bf16.weight_bytes_by_kind[kind]);
        assert!(a < b / 2 + b / 50 && a > b / 2, "{kind}: {a} against {b}");
    }
    for kind in ["routed_experts", "embedding", "lm_head"] {
        assert_eq!(p.weight_bytes_by_kind[kind], bf16.weight_bytes_by_kind[kind], "{kind} unchanged");
    }
    // Expert parallelism: 112 whole experts a GPU hold the same bytes as a slice of every expert.
    let mut ep = request(8, 288, true);
    ep.expert_parallel = true;
    let ep = plan_dir(&release(), &ep).expect("EP 8");
    assert_eq!(ep.weight_bytes_by_kind["routed_experts"], p.weight_bytes_by_kind["routed_experts"]);
    // Context parallelism: the tensor-parallel ranks split the (otherwise replicated) cache by
    // tokens, so a 1 M-token request takes an eighth of the cache on each GPU at CP 8.
    let mut cp = request(8, 288, true);
    cp.context_parallel = 8;
    let cp = plan_dir(&release(), &cp).expect("TP 8 × CP 8");
    assert_eq!((cp.tensor_parallel, cp.tokens_per_gpu), (8, 125_000));
    assert_eq!(cp.weight_bytes, p.weight_bytes);
    assert!(cp.sequences > 4 * p.sequences);
}

#[test]
fn a_plan_that_does_not_fit_names_the_term() {
    match plan_dir(&release(), &request(8, 150, true)) {
        Err(PlanError::DoesNotFit { term, .. }) => assert_eq!(term, "weights"),
        other => panic!("150 GB a GPU cannot hold the weights: {other:?}"),
    }
    match plan_dir(&release(), &request(8, 215, true)) {
        Err(PlanError::DoesNotFit { term, .. }) => assert!(term.contains("latent cache"), "{term}"),
        other => panic!("215 GB a GPU cannot hold a 1 M-token bf16 cache beside the weights: {other:?}"),
    }
    let mut huge = request(8, 288, true);
    huge.context = usize::MAX;
    assert!(matches!(plan_dir(&release(), &huge), Err(PlanError::Request(_))), "an oversized context is refused");
    let mut odd = request(8, 288, true);
    odd.tensor_parallel = Some(5);
    assert!(matches!(plan_dir(&release(), &odd), Err(PlanError::Request(_))));
    odd.tensor_parallel = Some(7);
    odd.gpus = 7;
    match plan_dir(&release(), &odd) {
        Err(PlanError::Model(e)) => assert!(e.to_string().contains("heads"), "{e}"),
        other => panic!("96 heads do not split over 7 ranks: {other:?}"),
    }

    let out = Command::new(env!("CARGO_BIN_EXE_kimi-host"))
        .arg("plan")
        .arg(release())
        .args(["--gpus", "8", "--gpu-memory", "288GB", "--context", "1000000", "--fp8-dense"])
        .output()
        .expect("run plan");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("fits") && text.contains("199 GB"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_kimi-host"))
        .arg("plan")
        .arg(release())
        .args(["--gpus", "8", "--gpu-memory", "150GB", "--fp8-dense"])
        .output()
        .expect("run plan");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("weights"));
}
