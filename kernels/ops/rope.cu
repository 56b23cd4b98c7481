// Rotary embedding from per-row cos / sin tables, in place: the vision tower's 2-D RoPE (whole
// heads) and, with host-built tables, the DSpark draft's interleaved RoPE on the rope lanes.
// Grid-stride, one lane pair a thread.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_rope_table_f32, KplRopeTableParams) {
    unsigned stride = kpl::block_dim() * kpl::grid_dim();
    unsigned total = p.rows * p.heads * p.pairs;
    for (unsigned i = kpl::block_id() * kpl::block_dim() + kpl::thread_id(); i < total; i += stride) {
        unsigned pair = i % p.pairs, head = (i / p.pairs) % p.heads, t = i / (p.pairs * p.heads);
        float* lanes = p.x + (t * p.heads + head) * p.head_stride + p.offset + 2 * pair;
        float c = p.cos[t * p.pairs + pair], s = p.sin[t * p.pairs + pair];
        float a = lanes[0], b = lanes[1];
        lanes[0] = a * c - b * s;
        lanes[1] = b * c + a * s;
    }
}
