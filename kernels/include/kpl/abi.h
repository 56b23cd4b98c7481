// One plain-C parameter struct per kernel entry point: the source of truth for the Rust mirrors
// in `kernels/src/gpu/abi.rs` (a test compares sizes). Pointers are device addresses; counts are
// u32. Keep fields 8-byte pointers first, then 4-byte values, so no target pads differently.
#pragma once

// kpl_rmsnorm_f32: out[r, c] = w[c] · x[r, c] / rms(x[r, :]); one block per row.
typedef struct {
    const float* x;
    const float* w;
    float* out;
    uint32_t rows;
    uint32_t cols;
    float eps;
    uint32_t pad_;
} KplRmsnormParams;

// kpl_gated_rmsnorm_f32: per head of `dim` values, out = w · o / rms(o) · σ(gate) (KDA's output
// norm); one block per (row, head).
typedef struct {
    const float* o;
    const float* gate;
    const float* w;
    float* out;
    uint32_t groups;
    uint32_t dim;
    float eps;
    uint32_t pad_;
} KplGatedRmsnormParams;

// kpl_situ_glu_f32: gate[i] ← β·tanh(g/β)·σ(g) · (β_lin·tanh(u/β_lin) | u), grid-stride.
typedef struct {
    float* gate;
    const float* up;
    uint32_t n;
    float beta;
    float linear_beta;
    // 1: cap the up branch with linear_beta; 0: use it as is.
    uint32_t has_linear_beta;
} KplSituParams;

// kpl_silu_glu_f32: gate[i] ← SiLU(gate[i]) · up[i] (SwiGLU), grid-stride.
typedef struct {
    float* gate;
    const float* up;
    uint32_t n;
    uint32_t pad_;
} KplGluParams;

// kpl_gelu_f32: x[i] ← GELU(x[i]), the tanh approximation (erf = 0) or the exact erf form
// (erf = 1), grid-stride.
typedef struct {
    float* x;
    uint32_t n;
    uint32_t erf;
} KplGeluParams;

// kpl_rope_table_f32: rotary embedding from per-row tables: x is [rows, heads, head_stride]; in
// each head, lanes offset + 2i and offset + 2i + 1 turn by the angle whose cosine and sine are
// cos[t, i], sin[t, i] ([rows, pairs]); grid-stride over rows · heads · pairs.
typedef struct {
    float* x;
    const float* cos;
    const float* sin;
    uint32_t rows;
    uint32_t heads;
    uint32_t head_stride;
    uint32_t offset;
    uint32_t pairs;
    uint32_t pad_;
} KplRopeTableParams;

// kpl_embedding_bf16: out[t, :] = table[ids[t], :] widened to f32, grid-stride over t · cols.
typedef struct {
    const uint16_t* table;
    const uint32_t* ids;
    float* out;
    uint32_t tokens;
    uint32_t cols;
} KplEmbeddingParams;

// kpl_kda_decode_f32: one KDA recurrent step for `seqs` sequences of one token each (decode),
// one block per (sequence, head). Row s of q/k/v/z is sequence s's token (`[seqs, heads·dim]`),
// beta_logits `[seqs, heads]`; slots[s] is sequence s's recurrent state `[heads, dim, dim]`
// (key-major), read and updated in place through the slot table; out `[seqs, heads·dim]`.
// q and k are L2-normalised here (q then scaled by q_scale), gates g = lower_bound ·
// σ(a_exp[h] · (z + dt_bias)), decay e^g, β = σ(beta_logit). head_dim ≤ 256.
typedef struct {
    const float* q;
    const float* k;
    const float* v;
    const float* z;
    const float* beta_logits;
    const float* a_exp;
    const float* dt_bias;
    float* const* slots;
    float* out;
    uint32_t seqs;
    uint32_t heads;
    uint32_t dim;
    float lower_bound;
    float q_scale;
    uint32_t pad_;
} KplKdaDecodeParams;

// kpl_attn_res_mix_f32: AttnRes (spec §2.3) per token t: a softmax over the candidates of
// query · c_i[t] / rms(c_i[t]), then Σ_i softmax_i · c_i[t]. `cands` is a table of n_cands
// (≤ 32) device addresses of `[tokens, dim]` blocks; one block per token.
typedef struct {
    const float* query;
    const float* const* cands;
    float* out;
    uint32_t tokens;
    uint32_t dim;
    uint32_t n_cands;
    float eps;
} KplAttnResParams;

// kpl_moe_route_f32: the sigmoid router (spec §2.7) for one token a block: scores = σ(logits)
// (`[tokens, experts]`, written out), selection by σ + bias (ties to the lower expert), the top_k
// ids and their weights (σ, renormalised when asked, times scaling), and the margin between the
// k-th and (k+1)-th selection scores (NaN when every expert is chosen). experts ≤ 1024.
typedef struct {
    const float* logits;
    const float* bias;
    float* scores;
    uint32_t* ids;
    float* weights;
    float* margins;
    uint32_t tokens;
    uint32_t experts;
    uint32_t top_k;
    uint32_t renormalize;
    float scaling;
    uint32_t pad_;
} KplMoeRouteParams;

// kpl_kda_conv_f32: KDA's causal depthwise convolution + SiLU (spec §2.4) over each sequence's
// rows of x (`[tokens, channels]`, in place), continuing from and updating that sequence's frames
// (`frames[s]`: its last kernel − 1 inputs, `[kernel − 1, channels]`, oldest first); taps
// `[channels, kernel]`, oldest first; kernel ≤ 8. Sequence s owns rows starts[s] .. + lens[s].
// Grid: seqs × ceil(channels / block); a thread slides one channel's window down its rows.
typedef struct {
    float* x;
    const float* taps;
    const uint32_t* starts;
    const uint32_t* lens;
    float* const* frames;
    uint32_t seqs;
    uint32_t channels;
    uint32_t kernel;
    uint32_t pad_;
} KplKdaConvParams;

// kpl_mma_gemm_bf16: c[m, n] = Σ_k a[m, k] · b[n, k] (BF16 in, f32 out) on the matrix cores: a wave
// per output tile of kpl::mma_shape(), K in steps of the instruction's; values outside m × n × k
// count as 0. Blocks are whole waves; grid · waves a block ≥ the number of tiles.
typedef struct {
    const uint16_t* a;
    const uint16_t* b;
    float* c;
    uint32_t m;
    uint32_t n;
    uint32_t k;
    uint32_t pad_;
} KplMmaGemmParams;

// kpl_topk_select_f32: per row of `n` scores, the `k` largest by (score descending, position
// ascending) — NaN scores (positions another context-parallel rank holds, or past the query) never
// — written as positions in ascending order to out[row, 0..count[row]], count = min(k, non-NaN
// scores). One block per row (at most 1024 threads).
typedef struct {
    const float* scores;
    uint32_t* out;
    uint32_t* count;
    uint32_t rows;
    uint32_t n;
    uint32_t k;
    uint32_t pad_;
} KplTopkParams;

// kpl_logits_stats_f32: per row of `cols` logits, what a sampler call needs from the full row (the
// host's `logit-stats`): the largest logit, its index (the lowest on ties; 0 when the row has no
// number) and log Σ exp(logit · inv_temperature), NaN logits left out. One block per row.
typedef struct {
    const float* logits;
    float* max;
    uint32_t* argmax;
    float* lse;
    uint32_t rows;
    uint32_t cols;
    float inv_temperature;
    uint32_t pad_;
} KplLogitsStatsParams;

// kpl_fp8_quantize_f32: per token row of `cols` activations, ATOM's ptpc_fp8 activation scale
// s = max|x| / 448 (1 when the row is all zero or its max is not finite) and the E4M3 codes of x / s
// (nearest, ties to even, saturating at ±448; NaN → 0x7F). One block per row.
typedef struct {
    const float* x;
    uint8_t* codes;
    float* scales;
    uint32_t rows;
    uint32_t cols;
} KplFp8QuantizeParams;
