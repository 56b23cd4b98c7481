//! Absorbed MLA attention (spec §2.5) over paged latent rows `[c | k_pe]`: every (token, head)
//! attends over its own sequence's rows — the indexer's selection, or every position up to its
//! own, skipping positions another context-parallel rank holds — and writes its latent context
//! (and, for a context-parallel partial, the scores' log-sum-exp). One rayon job per head.

use rayon::prelude::*;

use super::disjoint::DisjointOut;
use super::simd::{axpy_rows_by, dot, dot4};
use crate::backend::{PagedRows, Selection};

#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    q: &[f32],
    heads: usize,
    rank: usize,
    scale: f32,
    rows: &[(usize, usize)],
    caches: &[PagedRows<'_>],
    selected: Option<&[Selection]>,
    ctx: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let tokens = rows.len();
    let width = q.len() / (tokens * heads).max(1);
    assert_eq!(ctx.len(), tokens * heads * rank, "mla_attention: ctx has {} values", ctx.len());
    if let Some(lse) = &lse {
        assert_eq!(lse.len(), tokens * heads, "mla_attention: lse has {} values", lse.len());
    }
    // Each head's job writes its own (token, head) rows of ctx and entries of lse.
    let ctx_out = DisjointOut::new(ctx);
    let lse_out = lse.map(DisjointOut::new);
    (0..heads).into_par_iter().for_each(|hh| {
        // Taken out of the thread's slot, not borrowed (see `moe_experts`).
        let (mut scores, mut cand, mut row_at) = SCRATCH.with(|b| std::mem::take(&mut *b.borrow_mut()));
        for (t, &(seq, pos)) in rows.iter().enumerate() {
            let at = t * heads + hh;
            // SAFETY: row `at` of ctx (rank values) belongs to this head's job; ctx holds
            // tokens × heads × rank values (asserted).
            let ct = unsafe { std::slice::from_raw_parts_mut(ctx_out.at(at * rank), rank) };
            ct.fill(0.0);
            let mut lse_t = f32::NEG_INFINITY;
            let cache = &caches[seq];
            let qt = &q[at * width..(at + 1) * width];
            // The candidates and each one's (page, offset) in the cache, for both passes below.
            let (pt, w) = (cache.page_tokens, cache.width);
            cand.clear();
            row_at.clear();
            match selected {
                Some(sel) => {
                    for &s in sel[t].tokens.iter().filter(|&&s| cache.holds(s)) {
                        cand.push(s);
                        row_at.push((s / pt, (s % pt) * w));
                    }
                }
                // Every position up to its own, page by page (holes skipped).
                None => {
                    for (page, rows) in cache.pages.iter().enumerate().take(pos / pt + 1) {
                        if rows.is_empty() {
                            continue;
                        }
                        let s0 = page * pt;
                        for s in s0..(s0 + pt).min(pos + 1) {
                            cand.push(s);
                            row_at.push((page, (s - s0) * w));
                        }
                    }
                }
            }
            if !cand.is_empty() {
                let row = |i: usize| {
                    let (page, at) = row_at[i];
                    &cache.pages[page][at..at + cache.width]
                };
                scores.clear();
                let mut k = 0;
                while k + 4 <= cand.len() {
                    let d = dot4(qt, [row(k), row(k + 1), row(k + 2), row(k + 3)]);
                    scores.extend(d.map(|v| v * scale));
                    k += 4;
                }
                scores.extend((k..cand.len()).map(|i| dot(qt, row(i)) * scale));
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0f32;
                scores.iter_mut().for_each(|s| {
                    *s = (*s - m).exp();
                    z += *s;
                });
                lse_t = m + z.ln();
                // The softmax weights, then ct += weight · row over the candidates in order.
                scores.iter_mut().for_each(|p| *p /= z);
                axpy_rows_by(&scores, |i| &row(i)[..rank], ct);
            }
            if let Some(lse) = lse_out {
                // SAFETY: entry `at` belongs to this head's job; lse holds tokens × heads (asserted).
                unsafe { *lse.at(at) = lse_t };
            }
        }
        SCRATCH.with(|b| *b.borrow_mut() = (scores, cand, row_at));
    });
}

type RowScratch = (Vec<f32>, Vec<usize>, Vec<(usize, usize)>);

thread_local! {
    /// A head's scores, candidate positions and their rows' (page, offset), kept per thread.
    static SCRATCH: std::cell::RefCell<RowScratch> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}
