// The matrix-core product (kpl_mma_gemm_bf16): the reference use of kpl's MMA layer. Each wave
// loads its tile's fragments through kpl::mma_a_at / mma_b_at, steps K with kpl::mma_bf16 and
// stores through kpl::mma_d_at — no vendor layout appears here, so the same indexing runs
// v_mfma on gfx950 / gfx942, mma.sync on sm_90, and the table-driven emulation on the host.
#include "kpl/kpl.h"

KPL_KERNEL(kpl_mma_gemm_bf16, KplMmaGemmParams) {
    const kpl::MmaShape s = kpl::mma_shape();
    const unsigned lane = kpl::lane_id();
    const unsigned waves = kpl::block_dim() / kpl::wave_size();
    const unsigned tile = kpl::block_id() * waves + kpl::thread_id() / kpl::wave_size();
    const unsigned tiles_n = (p.n + s.n - 1) / s.n;
    const unsigned tiles = ((p.m + s.m - 1) / s.m) * tiles_n;
    // Uniform across the wave: its lanes share the tile.
    if (tile >= tiles) return;
    const unsigned row0 = (tile / tiles_n) * s.m, col0 = (tile % tiles_n) * s.n;
    float d[kpl::MMA_D] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned k0 = 0; k0 < p.k; k0 += s.k) {
        uint16_t a[kpl::MMA_A] = {}, b[kpl::MMA_B] = {};
        for (unsigned i = 0; i < s.a; ++i) {
            const kpl::MmaAt e = kpl::mma_a_at(lane, i);
            const unsigned r = row0 + e.r, k = k0 + e.c;
            a[i] = (r < p.m && k < p.k) ? p.a[(size_t)r * p.k + k] : (uint16_t)0;
        }
        for (unsigned i = 0; i < s.b; ++i) {
            const kpl::MmaAt e = kpl::mma_b_at(lane, i);
            const unsigned k = k0 + e.r, c = col0 + e.c;
            b[i] = (c < p.n && k < p.k) ? p.b[(size_t)c * p.k + k] : (uint16_t)0;
        }
        kpl::mma_bf16(d, a, b);
    }
    for (unsigned i = 0; i < s.d; ++i) {
        const kpl::MmaAt e = kpl::mma_d_at(lane, i);
        const unsigned r = row0 + e.r, c = col0 + e.c;
        if (r < p.m && c < p.n) p.c[(size_t)r * p.n + c] = d[i];
    }
}
