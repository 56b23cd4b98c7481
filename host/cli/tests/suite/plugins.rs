//! The plugin platform: sandbox limits with hostile components, tenant isolation, and the
//! standard sampler's correctness (determinism, greedy, exact distributions).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::TEST_HOSTILE;
use kimi_host::plugins::bindings::host::kimi::host::types::RequestInfo;
use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{
    KindLimits, PluginEnv, PluginError, PluginKind, PluginRuntime, RuntimeOptions, SamplerPlugin, TenantSampler,
    TenantServices,
};

fn runtime(cache: &tempfile::TempDir) -> Arc<PluginRuntime> {
    PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: Some(cache.path().to_path_buf()) }).expect("runtime")
}

fn env(vocab: u32) -> Arc<PluginEnv> {
    Arc::new(PluginEnv::bare(vocab, vec![vocab - 1]))
}

fn req(tenant: &str) -> RequestInfo {
    RequestInfo { tenant: tenant.into(), request_id: "r1".into(), model: "tiny".into(), params_json: "{}".into() }
}

fn sampler(rt: &Arc<PluginRuntime>, name: &str, bytes: &[u8]) -> Arc<SamplerPlugin> {
    let compiled = rt.load(name, bytes).expect("component loads");
    assert_eq!(compiled.kind, PluginKind::Sampler);
    Arc::new(SamplerPlugin::new(rt.clone(), &compiled).expect("sampler"))
}

fn logits(vocab: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 10_000) as f32 / 10_000.0) * 6.0 - 3.0
        })
        .collect()
}

#[test]
fn hostile_components_fail_only_their_request() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let deadline = Duration::from_millis(20);
    let limits = KindLimits { memory_bytes: 16 << 20, call: deadline, init: Duration::from_secs(2) };
    let compiled = rt.load("test-hostile", TEST_HOSTILE).expect("loads");
    let plugin = Arc::new(SamplerPlugin::new(rt.clone(), &compiled).expect("sampler").with_limits(limits));
    let services = Arc::new(TenantServices::default());
    let mut ts = TenantSampler::new(plugin, env(64), services, "acme");
    let row = logits(64, 1);
    let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("row");

    // Infinite loop: trapped within 10× its deadline; the next request succeeds.
    let inst = ts.instance().expect("instance");
    let seq = inst.create_sequence(&req("acme"), "loop", 1).expect("seq");
    let t = Instant::now();
    let r = inst.sample(&[(&seq, &row)], None);
    let took = t.elapsed();
    assert!(matches!(r, Err(PluginError::Timeout { .. })), "{r:?}");
    assert!(took < deadline * 10, "loop trapped after {took:?} (deadline {deadline:?})");
    let _ = ts.judge(r);
    let inst = ts.instance().expect("fresh instance after the trap");
    let ok = inst.create_sequence(&req("acme"), "ok", 1).expect("seq");
    assert_eq!(inst.sample(&[(&ok, &row)], None).expect("call")[0].as_ref().expect("token"), &argmax);

    // Unbounded memory growth traps at the cap. (Under a generous deadline: growing to the cap
    // can outlast 20 ms on a loaded CI machine, and this case is about memory, not time.)
    let roomy = KindLimits { call: Duration::from_secs(5), ..limits };
    let grower = Arc::new(SamplerPlugin::new(rt.clone(), &compiled).expect("sampler").with_limits(roomy));
    let mut ts_grow = TenantSampler::new(grower, env(64), Arc::new(TenantServices::default()), "acme");
    let inst = ts_grow.instance().expect("instance");
    let seq = inst.create_sequence(&req("acme"), "grow", 1).expect("seq");
    let r = inst.sample(&[(&seq, &row)], None);
    assert!(matches!(r, Err(PluginError::OutOfMemory { mib: 16, .. })), "{r:?}");

    // A panic fails the call with an error naming the plugin.
    let mut ts2 = TenantSampler::new(ts.plugin.clone(), env(64), Arc::new(TenantServices::default()), "acme");
    let inst = ts2.instance().expect("instance");
    let seq = inst.create_sequence(&req("acme"), "panic", 1).expect("seq");
    let err = inst.sample(&[(&seq, &row)], None).expect_err("panic traps");
    assert!(matches!(err, PluginError::Trap { .. }) && err.to_string().contains("test-hostile"), "{err}");

    // An out-of-range token fails that sequence only.
    let inst = ts2.instance().expect("instance");
    let bad = inst.create_sequence(&req("acme"), "bad-token", 1).expect("seq");
    let good = inst.create_sequence(&req("acme"), "ok", 1).expect("seq");
    let out = inst.sample(&[(&bad, &row), (&good, &row)], None).expect("call");
    assert!(
        matches!(&out[0], Err(PluginError::BadReturn { msg, .. }) if msg.contains("outside the vocabulary")),
        "{:?}",
        out[0]
    );
    assert_eq!(out[1].as_ref().expect("good row"), &argmax);
}

#[test]
fn repeated_failures_disable_the_plugin_for_that_tenant() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let plugin = sampler(&rt, "test-hostile", TEST_HOSTILE);
    let mut a = TenantSampler::new(plugin.clone(), env(64), Arc::new(TenantServices::default()), "a");
    let mut b = TenantSampler::new(plugin, env(64), Arc::new(TenantServices::default()), "b");
    let row = logits(64, 2);
    for _ in 0..3 {
        let inst = a.instance().expect("instance");
        let seq = inst.create_sequence(&req("a"), "panic", 1).expect("seq");
        let r = inst.sample(&[(&seq, &row)], None);
        let _ = a.judge(r);
    }
    assert!(matches!(a.instance(), Err(PluginError::Disabled { .. })));
    assert!(a.health.traps.load(std::sync::atomic::Ordering::Relaxed) >= 3);
    // Another tenant using the same plugin is unaffected.
    let inst = b.instance().expect("tenant b still works");
    let seq = inst.create_sequence(&req("b"), "ok", 1).expect("seq");
    assert!(inst.sample(&[(&seq, &row)], None).expect("call")[0].is_ok());
}

#[test]
fn forbidden_imports_are_rejected_at_load_with_the_import_named() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    for import in ["wasi:filesystem/types@0.2.0", "wasi:sockets/tcp@0.2.0", "acme:secret/exfiltrate@1.0.0"] {
        let wat = format!(r#"(component (import "{import}" (instance)))"#);
        let bytes = wat::parse_str(&wat).expect("wat");
        let err = rt.load("evil", &bytes).err().expect("rejected");
        let msg = err.to_string();
        assert!(msg.contains(import) && msg.contains("evil"), "{msg}");
        assert!(rt.check(&bytes).verdict.is_err());
    }
    // A kind may not use another kind's imports: a sampler importing `kv`.
    let wat = r#"(component (import "kimi:host/kv@0.1.0" (instance)))"#;
    let err = rt.load("sneaky", &wat::parse_str(wat).expect("wat")).err().expect("rejected").to_string();
    assert!(err.contains("exports none"), "{err}");
    // Garbage is not a component.
    assert!(rt.load("junk", b"\0asm junk").is_err());
}

#[test]
fn tenants_never_share_sampler_state() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let hostile = sampler(&rt, "test-hostile", TEST_HOSTILE);
    let standard = sampler(&rt, "sampler-standard", builtin("builtin:sampler-standard").expect("builtin"));
    let row = logits(64, 3);
    // Tenant A (counting sampler) and tenant B (standard sampler) in one process.
    let mut a = TenantSampler::new(hostile.clone(), env(64), Arc::new(TenantServices::default()), "a");
    let mut b = TenantSampler::new(standard, env(64), Arc::new(TenantServices::default()), "b");
    let ia = a.instance().expect("a");
    let sa = ia.create_sequence(&req("a"), "count", 1).expect("seq");
    let got: Vec<u32> =
        (0..3).map(|_| *ia.sample(&[(&sa, &row)], None).expect("call")[0].as_ref().expect("id")).collect();
    assert_eq!(got, [1, 2, 3]);
    let ib = b.instance().expect("b");
    let sb = ib.create_sequence(&req("b"), r#"{"temperature": 0}"#, 1).expect("seq");
    ib.sample(&[(&sb, &row)], None).expect("call")[0].as_ref().expect("id");
    // A third tenant on the counting plugin starts from zero: instance-global state is per tenant.
    let mut c = TenantSampler::new(hostile, env(64), Arc::new(TenantServices::default()), "c");
    let ic = c.instance().expect("c");
    let sc = ic.create_sequence(&req("c"), "count", 1).expect("seq");
    assert_eq!(ic.sample(&[(&sc, &row)], None).expect("call")[0].as_ref().expect("id"), &1);
    let ia = a.instance().expect("a");
    assert_eq!(ia.sample(&[(&sa, &row)], None).expect("call")[0].as_ref().expect("id"), &4);
}

/// The pooling allocator reuses a freed instance's slot (and may keep its pages resident); the
/// next instance, possibly another tenant's, must still start from the component's image.
#[test]
fn a_reused_pool_slot_starts_from_the_component_image() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let hostile = sampler(&rt, "test-hostile", TEST_HOSTILE);
    let row = logits(64, 5);
    for round in 0..12 {
        let tenant = if round % 2 == 0 { "a" } else { "b" };
        let mut inst = hostile.instantiate(env(64), Arc::new(TenantServices::default()), tenant).expect("instance");
        let counting = inst.create_sequence(&req(tenant), "count", 1).expect("seq");
        let scribbling = inst.create_sequence(&req(tenant), "residue", 1).expect("seq");
        let counts: Vec<u32> =
            (0..3).map(|_| *inst.sample(&[(&counting, &row)], None).expect("call")[0].as_ref().expect("id")).collect();
        assert_eq!(counts, [1, 2, 3], "round {round}: a static left over from an earlier instance");
        let dirty = inst.sample(&[(&scribbling, &row)], None).expect("call");
        assert_eq!(dirty[0].as_ref().expect("id"), &0, "round {round}: grown memory holds an earlier instance's bytes");
    }
}

fn standard(rt: &Arc<PluginRuntime>, vocab: u32) -> TenantSampler {
    let plugin = sampler(rt, "sampler-standard", builtin("sampler-standard").expect("builtin"));
    TenantSampler::new(plugin, env(vocab), Arc::new(TenantServices::default()), "t")
}

#[test]
fn sampler_standard_is_deterministic_and_greedy_at_temperature_zero() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let vocab = 1000;
    let mut ts = standard(&rt, vocab);
    let rows: Vec<Vec<f32>> = (0..20).map(|i| logits(vocab as usize, 100 + i)).collect();
    let run = |ts: &mut TenantSampler, params: &str, seed: u64| -> Vec<u32> {
        let inst = ts.instance().expect("instance");
        let seq = inst.create_sequence(&req("t"), params, seed).expect("seq");
        inst.accept(&seq, &[1, 2, 3]).expect("prompt");
        let mut out = Vec::new();
        for r in &rows {
            let id = *inst.sample(&[(&seq, r)], None).expect("call")[0].as_ref().expect("id");
            inst.accept(&seq, &[id]).expect("accept");
            out.push(id);
        }
        inst.drop_sequence(seq).expect("drop");
        out
    };
    let p = r#"{"temperature": 0.9, "top_p": 0.95, "frequency_penalty": 0.5}"#;
    assert_eq!(run(&mut ts, p, 42), run(&mut ts, p, 42), "same seed, same tokens");
    assert_ne!(run(&mut ts, p, 42), run(&mut ts, p, 43), "different seeds differ");
    let greedy = run(&mut ts, r#"{"temperature": 0}"#, 7);
    let argmax: Vec<u32> = rows
        .iter()
        .map(|r| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("max"))
        .collect();
    assert_eq!(greedy, argmax);
    // Bad parameters fail at sequence creation, naming the parameter.
    let inst = ts.instance().expect("instance");
    let err = inst.create_sequence(&req("t"), r#"{"top_p": 1.5}"#, 1).err().expect("rejected").to_string();
    assert!(err.contains("top_p"), "{err}");
}

#[test]
fn sampler_standard_distributions_match_exact_ones_chi_square() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let vocab = 40u32;
    let row: Vec<f32> = (0..vocab).map(|i| ((i * 13 % 17) as f32) / 4.0).collect();
    let mut ts = standard(&rt, vocab);
    for (params, t, k, p, m) in [
        (r#"{"temperature": 1.0, "top_k": 8}"#, 1.0, 8, 1.0, 0.0),
        (r#"{"temperature": 0.7, "top_p": 0.8}"#, 0.7, 0, 0.8, 0.0),
        (r#"{"temperature": 1.2, "min_p": 0.1}"#, 1.2, 0, 1.0, 0.1),
        (r#"{"temperature": 1.0}"#, 1.0, 0, 1.0, 0.0),
    ] {
        let want = common::exact_distribution(&row, t, k, p, m);
        let inst = ts.instance().expect("instance");
        let seq = inst.create_sequence(&req("t"), params, 5).expect("seq");
        let n = 20_000;
        let mut counts = vec![0u32; vocab as usize];
        // Batched: 50 rows per call, all the same sequence state (no accept → no penalties).
        let rows: Vec<(&_, &[f32])> = (0..50).map(|_| (&seq, row.as_slice())).collect();
        for _ in 0..n / 50 {
            for r in inst.sample(&rows, None).expect("call") {
                counts[r.expect("id") as usize] += 1;
            }
        }
        common::assert_chi_square(&counts, &want, n, params);
    }
}

/// `speculation.distributions` of the standard sampler: each row's distribution follows the
/// drafts before it (counted by the penalties as output), equals the brute-force one (with the
/// tail rule past the candidates when no filter cuts the vocabulary), and leaves the sequence
/// as it was — a twin that never saw the call draws the same next token. A component of the
/// plain `sampler` world (no `speculation` export) still loads and declines.
#[test]
fn sampler_standard_describes_its_distributions_for_speculation() {
    use kimi_host::engine::{Sampler as _, SamplerRequest};
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let vocab = 1000u32;
    let rows: Vec<Vec<f32>> = (0..4).map(|i| logits(vocab as usize, 500 + i)).collect();
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).unwrap();
    for (params, t, top_p, freq, presence) in [
        (r#"{"temperature": 0.8, "top_p": 0.9, "frequency_penalty": 0.5}"#, 0.8, 0.9, 0.5, 0.0),
        (r#"{"temperature": 1.0, "presence_penalty": 1.0}"#, 1.0, 1.0, 0.0, 1.0),
        (r#"{"temperature": 1.3}"#, 1.3, 1.0, 0.0, 0.0),
    ] {
        let mut ts = standard(&rt, vocab);
        assert!(ts.describes_distributions());
        let open = |ts: &mut TenantSampler| ts.open(&SamplerRequest::default(), params, 5, &[1, 2, 3]).expect("open");
        let (a, b) = (open(&mut ts), open(&mut ts));
        let first = ts.sample(&[(a, &rows[0])]).remove(0).expect("token");
        assert_eq!(ts.sample(&[(b, &rows[0])]).remove(0).expect("token"), first, "twins");
        ts.accept(a, first);
        ts.accept(b, first);
        // The drafts: the likeliest token of rows 1 and 2, and the first token again.
        let drafts = [argmax(&rows[1]), first];
        let call: Vec<(usize, &[f32])> = vec![(0, &rows[1]), (1, &rows[2]), (2, &rows[3])];
        let got = ts.distributions(a, &drafts, &call).expect("call").expect("described");
        assert_eq!(got.len(), 3);
        for (j, dense) in got.iter().enumerate() {
            // Brute force: the output so far is `first` and the drafts before row j.
            let output: Vec<u32> = std::iter::once(first).chain(drafts[..j].iter().copied()).collect();
            let row: Vec<f32> = rows[j + 1]
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    let count = output.iter().filter(|&&o| o == i as u32).count() as f32;
                    if count > 0.0 { l - freq * count - presence } else { l }
                })
                .collect();
            let want = common::exact_distribution(&row, t, 0, top_p, 0.0);
            for (i, (g, w)) in dense.iter().zip(&want).enumerate() {
                assert!((*g as f64 - w).abs() < 1e-6 + 1e-4 * w, "{params}: row {j} token {i}: {g} vs {w}");
            }
        }
        // Neither the drafts nor any draw stayed behind.
        for r in &rows {
            let (x, y) = (ts.sample(&[(a, r)]).remove(0).expect("a"), ts.sample(&[(b, r)]).remove(0).expect("b"));
            assert_eq!(x, y, "{params}: the call changed the sequence");
            ts.accept(a, x);
            ts.accept(b, y);
        }
    }
    // A plain `sampler` component: loads, and declines to describe.
    let hostile = sampler(&rt, "test-hostile", TEST_HOSTILE);
    let mut ts = TenantSampler::new(hostile, env(64), Arc::new(TenantServices::default()), "t");
    assert!(!ts.describes_distributions());
    let seq = ts.open(&SamplerRequest::default(), "{}", 1, &[1]).expect("open");
    let row = logits(64, 1);
    assert_eq!(ts.distributions(seq, &[], &[(0, &row)]).expect("no error"), None);
}

#[test]
fn compiled_components_are_cached_on_disk() {
    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let bytes = builtin("sampler-standard").expect("builtin");
    let first = rt.load("s", bytes).expect("load");
    let files: Vec<_> = std::fs::read_dir(cache.path()).expect("dir").flatten().collect();
    assert_eq!(files.len(), 1);
    assert!(files[0].file_name().to_string_lossy().starts_with(&first.sha256));
    let again = rt.load("s", bytes).expect("load from cache");
    assert_eq!(again.sha256, first.sha256);
    let report = rt.check(bytes);
    assert_eq!(report.kind, Some(PluginKind::Sampler));
    assert!(report.imports.iter().any(|i| i == "kimi:host/logits@0.1.0"));
    assert!(report.verdict.is_ok());
}

/// A plugin's `log.emit` reaches the host's log under its tenant and plugin name; a flood, even
/// spread over many instances, is cut to the per-plugin budget with a count of what was dropped.
#[test]
fn plugin_logs_reach_the_log_with_their_tenant_and_floods_are_limited() {
    use kimi_host::plugins::host::{LOG_BURST, LOG_PER_SECOND};
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let cache = tempfile::tempdir().expect("tempdir");
    let rt = runtime(&cache);
    let plugin = sampler(&rt, "test-hostile", TEST_HOSTILE);
    let mut s = TenantSampler::new(plugin, env(64), Arc::new(TenantServices::new_local("acme")), "acme");
    let row = logits(64, 3);
    let t0 = Instant::now();
    for mode in ["log", "log-flood", "log-flood", "log-flood", "log"] {
        if mode == "log" {
            // Lets the budget refill a little, so the line after the flood is written with the
            // count of what was dropped.
            std::thread::sleep(Duration::from_millis(200));
        }
        let inst = s.instance().expect("instance");
        let seq = inst.create_sequence(&req("acme"), mode, 1).expect("seq");
        let r = inst.sample(&[(&seq, &row)], None).expect("call");
        assert!(r[0].is_ok());
        inst.drop_sequence(seq).expect("drop");
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let text = String::from_utf8(capture.0.lock().expect("lock").clone()).expect("utf8");
    let hello = text.lines().find(|l| l.contains("test-hostile says hello")).expect("the plugin's line is logged");
    assert!(hello.contains("acme") && hello.contains("test-hostile") && hello.contains("tenant"), "{hello}");
    let flood = text.lines().filter(|l| l.contains("flood line")).count();
    let budget = LOG_BURST + LOG_PER_SECOND * elapsed + 1.0;
    assert!(flood as f64 <= budget, "{flood} flood lines passed a budget of {budget:.0}");
    assert!(flood >= 50, "the burst is written: {flood}");
    assert!(text.contains("dropped"), "the drop is reported");
}
