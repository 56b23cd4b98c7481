//! Absorbed MLA attention (spec §2.5) over paged latent rows `[c | k_pe]`: every (token, head)
//! attends over its own sequence's rows — the indexer's selection, or every position up to its
//! own, skipping positions another context-parallel rank holds — and writes its latent context
//! (and, for a context-parallel partial, the scores' log-sum-exp). One rayon job per group of
//! heads.

use rayon::prelude::*;

use super::disjoint::DisjointOut;
use super::elementwise::exp_in_place;
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
    // Each job takes a group of heads: every head of the group scores a block of rows while the
    // block is in L1, so a token's rows are read once per group, not once per head (the latent
    // cache is shared by all heads, as in MQA). Per head, the same dot products and the same
    // in-order sums as one head alone, so the grouping does not change any bit.
    let per_job = heads.div_ceil(rayon::current_num_threads().max(1)).clamp(1, MAX_GROUP);
    let ctx_out = DisjointOut::new(ctx);
    let lse_out = lse.map(DisjointOut::new);
    (0..heads.div_ceil(per_job)).into_par_iter().for_each(|job| {
        let group = job * per_job..heads.min((job + 1) * per_job);
        let g = group.len();
        // Taken out of the thread's slot, not borrowed (see `moe_experts`).
        let (mut scores, mut cand, mut row_at) = SCRATCH.with(|b| std::mem::take(&mut *b.borrow_mut()));
        for (t, &(seq, pos)) in rows.iter().enumerate() {
            let cache = &caches[seq];
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
            let n = cand.len();
            let row = |i: usize| {
                let (page, at) = row_at[i];
                &cache.pages[page][at..at + cache.width]
            };
            // SAFETY: rows (t, group) of ctx (rank values each) belong to this job; ctx holds
            // tokens × heads × rank values (asserted).
            let cts = unsafe { std::slice::from_raw_parts_mut(ctx_out.at((t * heads + group.start) * rank), g * rank) };
            cts.fill(0.0);
            let mut lses = [f32::NEG_INFINITY; MAX_GROUP];
            if n > 0 {
                scores.clear();
                scores.resize(g * n, 0.0);
                // Scores block by block (a multiple of 4 rows, so the groups of four are those
                // of one head alone), every head of the group per block.
                for k0 in (0..n).step_by(ROW_BLOCK) {
                    let k1 = n.min(k0 + ROW_BLOCK);
                    for (j, hh) in group.clone().enumerate() {
                        let at = t * heads + hh;
                        let qt = &q[at * width..(at + 1) * width];
                        let sc = &mut scores[j * n..(j + 1) * n];
                        let mut k = k0;
                        while k + 4 <= k1 {
                            let d = dot4(qt, [row(k), row(k + 1), row(k + 2), row(k + 3)]);
                            for (o, v) in sc[k..k + 4].iter_mut().zip(d) {
                                *o = v * scale;
                            }
                            k += 4;
                        }
                        for (i, o) in sc.iter_mut().enumerate().take(k1).skip(k) {
                            *o = dot(qt, row(i)) * scale;
                        }
                    }
                }
                for (j, sc) in scores.chunks_exact_mut(n).enumerate() {
                    let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    sc.iter_mut().for_each(|s| *s -= m);
                    exp_in_place(sc);
                    let z = sc.iter().fold(0f32, |z, s| z + s);
                    lses[j] = m + z.ln();
                    // The softmax weights; ctx += weight · row over the candidates in order.
                    sc.iter_mut().for_each(|p| *p /= z);
                }
                for k0 in (0..n).step_by(ROW_BLOCK) {
                    let k1 = n.min(k0 + ROW_BLOCK);
                    for (j, ct) in cts.chunks_exact_mut(rank).enumerate() {
                        axpy_rows_by(&scores[j * n + k0..j * n + k1], |i| &row(k0 + i)[..rank], ct);
                    }
                }
            }
            if let Some(lse) = lse_out {
                for (j, hh) in group.clone().enumerate() {
                    // SAFETY: entry (t, hh) belongs to this job; lse holds tokens × heads (asserted).
                    unsafe { *lse.at(t * heads + hh) = lses[j] };
                }
            }
        }
        SCRATCH.with(|b| *b.borrow_mut() = (scores, cand, row_at));
    });
}

/// Most heads one job scores together.
const MAX_GROUP: usize = 16;
/// Rows every head of a group scores (and adds) while they stay in L1.
const ROW_BLOCK: usize = 32;

type RowScratch = (Vec<f32>, Vec<usize>, Vec<(usize, usize)>);

thread_local! {
    /// A head's scores, candidate positions and their rows' (page, offset), kept per thread.
    static SCRATCH: std::cell::RefCell<RowScratch> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heads grouped into one job or one job each (the group size follows the pool's threads)
    /// give the same bits, with and without an indexer selection, over several pages.
    #[test]
    fn head_groups_do_not_change_any_bit() {
        let (heads, rank, rope, page_tokens, positions) = (6usize, 40usize, 8usize, 16usize, 45usize);
        let width = rank + rope;
        let mut rnd = crate::cpu::uniform_stream(9);
        let pages: Vec<Vec<f32>> =
            (0..positions.div_ceil(page_tokens)).map(|_| (0..page_tokens * width).map(|_| rnd()).collect()).collect();
        let cache = PagedRows { pages: pages.iter().map(|p| &p[..]).collect(), page_tokens, width };
        let rows = [(0usize, positions - 1), (0, 20)];
        let q: Vec<f32> = (0..rows.len() * heads * width).map(|_| rnd()).collect();
        let picked: Vec<usize> = (0..positions).filter(|p| p % 3 != 1).collect();
        let sel: Vec<Selection> = rows
            .iter()
            .map(|&(_, pos)| Selection {
                tokens: picked.iter().copied().filter(|&p| p <= pos).collect(),
                scores: vec![0.0; positions],
                margin: f32::NAN,
            })
            .collect();
        for selected in [None, Some(&sel[..])] {
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
                let mut ctx = vec![f32::NAN; rows.len() * heads * rank];
                let mut lse = vec![f32::NAN; rows.len() * heads];
                let caches = [cache.clone()];
                pool.install(|| {
                    mla_attention(&q, heads, rank, 0.3, &rows, &caches, selected, &mut ctx, Some(&mut lse))
                });
                (ctx, lse)
            };
            let (a, la) = run(1);
            let (b, lb) = run(heads);
            assert!(a.iter().chain(&la).all(|v| v.is_finite()));
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "ctx differs");
            assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()), "lse differs");
        }
    }
}
