"""KDA's chunked prefill (spec §2.4, fla's WY/UT form), for sequences of a varlen batch:
`S_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ q_t`, one chunk of
`C` tokens at a time:

    Γ = cumsum(g)                            (per key, inside the chunk)
    A_kk[i, j] = β_i Σ_c k_i k_j e^{Γ_i − Γ_j}   (j < i)      A_qk[i, j] = Σ_c q_i k_j e^{Γ_i − Γ_j}   (j ≤ i)
    Δ = (I + A_kk)⁻¹ diag(β) (V − (K ⊙ e^Γ) S₀)  (forward substitution, row by row)
    O = (Q ⊙ e^Γ) S₀ + A_qk Δ
    S = diag(e^{Γ_C}) S₀ + (K ⊙ e^{Γ_C − Γ})ᵀ Δ

Inputs are prepared as the CPU backend's `kda_prefill` takes them: q L2-normalised and scaled, k
L2-normalised, g the per-key log decay (≤ 0: KDA's gates are `lower_bound · σ(·)` with a negative
bound, so every decay factor above is ≤ 1 and nothing overflows), β per token. The decayed pair
products are formed per pair (a `[C, C, BLOCK_K]` tile), as the CPU's exact sub-chunk path.
"""

import triton
import triton.language as tl


@triton.jit
def _cumsum_rows(g, C: tl.constexpr):
    """Inclusive prefix sums down the rows of a `[C, n]` tile (a lower-triangular product)."""
    r = tl.arange(0, C)
    lower = (r[None, :] <= r[:, None]).to(tl.float32)
    return tl.dot(lower, g, input_precision="ieee")


@triton.jit
def kda_chunk_prefill(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cu_ptr, H, K, V,
                      C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid `(sequences, H, cdiv(V, BLOCK_V))`. Sequence `s` is tokens `cu[s] .. cu[s+1]` of the
    batch; `q`, `k`, `g` are `[tokens, H, K]`, `v` and `out` `[tokens, H, V]`, `beta` `[tokens, H]`,
    `state` `[sequences, H, K, V]` (read, advanced in place). A program owns `BLOCK_V` columns of
    one head's state: every column of V runs the same recurrence independently."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    rv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    live_v = rv < V
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    state = state_ptr + (s * H + h).to(tl.int64) * K * V
    rc = tl.arange(0, C)
    rk = tl.arange(0, BLOCK_K)
    for c0 in range(t0, t1, C):
        rows = c0 + rc
        live = rows < t1
        kv_row = (rows * H + h).to(tl.int64)
        beta = tl.load(beta_ptr + rows * H + h, mask=live, other=0.0)
        # Pass 1: A_kk, A_qk, and U = V − (K ⊙ e^Γ) S₀, O = (Q ⊙ e^Γ) S₀, over blocks of K.
        akk = tl.zeros((C, C), tl.float32)
        aqk = tl.zeros((C, C), tl.float32)
        u = tl.zeros((C, BLOCK_V), tl.float32)
        o = tl.zeros((C, BLOCK_V), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            m2 = live[:, None] & (cols[None, :] < K)
            qb = tl.load(q_ptr + kv_row[:, None] * K + cols[None, :], mask=m2, other=0.0)
            kb = tl.load(k_ptr + kv_row[:, None] * K + cols[None, :], mask=m2, other=0.0)
            gam = _cumsum_rows(tl.load(g_ptr + kv_row[:, None] * K + cols[None, :], mask=m2, other=0.0), C)
            # e^{Γ_i − Γ_j} for j ≤ i (0 above the diagonal, never exponentiated there).
            diff = gam[:, None, :] - gam[None, :, :]
            below = (rc[None, :] <= rc[:, None])[:, :, None]
            decay = tl.exp(tl.where(below, diff, float("-inf")))
            kj = kb[None, :, :] * decay
            akk += tl.sum(kb[:, None, :] * kj, axis=2)
            aqk += tl.sum(qb[:, None, :] * kj, axis=2)
            s0 = tl.load(state + cols[:, None] * V + rv[None, :], mask=(cols[:, None] < K) & live_v[None, :],
                         other=0.0)
            eg = tl.exp(gam)
            u += tl.dot(kb * eg, s0, input_precision="ieee")
            o += tl.dot(qb * eg, s0, input_precision="ieee")
        akk = tl.where(rc[None, :] < rc[:, None], akk * beta[:, None], 0.0)
        vb = tl.load(v_ptr + kv_row[:, None] * V + rv[None, :], mask=live[:, None] & live_v[None, :], other=0.0)
        # Δ by forward substitution: row i takes β_i U_i minus the finished rows before it.
        delta = beta[:, None] * (vb - u)
        for i in tl.static_range(1, C):
            a_i = tl.sum(tl.where(rc[:, None] == i, akk, 0.0), axis=0)
            corr = tl.sum(a_i[:, None] * delta, axis=0)
            delta = tl.where(rc[:, None] == i, delta - corr[None, :], delta)
        o += tl.dot(aqk, delta, input_precision="ieee")
        tl.store(out_ptr + kv_row[:, None] * V + rv[None, :], o, mask=live[:, None] & live_v[None, :])
        # Pass 2: S = diag(e^{Γ_C}) S₀ + (K ⊙ e^{Γ_C − Γ})ᵀ Δ, block by block of K. Rows past the
        # sequence have g = 0, so Γ's last row is the chunk's last token's.
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            m2 = live[:, None] & (cols[None, :] < K)
            kb = tl.load(k_ptr + kv_row[:, None] * K + cols[None, :], mask=m2, other=0.0)
            gam = _cumsum_rows(tl.load(g_ptr + kv_row[:, None] * K + cols[None, :], mask=m2, other=0.0), C)
            last = tl.sum(tl.where(rc[:, None] == C - 1, gam, 0.0), axis=0)
            ms = (cols[:, None] < K) & live_v[None, :]
            s0 = tl.load(state + cols[:, None] * V + rv[None, :], mask=ms, other=0.0)
            kd = kb * tl.exp(last[None, :] - gam)
            s1 = tl.exp(last)[:, None] * s0 + tl.dot(tl.trans(kd), delta, input_precision="ieee")
            tl.store(state + cols[:, None] * V + rv[None, :], s1, mask=ms)
