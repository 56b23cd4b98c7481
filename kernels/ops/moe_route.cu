// The MoE router: one block per token; k + 1 block-wide argmax rounds over the selection scores
// (the last one only for the margin).
#include "kpl/kpl.h"

KPL_KERNEL(kpl_moe_route_f32, KplMoeRouteParams) {
    KPL_SHARED float sel[1024];
    KPL_SHARED float sv[32];
    KPL_SHARED unsigned si[32];
    KPL_SHARED float kth;
    unsigned t = kpl::block_id();
    if (t >= p.tokens || p.experts > 1024 || p.top_k == 0 || p.top_k > p.experts) return;
    size_t row = (size_t)t * p.experts;
    for (unsigned e = kpl::thread_id(); e < p.experts; e += kpl::block_dim()) {
        float s = kpl::sigmoid(p.logits[row + e]);
        p.scores[row + e] = s;
        sel[e] = s + p.bias[e];
    }
    kpl::sync();
    unsigned rounds = p.top_k < p.experts ? p.top_k + 1 : p.top_k;
    for (unsigned r = 0; r < rounds; ++r) {
        float v = -__builtin_inff();
        unsigned i = 0xffffffffu;
        for (unsigned e = kpl::thread_id(); e < p.experts; e += kpl::block_dim())
            if (kpl::better(sel[e], e, v, i)) {
                v = sel[e];
                i = e;
            }
        kpl::block_argmax(v, i, sv, si);
        if (kpl::thread_id() == 0) {
            if (r < p.top_k) {
                p.ids[(size_t)t * p.top_k + r] = i;
                sel[i] = -__builtin_inff();
                if (r + 1 == p.top_k) kth = v;
            } else {
                p.margins[t] = kth - v;
            }
        }
        kpl::sync();
    }
    if (kpl::thread_id() == 0) {
        if (rounds == p.top_k) p.margins[t] = __builtin_nanf("");
        // Weights in selection order, summed in that order (as the CPU reference does).
        float sum = 1e-20f;
        for (unsigned r = 0; r < p.top_k; ++r) sum += p.scores[row + p.ids[(size_t)t * p.top_k + r]];
        for (unsigned r = 0; r < p.top_k; ++r) {
            float s = p.scores[row + p.ids[(size_t)t * p.top_k + r]];
            p.weights[(size_t)t * p.top_k + r] = (p.renormalize ? s / sum : s) * p.scaling;
        }
    }
}
