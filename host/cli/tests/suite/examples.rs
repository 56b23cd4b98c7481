//! The plugin-author examples: `examples/custom-sampler` (Rust, typical-p) is built and loaded
//! from its file path; `examples/python-policy` is built with componentize-py (installed from
//! PyPI into a virtualenv under the target directory) and run.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use common::{build_custom_sampler, repo, run};
use kimi_host::plugins::bindings::host::kimi::host::types::RequestInfo;
use kimi_host::plugins::{
    Admission, PluginEnv, PluginKind, PluginRuntime, PolicyPlugin, RequestMeta, RuntimeOptions, SamplerPlugin,
    TenantSampler, TenantServices,
};

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

fn runtime() -> Arc<PluginRuntime> {
    PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: Some(tmp().join("plugin-cache")) }).expect("runtime")
}

#[test]
fn custom_sampler_example_builds_loads_and_samples() {
    let wasm = build_custom_sampler();
    let bytes = std::fs::read(&wasm).expect("built component");
    let rt = runtime();
    let compiled = rt.load(&wasm.display().to_string(), &bytes).expect("loads from its file path");
    assert_eq!(compiled.kind, PluginKind::Sampler);
    let plugin = Arc::new(SamplerPlugin::new(rt, &compiled).expect("sampler"));
    let env = Arc::new(PluginEnv::bare(100, vec![99]));
    let mut ts = TenantSampler::new(plugin, env, Arc::new(TenantServices::default()), "t");
    let inst = ts.instance().expect("instance");
    assert_eq!(inst.caps.name, "typical-sampler");
    let row: Vec<f32> = (0..100).map(|i| -((i as f32) - 30.0).abs() / 8.0).collect();
    let req = RequestInfo { tenant: "t".into(), request_id: "r".into(), model: "m".into(), params_json: "{}".into() };
    let draw = |inst: &mut kimi_host::plugins::SamplerInstance, seed: u64| -> Vec<u32> {
        let seq = inst.create_sequence(&req, r#"{"temperature": 1.0, "typical_p": 0.5}"#, seed).expect("seq");
        (0..200).map(|_| *inst.sample(&[(&seq, &row)], None).expect("call")[0].as_ref().expect("id")).collect()
    };
    let a = draw(inst, 1);
    assert_eq!(a, draw(inst, 1), "seeded");
    // The typical set at p = 0.5 excludes both the single most likely token (30) and the far tail.
    assert!(a.iter().all(|&t| (15..=45).contains(&t)), "{a:?}");
    let distinct: std::collections::BTreeSet<_> = a.iter().collect();
    assert!(distinct.len() > 3);
    let err = inst.create_sequence(&req, r#"{"typical_p": 2}"#, 1).err().expect("bad parameter").to_string();
    assert!(err.contains("typical_p"), "{err}");
}

/// componentize-py from PyPI in a virtualenv (None: PyPI unreachable, the test is skipped).
fn componentize_py() -> Option<PathBuf> {
    let venv = tmp().join("py-venv");
    let bin = venv.join("bin/componentize-py");
    if !bin.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv));
        let mut pip = Command::new(venv.join("bin/pip"));
        pip.args(["install", "--quiet", "--no-cache-dir", "componentize-py==0.25.1"]);
        if !common::pip_install_or_skip("python_policy_example_builds_and_runs", &mut pip) {
            return None;
        }
    }
    Some(bin)
}

#[test]
fn python_policy_example_builds_and_runs() {
    let out = tmp().join("python-policy.wasm");
    let example = repo().join("examples/python-policy");
    let Some(componentize) = componentize_py() else { return };
    run(Command::new(componentize)
        .arg("-d")
        .arg(repo().join("wit"))
        .args(["-w", "policy", "componentize", "--stub-wasi", "-p"])
        .arg(&example)
        .arg("app")
        .arg("-o")
        .arg(&out));
    let bytes = std::fs::read(&out).expect("component");
    let rt = runtime();
    let report = rt.check(&bytes);
    assert!(report.imports.iter().all(|i| i.starts_with("kimi:host/")), "no WASI at all: {:?}", report.imports);
    let compiled = rt.load("python-policy", &bytes).expect("loads");
    let policy = PolicyPlugin::new(rt, &compiled).expect("policy");
    let env = Arc::new(PluginEnv::bare(512, vec![258]));
    let svc = Arc::new(TenantServices::default());
    let meta = |max: u32| RequestMeta {
        tenant: "acme".into(),
        key_id: "k1".into(),
        model: "kimi-k3".into(),
        path: "/v1/chat/completions".into(),
        prompt_tokens: 12,
        max_tokens: max,
        n: 1,
        streaming: false,
    };
    let cfg = r#"{"blocked_words": ["launch codes"], "max_tokens": 100}"#;
    let body = |text: &str| serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string();
    let admit = |max: u32, text: &str| policy.admit(&env, &svc, "acme", cfg, &meta(max), &body(text)).expect("admit");
    assert!(matches!(admit(50, "hello"), Admission::Allow));
    assert!(matches!(admit(50, "what's up"), Admission::Allow));
    match admit(50, "tell me the LAUNCH CODES") {
        Admission::Reject(r) => assert!(r.status == 403 && r.message.contains("launch codes")),
        Admission::Allow => panic!("blocked word"),
    }
    match admit(500, "hello") {
        Admission::Reject(r) => assert!(r.status == 400 && r.message.contains("max_tokens")),
        Admission::Allow => panic!("max_tokens cap"),
    }
    // The policy kept its count in the host's tenant-scoped kv store.
    assert_eq!(svc.kv_get("admitted:k1").map(|(v, _)| v), Some(b"2".to_vec()));
    policy.on_complete(&env, &svc, "acme", cfg, &meta(50), 12, 7).expect("on_complete");
    assert!(policy.admit(&env, &svc, "acme", "not json", &meta(1), "{}").is_err());
}
