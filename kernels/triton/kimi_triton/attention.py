"""Dense non-causal attention inside each span of a packed batch (block-diagonal; the vision
tower's: every patch of an item sees every patch of the same item and nothing else), in
FlashAttention's form: a program per (block of query rows, head, span), an online softmax over
blocks of keys, f32 throughout (`input_precision="ieee"`).
"""

import triton
import triton.language as tl

from .softmax import online_softmax_step


@triton.jit
def attention_varlen(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lens_ptr, H, D, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """Grid `(cdiv(longest span, BLOCK_M), H, spans)`. `q`, `k`, `v`, `out` are `[rows, H, D]`;
    span `s` is rows `starts[s] .. starts[s] + lens[s]`. Writes the rows of the spans; the caller
    zero-fills `out` first for rows in no span (as the CPU op does)."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(starts_ptr + s)
    n = tl.load(lens_ptr + s)
    if m0 < n:
        W = H * D
        rm = m0 + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D_PAD)
        live_d = rd[None, :] < D
        head = h * D + rd[None, :]
        q = tl.load(q_ptr + (start + rm)[:, None].to(tl.int64) * W + head, mask=(rm < n)[:, None] & live_d, other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        for j0 in range(0, n, BLOCK_N):
            rn = j0 + tl.arange(0, BLOCK_N)
            live_n = rn < n
            rows = (start + rn)[:, None].to(tl.int64) * W + head
            kk = tl.load(k_ptr + rows, mask=live_n[:, None] & live_d, other=0.0)
            vv = tl.load(v_ptr + rows, mask=live_n[:, None] & live_d, other=0.0)
            sc = tl.dot(q, tl.trans(kk), input_precision="ieee") * scale
            sc = tl.where(live_n[None, :], sc, float("-inf"))
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, sc, vv)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (start + rm)[:, None].to(tl.int64) * W + head, out, mask=(rm < n)[:, None] & live_d)
