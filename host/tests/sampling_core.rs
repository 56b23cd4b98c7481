//! The shared sampling algorithm (`plugins/sampling-core`) run natively: exact top-k, greedy,
//! and empirical distributions against brute force (chi-square). The same code runs inside the
//! `sampler-standard` plugin (see `plugins.rs` for the plugin-side chi-square test).

mod common;

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
