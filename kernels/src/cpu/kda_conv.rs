//! KDA's short causal depthwise convolution + SiLU (spec §2.4), per sequence of the step,
//! continuing from each sequence's conv window.

use super::elementwise::silu;
use crate::backend::SeqSpan;

/// `x`: `[tokens, P]` in place; `frames[s]`: sequence `s`'s last `kernel − 1` inputs `[kernel − 1, P]`,
/// oldest first (updated); `taps`: `[P, kernel]`, oldest first.
pub fn kda_conv(x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
    let p = taps.len() / kernel.max(1);
    for (span, fr) in spans.iter().zip(frames.iter_mut()) {
        conv_one(&mut x[span.start * p..(span.start + span.len) * p], taps, fr, kernel, p);
    }
}

fn conv_one(rows: &mut [f32], taps: &[f32], frames: &mut [f32], w: usize, p: usize) {
    let tokens = rows.len() / p;
    let mut ext = Vec::with_capacity(frames.len() + rows.len());
    ext.extend_from_slice(frames);
    ext.extend_from_slice(rows);
    for t in 0..tokens {
        for c in 0..p {
            let mut acc = 0f32;
            for i in 0..w {
                acc += taps[c * w + i] * ext[(t + i) * p + c];
            }
            rows[t * p + c] = silu(acc);
        }
    }
    frames.copy_from_slice(&ext[tokens * p..]);
}
