// Runs every kernel of kernels/ops/ once at wave 32 and once at wave 64 on small shapes, for a
// ThreadSanitizer build (tests/tsan.rs): a missing barrier between a shared-memory write and a
// read shows up as a data race with the source lines. Results are checked by tests/ops.rs; here
// only the absence of races and of deadlocks counts.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kpl/kpl.h"

extern "C" {
void kpl_cpu_launch_kpl_rmsnorm_f32(unsigned, unsigned, unsigned, const KplRmsnormParams*);
void kpl_cpu_launch_kpl_gated_rmsnorm_f32(unsigned, unsigned, unsigned, const KplGatedRmsnormParams*);
void kpl_cpu_launch_kpl_situ_glu_f32(unsigned, unsigned, unsigned, const KplSituParams*);
void kpl_cpu_launch_kpl_embedding_bf16(unsigned, unsigned, unsigned, const KplEmbeddingParams*);
void kpl_cpu_launch_kpl_kda_decode_f32(unsigned, unsigned, unsigned, const KplKdaDecodeParams*);
void kpl_cpu_launch_kpl_attn_res_mix_f32(unsigned, unsigned, unsigned, const KplAttnResParams*);
void kpl_cpu_launch_kpl_moe_route_f32(unsigned, unsigned, unsigned, const KplMoeRouteParams*);
void kpl_cpu_launch_kpl_kda_conv_f32(unsigned, unsigned, unsigned, const KplKdaConvParams*);
void kpl_cpu_launch_kpl_silu_glu_f32(unsigned, unsigned, unsigned, const KplGluParams*);
void kpl_cpu_launch_kpl_gelu_f32(unsigned, unsigned, unsigned, const KplGeluParams*);
void kpl_cpu_launch_kpl_rope_table_f32(unsigned, unsigned, unsigned, const KplRopeTableParams*);
void kpl_cpu_launch_kpl_mma_gemm_bf16(unsigned, unsigned, unsigned, const KplMmaGemmParams*);
void kpl_cpu_launch_kpl_topk_select_f32(unsigned, unsigned, unsigned, const KplTopkParams*);
void kpl_cpu_launch_kpl_logits_stats_f32(unsigned, unsigned, unsigned, const KplLogitsStatsParams*);
void kpl_cpu_launch_kpl_fp8_quantize_f32(unsigned, unsigned, unsigned, const KplFp8QuantizeParams*);
}

int main() {
    for (unsigned wave : {32u, 64u}) {
        const unsigned rows = 3, cols = 200;
        std::vector<float> x(rows * cols), w(cols), out(rows * cols), gate(rows * cols);
        for (unsigned i = 0; i < x.size(); ++i) x[i] = float(i % 17) - 8.0f, gate[i] = float(i % 5) - 2.0f;
        for (unsigned i = 0; i < cols; ++i) w[i] = 1.0f + float(i % 3);
        KplRmsnormParams rp{x.data(), w.data(), out.data(), rows, cols, 1e-5f, 0};
        kpl_cpu_launch_kpl_rmsnorm_f32(rows, 2 * wave, wave, &rp);
        KplGatedRmsnormParams gp{x.data(), gate.data(), w.data(), out.data(), rows * 2, cols / 2, 1e-5f, 0};
        kpl_cpu_launch_kpl_gated_rmsnorm_f32(rows * 2, 2 * wave, wave, &gp);
        KplSituParams sp{gate.data(), x.data(), rows * cols, 4.0f, 25.0f, 1};
        kpl_cpu_launch_kpl_situ_glu_f32(2, wave, wave, &sp);
        std::vector<uint16_t> table(10 * cols, 0x3f80);
        std::vector<uint32_t> ids{1, 9, 4};
        KplEmbeddingParams ep{table.data(), ids.data(), out.data(), 3, cols};
        kpl_cpu_launch_kpl_embedding_bf16(2, wave, wave, &ep);
        // Two sequences, two heads of 40: x rows double as q, k, v and z.
        std::vector<float> s0(2 * 40 * 40, 0.1f), s1(2 * 40 * 40, -0.1f), a{1.0f, 2.0f}, dt(80, 0.0f), o(160);
        float* slots[2] = {s0.data(), s1.data()};
        KplKdaDecodeParams kp{x.data(), x.data(), x.data(), x.data(), gate.data(), a.data(), dt.data(), slots,
                              o.data(), 2, 2, 40, -5.0f, 0.158f, 0};
        kpl_cpu_launch_kpl_kda_decode_f32(4, wave, wave, &kp);
        const float* cands[3] = {x.data(), gate.data(), out.data()};
        std::vector<float> mixed(rows * cols);
        KplAttnResParams ap{w.data(), cands, mixed.data(), rows, cols, 3, 1e-6f};
        kpl_cpu_launch_kpl_attn_res_mix_f32(rows, 2 * wave, wave, &ap);
        // Three tokens over 64 experts (x's rows as logits), top 8.
        std::vector<float> scores(3 * 64), rw(3 * 8), margins(3);
        std::vector<uint32_t> rid(3 * 8);
        KplMoeRouteParams mp{x.data(), w.data(), scores.data(), rid.data(), rw.data(), margins.data(), 3, 64, 8, 1, 1.0f, 0};
        kpl_cpu_launch_kpl_moe_route_f32(3, 2 * wave, wave, &mp);
        // Two sequences (rows 0..2 and 2..3) of 200 channels, kernel 4.
        std::vector<float> taps(200 * 4, 0.25f), f0(3 * 200, 0.0f), f1(3 * 200, 1.0f);
        uint32_t starts[2] = {0, 2}, lens[2] = {2, 1};
        float* windows[2] = {f0.data(), f1.data()};
        KplKdaConvParams cp{x.data(), taps.data(), starts, lens, windows, 2, 200, 4, 0};
        kpl_cpu_launch_kpl_kda_conv_f32(2 * ((200 + wave - 1) / wave), wave, wave, &cp);
        KplGluParams glp{gate.data(), x.data(), rows * cols, 0};
        kpl_cpu_launch_kpl_silu_glu_f32(2, wave, wave, &glp);
        KplGeluParams gep{gate.data(), rows * cols, 1};
        kpl_cpu_launch_kpl_gelu_f32(2, wave, wave, &gep);
        // x as [3 rows, 5 heads, 40 lanes], 20 pairs per row from gate's values as cos / sin.
        KplRopeTableParams rtp{x.data(), gate.data(), w.data(), rows, 5, 40, 0, 20, 0};
        kpl_cpu_launch_kpl_rope_table_f32(2, wave, wave, &rtp);
        // A 19×21×40 product on the emulated matrix cores, two waves a block.
        std::vector<uint16_t> ma(19 * 40, 0x3f80), mb(21 * 40, 0xbf00);
        std::vector<float> mc(19 * 21);
        KplMmaGemmParams mmp{ma.data(), mb.data(), mc.data(), 19, 21, 40, 0};
        kpl_cpu_launch_kpl_mma_gemm_bf16(4, 2 * wave, wave, &mmp);
        // Top 7 of x's rows (200 scores each, repeating values: ties), two waves a block.
        std::vector<uint32_t> tk(rows * 7), tc(rows);
        KplTopkParams tp{x.data(), tk.data(), tc.data(), rows, cols, 7, 0};
        kpl_cpu_launch_kpl_topk_select_f32(rows, 2 * wave, wave, &tp);
        std::vector<float> lmax(rows), lse(rows);
        std::vector<uint32_t> lam(rows);
        KplLogitsStatsParams lp{x.data(), lmax.data(), lam.data(), lse.data(), rows, cols, 1.0f, 0};
        kpl_cpu_launch_kpl_logits_stats_f32(rows, 2 * wave, wave, &lp);
        std::vector<uint8_t> codes(rows * cols);
        std::vector<float> scales(rows);
        KplFp8QuantizeParams fp{x.data(), codes.data(), scales.data(), rows, cols};
        kpl_cpu_launch_kpl_fp8_quantize_f32(rows, 2 * wave, wave, &fp);
    }
    std::puts("kpl ops ran at wave 32 and 64");
    return 0;
}
