//! Verifying a speculative block (spec `k3-dspark-vision.md` A.2.1): the target scores
//! `[x0, x1..xT]` in one step; drafts are accepted left to right and one more token is emitted —
//! a correction at the first rejection, or a bonus from the last row when every draft holds.
//!
//! At temperature 0 that is argmax agreement. Above it, standard rejection sampling against the
//! draft's own distribution (the Markov-biased one the draft was drawn from, or one-hot for a
//! greedy draft) keeps the output distribution exactly that of sampling the target alone:
//! accept x_k with probability min(1, p_t(x_k) / p_d(x_k)), else draw from
//! norm(max(0, p_t − p_d)). The uniforms are inputs, so a caller (and a golden) fixes them.

/// The lowest index of the largest value (`torch.argmax`'s tie rule).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// `softmax(logits / temperature)` in f32, max-subtracted.
pub fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&l| ((l - m) / t).exp()).collect();
    let z: f32 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= z);
    p
}

/// Inverse-CDF draw: the smallest `i` with `u < Σ_{j ≤ i} p_j` (the sum in f64 over the f32
/// probabilities); if rounding leaves `u` above the total, the last index with `p > 0`.
pub fn sample_with_uniform(p: &[f32], u: f32) -> usize {
    let u = u as f64;
    let mut acc = 0f64;
    for (i, &v) in p.iter().enumerate() {
        acc += v as f64;
        if u < acc {
            return i;
        }
    }
    p.iter().rposition(|&v| v > 0.0).unwrap_or(0)
}

/// The draft distribution a block was drawn from.
#[derive(Clone, Copy, Debug)]
pub enum DraftProbs<'a> {
    /// `[T, V]`: the walk's per-position probabilities (drafts sampled from them).
    Rows(&'a [f32]),
    /// Greedy drafts: p_d is one-hot on each draft token.
    OneHot,
}

/// What a verification decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Drafts accepted (0..=T).
    pub accepted: usize,
    /// The token emitted after them (correction or bonus).
    pub next: u32,
    /// Whether `next` is a bonus (every draft accepted) rather than a correction.
    pub bonus: bool,
    /// Per draft: min(1, p_t / p_d) (NaN where not computed).
    pub ratios: Vec<f32>,
    /// Per draft: 1 accepted, 0 rejected, −1 not evaluated.
    pub tests: Vec<i64>,
    /// The distribution `next` was drawn from (empty for greedy verification).
    pub final_probs: Vec<f32>,
}

/// Greedy verification: `target_logits` is `[T + 1, V]` (row j holds x_j's successor scores).
pub fn verify_greedy(drafts: &[u32], target_logits: &[f32], vocab: usize) -> Verdict {
    let mut tests = vec![-1i64; drafts.len()];
    let mut accepted = 0;
    for (k, &x) in drafts.iter().enumerate() {
        let hit = argmax(&target_logits[k * vocab..(k + 1) * vocab]) == x as usize;
        tests[k] = hit as i64;
        if !hit {
            break;
        }
        accepted += 1;
    }
    let next = argmax(&target_logits[accepted * vocab..(accepted + 1) * vocab]) as u32;
    Verdict {
        accepted,
        next,
        bonus: accepted == drafts.len(),
        ratios: vec![f32::NAN; drafts.len()],
        tests,
        final_probs: Vec::new(),
    }
}

/// Standard rejection sampling. `target_probs` is `[T + 1, V]` (the target's rows at the
/// sampling temperature, after the same top-k / top-p / penalties the draft rows had),
/// `u_accept` one uniform per draft and `u_final` the one for the emitted token. With
/// [`DraftProbs::Rows`] every ratio is computed (the tests stop at the first rejection); with
/// one-hot drafts ratios stop there too.
pub fn verify_rejection(
    drafts: &[u32],
    draft: DraftProbs<'_>,
    target_probs: &[f32],
    u_accept: &[f32],
    u_final: f32,
    vocab: usize,
) -> Verdict {
    let t = drafts.len();
    let p_d = |k: usize| -> Option<&[f32]> {
        match draft {
            DraftProbs::Rows(rows) => Some(&rows[k * vocab..(k + 1) * vocab]),
            DraftProbs::OneHot => None,
        }
    };
    let mut ratios = vec![f32::NAN; t];
    let mut tests = vec![-1i64; t];
    let mut rejected_at = None;
    for (k, &x) in drafts.iter().enumerate() {
        if rejected_at.is_some() && matches!(draft, DraftProbs::OneHot) {
            break;
        }
        let pt = target_probs[k * vocab + x as usize];
        let pd = p_d(k).map_or(1.0, |row| row[x as usize]);
        let ratio = if pd > 0.0 { (pt / pd).min(1.0) } else { 1.0 };
        ratios[k] = ratio;
        if rejected_at.is_none() {
            let ok = u_accept.get(k).is_some_and(|&u| u < ratio);
            tests[k] = ok as i64;
            if !ok {
                rejected_at = Some(k);
            }
        }
    }
    let (accepted, final_probs) = match rejected_at {
        Some(k) => {
            let pt = &target_probs[k * vocab..(k + 1) * vocab];
            let mut residual: Vec<f32> = match p_d(k) {
                Some(pd) => pt.iter().zip(pd).map(|(a, b)| (a - b).max(0.0)).collect(),
                None => {
                    let mut r = pt.to_vec();
                    r[drafts[k] as usize] = 0.0;
                    r
                }
            };
            let z: f32 = residual.iter().sum();
            if z > 0.0 {
                residual.iter_mut().for_each(|v| *v /= z);
            } else {
                // p_t ≤ p_d everywhere only when they are equal: then the target row itself.
                residual = pt.to_vec();
            }
            (k, residual)
        }
        None => (t, target_probs[t * vocab..(t + 1) * vocab].to_vec()),
    };
    let next = sample_with_uniform(&final_probs, u_final) as u32;
    Verdict { accepted, next, bonus: rejected_at.is_none(), ratios, tests, final_probs }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_cdf_takes_the_first_bin_past_u() {
        let p = [0.25f32, 0.0, 0.5, 0.25];
        assert_eq!(sample_with_uniform(&p, 0.0), 0);
        assert_eq!(sample_with_uniform(&p, 0.25), 2, "u on a boundary belongs to the next bin");
        assert_eq!(sample_with_uniform(&p, 0.74), 2);
        assert_eq!(sample_with_uniform(&p, 0.999_999), 3);
        assert_eq!(sample_with_uniform(&[0.5, 0.25, 0.0], 0.9), 1, "mass short of u: last nonzero bin");
    }

    #[test]
    fn greedy_accepts_the_agreeing_prefix_and_corrects() {
        // V = 3; argmax rows: 2, 0, 1, 1.
        let logits = [0., 1., 2., 5., 1., 0., 0., 3., 1., 0., 4., 1.];
        let v = verify_greedy(&[2, 0, 2], &logits, 3);
        assert_eq!((v.accepted, v.next, v.bonus, v.tests.clone()), (2, 1, false, vec![1, 1, 0]));
        let v = verify_greedy(&[2, 0, 1], &logits, 3);
        assert_eq!((v.accepted, v.next, v.bonus), (3, 1, true));
    }

    /// The output of one round (first emitted token) has exactly the target's distribution:
    /// summed over draft choices, P(accept x)·p_d(x) + P(reject)·residual = p_t.
    #[test]
    fn rejection_sampling_reproduces_the_target_row_exactly() {
        let pt = [0.1f32, 0.6, 0.3];
        let pd = [0.5f32, 0.2, 0.3];
        let mut got = [0f64; 3];
        for x in 0..3u32 {
            // Accept iff u < ratio: probability ratio; else the residual.
            let r = verify_rejection(&[x], DraftProbs::Rows(&pd), &[pt, pt].concat(), &[2.0], 0.5, 3);
            let ratio = r.ratios[0] as f64;
            got[x as usize] += pd[x as usize] as f64 * ratio;
            for (y, q) in r.final_probs.iter().enumerate() {
                got[y] += pd[x as usize] as f64 * (1.0 - ratio) * *q as f64;
            }
        }
        for (g, w) in got.iter().zip(pt) {
            assert!((g - w as f64).abs() < 1e-6, "{got:?} vs {pt:?}");
        }
    }
}
