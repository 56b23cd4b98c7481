"""The online softmax both attention kernels fold their key blocks into (FlashAttention's)."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(m, z, acc, s, values):
    """Folds one block of keys into a running softmax: `s` is the block's scaled scores
    `[rows, keys]` (−∞ for dead keys; every block holds a live one, so the new maximum is finite),
    `values` the block's rows `[keys, width]`; `m`, `z`, `acc` the running maximum, normaliser and
    unnormalised context. Returns the updated (m, z, acc)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    z = z * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p, values, acc * alpha[:, None], input_precision="ieee")
    return m_new, z, acc
