// kpl — the kernel portability layer: the only place with vendor #ifs. One kernel source builds
// three ways:
//   * AMD (gfx950, gfx942) header-free with clang builtins: `-x hip --cuda-device-only -nogpuinc`;
//   * NVIDIA (sm_90) header-free with NVVM builtins: `-x cuda --cuda-device-only -nocudainc`;
//   * the host (KPL_CPU), where every GPU thread of a block is a std::thread (kpl_cpu.h), the wave
//     size is a launch parameter, barriers are std::barrier and shuffles go through an exchange
//     buffer — so wave-32/64 and missing-barrier bugs show up in `cargo test` (and under TSan).
//
// Rules for kernels: one entry point per KPL_KERNEL with one by-value parameter struct from abi.h;
// no system headers; shuffles always name their width; barriers only in uniform control flow.
#pragma once

#if defined(KPL_CPU)
#include "kpl_cpu.h"
#define KPL_DEVICE inline
#define KPL_SHARED static
#define KPL_KERNEL(name, P)                                                                       \
    extern "C" void name(P p);                                                                    \
    extern "C" void kpl_cpu_launch_##name(unsigned grid, unsigned block, unsigned wave, const P* p) { \
        kpl::cpu::launch(grid, block, wave, [p] { name(*p); });                                   \
    }                                                                                             \
    extern "C" unsigned long kpl_abi_size_##name(void) { return sizeof(P); }                      \
    extern "C" void name(P p)
#elif defined(__AMDGCN__)
#define KPL_AMD 1
#define KPL_DEVICE static inline __attribute__((device)) __attribute__((always_inline))
#define KPL_SHARED static __attribute__((shared))
#define KPL_KERNEL(name, P)                                                                       \
    extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(1, 1024))) void name(P p)
#elif defined(__NVPTX__)
#define KPL_NV 1
#define KPL_DEVICE static inline __attribute__((device)) __attribute__((always_inline))
#define KPL_SHARED static __attribute__((shared))
#define KPL_KERNEL(name, P) extern "C" __attribute__((global)) void name(P p)
#else
// The host pass of an offload compile sees only declarations.
#define KPL_HOST_PASS 1
#define KPL_DEVICE static inline
#define KPL_SHARED static
#define KPL_KERNEL(name, P) extern "C" void name(P p)
#endif

#if !defined(KPL_CPU)
// No system headers on the device: the fixed-width types from the compiler's builtins.
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __INT32_TYPE__ int32_t;
typedef __SIZE_TYPE__ size_t;
#endif

#include "abi.h"

namespace kpl {

// ---- indices -------------------------------------------------------------------------------
KPL_DEVICE unsigned thread_id() {
#if defined(KPL_AMD)
    return __builtin_amdgcn_workitem_id_x();
#elif defined(KPL_NV)
    return __nvvm_read_ptx_sreg_tid_x();
#elif defined(KPL_CPU)
    return cpu::ctx.tid;
#else
    return 0;
#endif
}

KPL_DEVICE unsigned block_id() {
#if defined(KPL_AMD)
    return __builtin_amdgcn_workgroup_id_x();
#elif defined(KPL_NV)
    return __nvvm_read_ptx_sreg_ctaid_x();
#elif defined(KPL_CPU)
    return cpu::ctx.bid;
#else
    return 0;
#endif
}

KPL_DEVICE unsigned block_dim() {
#if defined(KPL_AMD)
    return __builtin_amdgcn_workgroup_size_x();
#elif defined(KPL_NV)
    return __nvvm_read_ptx_sreg_ntid_x();
#elif defined(KPL_CPU)
    return cpu::ctx.bdim;
#else
    return 1;
#endif
}

KPL_DEVICE unsigned grid_dim() {
#if defined(KPL_AMD)
    return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x();
#elif defined(KPL_NV)
    return __nvvm_read_ptx_sreg_nctaid_x();
#elif defined(KPL_CPU)
    return cpu::ctx.grid;
#else
    return 1;
#endif
}

// Lanes in a wave: 64 on CDNA, 32 on NVIDIA, the launch's choice on the host.
KPL_DEVICE unsigned wave_size() {
#if defined(KPL_AMD)
    return 64;
#elif defined(KPL_NV)
    return 32;
#elif defined(KPL_CPU)
    return cpu::ctx.wave;
#else
    return 1;
#endif
}

KPL_DEVICE unsigned lane_id() { return thread_id() % wave_size(); }

// ---- synchronisation -------------------------------------------------------------------------
// A block-wide barrier that also orders workgroup memory.
KPL_DEVICE void sync() {
#if defined(KPL_AMD)
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#elif defined(KPL_NV)
    __nvvm_bar_sync(0);
#elif defined(KPL_CPU)
    cpu::block_sync();
#endif
}

// The value of lane (lane ^ mask) within segments of `width` lanes (mask < width ≤ wave).
KPL_DEVICE float shfl_xor(float v, unsigned mask, unsigned width) {
#if defined(KPL_AMD)
    (void)width;
    int src = (int)(lane_id() ^ mask);
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
#elif defined(KPL_NV)
    unsigned c = ((32u - width) << 8) | 0x1fu;
    return __nvvm_shfl_sync_bfly_f32(0xffffffffu, v, (int)mask, (int)c);
#elif defined(KPL_CPU)
    (void)width;
    return cpu::shfl_xor(v, mask);
#else
    (void)mask;
    (void)width;
    return v;
#endif
}

// ---- math --------------------------------------------------------------------------------------
KPL_DEVICE float rsqrt(float x) {
#if defined(KPL_AMD)
    return __builtin_amdgcn_rsqf(x);
#elif defined(KPL_NV)
    return __nvvm_rsqrt_approx_f(x);
#elif defined(KPL_CPU)
    return 1.0f / std::sqrt(x);
#else
    return x;
#endif
}

// 2^x.
KPL_DEVICE float exp2(float x) {
#if defined(KPL_AMD)
    return __builtin_amdgcn_exp2f(x);
#elif defined(KPL_NV)
    return __nvvm_ex2_approx_f(x);
#elif defined(KPL_CPU)
    return std::exp2(x);
#else
    return x;
#endif
}

KPL_DEVICE float exp(float x) { return exp2(x * 1.4426950408889634f); }

// log₂(x).
KPL_DEVICE float log2(float x) {
#if defined(KPL_AMD)
    return __builtin_amdgcn_logf(x);
#elif defined(KPL_NV)
    return __nvvm_lg2_approx_f(x);
#elif defined(KPL_CPU)
    return std::log2(x);
#else
    return x;
#endif
}

KPL_DEVICE float log(float x) { return log2(x) * 0.6931471805599453f; }

KPL_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

// tanh through e^{-2|x|} ≤ 1, so nothing overflows.
KPL_DEVICE float tanh(float x) {
    float a = x < 0.0f ? -x : x;
    float e = exp(-2.0f * a);
    float t = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -t : t;
}

// erf by Abramowitz & Stegun 7.1.26 (|error| ≤ 1.5e-7): no device math library is linked.
KPL_DEVICE float erf(float x) {
    float a = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    float y = 1.0f - poly * exp(-a * a);
    return x < 0.0f ? -y : y;
}

// ---- storage types --------------------------------------------------------------------------
KPL_DEVICE float bf16_to_f32(uint16_t b) { return __builtin_bit_cast(float, (uint32_t)b << 16); }

// ---- reductions ---------------------------------------------------------------------------------
// Sum over the wave: every lane gets it.
KPL_DEVICE float wave_sum(float v) {
    unsigned w = wave_size();
    for (unsigned m = w / 2; m > 0; m /= 2) v += shfl_xor(v, m, w);
    return v;
}

// Sum over the block (block_dim a multiple of the wave, at most 32 waves): every thread gets it.
// `scratch` is shared memory of at least 32 floats.
KPL_DEVICE float block_sum(float v, float* scratch) {
    unsigned w = wave_size(), lane = lane_id(), wid = thread_id() / w, waves = block_dim() / w;
    v = wave_sum(v);
    if (lane == 0) scratch[wid] = v;
    sync();
    float t = lane < waves ? scratch[lane] : 0.0f;
    t = wave_sum(t);
    // Everyone has read the partials before anyone may write scratch again.
    sync();
    return t;
}

// Adds `v` to `*p` atomically (shared or global memory), returning the old value.
KPL_DEVICE unsigned atomic_add(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

// Exclusive prefix sum of `v` over the block's threads in thread order; `total` gets the sum.
// `scratch` is shared memory of at least block_dim() entries. Hillis–Steele: log₂(block) rounds,
// each read and write separated by barriers.
KPL_DEVICE unsigned block_exclusive_scan(unsigned v, unsigned* scratch, unsigned& total) {
    unsigned t = thread_id(), n = block_dim();
    scratch[t] = v;
    sync();
    for (unsigned off = 1; off < n; off <<= 1) {
        unsigned add = t >= off ? scratch[t - off] : 0u;
        sync();
        scratch[t] += add;
        sync();
    }
    unsigned inclusive = scratch[t];
    total = scratch[n - 1];
    // Everyone has read before anyone may write scratch again.
    sync();
    return inclusive - v;
}

// The larger of (v, i) and (ov, oi): greater value, ties to the lower index.
KPL_DEVICE bool better(float ov, unsigned oi, float v, unsigned i) { return ov > v || (ov == v && oi < i); }

// Argmax over the wave (ties to the lower index): every lane gets it.
KPL_DEVICE void wave_argmax(float& v, unsigned& i) {
    unsigned w = wave_size();
    for (unsigned m = w / 2; m > 0; m /= 2) {
        float ov = shfl_xor(v, m, w);
        unsigned oi = __builtin_bit_cast(unsigned, shfl_xor(__builtin_bit_cast(float, i), m, w));
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

// Argmax over the block (ties to the lower index); every thread gets it in (v, i). `sv` and
// `si` are shared memory of at least 32 entries.
KPL_DEVICE void block_argmax(float& v, unsigned& i, float* sv, unsigned* si) {
    unsigned w = wave_size(), lane = lane_id(), wid = thread_id() / w, waves = block_dim() / w;
    wave_argmax(v, i);
    if (lane == 0) {
        sv[wid] = v;
        si[wid] = i;
    }
    sync();
    v = lane < waves ? sv[lane] : -__builtin_inff();
    i = lane < waves ? si[lane] : 0xffffffffu;
    wave_argmax(v, i);
    sync();
}

}  // namespace kpl

namespace kpl {

// ---- matrix cores ------------------------------------------------------------------------------
// One wave computes D = A·B + D for a tile of A [m × k] and B [k × n] in BF16, D in f32; each lane
// holds fixed elements of every operand (the ISA's lane tables):
//   gfx950  v_mfma_f32_16x16x32_bf16   16×16×32, wave 64: 8 A, 8 B, 4 D values a lane;
//   gfx942  v_mfma_f32_16x16x16_bf16   16×16×16, wave 64: 4 A, 4 B, 4 D;
//   sm_90   mma.sync.m16n8k16 (BF16)   16×8×16,  wave 32: 8 A, 4 B, 4 D.
// Kernels stay vendor-free: they ask `mma_shape()` for the tile and `mma_a_at` / `mma_b_at` /
// `mma_d_at` for the element each fragment value holds. On the host a launch at wave 64 emulates
// gfx950's instruction and one at wave 32 sm_90's (kpl_cpu.h), each from its own table written the
// other way round (element → lane and value), so a kernel's fragment indexing is checked in
// `cargo test`; the tables themselves need one check on each GPU.
struct MmaShape {
    unsigned m, n, k, a, b, d;
};

// Most fragment values a lane holds for A, B and D on any target.
constexpr unsigned MMA_A = 8, MMA_B = 8, MMA_D = 4;

// Which instruction this build (or, on the host, this launch's wave size) uses.
enum class MmaKind { Gfx950, Gfx942, Sm90 };

KPL_DEVICE MmaKind mma_kind() {
#if defined(KPL_AMD) && defined(__gfx950__)
    return MmaKind::Gfx950;
#elif defined(KPL_AMD)
    return MmaKind::Gfx942;
#elif defined(KPL_NV)
    return MmaKind::Sm90;
#elif defined(KPL_CPU)
    return wave_size() == 64 ? MmaKind::Gfx950 : MmaKind::Sm90;
#else
    return MmaKind::Gfx950;
#endif
}

KPL_DEVICE MmaShape mma_shape() {
    switch (mma_kind()) {
    case MmaKind::Gfx950: return MmaShape{16, 16, 32, 8, 8, 4};
    case MmaKind::Gfx942: return MmaShape{16, 16, 16, 4, 4, 4};
    default: return MmaShape{16, 8, 16, 8, 4, 4};
    }
}

// An element of a tile: row and column (for B: k and n).
struct MmaAt {
    unsigned r, c;
};

// A value `i` of `lane` holds A[r][c] (c: along k).
KPL_DEVICE MmaAt mma_a_at(unsigned lane, unsigned i) {
    switch (mma_kind()) {
    case MmaKind::Gfx950: return MmaAt{lane % 16, 8 * (lane / 16) + i};
    case MmaKind::Gfx942: return MmaAt{lane % 16, 4 * (lane / 16) + i};
    default: return MmaAt{lane / 4 + 8 * ((i >> 1) & 1), 2 * (lane % 4) + (i & 1) + 8 * (i >> 2)};
    }
}

// B value `i` of `lane` holds B[r][c] (r: along k, c: along n).
KPL_DEVICE MmaAt mma_b_at(unsigned lane, unsigned i) {
    switch (mma_kind()) {
    case MmaKind::Gfx950: return MmaAt{8 * (lane / 16) + i, lane % 16};
    case MmaKind::Gfx942: return MmaAt{4 * (lane / 16) + i, lane % 16};
    default: return MmaAt{2 * (lane % 4) + (i & 1) + 8 * (i >> 1), lane / 4};
    }
}

// D value `i` of `lane` holds D[r][c].
KPL_DEVICE MmaAt mma_d_at(unsigned lane, unsigned i) {
    switch (mma_kind()) {
    case MmaKind::Gfx950:
    case MmaKind::Gfx942: return MmaAt{4 * (lane / 16) + i, lane % 16};
    default: return MmaAt{lane / 4 + 8 * (i >> 1), 2 * (lane % 4) + (i & 1)};
    }
}

// d ← a·b + d for the wave's tile; a, b hold BF16 bit patterns. Every lane of the wave calls it.
KPL_DEVICE void mma_bf16(float d[MMA_D], const uint16_t a[MMA_A], const uint16_t b[MMA_B]) {
#if defined(KPL_AMD) && defined(__gfx950__)
    typedef unsigned short u16x8 __attribute__((ext_vector_type(8)));
    typedef __bf16 bf16x8 __attribute__((ext_vector_type(8)));
    typedef float f32x4 __attribute__((ext_vector_type(4)));
    u16x8 va = {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};
    u16x8 vb = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]};
    f32x4 vd = {d[0], d[1], d[2], d[3]};
    vd = __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(bf16x8, va), __builtin_bit_cast(bf16x8, vb), vd,
                                                 0, 0, 0);
    for (unsigned i = 0; i < 4; ++i) d[i] = vd[i];
#elif defined(KPL_AMD)
    typedef short s16x4 __attribute__((ext_vector_type(4)));
    typedef float f32x4 __attribute__((ext_vector_type(4)));
    s16x4 va = {(short)a[0], (short)a[1], (short)a[2], (short)a[3]};
    s16x4 vb = {(short)b[0], (short)b[1], (short)b[2], (short)b[3]};
    f32x4 vd = {d[0], d[1], d[2], d[3]};
    vd = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(va, vb, vd, 0, 0, 0);
    for (unsigned i = 0; i < 4; ++i) d[i] = vd[i];
#elif defined(KPL_NV)
    // Two BF16 values a register, the lower index in the low half.
    unsigned ra[4], rb[2];
    for (unsigned r = 0; r < 4; ++r) ra[r] = (unsigned)a[2 * r] | ((unsigned)a[2 * r + 1] << 16);
    for (unsigned r = 0; r < 2; ++r) rb[r] = (unsigned)b[2 * r] | ((unsigned)b[2 * r + 1] << 16);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
#elif defined(KPL_CPU)
    cpu::mma_bf16(d, a, b);
#else
    (void)d;
    (void)a;
    (void)b;
#endif
}

}  // namespace kpl

