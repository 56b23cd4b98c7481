// KDA decode: the gated delta rule's recurrent step (spec §2.4) for one token per sequence, the
// state read and written in place through the slot table. One block per (sequence, head); thread
// c owns column c of the head's [dim, dim] state.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_kda_decode_f32, KplKdaDecodeParams) {
    KPL_SHARED float q[256];
    KPL_SHARED float k[256];
    KPL_SHARED float decay[256];
    KPL_SHARED float scratch[32];
    unsigned b = kpl::block_id();
    if (b >= p.seqs * p.heads || p.dim > 256) return;
    unsigned s = b / p.heads, h = b % p.heads, n = p.dim;
    size_t row = (size_t)s * p.heads * n + (size_t)h * n;
    // Stage q, k and the decay; sum their squares for the L2 norms.
    float qq = 0.0f, kk = 0.0f;
    for (unsigned j = kpl::thread_id(); j < n; j += kpl::block_dim()) {
        float qj = p.q[row + j], kj = p.k[row + j];
        q[j] = qj;
        k[j] = kj;
        qq += qj * qj;
        kk += kj * kj;
        float g = p.lower_bound * kpl::sigmoid(p.a_exp[h] * (p.z[row + j] + p.dt_bias[h * n + j]));
        decay[j] = kpl::exp(g);
    }
    float qn = kpl::block_sum(qq, scratch);
    float kn = kpl::block_sum(kk, scratch);
    float qr = p.q_scale / __builtin_sqrtf(qn + 1e-6f), kr = 1.0f / __builtin_sqrtf(kn + 1e-6f);
    for (unsigned j = kpl::thread_id(); j < n; j += kpl::block_dim()) {
        q[j] *= qr;
        k[j] *= kr;
    }
    kpl::sync();
    float kq_part = 0.0f;
    for (unsigned j = kpl::thread_id(); j < n; j += kpl::block_dim()) kq_part += k[j] * q[j];
    float kq = kpl::block_sum(kq_part, scratch);
    float beta = kpl::sigmoid(p.beta_logits[(size_t)s * p.heads + h]);
    float* S = p.slots[s] + (size_t)h * n * n;
    for (unsigned c = kpl::thread_id(); c < n; c += kpl::block_dim()) {
        // pred = S_decᵀ k and read = S_decᵀ q over the decayed column; then the delta update.
        float pred = 0.0f, read = 0.0f;
        for (unsigned j = 0; j < n; ++j) {
            float v = S[(size_t)j * n + c] * decay[j];
            S[(size_t)j * n + c] = v;
            pred += k[j] * v;
            read += q[j] * v;
        }
        float err = beta * (p.v[row + c] - pred);
        for (unsigned j = 0; j < n; ++j) S[(size_t)j * n + c] += k[j] * err;
        p.out[row + c] = read + kq * err;
    }
}
