"""Absorbed MLA decode over the paged latent cache (spec §2.5), split over the context for
context parallelism and long sequences (split-KV), and the exact merge of the splits' partials.

The cache is one arena of pages, `[pages, PAGE_TOKENS, RANK + ROPE]` f32 rows `[c | k_pe]`; a
sequence's page table `table[seq, i]` names the page holding its positions `i·PAGE_TOKENS ..`, or
−1 where another context-parallel rank holds them (skipped). Scores and the softmax are f32;
the products use IEEE f32 (`input_precision="ieee"`), as the CPU backend's.
"""

import triton
import triton.language as tl

from .softmax import online_softmax_step


@triton.jit
def mla_decode(q_ptr, cache_ptr, table_ptr, seq_ptr, pos_ptr, ctx_ptr, lse_ptr,
               T, H, RANK, ROPE, PAGE_TOKENS, MAX_PAGES, SPLIT_TOKENS, scale,
               BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr):
    """Grid `(T, cdiv(H, BLOCK_H), splits)`. Token `t` (sequence `seq[t]`, position `pos[t]`),
    heads `BLOCK_H` at a time, attends with `q[t, h]` (`RANK + ROPE` values) over the positions
    `split·SPLIT_TOKENS .. min((split+1)·SPLIT_TOKENS, pos+1)` its page table holds, and writes the
    split's partial: the normalised latent context `ctx[split, t, h]` (`RANK` values) and the
    log-sum-exp of its scaled scores `lse[split, t, h]` (−∞ and zeros when it holds none).
    `BLOCK_S` divides `PAGE_TOKENS`, which divides `SPLIT_TOKENS`, so a block lies in one page."""
    t = tl.program_id(0)
    split = tl.program_id(2)
    W = RANK + ROPE
    seq = tl.load(seq_ptr + t)
    pos = tl.load(pos_ptr + t)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live_h = rh < H
    rr = tl.arange(0, R_PAD)
    rp = tl.arange(0, P_PAD)
    q_row = q_ptr + (t * H + rh)[:, None].to(tl.int64) * W
    qc = tl.load(q_row + rr[None, :], mask=live_h[:, None] & (rr[None, :] < RANK), other=0.0)
    qp = tl.load(q_row + RANK + rp[None, :], mask=live_h[:, None] & (rp[None, :] < ROPE), other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    z = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, R_PAD), tl.float32)
    lo = split * SPLIT_TOKENS
    hi = tl.minimum(lo + SPLIT_TOKENS, pos + 1)
    for s0 in range(lo, hi, BLOCK_S):
        page = tl.load(table_ptr + seq * MAX_PAGES + s0 // PAGE_TOKENS)
        if page >= 0:
            rs = s0 + tl.arange(0, BLOCK_S)
            live_s = rs < hi
            row = cache_ptr + (page.to(tl.int64) * PAGE_TOKENS + (rs % PAGE_TOKENS))[:, None] * W
            kc = tl.load(row + rr[None, :], mask=live_s[:, None] & (rr[None, :] < RANK), other=0.0)
            kp = tl.load(row + RANK + rp[None, :], mask=live_s[:, None] & (rp[None, :] < ROPE), other=0.0)
            s = tl.dot(qc, tl.trans(kc), input_precision="ieee")
            s = tl.dot(qp, tl.trans(kp), s, input_precision="ieee") * scale
            s = tl.where(live_s[None, :], s, float("-inf"))
            # The latent rows are the values too.
            m, z, acc = online_softmax_step(m, z, acc, s, kc)
    held = z > 0
    ctx = tl.where(held[:, None], acc / tl.where(held, z, 1.0)[:, None], 0.0)
    lse = tl.where(held, m + tl.log(tl.where(held, z, 1.0)), float("-inf"))
    out = ((split * T + t) * H + rh).to(tl.int64)
    tl.store(ctx_ptr + out[:, None] * RANK + rr[None, :], ctx, mask=live_h[:, None] & (rr[None, :] < RANK))
    tl.store(lse_ptr + out, lse, mask=live_h)


@triton.jit
def attention_merge(part_ptr, lse_ptr, out_ptr, lse_out_ptr, ROWS, WIDTH, SPLITS,
                    BLOCK_W: tl.constexpr):
    """Grid `(ROWS, cdiv(WIDTH, BLOCK_W))`: `out[r] = Σ_i e^{lse_i − m} part_i[r] / Σ_i e^{lse_i − m}`,
    `m = max_i lse_i[r]`, in split order (zeros when no split holds anything), and the merged
    log-sum-exp. `part` is `[SPLITS, ROWS, WIDTH]`, `lse` `[SPLITS, ROWS]`."""
    r = tl.program_id(0)
    rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    live = rw < WIDTH
    m = tl.load(lse_ptr + r)
    for i in range(1, SPLITS):
        m = tl.maximum(m, tl.load(lse_ptr + i * ROWS + r))
    acc = tl.zeros((BLOCK_W,), tl.float32)
    z = tl.zeros((BLOCK_W,), tl.float32)
    if m > float("-inf"):
        for i in range(0, SPLITS):
            w = tl.exp(tl.load(lse_ptr + i * ROWS + r) - m)
            part = tl.load(part_ptr + (i * ROWS + r).to(tl.int64) * WIDTH + rw, mask=live, other=0.0)
            acc += w * part
            z += w
        acc = acc / z
    tl.store(out_ptr + r.to(tl.int64) * WIDTH + rw, acc, mask=live)
    zs = tl.max(z, axis=0)
    if tl.program_id(1) == 0:
        tl.store(lse_out_ptr + r, tl.where(zs > 0, m + tl.log(tl.where(zs > 0, zs, 1.0)), float("-inf")))
