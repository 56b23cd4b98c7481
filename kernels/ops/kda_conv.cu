// KDA's short convolution: one thread a channel of one sequence, its window of the last
// kernel − 1 inputs in registers, down the sequence's rows in order (a decode step is one row).
#include "kpl/kpl.h"

KPL_KERNEL(kpl_kda_conv_f32, KplKdaConvParams) {
    unsigned chunks = (p.channels + kpl::block_dim() - 1) / kpl::block_dim();
    unsigned s = kpl::block_id() / chunks;
    unsigned c = (kpl::block_id() % chunks) * kpl::block_dim() + kpl::thread_id();
    if (s >= p.seqs || c >= p.channels || p.kernel == 0 || p.kernel > 8) return;
    unsigned w = p.kernel, n = p.channels;
    float win[8];
    float* frames = p.frames[s];
    for (unsigned j = 0; j + 1 < w; ++j) win[j] = frames[(size_t)j * n + c];
    const float* tap = p.taps + (size_t)c * w;
    for (unsigned r = 0; r < p.lens[s]; ++r) {
        float* x = p.x + ((size_t)p.starts[s] + r) * n + c;
        win[w - 1] = *x;
        float acc = 0.0f;
        for (unsigned i = 0; i < w; ++i) acc += tap[i] * win[i];
        *x = acc * kpl::sigmoid(acc);
        for (unsigned i = 0; i + 1 < w; ++i) win[i] = win[i + 1];
    }
    for (unsigned j = 0; j + 1 < w; ++j) frames[(size_t)j * n + c] = win[j];
}
