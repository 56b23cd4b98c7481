// Logits helpers: the statistics of a full vocabulary row a sampler call starts from (max, argmax
// with ties to the lowest index, log-sum-exp at a temperature), one block per row, NaN left out —
// as the CPU's `reduce::argmax` / `log_sum_exp`.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_logits_stats_f32, KplLogitsStatsParams) {
    KPL_SHARED float sv[32];
    KPL_SHARED unsigned si[32];
    KPL_SHARED float red[32];
    const unsigned row = kpl::block_id(), t = kpl::thread_id(), bd = kpl::block_dim();
    if (row >= p.rows) return;
    const float* x = p.logits + (size_t)row * p.cols;
    float v = -__builtin_inff();
    unsigned i = 0xffffffffu;
    for (unsigned c = t; c < p.cols; c += bd)
        if (x[c] == x[c] && kpl::better(x[c], c, v, i)) {
            v = x[c];
            i = c;
        }
    kpl::block_argmax(v, i, sv, si);
    // v is the row's largest number (−∞ if none): the exponents below are all ≤ 0.
    float s = 0.0f;
    if (v > -__builtin_inff())
        for (unsigned c = t; c < p.cols; c += bd)
            if (x[c] == x[c]) s += kpl::exp((x[c] - v) * p.inv_temperature);
    s = kpl::block_sum(s, red);
    if (t == 0) {
        p.max[row] = v;
        p.argmax[row] = i == 0xffffffffu ? 0u : i;
        p.lse[row] = v > -__builtin_inff() ? v * p.inv_temperature + kpl::log(s) : v;
    }
}
