"""The K3.1 lightning indexer's scores (spec §5) over the paged key cache: for query token `t`,
`I(t, s) = Σ_j w[t, j] · scale · relu(q[t, j] · key[s])` for every position `s ≤ pos[t]` its
sequence's page table holds. The top-k selection over these scores is a separate op.
"""

import triton
import triton.language as tl


@triton.jit
def indexer_scores(q_ptr, w_ptr, key_ptr, table_ptr, seq_ptr, pos_ptr, out_ptr,
                   HI, D, PAGE_TOKENS, MAX_PAGES, S_MAX, scale,
                   BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr):
    """Grid `(T, cdiv(S_MAX, BLOCK_S))`. Keys are `[pages, PAGE_TOKENS, D]` f32; `table[seq, i]`
    is the page of positions `i·PAGE_TOKENS ..` or −1 (another context-parallel rank's). Writes
    `out[t, s]` for `s < S_MAX`: the score, NaN at a position another rank holds, −∞ after
    `pos[t]`. `BLOCK_S` divides `PAGE_TOKENS`, so a block lies in one page."""
    t = tl.program_id(0)
    s0 = tl.program_id(1) * BLOCK_S
    seq = tl.load(seq_ptr + t)
    pos = tl.load(pos_ptr + t)
    rs = s0 + tl.arange(0, BLOCK_S)
    live = rs < S_MAX
    out = out_ptr + t.to(tl.int64) * S_MAX + rs
    if s0 > pos:
        tl.store(out, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=live)
    else:
        page = tl.load(table_ptr + seq * MAX_PAGES + s0 // PAGE_TOKENS)
        if page < 0:
            score = tl.full((BLOCK_S,), float("nan"), tl.float32)
        else:
            rh = tl.arange(0, BLOCK_H)
            rd = tl.arange(0, D_PAD)
            q = tl.load(q_ptr + (t * HI + rh)[:, None].to(tl.int64) * D + rd[None, :],
                        mask=(rh[:, None] < HI) & (rd[None, :] < D), other=0.0)
            k = tl.load(key_ptr + (page.to(tl.int64) * PAGE_TOKENS + rs % PAGE_TOKENS)[:, None] * D + rd[None, :],
                        mask=(rs[:, None] <= pos) & (rd[None, :] < D), other=0.0)
            w = tl.load(w_ptr + t * HI + rh, mask=rh < HI, other=0.0) * scale
            qk = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
            score = tl.sum(qk * w[:, None], axis=0)
        tl.store(out, tl.where(rs <= pos, score, float("-inf")), mask=live)
