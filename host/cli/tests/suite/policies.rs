//! The standard policies: `policy-kimi-vendor` (KVV parameter rules) and `policy-limits` (rate,
//! size and concurrency limits through the host's tenant-scoped buckets).

use std::sync::Arc;

use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{
    Admission, PluginEnv, PluginRuntime, PolicyPlugin, RequestMeta, RuntimeOptions, TenantServices,
};

fn policy(name: &str) -> PolicyPlugin {
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load(name, builtin(name).expect("builtin")).expect("loads");
    PolicyPlugin::new(rt, &compiled).expect("policy")
}

fn env() -> Arc<PluginEnv> {
    Arc::new(PluginEnv::bare(512, vec![258]))
}

fn meta(key: &str, prompt: u32, max: u32) -> RequestMeta {
    RequestMeta {
        tenant: "acme".into(),
        key_id: key.into(),
        model: "kimi-k3".into(),
        path: "/v1/chat/completions".into(),
        prompt_tokens: prompt,
        max_tokens: max,
        n: 1,
        streaming: false,
    }
}

#[test]
fn kimi_vendor_policy_follows_the_verifier_rules() {
    let p = policy("policy-kimi-vendor");
    let (env, svc) = (env(), Arc::new(TenantServices::default()));
    let admit = |body: &str| p.admit(&env, &svc, "acme", "", &meta("k", 10, 10), body).expect("admit");
    for ok in [
        r#"{"messages": []}"#,
        r#"{"temperature": 0.0}"#,
        r#"{"temperature": 0.6}"#,
        r#"{"temperature": 1.0, "top_p": 0.95}"#,
        r#"{"presence_penalty": 0, "frequency_penalty": 0.0, "n": 1}"#,
    ] {
        assert!(matches!(admit(ok), Admission::Allow), "{ok} must be accepted");
    }
    for (bad, word) in [
        (r#"{"temperature": 1.1}"#, "temperature"),
        (r#"{"temperature": 2.0}"#, "temperature"),
        (r#"{"temperature": -0.1}"#, "temperature"),
        (r#"{"top_p": 0.8}"#, "top_p"),
        (r#"{"presence_penalty": 0.5}"#, "presence_penalty"),
        (r#"{"frequency_penalty": 0.5}"#, "frequency_penalty"),
        (r#"{"n": 2}"#, "n must"),
    ] {
        match admit(bad) {
            Admission::Reject(r) => {
                assert_eq!(r.status, 400, "{bad}");
                assert!(r.message.contains(word), "{bad}: {}", r.message);
            }
            Admission::Allow => panic!("{bad} must be rejected"),
        }
    }
    // A bad configuration is the plugin's error, not a crash.
    assert!(p.admit(&env, &svc, "acme", "{\"nope\": 1}", &meta("k", 1, 1), "{}").is_err());
}

#[test]
fn limits_policy_rate_limits_caps_and_concurrency() {
    let p = policy("policy-limits");
    let (env, svc) = (env(), Arc::new(TenantServices::default()));
    let cfg = r#"{"requests_per_minute": 3, "max_prompt_tokens": 100, "max_completion_tokens": 50, "max_concurrent": 2, "per_key": true}"#;
    let admit = |m: &RequestMeta| p.admit(&env, &svc, "acme", cfg, m, "{}").expect("admit");
    match admit(&meta("k1", 101, 10)) {
        Admission::Reject(r) => assert!(r.status == 400 && r.message.contains("prompt"), "{}", r.message),
        Admission::Allow => panic!("prompt cap"),
    }
    match admit(&meta("k1", 10, 51)) {
        Admission::Reject(r) => assert!(r.status == 400 && r.message.contains("max_tokens")),
        Admission::Allow => panic!("completion cap"),
    }
    // Concurrency: two in flight, the third waits for a completion.
    assert!(matches!(admit(&meta("k1", 10, 10)), Admission::Allow));
    assert!(matches!(admit(&meta("k1", 10, 10)), Admission::Allow));
    match admit(&meta("k1", 10, 10)) {
        Admission::Reject(r) => assert!(r.status == 429 && r.message.contains("concurrent")),
        Admission::Allow => panic!("concurrency cap"),
    }
    p.on_complete(&env, &svc, "acme", cfg, &meta("k1", 10, 10), 10, 5).expect("complete");
    // The slot is back, but the request bucket (3 per minute, 4 admitted attempts) is empty now.
    match admit(&meta("k1", 10, 10)) {
        Admission::Reject(r) => {
            assert_eq!(r.status, 429);
            assert!(r.message.contains("requests per minute"), "{}", r.message);
            assert!(r.retry_after_ms.is_some_and(|ms| ms > 0 && ms <= 60_000), "{:?}", r.retry_after_ms);
        }
        Admission::Allow => panic!("rate limit"),
    }
    // Per key: another key of the same tenant has its own buckets.
    assert!(matches!(admit(&meta("k2", 10, 10)), Admission::Allow));
    // Another tenant's services are separate.
    let other = Arc::new(TenantServices::default());
    assert!(matches!(
        p.admit(&env, &other, "globex", cfg, &meta("k1", 10, 10), "{}").expect("admit"),
        Admission::Allow
    ));
}
