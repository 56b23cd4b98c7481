//! KDA's short causal depthwise convolution + SiLU (spec §2.4), per sequence of the step,
//! continuing from each sequence's conv window.

use rayon::prelude::*;

use super::elementwise::silu_in_place;
use super::kept::KeptBuffers;
use crate::backend::SeqSpan;

/// Rows per rayon task: a decode token stays on the calling thread.
const ROWS_PER_TASK: usize = 8;

thread_local! {
    /// A sequence's window followed by its new rows, `[kernel − 1 + tokens, P]`.
    static WINDOW: KeptBuffers<Vec<f32>> = const { KeptBuffers::new() };
    /// The call's taps, tap-major.
    static BY_TAP: KeptBuffers<Vec<f32>> = const { KeptBuffers::new() };
}

/// `x`: `[tokens, P]` in place; `frames[s]`: sequence `s`'s last `kernel − 1` inputs `[kernel − 1, P]`,
/// oldest first (updated); `taps`: `[P, kernel]`, oldest first.
///
/// Sequences run side by side (a decode step's many one-token sequences), and within one its
/// rows (a prefill chunk). Each output is `Σ_i taps[c, i] · input[t + i, c]` summed from 0 in tap
/// order, whatever the batch.
pub fn kda_conv(x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
    let p = taps.len() / kernel.max(1);
    // The taps tap-major, `[kernel, P]`: a row's sums then run along contiguous channels.
    let mut by_tap = BY_TAP.with(KeptBuffers::take);
    by_tap.resize(taps.len(), 0.0);
    for (c, row) in taps.chunks_exact(kernel.max(1)).enumerate() {
        for (i, &t) in row.iter().enumerate() {
            by_tap[i * p + c] = t;
        }
    }
    // Each sequence's rows, split off `x` in batch order (spans are disjoint and ordered).
    let mut jobs: Vec<(&mut [f32], &mut [f32])> = Vec::with_capacity(spans.len());
    let mut rest = &mut x[..];
    let mut consumed = 0;
    for (span, fr) in spans.iter().zip(frames.iter_mut()) {
        assert!(span.start >= consumed, "kda_conv: spans overlap or are out of order");
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut((span.start - consumed) * p);
        let (rows, tail) = tail.split_at_mut(span.len * p);
        rest = tail;
        consumed = span.start + span.len;
        jobs.push((rows, &mut **fr));
    }
    jobs.into_par_iter().for_each(|(rows, fr)| conv_one(rows, &by_tap, fr, kernel, p));
    BY_TAP.with(|k| k.give(by_tap));
}

fn conv_one(rows: &mut [f32], by_tap: &[f32], frames: &mut [f32], w: usize, p: usize) {
    if rows.is_empty() {
        return;
    }
    let mut ext = WINDOW.with(KeptBuffers::take);
    ext.clear();
    ext.extend_from_slice(frames);
    ext.extend_from_slice(rows);
    // Each output row reads only `ext`, so rows run in parallel (a prefill chunk's many rows).
    rows.par_chunks_mut(p).with_min_len(ROWS_PER_TASK).enumerate().for_each(|(t, row)| {
        row.fill(0.0);
        for i in 0..w {
            let input = &ext[(t + i) * p..(t + i + 1) * p];
            for ((out, &tap), &v) in row.iter_mut().zip(&by_tap[i * p..(i + 1) * p]).zip(input) {
                *out += tap * v;
            }
        }
        silu_in_place(row);
    });
    let tokens = rows.len() / p;
    frames.copy_from_slice(&ext[tokens * p..]);
    WINDOW.with(|k| k.give(ext));
}
