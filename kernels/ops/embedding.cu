// Embedding gather from a BF16 table, widened to f32: grid-stride over tokens × columns.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_embedding_bf16, KplEmbeddingParams) {
    unsigned stride = kpl::block_dim() * kpl::grid_dim();
    unsigned n = p.tokens * p.cols;
    for (unsigned i = kpl::block_id() * kpl::block_dim() + kpl::thread_id(); i < n; i += stride) {
        unsigned t = i / p.cols, c = i % p.cols;
        p.out[i] = kpl::bf16_to_f32(p.table[(size_t)p.ids[t] * p.cols + c]);
    }
}
