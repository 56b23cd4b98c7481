//! Exact merge of context-parallel attention partials: each rank attended over the positions it
//! holds and reported its normalised context and log-sum-exp; the softmax over all positions is
//! their log-sum-exp-weighted mean.

use rayon::prelude::*;

pub fn attention_merge(parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]) {
    let rows = out.len() / width.max(1);
    assert_eq!(parts.len(), lses.len(), "attention_merge: one lse per part");
    for (p, l) in parts.iter().zip(lses) {
        assert!(p.len() == rows * width && l.len() == rows, "attention_merge: part shapes");
    }
    out.par_chunks_mut(width.max(1)).enumerate().for_each(|(i, o)| {
        let m = lses.iter().map(|l| l[i]).fold(f32::NEG_INFINITY, f32::max);
        o.fill(0.0);
        if m == f32::NEG_INFINITY {
            return;
        }
        let mut z = 0f32;
        for (p, l) in parts.iter().zip(lses) {
            let w = (l[i] - m).exp();
            if w == 0.0 {
                continue;
            }
            z += w;
            for (o, x) in o.iter_mut().zip(&p[i * width..(i + 1) * width]) {
                *o += w * x;
            }
        }
        o.iter_mut().for_each(|x| *x /= z);
    });
}
