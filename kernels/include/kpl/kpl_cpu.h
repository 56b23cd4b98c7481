// The host runtime of kpl (KPL_CPU): a block's GPU threads are std::threads running the kernel
// body in lock-step where it synchronises; blocks run one after another (so __shared__ can be a
// function-local static), and launches are serialised process-wide. The wave size is a launch
// parameter: the same source is checked at 32 and 64 lanes.
#pragma once

#include <barrier>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kpl::cpu {

struct Ctx {
    unsigned tid = 0, bid = 0, bdim = 1, grid = 1, wave = 32;
    std::barrier<>* block_bar = nullptr;
    std::vector<std::unique_ptr<std::barrier<>>>* wave_bars = nullptr;
    std::vector<float>* xchg = nullptr;
    // Matrix-core emulation: every lane's A, B and D fragments (MMA_SLOTS floats a thread).
    std::vector<float>* mma_xchg = nullptr;
};

inline thread_local Ctx ctx;

inline std::mutex& launch_mutex() {
    static std::mutex m;
    return m;
}

inline void block_sync() { ctx.block_bar->arrive_and_wait(); }

// Each lane posts its value, the wave meets, each reads its partner's, the wave meets again
// (so no lane overwrites a value another has not read yet).
inline float shfl_xor(float v, unsigned mask) {
    unsigned base = ctx.tid - ctx.tid % ctx.wave;
    std::barrier<>& bar = *(*ctx.wave_bars)[ctx.tid / ctx.wave];
    (*ctx.xchg)[ctx.tid] = v;
    bar.arrive_and_wait();
    float r = (*ctx.xchg)[base + ((ctx.tid - base) ^ mask)];
    bar.arrive_and_wait();
    return r;
}

// ---- matrix-core emulation ---------------------------------------------------------------------
// The instructions' lane tables, written element → (lane, value): the opposite direction of the
// fragment helpers in kpl.h, which kernels use, so the two statements check each other.
// gfx950 v_mfma_f32_16x16x32_bf16 (CDNA4 ISA, dense MFMA operand layout, 64 lanes):
//   A[i][k]: lane i + 16·(k / 8), value k % 8;   B[k][j]: lane j + 16·(k / 8), value k % 8;
//   D[i][j]: lane j + 16·(i / 4), value i % 4.
// sm_90 mma.m16n8k16 .bf16 (PTX ISA, "Matrix fragments for mma.m16n8k16", 32 lanes; group = lane / 4,
// t = lane % 4): A[r][c] in lane 4·(r % 8) + (c % 8) / 2, value (c % 2) + 2·(r / 8) + 4·(c / 8);
//   B[k][n] in lane 4·n + (k % 8) / 2, value (k % 2) + 2·(k / 8);
//   D[r][c] in lane 4·(r % 8) + c / 2, value (c % 2) + 2·(r / 8).
struct LaneValue {
    unsigned lane, value;
};

struct MmaTable {
    unsigned m, n, k;
    LaneValue (*a)(unsigned, unsigned);
    LaneValue (*b)(unsigned, unsigned);
    LaneValue (*d)(unsigned, unsigned);
};

inline const MmaTable& mma_table(unsigned wave) {
    static const MmaTable gfx950{16, 16, 32,
                                 [](unsigned i, unsigned k) { return LaneValue{i + 16 * (k / 8), k % 8}; },
                                 [](unsigned k, unsigned j) { return LaneValue{j + 16 * (k / 8), k % 8}; },
                                 [](unsigned i, unsigned j) { return LaneValue{j + 16 * (i / 4), i % 4}; }};
    static const MmaTable sm90{
        16, 8, 16,
        [](unsigned r, unsigned c) { return LaneValue{4 * (r % 8) + (c % 8) / 2, (c % 2) + 2 * (r / 8) + 4 * (c / 8)}; },
        [](unsigned k, unsigned n) { return LaneValue{4 * n + (k % 8) / 2, (k % 2) + 2 * (k / 8)}; },
        [](unsigned r, unsigned c) { return LaneValue{4 * (r % 8) + c / 2, (c % 2) + 2 * (r / 8)}; }};
    return wave == 64 ? gfx950 : sm90;
}

constexpr unsigned MMA_SLOTS = 20;  // 8 A, 8 B, 4 D

inline float bf16_value(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// The wave-collective instruction: each lane posts its fragments, the wave meets, each lane forms
// the D elements the table gives it (f32, k ascending), the wave meets again before anyone posts.
inline void mma_bf16(float d[4], const uint16_t a[8], const uint16_t b[8]) {
    const MmaTable& t = mma_table(ctx.wave);
    unsigned lane = ctx.tid % ctx.wave, base = ctx.tid - lane;
    std::vector<float>& x = *ctx.mma_xchg;
    for (unsigned i = 0; i < 8; ++i) x[ctx.tid * MMA_SLOTS + i] = bf16_value(a[i]);
    for (unsigned i = 0; i < 8; ++i) x[ctx.tid * MMA_SLOTS + 8 + i] = bf16_value(b[i]);
    for (unsigned i = 0; i < 4; ++i) x[ctx.tid * MMA_SLOTS + 16 + i] = d[i];
    std::barrier<>& bar = *(*ctx.wave_bars)[ctx.tid / ctx.wave];
    bar.arrive_and_wait();
    auto at = [&](LaneValue lv, unsigned slot) { return x[(base + lv.lane) * MMA_SLOTS + slot + lv.value]; };
    for (unsigned r = 0; r < t.m; ++r) {
        for (unsigned c = 0; c < t.n; ++c) {
            LaneValue o = t.d(r, c);
            if (o.lane != lane) continue;
            float acc = at(o, 16);
            for (unsigned k = 0; k < t.k; ++k) acc += at(t.a(r, k), 0) * at(t.b(k, c), 8);
            d[o.value] = acc;
        }
    }
    bar.arrive_and_wait();
}

// The block's threads, kept from launch to launch (creating a thread per GPU thread per launch
// costs more than most test kernels): worker i runs the current job's thread i, if it has one.
class Workers {
  public:
    // Runs job(0..n) on n threads and waits for all of them.
    void run(unsigned n, const std::function<void(unsigned)>& job) {
        std::unique_lock<std::mutex> lock(m_);
        while (threads_.size() < n) {
            unsigned i = (unsigned)threads_.size();
            threads_.emplace_back([this, i] { loop(i); });
            threads_.back().detach();
        }
        job_ = &job;
        active_ = n;
        done_ = 0;
        ++generation_;
        start_.notify_all();
        finished_.wait(lock, [this] { return done_ == active_; });
        job_ = nullptr;
    }

  private:
    void loop(unsigned i) {
        unsigned seen = 0;
        std::unique_lock<std::mutex> lock(m_);
        for (;;) {
            start_.wait(lock, [&] { return generation_ != seen; });
            seen = generation_;
            if (i >= active_) continue;
            const std::function<void(unsigned)>* job = job_;
            lock.unlock();
            (*job)(i);
            lock.lock();
            if (++done_ == active_) finished_.notify_one();
        }
    }

    std::mutex m_;
    std::condition_variable start_, finished_;
    std::vector<std::thread> threads_;
    const std::function<void(unsigned)>* job_ = nullptr;
    unsigned active_ = 0, done_ = 0, generation_ = 0;
};

inline Workers& workers() {
    // Never destroyed: detached workers wait on it until the process ends.
    static Workers* w = new Workers();
    return *w;
}

// Runs `body` as `grid` blocks of `block` threads, waves of `wave` lanes. Returns false (and
// runs nothing) for a shape the model cannot run: a block that is not whole waves.
template <class F>
bool launch(unsigned grid, unsigned block, unsigned wave, F body) {
    if (block == 0 || wave == 0 || block % wave != 0) return false;
    std::lock_guard<std::mutex> guard(launch_mutex());
    std::barrier<> block_bar(block);
    std::vector<std::unique_ptr<std::barrier<>>> wave_bars;
    for (unsigned w = 0; w < block / wave; ++w) wave_bars.push_back(std::make_unique<std::barrier<>>(wave));
    std::vector<float> xchg(block), mma_xchg(block * MMA_SLOTS);
    std::function<void(unsigned)> thread = [&](unsigned t) {
        for (unsigned b = 0; b < grid; ++b) {
            ctx = Ctx{t, b, block, grid, wave, &block_bar, &wave_bars, &xchg, &mma_xchg};
            body();
            // No thread starts block b + 1 while another is still in block b.
            block_bar.arrive_and_wait();
        }
    };
    workers().run(block, thread);
    return true;
}

}  // namespace kpl::cpu
