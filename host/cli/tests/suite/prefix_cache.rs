//! Prefix caching through the engine, on the three golden models: requests served from a cached
//! prefix (at a block boundary, between boundaries, forked, side by side with other hits, next
//! to a request cancelled mid-prefill) give the tokens and log-probabilities of an uncached run;
//! partitions never mix; under pool pressure cached states are evicted before anyone waits, and
//! clearing the cache returns every slot and page.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kimi_host::engine::prefix::BLOCK_TOKENS;
use kimi_host::engine::{
    Engine, EngineConfig, EngineError, GenHandle, GenRequest, SamplerRequest, SamplingSpec, SeqEvent,
};
use kimi_host::model::Model;
use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{PluginEnv, PluginRuntime, RuntimeOptions, SamplerPlugin, TenantSampler, TenantServices};

use crate::common;

fn sampler(vocab: usize) -> Arc<Mutex<TenantSampler>> {
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load("sampler-standard", builtin("sampler-standard").expect("builtin")).expect("loads");
    let plugin = Arc::new(SamplerPlugin::new(rt, &compiled).expect("sampler"));
    let env = Arc::new(PluginEnv::bare(vocab as u32, vec![]));
    Arc::new(Mutex::new(TenantSampler::new(plugin, env, Arc::new(TenantServices::default()), "t")))
}

fn request(s: &Arc<Mutex<TenantSampler>>, prompt: Vec<u32>, n: usize, salt: Option<&str>) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens: 6,
        n,
        stop_tokens: vec![],
        constraint: None,
        sampling: SamplingSpec {
            sampler: s.clone(),
            params_json: r#"{"temperature": 0}"#.into(),
            seed: 1,
            info: SamplerRequest::default(),
        },
        logprobs: Some(3),
        cache_salt: salt.map(str::to_string),
        media: None,
    }
}

/// Per sequence: (token, its log-probability then the top-3 alternatives'); and the cached
/// prompt tokens reported.
type Output = (Vec<Vec<(u32, Vec<f32>)>>, usize);

fn drain(mut h: GenHandle, n: usize) -> Result<Output, EngineError> {
    let mut out = vec![Vec::new(); n];
    let (mut finished, mut cached) = (0, 0);
    while finished < n {
        match h.events.blocking_recv() {
            Some(SeqEvent::Cached { tokens }) => cached = tokens,
            Some(SeqEvent::Token { index, id, logprob }) => {
                let lp = logprob.expect("logprobs were asked for");
                out[index].push((id, std::iter::once(lp.logprob).chain(lp.top.iter().map(|t| t.1)).collect()));
            }
            Some(SeqEvent::Finished { .. }) => finished += 1,
            Some(SeqEvent::Failed { error, .. }) => return Err(error),
            None => panic!("stream closed early"),
        }
    }
    Ok((out, cached))
}

/// Same tokens, log-probabilities (the chosen token's and the top alternatives') within `tol`.
fn assert_same(got: &[Vec<(u32, Vec<f32>)>], want: &[(u32, Vec<f32>)], tol: f32, what: &str) {
    for seq in got {
        let (gt, wt): (Vec<u32>, Vec<u32>) = (seq.iter().map(|x| x.0).collect(), want.iter().map(|x| x.0).collect());
        assert_eq!(gt, wt, "{what}: tokens");
        for ((_, a), (_, b)) in seq.iter().zip(want) {
            assert_eq!(a.len(), b.len(), "{what}: alternatives");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= tol, "{what}: log-probability {x} vs {y}");
            }
        }
    }
}

fn ids(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    // Below the reserved specials at the top of the vocabulary.
    (0..len as u32)
        .map(|j| (j.wrapping_mul(2654435761).wrapping_add(seed * 97 + 13) >> 7) % (vocab as u32 - 8))
        .collect()
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn cached_prefixes_give_the_uncached_tokens_on_every_golden_model() {
    for case in ["k3-tiny", "k3-tiny-mxfp4", "k31-tiny-indexer"] {
        let model = Arc::new(Model::load(&common::golden_dir().join(case)).expect("model"));
        let v = model.text_config().vocab_size;
        let s = sampler(v);
        let cfg = EngineConfig {
            max_batched_tokens: 512,
            max_seqs: 16,
            state_memory: 64 << 20,
            prefix_cache: true,
            ..Default::default()
        };
        let engine = Engine::start(model.clone(), cfg).expect("engine");
        let shared = ids(1, 150, v);
        let with =
            |tail: u32, len: usize| -> Vec<u32> { shared[..len].iter().copied().chain(ids(tail, 9, v)).collect() };
        // The reference, from scratch: the same engine, each request in a partition of its own
        // (so its prefill is chunked by the same rule, and nothing is found).
        let fresh = std::sync::atomic::AtomicUsize::new(0);
        let reference = |prompt: &[u32]| {
            let salt = format!("reference-{}", fresh.fetch_add(1, Relaxed));
            let (mut out, cached) =
                drain(engine.submit(request(&s, prompt.to_vec(), 1, Some(&salt))).expect("submit"), 1).expect("runs");
            assert_eq!(cached, 0);
            out.remove(0)
        };
        let run = |prompt: &[u32], n: usize, salt: &str| {
            drain(engine.submit(request(&s, prompt.to_vec(), n, Some(salt))).expect("submit"), n).expect("runs")
        };

        // The first request fills the cache: its prefill stops at the last block boundary
        // before its final token (128 of 159), and the state there is stored.
        let (first, cached) = run(&with(2, 150), 1, "a");
        assert_eq!(cached, 0);
        assert_same(&first, &reference(&with(2, 150)), 1e-5, &format!("{case}: the filling request"));
        assert_eq!(engine.stats.prefix_inserted.load(Relaxed), 2, "{case}: one state at 128, and the reference's");

        // A hit between boundaries (150 shared tokens: resumes at 128), one exactly at a
        // boundary (128 shared), and a fork.
        for (what, prompt, n, want_cached) in [
            ("between boundaries", with(3, 150), 1, 2 * BLOCK_TOKENS),
            ("at a boundary", with(4, 128), 1, 2 * BLOCK_TOKENS),
            ("a fork (n = 2)", with(5, 150), 2, 2 * BLOCK_TOKENS),
        ] {
            let (got, cached) = run(&prompt, n, "a");
            assert_eq!(cached, want_cached, "{case}: {what}");
            assert_same(&got, &reference(&prompt), 1e-5, &format!("{case}: {what}"));
        }

        // Hits side by side never see each other's tokens: each equals its own reference (a
        // cached state updated in place by one would change the others).
        let prompts: Vec<Vec<u32>> = (10..14).map(|t| with(t, 150)).collect();
        let handles: Vec<_> =
            prompts.iter().map(|p| engine.submit(request(&s, p.clone(), 1, Some("a"))).expect("submit")).collect();
        for (p, h) in prompts.iter().zip(handles) {
            let (got, cached) = drain(h, 1).expect("runs");
            assert_eq!(cached, 2 * BLOCK_TOKENS);
            assert_same(&got, &reference(p), 1e-5, &format!("{case}: concurrent hit"));
        }

        // Conversations that share only a system prompt: the first two part after 128 shared
        // tokens (the first stored its state at 192, inside its own tail), so the second stops
        // its prefill at 128 once and stores the state there; the third resumes from it.
        let system = ids(30, 150, v);
        let talk = |t: u32| -> Vec<u32> { system.iter().copied().chain(ids(t, 100, v)).collect() };
        assert_eq!(run(&talk(31), 1, "c").1, 0);
        assert_eq!(run(&talk(32), 1, "c").1, 0);
        let (got, cached) = run(&talk(33), 1, "c");
        assert_eq!(
            cached,
            2 * BLOCK_TOKENS,
            "{case}: the shared system prompt is cached from the second conversation on"
        );
        assert_same(&got, &reference(&talk(33)), 1e-5, &format!("{case}: shared system prompt"));

        // Another partition never hits.
        let (got, cached) = run(&with(6, 150), 1, "b");
        assert_eq!(cached, 0, "{case}: a prefix is found only under its own salt");
        assert_same(&got, &reference(&with(6, 150)), 1e-5, &format!("{case}: other partition"));

        // A request sharing a long prefix is dropped mid-prefill while another uses it.
        let long: Vec<u32> = ids(7, 700, v);
        let tail = |t: u32| -> Vec<u32> { long.iter().copied().chain(ids(t, 5, v)).collect() };
        let dropped = engine.submit(request(&s, tail(8), 1, Some("a"))).expect("submit");
        let kept = engine.submit(request(&s, tail(9), 1, Some("a"))).expect("submit");
        std::thread::sleep(Duration::from_millis(2));
        drop(dropped);
        let (got, _) = drain(kept, 1).expect("runs");
        assert_same(&got, &reference(&tail(9)), 1e-5, &format!("{case}: next to a cancelled request"));
        // States exist where the kept request's first chunk ended (512) and, when the engine saw
        // the dropped request before it left, where the two parted (640).
        let (got, cached) = run(&tail(10), 1, "a");
        assert!(cached == 640 || cached == 512, "{case}: the long prefix is cached ({cached})");
        assert_same(&got, &reference(&tail(10)), 1e-5, &format!("{case}: after the cancellation"));

        assert!(engine.stats.prefix_hits.load(Relaxed) >= 8);
        // Clearing the cache gives every slot and page back.
        engine.clear_prefix_cache();
        wait_for("the pool to empty", || {
            engine.stats.used_slots.load(Relaxed) == 0
                && engine.stats.leased_slots.load(Relaxed) == 0
                && engine.stats.leased_pages.load(Relaxed) == 0
                && engine.stats.prefix_entries.load(Relaxed) == 0
        });
        engine.shutdown(Duration::from_secs(5));
    }
}

/// A pool that cached prefixes fill: a new request is admitted by evicting them (least recently
/// used first), not refused; without the cache the same request fits the same pool.
#[test]
fn cached_prefixes_are_evicted_before_a_request_waits() {
    let model = Arc::new(Model::load(&common::golden_dir().join("k3-tiny")).expect("model"));
    let v = model.text_config().vocab_size;
    let s = sampler(v);
    let shape = kimi_host::engine::pool::StateShape::of(model.rank_config(), 1, 1);
    // Room for about three sequences of 1,000 tokens.
    let budget = 3 * (shape.slot_bytes + 1000usize.div_ceil(16) * shape.page_bytes);
    let cfg = EngineConfig {
        max_batched_tokens: 512,
        max_seqs: 4,
        state_memory: budget,
        queue_timeout: Duration::from_millis(1500),
        prefix_cache: true,
        ..Default::default()
    };
    let engine = Engine::start(model.clone(), cfg).expect("engine");
    for k in 0..6 {
        let (_, cached) =
            drain(engine.submit(request(&s, ids(20 + k, 400, v), 1, Some("a"))).expect("submit"), 1).expect("fills");
        assert_eq!(cached, 0);
    }
    assert!(engine.stats.prefix_entries.load(Relaxed) > 0);
    let evictions = engine.stats.prefix_evictions.load(Relaxed);
    // Needs nearly the whole pool: only evicting the cache makes room.
    let big = request(&s, ids(40, 2 * 900, v), 1, Some("a"));
    drain(engine.submit(big).expect("submit"), 1).expect("admitted after evicting cached prefixes");
    assert!(engine.stats.prefix_evictions.load(Relaxed) > evictions, "cached states were evicted");
    assert_eq!(engine.stats.pool_timeouts.load(Relaxed), 0, "nobody was refused");
    engine.clear_prefix_cache();
    wait_for("the pool to empty", || {
        engine.stats.used_slots.load(Relaxed) == 0 && engine.stats.leased_pages.load(Relaxed) == 0
    });
    engine.shutdown(Duration::from_secs(5));
}

/// With a DSpark draft: a cached entry carries the draft's context rows for its tokens, so a hit
/// speculates from them at once. Every request emits the tokens a plain engine (no cache, no
/// draft) emits, hits are found, drafts are accepted, and all state goes back afterwards.
#[test]
fn cached_prefixes_with_a_draft_give_the_plain_tokens() {
    use kimi_host::engine::Speculation;
    use kimi_host::model::dspark::DsparkDraft;
    let g = common::golden_dir();
    let model = Arc::new(Model::load(&g.join("k3-tiny")).expect("target"));
    let v = model.text_config().vocab_size;
    let s = sampler(v);
    let draft = Arc::new(DsparkDraft::load(&g.join("dspark-tiny"), &model).expect("draft"));
    let base = EngineConfig { max_batched_tokens: 512, max_seqs: 16, state_memory: 64 << 20, ..Default::default() };
    let plain = Engine::start(model.clone(), base.clone()).expect("plain");
    let cfg = EngineConfig { prefix_cache: true, speculation: Some(Speculation::new(draft, 3)), ..base };
    let engine = Engine::start(model.clone(), cfg).expect("engine");
    let shared = ids(1, 150, v);
    let with = |tail: u32| -> Vec<u32> { shared.iter().copied().chain(ids(tail, 9, v)).collect() };
    for (k, tail) in [2u32, 3, 4, 5].into_iter().enumerate() {
        let n = if k == 2 { 2 } else { 1 };
        let mut req = request(&s, with(tail), n, Some("a"));
        req.max_tokens = 12;
        let (got, cached) = drain(engine.submit(req).expect("submit"), n).expect("runs");
        assert_eq!(cached, if k == 0 { 0 } else { 2 * BLOCK_TOKENS }, "request {k}");
        let mut req = request(&s, with(tail), 1, None);
        req.max_tokens = 12;
        let (mut want, _) = drain(plain.submit(req).expect("submit"), 1).expect("runs");
        assert_same(&got, &want.remove(0), 1e-4, &format!("request {k}"));
    }
    assert!(engine.stats.prefix_hits.load(Relaxed) >= 3);
    assert!(engine.stats.spec_rounds.load(Relaxed) > 0, "the hits speculated");
    // The draft read the same context from a hit as from a full prefill: the same drafts are
    // proposed and accepted for the same request (tokens alone could not show it: sample-and-
    // match emits the plain tokens whatever the draft proposes).
    let nocache = Engine::start(model.clone(), EngineConfig { prefix_cache: false, ..engine.config.clone() })
        .expect("engine without the cache");
    let accepted = |e: &Engine, salt: Option<&str>, tail: u32| {
        let before = (e.stats.spec_proposed.load(Relaxed), e.stats.spec_accepted.load(Relaxed));
        let mut req = request(&s, with(tail), 1, salt);
        req.max_tokens = 24;
        let (_, cached) = drain(e.submit(req).expect("submit"), 1).expect("runs");
        (cached, e.stats.spec_proposed.load(Relaxed) - before.0, e.stats.spec_accepted.load(Relaxed) - before.1)
    };
    // Tails whose drafts the target accepts from scratch (a random draft rarely agrees).
    let mut compared = 0;
    for tail in 20..60 {
        let from_scratch = accepted(&nocache, None, tail);
        if from_scratch.2 == 0 {
            continue;
        }
        let hit = accepted(&engine, Some("a"), tail);
        assert_eq!(hit.0, 2 * BLOCK_TOKENS);
        assert_eq!((hit.1, hit.2), (from_scratch.1, from_scratch.2), "tail {tail}: drafts proposed and accepted");
        compared += 1;
        if compared == 3 {
            break;
        }
    }
    assert!(compared > 0, "no tail had an accepted draft");
    nocache.shutdown(Duration::from_secs(5));
    engine.clear_prefix_cache();
    wait_for("the state to go back", || {
        engine.stats.used_slots.load(Relaxed) == 0
            && engine.stats.leased_pages.load(Relaxed) == 0
            && engine.stats.prefix_entries.load(Relaxed) == 0
    });
    engine.shutdown(Duration::from_secs(5));
    plain.shutdown(Duration::from_secs(5));
}
