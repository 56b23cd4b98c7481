// RMSNorm family: one block per row (or per head), a block reduction of the squares.
#include "kpl/kpl.h"

// out[r, c] = w[c] · x[r, c] / sqrt(mean(x[r, :]²) + eps).
KPL_KERNEL(kpl_rmsnorm_f32, KplRmsnormParams) {
    KPL_SHARED float scratch[32];
    unsigned r = kpl::block_id();
    if (r >= p.rows) return;  // uniform per block: no barrier is skipped by part of it
    const float* x = p.x + (size_t)r * p.cols;
    float* out = p.out + (size_t)r * p.cols;
    float ss = 0.0f;
    for (unsigned c = kpl::thread_id(); c < p.cols; c += kpl::block_dim()) ss += x[c] * x[c];
    float total = kpl::block_sum(ss, scratch);
    float inv = kpl::rsqrt(total / (float)p.cols + p.eps);
    for (unsigned c = kpl::thread_id(); c < p.cols; c += kpl::block_dim()) out[c] = p.w[c] * (x[c] * inv);
}

// KDA's output norm: per group (row × head) of `dim` values, out = w · o / rms(o) · σ(gate).
KPL_KERNEL(kpl_gated_rmsnorm_f32, KplGatedRmsnormParams) {
    KPL_SHARED float scratch[32];
    unsigned g = kpl::block_id();
    if (g >= p.groups) return;
    size_t at = (size_t)g * p.dim;
    float ss = 0.0f;
    for (unsigned c = kpl::thread_id(); c < p.dim; c += kpl::block_dim()) ss += p.o[at + c] * p.o[at + c];
    float total = kpl::block_sum(ss, scratch);
    float inv = kpl::rsqrt(total / (float)p.dim + p.eps);
    for (unsigned c = kpl::thread_id(); c < p.dim; c += kpl::block_dim())
        p.out[at + c] = p.w[c] * (p.o[at + c] * inv) * kpl::sigmoid(p.gate[at + c]);
}
