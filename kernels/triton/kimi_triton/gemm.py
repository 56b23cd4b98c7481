"""Matrix products `y[m, n] = Σ_k x[m, k] · W[n, k]` (a token per row of `x`, a weight matrix in
PyTorch's `[out, in]` layout, as the CPU backend's `matmul`): BF16, MXFP4 and FP8 weights, and the
grouped MoE product over MXFP4 experts. Activations arrive as f32 and enter the matrix cores as
BF16 (rounded to nearest even), accumulation is f32.

Grid: `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))` (the MoE product adds the expert as a leading axis).
Every tile shape is a constexpr, chosen per target by the launcher; only `tl.*` operations are
used, so Triton's interpreter runs the same source on the CPU.
"""

import triton
import triton.language as tl


@triton.jit
def _bf16(x):
    """f32 → BF16, rounded to nearest even in integer arithmetic: hardware's `fptrunc` rounds so,
    Triton's interpreter truncates; rounding first makes the cast exact on both."""
    b = x.to(tl.uint32, bitcast=True)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """`acc + a · b` for BF16 tiles. Triton 3.9's interpreter multiplies BF16 tiles as their raw
    16-bit patterns; the launcher sets `INTERPRETED` there, and the tiles are widened to f32 first
    (exact, as are the BF16 products the matrix cores form; both accumulate in f32)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _split(x):
    """f32 activations as two BF16 tiles, `hi + lo = x` to 16 significant bits (relative error
    ≤ 2⁻¹⁷): the matrix cores multiply BF16, and the sum of both products keeps activations' f32
    precision where it matters — a router's top-k decided by margins smaller than BF16's 2⁻⁹ flips
    on BF16 activations (the goldens' random models miss their tolerance by 400× on them). Weight
    bandwidth is unchanged; the matrix cores do twice the work, idle in memory-bound decode."""
    hi = _bf16(x)
    lo = _bf16(x - hi.to(tl.float32))
    return hi, lo


@triton.jit
def _load_x(x_ptr, rm, rk, M, K, stride_xm):
    """A `[BLOCK_M, BLOCK_K]` tile of f32 activations as BF16 `hi + lo` (zero outside `M × K`)."""
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
    return _split(x)


@triton.jit
def matmul_bf16(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """`W`: BF16 `[N, K]`, row-major."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        hi, lo = _load_x(x_ptr, rm, rk, M, K, stride_xm)
        # Wᵀ's tile `[BLOCK_K, BLOCK_N]` straight from W's rows.
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = _dot(hi, w, acc, INTERPRETED)
        acc = _dot(lo, w, acc, INTERPRETED)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _mxfp4_tile(acc, hi, lo, wq_ptr, ws_ptr, rn, k0, N, K, BLOCK_K: tl.constexpr):
    """`acc += (hi + lo) · Wᵀ` over columns `k0..k0+BLOCK_K` of an MXFP4 `W`: `wq` `[N, K/2]` bytes
    (E2M1, the even column in the low nibble), `ws` `[N, K/32]` E8M0 scales, read once for both
    halves of the activations. The scaled matrix-core product reads both as stored."""
    rk2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    wq = tl.load(wq_ptr + rn[None, :] * (K // 2) + rk2[:, None],
                 mask=(rn[None, :] < N) & (rk2[:, None] < K // 2), other=0)
    rs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    ws = tl.load(ws_ptr + rn[:, None] * (K // 32) + rs[None, :],
                 mask=(rn[:, None] < N) & (rs[None, :] < K // 32), other=127)
    acc = tl.dot_scaled(hi, None, "bf16", wq, ws, "e2m1", acc)
    return tl.dot_scaled(lo, None, "bf16", wq, ws, "e2m1", acc)


@triton.jit
def matmul_mxfp4(x_ptr, wq_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`W`: MXFP4 `[N, K]` (`K` a multiple of 32)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        hi, lo = _load_x(x_ptr, rm, rk, M, K, stride_xm)
        acc = _mxfp4_tile(acc, hi, lo, wq_ptr, ws_ptr, rn, k0, N, K, BLOCK_K)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _e4m3(code):
    """E4M3 codes (OCP `e4m3fn`) to their values, exactly: normal codes by building the f32's
    bits, subnormal ones as `m · 2⁻⁹` (no approximate `exp2`, nothing that flushes subnormals)."""
    c = code.to(tl.int32)
    s = (c >> 7) & 1
    e = (c >> 3) & 15
    m = c & 7
    normal = ((s << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(s == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def matmul_fp8(xq_ptr, xs_ptr, wq_ptr, ws_ptr, y_ptr, M, N, K, stride_ym,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Per-token, per-channel FP8 (ATOM's `ptpc_fp8`): `xq` `[M, K]` E4M3 codes with a scale per
    token `xs[M]`, `wq` `[N, K]` E4M3 codes with a scale per row `ws[N]`; `y = (xq · wqᵀ) · xs ·
    ws`. E4M3 values are exact in BF16, so the matrix cores see the codes' values unrounded."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xq = tl.load(xq_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        wq = tl.load(wq_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
        acc = _dot(_e4m3(xq).to(tl.bfloat16), _e4m3(wq).to(tl.bfloat16), acc, INTERPRETED)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def moe_mxfp4(x_ptr, rows_ptr, offsets_ptr, wq_ptr, ws_ptr, y_ptr, N, K, stride_xm, stride_ym,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The grouped product of routed experts: expert `e` (program axis 0) multiplies the token
    rows `x[rows[p]]` for `p` in `offsets[e]..offsets[e+1]` (the batch's (token, choice) pairs,
    sorted by expert) by its MXFP4 matrix (`wq` `[E, N, K/2]`, `ws` `[E, N, K/32]`), writing
    `y[p]`. Each expert's weights are read once for all its tokens; an empty group does nothing.
    Axis 1 runs over the largest group's row tiles, axis 2 over `N`."""
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    count = tl.load(offsets_ptr + e + 1) - start
    if tl.program_id(1) * BLOCK_M < count:
        rp = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rp < count
        tok = tl.load(rows_ptr + start + rp, mask=live, other=0)
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        wq_e = wq_ptr + e.to(tl.int64) * N * (K // 2)
        ws_e = ws_ptr + e.to(tl.int64) * N * (K // 32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tok[:, None] * stride_xm + rk[None, :], mask=live[:, None] & (rk[None, :] < K),
                        other=0.0)
            hi, lo = _split(x)
            acc = _mxfp4_tile(acc, hi, lo, wq_e, ws_e, rn, k0, N, K, BLOCK_K)
        out = y_ptr + (start + rp)[:, None] * stride_ym + rn[None, :]
        tl.store(out, acc, mask=live[:, None] & (rn[None, :] < N))
