//! The shared sampling algorithm (`plugins/sampling-core`) run natively: exact top-k, greedy,
//! and empirical distributions against brute force (chi-square). The same code runs inside the
//! `sampler-standard` plugin (see `plugins.rs` for the plugin-side chi-square test).

use crate::common;

use kimi_sampling_core::{Params, SeqState, SliceLogits, top_k};

fn exact(logits: &[f32], p: &Params) -> Vec<f64> {
    common::exact_distribution(logits, p.temperature as f64, p.top_k as usize, p.top_p as f64, p.min_p as f64)
}

#[test]
fn top_k_matches_a_full_sort() {
    let v: Vec<f32> = (0..5000).map(|i| ((i * 7919 % 1013) as f32) / 7.0).collect();
    let mut all: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for k in [1, 2, 10, 333, 5000, 6000] {
        assert_eq!(top_k(&v, k), all[..k.min(5000)].to_vec());
    }
}

#[test]
fn greedy_is_argmax_even_with_few_candidates() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
    let mut s = SeqState::new(Params { temperature: 0.0, ..Default::default() }, 1);
    let got = s.sample(&mut SliceLogits(&logits), vec![]).unwrap();
    assert_eq!(got as usize, logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0);
}

#[test]
fn empirical_distribution_matches_exact() {
    let logits: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32) / 25.0).collect();
    for p in [
        Params { temperature: 0.8, top_p: 0.9, ..Default::default() },
        Params { temperature: 1.3, top_k: 20, ..Default::default() },
        Params { temperature: 1.0, min_p: 0.05, ..Default::default() },
        Params { temperature: 0.7, ..Default::default() },
    ] {
        let want = exact(&logits, &p);
        let mut s = SeqState::new(p.clone(), 9);
        let n = 40_000;
        let mut counts = vec![0u32; logits.len()];
        for _ in 0..n {
            counts[s.sample(&mut SliceLogits(&logits), vec![]).unwrap() as usize] += 1;
        }
        common::assert_chi_square(&counts, &want, n, &format!("{p:?}"));
    }
}

/// Penalties and biases applied by brute force to the whole row (vLLM / OpenAI meanings).
fn penalised(row: &[f32], p: &Params, prompt: &[u32], output: &[u32]) -> Vec<f32> {
    row.iter()
        .enumerate()
        .map(|(i, &raw)| {
            let i = i as u32;
            let count = output.iter().filter(|&&t| t == i).count() as f32;
            let seen = count > 0.0 || prompt.contains(&i);
            let mut l = raw;
            if seen {
                l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
            }
            if count > 0.0 {
                l -= p.frequency_penalty * count + p.presence_penalty;
            }
            l + p.logit_bias.get(&i).copied().unwrap_or(0.0)
        })
        .collect()
}

#[test]
fn penalties_biases_and_rollback_match_brute_force() {
    // Peaked logits (the top tokens carry most of the mass), so penalties on them matter.
    let logits: Vec<f32> = (0..400).map(|i| 6.0 - 2.0 * (((i * 7919) % 400) as f32 + 1.0).ln()).collect();
    let top: Vec<u32> = top_k(&logits, 8).into_iter().map(|c| c.0).collect();
    let low = top_k(&logits, 400)[350].0;
    let prompt = vec![top[0], top[3], 17, 17];
    // Generated: top[1] three times, top[2] once, top[0] once; the last two are rolled back.
    let generated = vec![top[1], top[2], top[1], top[1], top[0], 99, top[5]];
    let kept = &generated[..generated.len() - 2];
    for p in [
        Params { temperature: 0.9, frequency_penalty: 0.7, presence_penalty: 0.4, ..Default::default() },
        Params { temperature: 1.1, repetition_penalty: 1.6, top_p: 0.9, ..Default::default() },
        Params {
            temperature: 1.0,
            frequency_penalty: -0.5,
            repetition_penalty: 0.8,
            min_p: 0.02,
            logit_bias: [(low, 9.0), (top[0], -3.0)].into_iter().collect(),
            ..Default::default()
        },
        Params { temperature: 0.8, top_k: 5, presence_penalty: 1.5, ..Default::default() },
        // top-k past the candidate list, then top-p and min-p (the kept set is only partly known).
        Params { temperature: 1.2, top_k: 40, top_p: 0.8, min_p: 0.01, frequency_penalty: 1.0, ..Default::default() },
        Params { temperature: 1.5, top_p: 0.97, repetition_penalty: 1.3, ..Default::default() },
    ] {
        let row = penalised(&logits, &p, &prompt, kept);
        let want = exact(&row, &p);
        let mut s = SeqState::new(p.clone(), 3);
        s.accept(&prompt);
        s.sample(&mut SliceLogits(&logits), vec![]).unwrap(); // ends the prompt
        s.accept(&generated);
        s.rollback(2);
        let n = 40_000;
        let mut counts = vec![0u32; logits.len()];
        for _ in 0..n {
            // A short candidate list (as a host would send): penalised tokens leave it, the
            // biased low token joins it from outside.
            let cands = top_k(&logits, 16);
            counts[s.sample(&mut SliceLogits(&logits), cands).unwrap() as usize] += 1;
        }
        common::assert_chi_square(&counts, &want, n, &format!("{p:?}"));
        // Greedy under the same adjustments is the adjusted argmax.
        let mut g = SeqState::new(Params { temperature: 0.0, ..p.clone() }, 1);
        g.accept(&prompt);
        g.sample(&mut SliceLogits(&logits), vec![]).unwrap();
        g.accept(&generated);
        g.rollback(2);
        let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).unwrap().0;
        assert_eq!(g.sample(&mut SliceLogits(&logits), top_k(&logits, 16)).unwrap() as usize, argmax, "{p:?}");
    }
}

#[test]
fn sequences_sampled_in_turn_on_one_thread_do_not_share_adjustments() {
    // The step's adjusted tokens are marked in a per-thread scratch set; a sequence sampled right
    // after a penalised one must see none of the other's marks.
    let logits: Vec<f32> = (0..400).map(|i| 6.0 - 2.0 * (((i * 7919) % 400) as f32 + 1.0).ln()).collect();
    let top: Vec<u32> = top_k(&logits, 8).into_iter().map(|c| c.0).collect();
    let plain = Params { temperature: 1.0, top_p: 0.9, ..Default::default() };
    let pen = Params { frequency_penalty: 2.0, logit_bias: [(top[0], -100.0)].into_iter().collect(), ..plain.clone() };
    let mut a = SeqState::new(pen.clone(), 5);
    a.sample(&mut SliceLogits(&logits), vec![]).unwrap(); // ends the (empty) prompt
    a.accept(&top[..4]);
    let mut b = SeqState::new(plain.clone(), 6);
    let n = 40_000;
    let (mut counts_a, mut counts_b) = (vec![0u32; logits.len()], vec![0u32; logits.len()]);
    for _ in 0..n {
        counts_a[a.sample(&mut SliceLogits(&logits), top_k(&logits, 16)).unwrap() as usize] += 1;
        counts_b[b.sample(&mut SliceLogits(&logits), top_k(&logits, 16)).unwrap() as usize] += 1;
    }
    let want_a = exact(&penalised(&logits, &pen, &[], &top[..4]), &pen);
    common::assert_chi_square(&counts_a, &want_a, n, "penalised");
    common::assert_chi_square(&counts_b, &exact(&logits, &plain), n, "plain after penalised");
}

/// `distribution` (what speculative decoding draws drafts from and verifies against) gives,
/// token for token, the brute-force probabilities of the penalised, filtered row — with a
/// tail rule when no filter cuts the vocabulary — and leaves the random stream alone.
#[test]
fn distributions_equal_the_brute_force_rows() {
    let logits: Vec<f32> = (0..400).map(|i| 6.0 - 2.0 * (((i * 7919) % 400) as f32 + 1.0).ln()).collect();
    let top: Vec<u32> = top_k(&logits, 8).into_iter().map(|c| c.0).collect();
    let low = top_k(&logits, 400)[350].0;
    let prompt = vec![top[0], top[3], 17, 17];
    let generated = vec![top[1], top[2], top[1], top[1], top[0]];
    for p in [
        Params { temperature: 0.9, frequency_penalty: 0.7, presence_penalty: 0.4, ..Default::default() },
        Params { temperature: 1.1, repetition_penalty: 1.6, top_p: 0.9, ..Default::default() },
        Params {
            temperature: 1.0,
            frequency_penalty: -0.5,
            repetition_penalty: 0.8,
            min_p: 0.02,
            logit_bias: [(low, 9.0), (top[0], -3.0)].into_iter().collect(),
            ..Default::default()
        },
        Params { temperature: 0.8, top_k: 5, presence_penalty: 1.5, ..Default::default() },
        Params { temperature: 1.2, top_k: 40, top_p: 0.8, min_p: 0.01, frequency_penalty: 1.0, ..Default::default() },
        Params { temperature: 1.5, top_p: 0.97, repetition_penalty: 1.3, ..Default::default() },
        Params { temperature: 1.0, logit_bias: [(low, f32::NEG_INFINITY)].into_iter().collect(), ..Default::default() },
        Params { temperature: 0.0, presence_penalty: 2.0, ..Default::default() },
    ] {
        let row = penalised(&logits, &p, &prompt, &generated);
        let want: Vec<f64> = if p.temperature == 0.0 {
            let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).unwrap().0;
            (0..row.len()).map(|i| (i == argmax) as u8 as f64).collect()
        } else {
            exact(&row, &p)
        };
        let mut s = SeqState::new(p.clone(), 3);
        s.accept(&prompt);
        s.sample(&mut SliceLogits(&logits), vec![]).unwrap(); // ends the prompt
        s.accept(&generated);
        let mut twin = s.clone();
        for cands in [top_k(&logits, 16), vec![], top_k(&logits, 400)] {
            let d = s.distribution(&mut SliceLogits(&logits), cands.clone()).unwrap();
            let unfiltered = p.top_k == 0 && p.top_p >= 1.0 && p.min_p == 0.0 && p.temperature > 0.0;
            assert_eq!(d.tail.is_some(), unfiltered && cands.len() < logits.len(), "{p:?}: tail");
            let got = d.dense(&logits);
            let sum: f64 = got.iter().map(|&x| x as f64).sum();
            assert!((sum - 1.0).abs() < 1e-4, "{p:?}: sums to {sum}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((*g as f64 - w).abs() < 1e-5 + 1e-4 * w, "{p:?}: token {i}: {g} vs {w}");
            }
        }
        // The random stream is untouched: the next draw is the twin's.
        let a = s.sample(&mut SliceLogits(&logits), top_k(&logits, 16)).unwrap();
        let b = twin.sample(&mut SliceLogits(&logits), top_k(&logits, 16)).unwrap();
        assert_eq!(a, b, "{p:?}");
    }
}
