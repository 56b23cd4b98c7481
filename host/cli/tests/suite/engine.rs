//! The continuous-batching engine against the model run alone: with greedy sampling through the
//! builtin sampler plugin, requests batched together, prefilled in small chunks and decoded side by
//! side give the tokens a one-sequence-at-a-time loop gives; `n > 1` shares one prefill; cancelled
//! and dropped requests give their state back; a full pool refuses instead of over-allocating.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kimi_host::engine::pool::StateShape;
use kimi_host::engine::{
    Engine, EngineConfig, EngineError, FinishReason, GenRequest, SamplerRequest, SamplingSpec, SeqEvent,
};
use kimi_host::model::config::MixerKind;
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::model::{LogitsFor, Model};
use kimi_host::plugins::builtin::builtin;
use kimi_host::plugins::{PluginEnv, PluginRuntime, RuntimeOptions, SamplerPlugin, TenantSampler, TenantServices};

struct Fixture {
    _dir: tempfile::TempDir,
    model: Arc<Model>,
    sampler: Arc<Mutex<TenantSampler>>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    make_tiny(dir.path(), &TinyOptions { seed: 5, k31: true, mxfp4: true, vision: false }).expect("make-tiny");
    let model = Arc::new(Model::load(dir.path()).expect("model"));
    fixture_with(dir, model)
}

fn fixture_with(dir: tempfile::TempDir, model: Arc<Model>) -> Fixture {
    let rt = PluginRuntime::new(RuntimeOptions { pooling: true, cache_dir: None }).expect("runtime");
    let compiled = rt.load("sampler-standard", builtin("sampler-standard").expect("builtin")).expect("loads");
    let plugin = Arc::new(SamplerPlugin::new(rt, &compiled).expect("sampler"));
    let env = Arc::new(PluginEnv::bare(model.text_config().vocab_size as u32, vec![]));
    let sampler = Arc::new(Mutex::new(TenantSampler::new(plugin, env, Arc::new(TenantServices::default()), "t")));
    Fixture { _dir: dir, model, sampler }
}

fn request(f: &Fixture, prompt: Vec<u32>, max_tokens: usize, n: usize, params: &str) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        n,
        stop_tokens: vec![],
        constraint: None,
        sampling: SamplingSpec {
            sampler: f.sampler.clone(),
            params_json: params.into(),
            seed: 42,
            info: SamplerRequest {
                tenant: "t".into(),
                request_id: "r".into(),
                model: "m".into(),
                params_json: "{}".into(),
            },
        },
        logprobs: None,
        cache_salt: None,
        media: None,
    }
}

/// Greedy tokens from the model alone (one prefill, then one decode step per token).
fn reference(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut state = model.new_state();
    let mut logits = model.forward(prompt, &mut state, LogitsFor::LastToken, None).expect("prefill");
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let (t, _) = kimi_kernels::cpu::reduce::argmax(&logits);
        out.push(t);
        logits = model.forward(&[t], &mut state, LogitsFor::LastToken, None).expect("decode");
    }
    out
}

/// Tokens per sequence and finish reasons, until every sequence ended.
fn drain(h: &mut kimi_host::engine::GenHandle, n: usize) -> Result<Vec<(Vec<u32>, FinishReason)>, EngineError> {
    let mut toks = vec![Vec::new(); n];
    let mut reasons = vec![None; n];
    while reasons.iter().any(Option::is_none) {
        match h.events.blocking_recv() {
            Some(SeqEvent::Token { index, id, .. }) => toks[index].push(id),
            Some(SeqEvent::Finished { index, reason }) => reasons[index] = Some(reason),
            Some(SeqEvent::Failed { error, .. }) => return Err(error),
            Some(SeqEvent::Cached { .. }) => {}
            None => panic!("engine closed the stream early"),
        }
    }
    Ok(toks.into_iter().zip(reasons.into_iter().map(|r| r.expect("reason"))).collect())
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32).map(|i| (0..(9 + 7 * i)).map(|j| (j * 31 + i * 17 + 3) % 256).collect()).collect()
}

fn wait_idle(e: &Engine) {
    use std::sync::atomic::Ordering::Relaxed;
    for _ in 0..500 {
        if e.stats.used_slots.load(Relaxed) == 0
            && e.stats.leased_slots.load(Relaxed) == 0
            && e.stats.leased_pages.load(Relaxed) == 0
            && e.stats.running_requests.load(Relaxed) == 0
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("engine still holds state: {:?}", e.stats);
}

#[test]
fn batched_chunked_generation_matches_the_model_alone() {
    let f = fixture();
    // Small steps force chunked prefill interleaved with other sequences' decode steps.
    let cfg = EngineConfig { max_batched_tokens: 7, max_seqs: 8, state_memory: 64 << 20, ..Default::default() };
    let engine = Engine::start(f.model.clone(), cfg).expect("engine");
    let greedy = r#"{"temperature": 0}"#;
    let mut handles: Vec<_> =
        prompts().into_iter().map(|p| engine.submit(request(&f, p, 12, 1, greedy)).expect("submit")).collect();
    for (p, h) in prompts().iter().zip(&mut handles) {
        let out = drain(h, 1).expect("generates");
        assert_eq!(out[0].1, FinishReason::Length);
        assert_eq!(out[0].0, reference(&f.model, p, 12), "prompt of {} tokens", p.len());
    }
    // n = 2 shares the prefill; greedy sequences agree with each other and with the reference.
    let mut h = engine.submit(request(&f, prompts()[2].clone(), 8, 2, greedy)).expect("submit");
    let out = drain(&mut h, 2).expect("generates");
    assert_eq!(out[0].0, reference(&f.model, &prompts()[2], 8));
    assert_eq!(out[0].0, out[1].0);
    drop(handles);
    drop(h);
    wait_idle(&engine);
    // Sampled (seeded) sequences of one request differ from each other but repeat across runs.
    let sampled = r#"{"temperature": 1.0}"#;
    let run = || {
        let mut h = engine.submit(request(&f, prompts()[0].clone(), 16, 2, sampled)).expect("submit");
        drain(&mut h, 2).expect("generates")
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b, "same seed, same tokens");
    assert_ne!(a[0].0, a[1].0, "sequence i is seeded with seed + i");
    engine.shutdown(Duration::from_secs(5));
}

#[test]
fn cancelled_and_dropped_requests_free_their_state() {
    let f = fixture();
    let engine =
        Engine::start(f.model.clone(), EngineConfig { state_memory: 64 << 20, ..Default::default() }).expect("engine");
    let mut kept = Vec::new();
    for i in 0..6 {
        let mut h = engine.submit(request(&f, prompts()[i % 6].clone(), 10_000, 1, "{}")).expect("submit");
        // Wait for the first token: the request holds state now.
        assert!(matches!(h.events.blocking_recv(), Some(SeqEvent::Token { .. })));
        if i % 2 == 0 {
            h.cancel(0);
            kept.push(h);
        } else {
            drop(h);
        }
    }
    wait_idle(&engine);
    assert!(engine.stats.cancelled.load(std::sync::atomic::Ordering::Relaxed) >= 6);
    drop(kept);
    engine.shutdown(Duration::from_secs(1));
}

/// `n = 4` forks share the prompt's latent pages: the pool holds the prompt's full pages once,
/// not four times, while the request runs, and each fork leases its own KDA slot; cancelling
/// gives every page and slot back.
#[test]
fn forks_share_the_prompt_pages() {
    use std::sync::atomic::Ordering::Relaxed;
    const P: usize = kimi_host::engine::pool::PAGE_TOKENS;
    let f = fixture();
    let cfg = EngineConfig { state_memory: 256 << 20, ..Default::default() };
    let engine = Engine::start(f.model.clone(), cfg).expect("engine");
    let prompt: Vec<u32> = (0..16 * P as u32).map(|i| i % 250).collect();
    let max_tokens = 1000;
    let mut h = engine.submit(request(&f, prompt.clone(), max_tokens, 4, r#"{"temperature": 1}"#)).expect("submit");
    assert!(matches!(h.events.blocking_recv(), Some(SeqEvent::Token { .. })));
    let mut used = 0;
    for _ in 0..200 {
        used = engine.stats.used_pages.load(Relaxed);
        if used > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let prompt_pages = prompt.len() / P;
    let own = (prompt.len() + max_tokens).div_ceil(P) - prompt_pages;
    assert_eq!(used, prompt_pages + 4 * own, "the prompt's {prompt_pages} pages are held once");
    assert!(used < 4 * (prompt.len() + max_tokens).div_ceil(P));
    let mut leased = 0;
    for _ in 0..200 {
        leased = engine.stats.leased_slots.load(Relaxed);
        if leased == 4 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(leased, 4, "each fork holds a KDA slot of the engine's arena");
    // The page arena itself holds the prompt's pages once per MLA layer (the forks' own pages
    // come as they decode) — far from four copies.
    let mla = f.model.text_config().layer_kinds.iter().filter(|k| matches!(k, MixerKind::Mla)).count();
    let pages = engine.stats.leased_pages.load(Relaxed);
    assert!(pages >= mla * prompt_pages && pages < mla * 2 * prompt_pages, "{pages} latent pages leased");
    drop(h);
    wait_idle(&engine);
    assert_eq!(engine.stats.used_pages.load(Relaxed), 0, "cancelling returns every page");
    assert_eq!(engine.stats.leased_slots.load(Relaxed), 0, "and every KDA slot");
    assert_eq!(engine.stats.leased_pages.load(Relaxed), 0, "and every latent page");
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn a_full_pool_refuses_after_the_queue_timeout() {
    let f = fixture();
    let shape = StateShape::of(f.model.rank_config(), f.model.ranks().len(), f.model.cache_replicas());
    // Room for exactly two sequences of 64 + 2000 tokens (the holders never get that far: they are
    // dropped once the late request has been refused).
    let per_seq = shape.slot_bytes + StateShape::pages_for(2064) * shape.page_bytes;
    let cfg = EngineConfig {
        state_memory: 2 * per_seq + shape.page_bytes / 2,
        max_seqs: 8,
        queue_timeout: Duration::from_millis(150),
        ..Default::default()
    };
    let engine = Engine::start(f.model.clone(), cfg).expect("engine");
    let prompt: Vec<u32> = (0..64).collect();
    let mut holders: Vec<_> =
        (0..2).map(|_| engine.submit(request(&f, prompt.clone(), 2000, 1, "{}")).expect("submit")).collect();
    for h in &mut holders {
        assert!(matches!(h.events.blocking_recv(), Some(SeqEvent::Token { .. })));
    }
    let mut late = engine.submit(request(&f, prompt.clone(), 2000, 1, "{}")).expect("queued");
    match late.events.blocking_recv() {
        Some(SeqEvent::Failed { index: None, error }) => assert!(error.is_busy(), "{error}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A request that could never fit is refused at once, not queued.
    let huge = engine.submit(request(&f, prompt.clone(), 100_000, 1, "{}"));
    assert!(matches!(huge, Err(EngineError::TooLarge { .. })));
    drop(holders);
    wait_idle(&engine);
    // Freed state is reusable.
    let mut h = engine.submit(request(&f, prompt, 4, 1, "{}")).expect("submit");
    assert_eq!(drain(&mut h, 1).expect("runs")[0].0.len(), 4);
    engine.shutdown(Duration::from_secs(1));
}

/// A panic inside a model call or the sampling pass (simulated through the engine's fault probe)
/// fails only the requests that step touched, frees their state, is counted, and the engine goes
/// on serving: the survivors' tokens still match the model alone.
#[test]
fn a_fault_inside_a_step_fails_only_its_requests() {
    use kimi_host::engine::{FaultPoint, FaultProbe};
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    const POISON: u32 = 300; // a special id no other prompt here contains
    let f = fixture();
    let decode_fault = Arc::new(AtomicBool::new(false));
    let sample_fault = Arc::new(AtomicBool::new(false));
    let probe = {
        let (decode_fault, sample_fault) = (decode_fault.clone(), sample_fault.clone());
        FaultProbe(Arc::new(move |point, tokens: &[u32]| match point {
            FaultPoint::Forward if tokens.contains(&POISON) => panic!("injected prefill fault"),
            FaultPoint::Forward if tokens.len() == 1 && decode_fault.swap(false, Relaxed) => {
                panic!("injected decode fault")
            }
            FaultPoint::Sample if sample_fault.swap(false, Relaxed) => panic!("injected sampling fault"),
            _ => {}
        }))
    };
    let cfg = EngineConfig { state_memory: 64 << 20, fault_probe: Some(probe), ..Default::default() };
    let engine = Engine::start(f.model.clone(), cfg).expect("engine");
    let greedy = r#"{"temperature": 0}"#;
    let is_fault = |r: &Result<_, EngineError>| matches!(r, Err(EngineError::Fault(_)));

    // 1. A prefill fault fails its own request; the one beside it is untouched.
    let mut poisoned = prompts()[1].clone();
    poisoned[3] = POISON;
    let mut bad = engine.submit(request(&f, poisoned, 6, 2, greedy)).expect("submit");
    let mut good = engine.submit(request(&f, prompts()[0].clone(), 6, 1, greedy)).expect("submit");
    assert!(is_fault(&drain(&mut bad, 2)), "the poisoned prompt fails with Fault");
    assert_eq!(drain(&mut good, 1).expect("survives")[0].0, reference(&f.model, &prompts()[0], 6));

    // 2. A decode fault stops exactly one of two decoding sequences.
    let mut hs: Vec<_> =
        (2..4).map(|i| engine.submit(request(&f, prompts()[i].clone(), 8, 1, greedy)).expect("submit")).collect();
    let mut firsts = Vec::new();
    for h in &mut hs {
        match h.events.blocking_recv() {
            Some(SeqEvent::Token { id, .. }) => firsts.push(id),
            other => panic!("expected a first token, got {other:?}"),
        }
    }
    decode_fault.store(true, Relaxed);
    let mut survivors = 0;
    for (k, h) in hs.iter_mut().enumerate() {
        let r = drain(h, 1);
        if let Ok(out) = r {
            survivors += 1;
            let mut toks = vec![firsts[k]];
            toks.extend(&out[0].0);
            assert_eq!(toks, reference(&f.model, &prompts()[k + 2], 8), "a survivor's tokens are unchanged");
        } else {
            assert!(is_fault(&r), "the failed one reports the fault");
        }
    }
    assert_eq!(survivors, 1, "one decode call panicked, one sequence failed");

    // 3. A panic outside the model calls (the sampling pass) fails everything running, frees it,
    //    and the next request is served normally.
    let mut running = engine.submit(request(&f, prompts()[4].clone(), 10_000, 1, greedy)).expect("submit");
    assert!(matches!(running.events.blocking_recv(), Some(SeqEvent::Token { .. })));
    sample_fault.store(true, Relaxed);
    assert!(is_fault(&drain(&mut running, 1)));
    wait_idle(&engine);
    let mut after = engine.submit(request(&f, prompts()[5].clone(), 5, 1, greedy)).expect("submit");
    assert_eq!(drain(&mut after, 1).expect("served after the fault")[0].0, reference(&f.model, &prompts()[5], 5));
    assert!(engine.is_running());
    assert_eq!(engine.stats.faults.load(Relaxed), 3);
    assert!(engine.stats.seconds_since_fault().is_some());
    drop((bad, good, hs, running, after));
    wait_idle(&engine);
    engine.shutdown(Duration::from_secs(1));
}

/// State memory the machine cannot give is a named start-up error, not an abort.
#[test]
fn state_memory_the_machine_cannot_give_is_a_start_up_error() {
    let f = fixture();
    let cfg = EngineConfig { state_memory: 1 << 60, ..Default::default() };
    match Engine::start(f.model.clone(), cfg) {
        Err(e) => assert!(e.to_string().contains("state memory"), "{e}"),
        Ok(_) => panic!("an engine started with 2^60 bytes of state memory"),
    }
}

#[test]
fn serving_after_start_up_allocates_no_step_buffers() {
    // The engine's start-up step sizes the step buffers for its budget; mixed prefill chunks and
    // decode steps within that budget then take every buffer from the pool.
    let f = fixture();
    let cfg = EngineConfig { max_batched_tokens: 48, max_seqs: 6, state_memory: 64 << 20, ..Default::default() };
    let engine = Engine::start(f.model.clone(), cfg).expect("engine");
    let sized = f.model.scratch().created();
    assert!(sized > 0, "start-up filled the pool");
    let greedy = r#"{"temperature": 0}"#;
    let mut handles: Vec<_> =
        prompts().into_iter().map(|p| engine.submit(request(&f, p, 10, 1, greedy)).expect("submit")).collect();
    for h in &mut handles {
        drain(h, 1).expect("generates");
    }
    let mut h = engine.submit(request(&f, prompts()[1].clone(), 6, 2, greedy)).expect("submit");
    drain(&mut h, 2).expect("generates");
    assert_eq!(f.model.scratch().created(), sized, "serving created step buffers");
    engine.shutdown(Duration::from_secs(5));
}

/// Speculative decoding with the DSpark draft (`dspark-tiny` on the `k3-tiny` target) and greedy
/// drafts emits exactly the tokens plain decoding emits — greedy, and sampled at temperature 1
/// with top-p for every seed (sample-and-match: each emitted token is the sampler's own draw on the same
/// row, so not only the distribution but the very tokens agree) — for one and for forked
/// sequences, while drafts are accepted; state goes back to zero afterwards.
#[test]
fn speculative_decoding_emits_exactly_the_plain_tokens() {
    use kimi_host::engine::{DraftMode, Speculation};
    use kimi_host::model::dspark::DsparkDraft;
    use std::sync::atomic::Ordering::Relaxed;
    let golden = crate::common::golden_dir();
    let model = Arc::new(Model::load(&golden.join("k3-tiny")).expect("target"));
    let f = fixture_with(tempfile::tempdir().expect("tempdir"), model.clone());
    let draft = Arc::new(DsparkDraft::load(&golden.join("dspark-tiny"), &model).expect("draft"));
    let base = EngineConfig { max_batched_tokens: 24, max_seqs: 8, state_memory: 64 << 20, ..Default::default() };
    let plain = Engine::start(model.clone(), base.clone()).expect("plain engine");
    // Greedy drafts (sample-and-match); a second engine draws its drafts from the sampler
    // (rejection sampling), which at temperature 0 must give the plain tokens too.
    let greedy_drafts = Speculation { drafts: DraftMode::Greedy, ..Speculation::new(draft.clone(), 4) };
    let spec_cfg = EngineConfig { speculation: Some(greedy_drafts), ..base.clone() };
    let spec = Engine::start(model.clone(), spec_cfg).expect("speculative engine");
    let sampled_cfg = EngineConfig { speculation: Some(Speculation::new(draft, 4)), ..base };
    let sampled = Engine::start(model.clone(), sampled_cfg).expect("engine with sampled drafts");
    let case = crate::common::Golden::open("dspark-tiny");
    let mut all_prompts = vec![case.ids("prompt.input_ids")];
    all_prompts.extend(prompts().into_iter().take(3));
    let params =
        [r#"{"temperature": 0}"#, r#"{"temperature": 1.0, "top_p": 0.9}"#, r#"{"temperature": 0.7, "top_k": 20}"#];
    for (k, prompt) in all_prompts.iter().enumerate() {
        for (j, p) in params.iter().enumerate() {
            let n = if k == 1 { 2 } else { 1 };
            for seed in 0..3u64 {
                let run = |e: &Engine| {
                    let mut req = request(&f, prompt.clone(), 20, n, p);
                    req.sampling.seed = seed;
                    let mut h = e.submit(req).expect("submit");
                    drain(&mut h, n).expect("generates")
                };
                let want = run(&plain);
                assert_eq!(run(&spec), want, "prompt {k}, params {j}, seed {seed}");
                if j == 0 {
                    assert_eq!(run(&sampled), want, "prompt {k}: sampled drafts at temperature 0");
                    break; // greedy: the seed does not matter
                }
            }
        }
    }
    let s = &spec.stats;
    let (rounds, proposed, accepted) =
        (s.spec_rounds.load(Relaxed), s.spec_proposed.load(Relaxed), s.spec_accepted.load(Relaxed));
    eprintln!("speculation: {rounds} verify rounds, {proposed} drafts proposed, {accepted} accepted");
    assert!(rounds > 0 && proposed >= rounds, "the draft proposed: {rounds} rounds, {proposed} drafts");
    assert!(accepted > 0, "some drafts were accepted (the golden prompt's greedy round accepts 2)");
    assert!(
        s.decode_tokens.load(Relaxed) > plain.stats.decode_tokens.load(Relaxed),
        "verifies run drafts through the target"
    );
    assert!(s.steps.load(Relaxed) < plain.stats.steps.load(Relaxed), "accepted drafts save steps");
    assert!(sampled.stats.spec_accepted.load(Relaxed) > 0, "sampled drafts were accepted");
    wait_idle(&sampled);
    sampled.shutdown(Duration::from_secs(5));
    wait_idle(&spec);
    spec.shutdown(Duration::from_secs(5));
    plain.shutdown(Duration::from_secs(5));
}

/// At temperature 1 with top-p, a presence penalty (and top-k, to keep the outcome space small),
/// the first three tokens of speculative decoding with sampled drafts follow the target's exact
/// joint distribution — computed by brute force from the model's rows — by a chi-square test over
/// 1,600 sequences; the draft proposes for tokens 2 and 3, so drafts drawn from the sampler's
/// distribution, rejection sampling, the correction and bonus draws and the rollback all sit
/// under the test.
#[test]
fn speculative_sampling_follows_the_exact_distribution() {
    use kimi_host::engine::Speculation;
    use kimi_host::model::dspark::DsparkDraft;
    use std::collections::HashMap;
    let golden = crate::common::golden_dir();
    let model = Arc::new(Model::load(&golden.join("k3-tiny")).expect("target"));
    let f = fixture_with(tempfile::tempdir().expect("tempdir"), model.clone());
    let draft = Arc::new(DsparkDraft::load(&golden.join("dspark-tiny"), &model).expect("draft"));
    let cfg = EngineConfig {
        max_batched_tokens: 256,
        max_seqs: 64,
        state_memory: 256 << 20,
        max_waiting: 512,
        speculation: Some(Speculation::new(draft, 3)),
        ..Default::default()
    };
    let engine = Engine::start(model.clone(), cfg).expect("engine");
    let prompt = crate::common::Golden::open("dspark-tiny").ids("prompt.input_ids");
    let (t, top_k, top_p, presence) = (1.0, 4, 0.9, 0.5f32);
    let params =
        format!(r#"{{"temperature": {t}, "top_k": {top_k}, "top_p": {top_p}, "presence_penalty": {presence}}}"#);

    // The exact joint distribution of the first three tokens (the presence penalty lowers the
    // tokens already generated, drafts the sampler described included).
    let dist = |row: &[f32], output: &[usize]| {
        let row: Vec<f32> =
            row.iter().enumerate().map(|(i, &l)| if output.contains(&i) { l - presence } else { l }).collect();
        crate::common::exact_distribution(&row, t, top_k, top_p, 0.0)
    };
    let mut exact: Vec<([u32; 3], f64)> = Vec::new();
    let mut st = model.new_state();
    let row1 = model.forward(&prompt, &mut st, LogitsFor::LastToken, None).expect("prefill");
    for (a, &pa) in dist(&row1, &[]).iter().enumerate().filter(|(_, p)| **p > 0.0) {
        let mut s1 = st.fork().expect("fork");
        let row2 = model.forward(&[a as u32], &mut s1, LogitsFor::LastToken, None).expect("step");
        for (b, &pb) in dist(&row2, &[a]).iter().enumerate().filter(|(_, p)| **p > 0.0) {
            let mut s2 = s1.fork().expect("fork");
            let row3 = model.forward(&[b as u32], &mut s2, LogitsFor::LastToken, None).expect("step");
            for (c, &pc) in dist(&row3, &[a, b]).iter().enumerate().filter(|(_, p)| **p > 0.0) {
                exact.push(([a as u32, b as u32, c as u32], pa * pb * pc));
            }
        }
    }
    let index: HashMap<[u32; 3], usize> = exact.iter().enumerate().map(|(i, (k, _))| (*k, i)).collect();

    let (requests, n) = (200u64, 8usize);
    let handles: Vec<_> = (0..requests)
        .map(|k| {
            let mut req = request(&f, prompt.clone(), 4, n, &params);
            req.sampling.seed = k * n as u64;
            engine.submit(req).expect("submit")
        })
        .collect();
    let mut counts = vec![0u32; exact.len()];
    for mut h in handles {
        for (toks, _) in drain(&mut h, n).expect("generates") {
            let key = [toks[0], toks[1], toks[2]];
            let i = *index.get(&key).unwrap_or_else(|| panic!("{key:?} has probability 0 under the filters"));
            counts[i] += 1;
        }
    }
    let want: Vec<f64> = exact.iter().map(|(_, p)| *p).collect();
    crate::common::assert_chi_square(&counts, &want, requests as usize * n, "first three tokens with speculation");
    let s = &engine.stats;
    use std::sync::atomic::Ordering::Relaxed;
    eprintln!(
        "rounds {} proposed {} accepted {}",
        s.spec_rounds.load(Relaxed),
        s.spec_proposed.load(Relaxed),
        s.spec_accepted.load(Relaxed)
    );
    assert!(s.spec_rounds.load(Relaxed) > 0, "the draft proposed");
    engine.shutdown(Duration::from_secs(5));
}

/// Images through the engine: the vision-tiny case's prompt (five images, 85 tokens) served by
/// an engine whose 7-token chunks cut through the image rows, two requests at once. The first
/// token's log-probabilities equal the golden end-to-end logits' (the release merge, no cache),
/// and the tower ran over both requests' images.
#[test]
fn images_in_chunked_prefill_match_the_vision_goldens() {
    use kimi_host::engine::MediaPrompt;
    use kimi_host::model::vision::VisionModel;
    let g = crate::common::Golden::open("vision-tiny");
    let model = Arc::new(Model::load(&g.dir).expect("the vision case's text model loads"));
    let vc = model.config.vision_config.clone().expect("vision_config");
    let vision = Arc::new(VisionModel::load(&g.dir, &vc, model.backend()).expect("tower"));
    let items: Vec<_> = ["img0", "img1", "img2", "img3", "img4"]
        .iter()
        .map(|name| vision.preprocess(&g.image(&format!("input.{name}")).expect("image")).input)
        .collect();
    let prompt = g.ids("e2e.expanded_input_ids");
    let pad = model.config.media_placeholder_token_id.expect("pad id");
    let positions: Vec<usize> = prompt.iter().enumerate().filter(|(_, t)| **t == pad).map(|(i, _)| i).collect();
    let media = Arc::new(MediaPrompt { items, positions });
    let f = fixture_with(tempfile::tempdir().expect("tempdir"), model.clone());
    let cfg =
        EngineConfig { max_batched_tokens: 7, state_memory: 64 << 20, vision: Some(vision), ..Default::default() };
    let e = Engine::start(model.clone(), cfg).expect("engine");
    let mut handles: Vec<_> = (0..2)
        .map(|_| {
            let mut r = request(&f, prompt.clone(), 1, 1, r#"{"temperature": 0}"#);
            r.logprobs = Some(5);
            r.media = Some(media.clone());
            e.submit(r).expect("submit")
        })
        .collect();
    // The golden's last row, as log-probabilities.
    let logits = g.f32("e2e.logits");
    let v = model.text_config().vocab_size;
    let last = &logits[logits.len() - v..];
    let m = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + last.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    for h in &mut handles {
        let first = loop {
            match h.events.blocking_recv() {
                Some(SeqEvent::Token { logprob, id, .. }) => break (id, logprob.expect("logprobs")),
                Some(SeqEvent::Failed { error, .. }) => panic!("failed: {error:?}"),
                Some(_) => {}
                None => panic!("stream closed"),
            }
        };
        let (id, lp) = first;
        let want = last[id as usize] - lse;
        assert!((lp.logprob - want).abs() < 0.03, "token {id}: logprob {} vs golden {want}", lp.logprob);
        for (t, l) in &lp.top {
            assert!((l - (last[*t as usize] - lse)).abs() < 0.03, "top token {t}: {l}");
        }
    }
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(e.stats.vision_items.load(Relaxed), 10, "each request's five images ran through the tower");
    assert!(e.stats.vision_calls.load(Relaxed) >= 1);
}

/// The draft under tensor parallelism: a target spread over two ranks (its embedding and LM
/// head split by vocabulary, which the draft shares) speculates and emits exactly the tokens its
/// own plain decoding emits, greedy and sampled, with drafts accepted.
#[test]
fn speculative_decoding_under_tensor_parallelism() {
    use kimi_host::engine::Speculation;
    use kimi_host::model::Parallelism;
    use kimi_host::model::dspark::DsparkDraft;
    use std::sync::atomic::Ordering::Relaxed;
    let golden = crate::common::golden_dir();
    let model = Arc::new(Model::load_with(&golden.join("k3-tiny"), Parallelism::tensor(2)).expect("target on 2 ranks"));
    let f = fixture_with(tempfile::tempdir().expect("tempdir"), model.clone());
    let draft = Arc::new(DsparkDraft::load(&golden.join("dspark-tiny"), &model).expect("draft at TP 2"));
    let base = EngineConfig { max_batched_tokens: 24, max_seqs: 8, state_memory: 64 << 20, ..Default::default() };
    let plain = Engine::start(model.clone(), base.clone()).expect("plain engine");
    let greedy_drafts = Speculation { drafts: kimi_host::engine::DraftMode::Greedy, ..Speculation::new(draft, 4) };
    let spec_cfg = EngineConfig { speculation: Some(greedy_drafts), ..base };
    let spec = Engine::start(model.clone(), spec_cfg).expect("speculative engine");
    let case = crate::common::Golden::open("dspark-tiny");
    for (prompt, n, params) in [
        (case.ids("prompt.input_ids"), 1, r#"{"temperature": 0}"#),
        (prompts()[2].clone(), 2, r#"{"temperature": 1.0, "top_p": 0.9}"#),
    ] {
        let run = |e: &Engine| {
            let mut h = e.submit(request(&f, prompt.clone(), 16, n, params)).expect("submit");
            drain(&mut h, n).expect("generates")
        };
        assert_eq!(run(&spec), run(&plain), "{params}");
    }
    assert!(spec.stats.spec_accepted.load(Relaxed) > 0, "drafts were accepted at TP 2");
    wait_idle(&spec);
    spec.shutdown(Duration::from_secs(5));
    plain.shutdown(Duration::from_secs(5));
}
