//! KDA's short causal depthwise convolution + SiLU (spec §2.4), per sequence of the step,
//! continuing from each sequence's conv window.

use rayon::prelude::*;

use super::elementwise::silu_in_place;
use crate::backend::SeqSpan;

/// Rows per rayon task: a decode token stays on the calling thread.
const ROWS_PER_TASK: usize = 8;

/// `x`: `[tokens, P]` in place; `frames[s]`: sequence `s`'s last `kernel − 1` inputs `[kernel − 1, P]`,
/// oldest first (updated); `taps`: `[P, kernel]`, oldest first.
pub fn kda_conv(x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
    let p = taps.len() / kernel.max(1);
    for (span, fr) in spans.iter().zip(frames.iter_mut()) {
        conv_one(&mut x[span.start * p..(span.start + span.len) * p], taps, fr, kernel, p);
    }
}

fn conv_one(rows: &mut [f32], taps: &[f32], frames: &mut [f32], w: usize, p: usize) {
    let mut ext = Vec::with_capacity(frames.len() + rows.len());
    ext.extend_from_slice(frames);
    ext.extend_from_slice(rows);
    // Each output row reads only `ext`, so rows run in parallel (a prefill chunk's many rows).
    rows.par_chunks_mut(p).with_min_len(ROWS_PER_TASK).enumerate().for_each(|(t, row)| {
        for (c, out) in row.iter_mut().enumerate() {
            let mut acc = 0f32;
            for i in 0..w {
                acc += taps[c * w + i] * ext[(t + i) * p + c];
            }
            *out = acc;
        }
        silu_in_place(row);
    });
    let tokens = rows.len() / p;
    frames.copy_from_slice(&ext[tokens * p..]);
}
