// The host runtime of kpl (KPL_CPU): a block's GPU threads are std::threads running the kernel
// body in lock-step where it synchronises; blocks run one after another (so __shared__ can be a
// function-local static), and launches are serialised process-wide. The wave size is a launch
// parameter: the same source is checked at 32 and 64 lanes.
#pragma once

#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

// Runs `body` as `grid` blocks of `block` threads, waves of `wave` lanes. Returns false (and
// runs nothing) for a shape the model cannot run: a block that is not whole waves.
template <class F>
bool launch(unsigned grid, unsigned block, unsigned wave, F body) {
    if (block == 0 || wave == 0 || block % wave != 0) return false;
    std::lock_guard<std::mutex> guard(launch_mutex());
    std::barrier<> block_bar(block);
    std::vector<std::unique_ptr<std::barrier<>>> wave_bars;
    for (unsigned w = 0; w < block / wave; ++w) wave_bars.push_back(std::make_unique<std::barrier<>>(wave));
    std::vector<float> xchg(block);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&, t] {
            for (unsigned b = 0; b < grid; ++b) {
                ctx = Ctx{t, b, block, grid, wave, &block_bar, &wave_bars, &xchg};
                body();
                // No thread starts block b + 1 while another is still in block b.
                block_bar.arrive_and_wait();
            }
        });
    }
    for (auto& th : threads) th.join();
    return true;
}

}  // namespace kpl::cpu
