// AttnRes block mixing: one block per token; two block reductions per candidate (its dot with
// the query and its sum of squares), a softmax over at most 32 candidates, then the weighted sum.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_attn_res_mix_f32, KplAttnResParams) {
    KPL_SHARED float scratch[32];
    KPL_SHARED float weight[32];
    unsigned t = kpl::block_id();
    if (t >= p.tokens || p.n_cands == 0 || p.n_cands > 32) return;
    size_t at = (size_t)t * p.dim;
    for (unsigned i = 0; i < p.n_cands; ++i) {
        const float* c = p.cands[i] + at;
        float dq = 0.0f, ss = 0.0f;
        for (unsigned j = kpl::thread_id(); j < p.dim; j += kpl::block_dim()) {
            dq += c[j] * p.query[j];
            ss += c[j] * c[j];
        }
        float d = kpl::block_sum(dq, scratch);
        float s = kpl::block_sum(ss, scratch);
        if (kpl::thread_id() == 0) weight[i] = d * kpl::rsqrt(s / (float)p.dim + p.eps);
    }
    kpl::sync();
    // Every thread computes the (few) softmax weights itself: no further barrier needed.
    float m = weight[0];
    for (unsigned i = 1; i < p.n_cands; ++i) m = weight[i] > m ? weight[i] : m;
    float z = 0.0f;
    for (unsigned i = 0; i < p.n_cands; ++i) z += kpl::exp(weight[i] - m);
    for (unsigned j = kpl::thread_id(); j < p.dim; j += kpl::block_dim()) {
        float acc = 0.0f;
        for (unsigned i = 0; i < p.n_cands; ++i) acc += kpl::exp(weight[i] - m) / z * p.cands[i][at + j];
        p.out[at + j] = acc;
    }
}
