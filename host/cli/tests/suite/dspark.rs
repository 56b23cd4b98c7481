//! DSpark speculative decoding against the `dspark-tiny` goldens (draft on the `k3-tiny` target,
//! two rounds greedy and sampled with stored uniforms), and the state machinery under it:
//! per-token KDA snapshots, accept-and-roll-back, pages and slots returned.

use crate::common;

use common::{Golden, max_abs_diff};
use kimi_host::model::dspark::DsparkDraft;
use kimi_host::model::{LogitsFor, Model, SequenceState};

/// The case's tolerance class of a golden tensor (`suggested_tolerance`) and its bound, or
/// `None` for exact (ids, accept lengths, decisions).
fn tolerance(g: &Golden, name: &str) -> Option<(&'static str, f32)> {
    let t = &g.case["suggested_tolerance"];
    let get = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("suggested_tolerance.{k}")) as f32;
    let leaf = name.rsplit('.').next().unwrap_or(name);
    let target = name.starts_with("target.")
        || name.contains("verify_")
        || name.contains("context_aux_hidden")
        || name.contains("state_after_accept")
        || name.contains("kda_per_token");
    if g.case["golden_tensors"][name]["dtype"] == "int64" {
        None
    } else if name.contains(".u_") {
        Some(("stored inputs", 0.0))
    } else if target {
        Some(("target", get("target_logits_max_abs").max(get("target_states_max_abs"))))
    } else if leaf.ends_with("probs") || leaf == "accept_ratio" {
        Some(("probabilities", get("probabilities_max_abs")))
    } else {
        Some(("draft", get("draft_logits_max_abs").max(get("draft_hidden_and_rows_max_abs"))))
    }
}

#[test]
fn speculate_reproduces_the_dspark_tiny_goldens() {
    let g = Golden::open("dspark-tiny");
    let target = Model::load(&common::golden_dir().join("k3-tiny")).expect("target loads");
    let draft = DsparkDraft::load(&g.dir, &target).expect("draft loads");
    let tr = kimi_host_cli::speculate::run_case(&target, &draft, &g.dir).expect("the case runs");
    let mut worst = std::collections::BTreeMap::<&str, f32>::new();
    for name in g.names() {
        match tolerance(&g, &name) {
            None => {
                let got = tr.get_i64(&name).unwrap_or_else(|| panic!("{name} was not computed"));
                assert_eq!(got, g.i64(&name).as_slice(), "{name}");
            }
            Some((class, tol)) => {
                let got = tr.get_f32(&name).unwrap_or_else(|| panic!("{name} was not computed"));
                let mut want = g.f32(&name);
                assert_eq!(got.len(), want.len(), "{name}: shape");
                if name.contains("conv_state") {
                    // Column 0 of fla's window is the input W tokens back: no later step reads it
                    // and no state keeps it (written as NaN); the W − 1 columns after it are state.
                    for (w, gv) in want.iter_mut().zip(got) {
                        if gv.is_nan() {
                            *w = f32::NAN;
                        }
                    }
                }
                let d = max_abs_diff(got, &want);
                assert!(d <= tol, "{name}: max |Δ| {d} > {tol}");
                let e = worst.entry(class).or_default();
                *e = e.max(d);
            }
        }
    }
    eprintln!("dspark-tiny worst |Δ| by class: {worst:?}");
}

/// The same case with the target on two tensor-parallel ranks (the draft shares its embedding
/// and LM head, split by vocabulary): every tensor within the case's tolerances, accept lengths
/// and draft tokens exact (KDA states are each rank's heads, so their whole-state tensors are
/// checked at TP 1 only).
#[test]
fn speculate_reproduces_the_dspark_tiny_goldens_at_tp2() {
    let g = Golden::open("dspark-tiny");
    let target = Model::load_with(&common::golden_dir().join("k3-tiny"), kimi_host::model::Parallelism::tensor(2))
        .expect("target on 2 ranks");
    let draft = DsparkDraft::load(&g.dir, &target).expect("draft loads at TP 2");
    let tr = kimi_host_cli::speculate::run_case(&target, &draft, &g.dir).expect("the case runs");
    let mut checked = 0;
    for name in g.names() {
        if name.contains("recurrent_state") || name.contains("conv_state") {
            continue;
        }
        checked += 1;
        match tolerance(&g, &name) {
            None => {
                assert_eq!(tr.get_i64(&name).unwrap_or_else(|| panic!("{name}")), g.i64(&name).as_slice(), "{name}")
            }
            Some((_, tol)) => {
                let got = tr.get_f32(&name).unwrap_or_else(|| panic!("{name}"));
                let want = g.f32(&name);
                let d = got
                    .iter()
                    .zip(&want)
                    .filter(|(a, b)| !a.is_nan() && !b.is_nan())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d <= tol, "{name}: max |Δ| {d} > {tol}");
            }
        }
    }
    assert!(checked > 40, "{checked} tensors checked");
}

/// Drafts that the target rejects leave nothing behind: after a verify of 5 tokens keeping k,
/// the state is bit for bit the one of a run that fed only those k tokens (KDA state and
/// windows, latent rows), every snapshot slot and page of the rejected tokens is back in its
/// arena, and the next step's logits are identical.
#[test]
fn a_rolled_back_verify_equals_running_only_the_kept_tokens() {
    let g = Golden::open("dspark-tiny");
    let target = Model::load(&common::golden_dir().join("k3-tiny")).expect("target loads");
    let c = target.text_config().clone();
    let arenas = target.state_arenas(8, 64).expect("fixed arenas");
    let prompt: Vec<u32> = g.ids("prompt.input_ids");
    // Cross a page boundary (16 tokens a page) inside the verify, so dropped pages are tested.
    let prompt = &prompt[..14];
    let verify = [7u32, 99, 3, 250, 41];
    for kept in 1..=verify.len() {
        let mut spec = target.new_state_in(&arenas).expect("state");
        target.forward(prompt, &mut spec, LogitsFor::LastToken, None).expect("prefill");
        let slots_before = arenas.slots.in_use();
        spec.begin_verify(verify.len()).expect("snapshot slots");
        assert_eq!(arenas.slots.in_use(), slots_before + verify.len(), "one snapshot slot per verified token");
        target.forward(&verify, &mut spec, LogitsFor::AllTokens, None).expect("verify");
        spec.accept(verify.len(), kept).expect("accept");
        assert_eq!(arenas.slots.in_use(), slots_before, "kept {kept}: snapshot slots returned");
        assert_eq!(spec.snapshot_slots(), 0);

        let mut plain = target.new_state_in(&arenas).expect("state");
        target.forward(prompt, &mut plain, LogitsFor::LastToken, None).expect("prefill");
        // One token a call: the recurrent form the verify used, so the states are bit-identical
        // (every other op gives the same bits for any batch).
        for id in &verify[..kept] {
            target.forward(&[*id], &mut plain, LogitsFor::LastToken, None).expect("kept token");
        }
        assert_eq!(spec.len, plain.len);
        for i in 0..c.num_layers {
            if let (Some(a), Some(b)) = (spec.kda(i), plain.kda(i)) {
                assert_eq!(a.recurrent, b.recurrent, "kept {kept}, layer {i}: KDA state");
                for br in 0..3 {
                    assert_eq!(a.conv_frames(br), b.conv_frames(br), "kept {kept}, layer {i}: conv window {br}");
                }
            }
            if let (Some(a), Some(b)) = (spec.mla(i), plain.mla(i)) {
                assert_eq!(a.len(), b.len());
                assert_eq!(a.pages(), b.pages(), "kept {kept}, layer {i}: pages of rejected rows returned");
                assert_eq!(a.rows(), b.rows(), "kept {kept}, layer {i}: latent rows");
            }
        }
        let next = [12u32];
        let la = target.forward(&next, &mut spec, LogitsFor::LastToken, None).expect("after rollback");
        let lb = target.forward(&next, &mut plain, LogitsFor::LastToken, None).expect("plain");
        assert_eq!(la, lb, "kept {kept}: the next step's logits");
        drop((spec, plain));
        assert_eq!((arenas.slots.in_use(), arenas.pages.in_use()), (0, 0), "everything returned");
    }

    // Misuse is an error, not a panic: keeping nothing, or a verify step of the wrong width.
    let mut st: SequenceState = target.new_state_in(&arenas).expect("state");
    target.forward(prompt, &mut st, LogitsFor::LastToken, None).expect("prefill");
    assert!(st.accept(3, 0).is_err());
    st.begin_verify(3).expect("slots");
    assert!(target.forward(&verify[..2], &mut st, LogitsFor::LastToken, None).is_err(), "2 tokens, 3 snapshots");
}
