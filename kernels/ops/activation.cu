// Activations, in place, grid-stride, one value a thread: SiTU GLU (spec §2.6), SwiGLU (the
// DSpark draft's MLP) and GELU in both forms (the vision tower's MLP and projector).
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

KPL_KERNEL(kpl_silu_glu_f32, KplGluParams) {
    unsigned stride = kpl::block_dim() * kpl::grid_dim();
    for (unsigned i = kpl::block_id() * kpl::block_dim() + kpl::thread_id(); i < p.n; i += stride) {
        float g = p.gate[i];
        p.gate[i] = g * kpl::sigmoid(g) * p.up[i];
    }
}

KPL_KERNEL(kpl_gelu_f32, KplGeluParams) {
    unsigned stride = kpl::block_dim() * kpl::grid_dim();
    for (unsigned i = kpl::block_id() * kpl::block_dim() + kpl::thread_id(); i < p.n; i += stride) {
        float x = p.x[i];
        float inner = p.erf ? 0.70710678118654752f * x
                            : 0.7978845608028654f * (x + 0.044715f * x * x * x);
        p.x[i] = 0.5f * x * (1.0f + (p.erf ? kpl::erf(inner) : kpl::tanh(inner)));
    }
}
