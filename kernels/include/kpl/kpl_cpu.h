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
    std::vector<float> xchg(block);
    std::function<void(unsigned)> thread = [&](unsigned t) {
        for (unsigned b = 0; b < grid; ++b) {
            ctx = Ctx{t, b, block, grid, wave, &block_bar, &wave_bars, &xchg};
            body();
            // No thread starts block b + 1 while another is still in block b.
            block_bar.arrive_and_wait();
        }
    };
    workers().run(block, thread);
    return true;
}

}  // namespace kpl::cpu
