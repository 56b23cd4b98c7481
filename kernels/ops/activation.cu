// SiTU GLU (spec §2.6), in place over the gate: grid-stride, one value a thread.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_situ_glu_f32, KplSituParams) {
    unsigned stride = kpl::block_dim() * kpl::grid_dim();
    for (unsigned i = kpl::block_id() * kpl::block_dim() + kpl::thread_id(); i < p.n; i += stride) {
        float a = p.gate[i], u = p.up[i];
        float g = p.beta * kpl::tanh(a / p.beta) * kpl::sigmoid(a);
        float up = p.has_linear_beta ? p.linear_beta * kpl::tanh(u / p.linear_beta) : u;
        p.gate[i] = g * up;
    }
}
