// The indexer's top-k select (K3.1, spec §5; top-2048 in the release): one block per query row.
// A radix select finds the k-th largest score 8 bits at a time (a shared histogram per pass), then
// an ordered block-wide compaction writes the positions above it and, of those equal to it, the
// lowest ones — the CPU backend's order (score descending, position ascending), output ascending.
#include "kpl/kpl.h"

// A score as an unsigned key in the same order (−0 below +0, as f32::total_cmp); NaN → 0, below
// every score (−∞ is 0x007FFFFF), and never selected.
KPL_DEVICE unsigned order_key(float s) {
    if (s != s) return 0u;
    unsigned b = __builtin_bit_cast(unsigned, s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

KPL_KERNEL(kpl_topk_select_f32, KplTopkParams) {
    KPL_SHARED unsigned hist[256];
    KPL_SHARED unsigned scan[1024];
    KPL_SHARED unsigned chosen[2];
    KPL_SHARED float red[32];
    const unsigned row = kpl::block_id(), t = kpl::thread_id(), bd = kpl::block_dim();
    if (row >= p.rows || bd > 1024) return;
    const float* s = p.scores + (size_t)row * p.n;
    float held = 0.0f;
    for (unsigned i = t; i < p.n; i += bd) held += (s[i] == s[i]) ? 1.0f : 0.0f;
    // Exact: counts stay far below 2^24.
    const unsigned count = (unsigned)kpl::block_sum(held, red);
    const unsigned k = p.k < count ? p.k : count;
    if (t == 0) p.count[row] = k;
    if (k == 0) return;
    // Radix select of the k-th largest key: `want` of the keys matching `prefix` so far are in.
    unsigned prefix = 0u, want = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (unsigned b = t; b < 256; b += bd) hist[b] = 0u;
        kpl::sync();
        const unsigned high = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (unsigned i = t; i < p.n; i += bd) {
            const unsigned key = order_key(s[i]);
            if (key != 0u && (key & high) == (prefix & high)) kpl::atomic_add(&hist[(key >> shift) & 255u], 1u);
        }
        kpl::sync();
        if (t == 0) {
            unsigned cum = 0u, b = 255u;
            while (b > 0u && cum + hist[b] < want) cum += hist[b--];
            chosen[0] = prefix | (b << shift);
            chosen[1] = want - cum;
        }
        kpl::sync();
        prefix = chosen[0];
        want = chosen[1];
        kpl::sync();
    }
    // `prefix` is the k-th largest key; the `want` lowest positions holding it are taken.
    unsigned out_base = 0u, eq_base = 0u;
    for (unsigned i0 = 0; i0 < p.n; i0 += bd) {
        const unsigned i = i0 + t;
        const unsigned key = i < p.n ? order_key(s[i]) : 0u;
        unsigned eq_total = 0u, take_total = 0u;
        const unsigned eq = (key != 0u && key == prefix) ? 1u : 0u;
        const unsigned eq_rank = eq_base + kpl::block_exclusive_scan(eq, scan, eq_total);
        const unsigned take = ((key != 0u && key > prefix) || (eq && eq_rank < want)) ? 1u : 0u;
        const unsigned at = out_base + kpl::block_exclusive_scan(take, scan, take_total);
        if (take) p.out[(size_t)row * p.k + at] = i;
        eq_base += eq_total;
        out_base += take_total;
    }
}
