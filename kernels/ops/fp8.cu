// FP8 activation quantisation for the per-token, per-channel FP8 products (ATOM's ptpc_fp8): a
// block per token finds max|x| (NaN left out, as f32::max), then every thread rounds its values to
// E4M3 — the CPU's `f32_to_e4m3`, bit for bit.
#include "kpl/kpl.h"

// The nearest E4M3 code (ties to even), saturating at ±448; NaN → 0x7F. A value's quantum is a
// power of two, so a / quantum is exact and rint (round half to even) is the E4M3 rounding.
KPL_DEVICE uint8_t f32_to_e4m3(float x) {
    if (x != x) return 0x7F;
    const uint32_t bits = __builtin_bit_cast(uint32_t, x);
    const uint8_t sign = (bits >> 31) ? 0x80 : 0x00;
    float a = __builtin_bit_cast(float, bits & 0x7FFFFFFFu);
    if (a > 448.0f) a = 448.0f;
    if (a < 0.015625f) return sign | (uint8_t)__builtin_rintf(a * 512.0f);
    const int e = (int)(__builtin_bit_cast(uint32_t, a) >> 23) - 127;
    const float quantum = __builtin_bit_cast(float, (uint32_t)(e - 3 + 127) << 23);
    const float r = __builtin_rintf(a / quantum) * quantum;
    const uint32_t rb = __builtin_bit_cast(uint32_t, r);
    uint32_t code = ((uint32_t)((int)(rb >> 23) - 127 + 7) << 3) | ((rb >> 20) & 7u);
    if (code > 0x7Eu) code = 0x7Eu;
    return sign | (uint8_t)code;
}

KPL_KERNEL(kpl_fp8_quantize_f32, KplFp8QuantizeParams) {
    KPL_SHARED float sv[32];
    KPL_SHARED unsigned si[32];
    const unsigned row = kpl::block_id(), t = kpl::thread_id(), bd = kpl::block_dim();
    if (row >= p.rows) return;
    const float* x = p.x + (size_t)row * p.cols;
    float m = 0.0f;
    unsigned dummy = 0u;
    for (unsigned c = t; c < p.cols; c += bd) {
        const float a = x[c] < 0.0f ? -x[c] : x[c];
        if (a > m) m = a;
    }
    kpl::block_argmax(m, dummy, sv, si);
    const float s = (m > 0.0f && m <= 3.4028235e38f) ? m / 448.0f : 1.0f;
    if (t == 0) p.scales[row] = s;
    for (unsigned c = t; c < p.cols; c += bd) p.codes[(size_t)row * p.cols + c] = f32_to_e4m3(x[c] / s);
}
