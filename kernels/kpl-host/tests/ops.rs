//! Every kernel of `kernels/ops/` run on the host at wave 32 and 64 against the Rust CPU backend,
//! over odd shapes (rows of 1 and 65, a column count that is not a multiple of the block, a
//! single-wave block and a 32-wave one).

use kimi_kernels::cpu::bf16::f32_to_bf16_bits;
use kimi_kernels::gpu::abi::{
    AttnResParams, EmbeddingParams, GatedRmsnormParams, KdaConvParams, KdaDecodeParams, MoeRouteParams, RmsnormParams,
    SituParams,
};
use kimi_kernels::{Backend, Bf16Matrix, CpuBackend, KdaSlot, Matrix, SituParams as Situ};
use kimi_kpl_host::{Launch, addr};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// |got − want| ≤ tol · (1 + |want|): the device's rsqrt / exp2 are approximate (about 1 ulp on
/// hardware; exact on the host), so the bound leaves room for them.
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

const WAVES: [u32; 2] = [32, 64];

#[test]
fn parameter_structs_match_abi_h() {
    use std::mem::size_of;
    // SAFETY: the size functions read nothing.
    unsafe {
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_rmsnorm_f32() as usize, size_of::<RmsnormParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_gated_rmsnorm_f32() as usize, size_of::<GatedRmsnormParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_situ_glu_f32() as usize, size_of::<SituParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_embedding_bf16() as usize, size_of::<EmbeddingParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_kda_decode_f32() as usize, size_of::<KdaDecodeParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_attn_res_mix_f32() as usize, size_of::<AttnResParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_moe_route_f32() as usize, size_of::<MoeRouteParams>());
        assert_eq!(kimi_kpl_host::kpl_abi_size_kpl_kda_conv_f32() as usize, size_of::<KdaConvParams>());
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_silu_glu_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::GluParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_gelu_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::GeluParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_rope_table_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::RopeTableParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_mma_gemm_bf16() as usize,
            size_of::<kimi_kernels::gpu::abi::MmaGemmParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_topk_select_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::TopkParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_logits_stats_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::LogitsStatsParams>()
        );
        assert_eq!(
            kimi_kpl_host::kpl_abi_size_kpl_fp8_quantize_f32() as usize,
            size_of::<kimi_kernels::gpu::abi::Fp8QuantizeParams>()
        );
    }
}

#[test]
fn rmsnorm_matches_the_cpu_backend_at_both_wave_sizes() {
    let mut rng = StdRng::seed_from_u64(1);
    for wave in WAVES {
        for (rows, cols, block) in [(1usize, 7usize, 64u32), (65, 300, 128), (3, 1000, 64), (2, 4096, 1024)] {
            let block = block.max(wave);
            let x = randn(&mut rng, rows * cols, 3.0);
            let w = randn(&mut rng, cols, 1.0);
            let mut want = vec![0f32; rows * cols];
            CpuBackend.rms_norm(&x, &w, 1e-5, &mut want);
            let mut got = vec![f32::NAN; rows * cols];
            let p = RmsnormParams {
                x: addr(x.as_ptr()),
                w: addr(w.as_ptr()),
                out: addr(got.as_mut_ptr()),
                rows: rows as u32,
                cols: cols as u32,
                eps: 1e-5,
                pad_: 0,
            };
            // A grid larger than the rows: the extra blocks must leave everything alone.
            let l = Launch { grid: rows as u32 + 1, block, wave };
            // SAFETY: x, w and got hold rows × cols / cols values and outlive the launch.
            unsafe { kimi_kpl_host::rmsnorm_f32(l, p) };
            close(&got, &want, 2e-6, &format!("rmsnorm {rows}×{cols} block {block} wave {wave}"));
        }
    }
}

#[test]
fn gated_rmsnorm_matches_the_cpu_backend_at_both_wave_sizes() {
    let mut rng = StdRng::seed_from_u64(2);
    for wave in WAVES {
        let (groups, dim) = (9usize, 96usize);
        let o = randn(&mut rng, groups * dim, 2.0);
        let gate = randn(&mut rng, groups * dim, 4.0);
        let w = randn(&mut rng, dim, 1.0);
        let mut want = vec![0f32; groups * dim];
        CpuBackend.gated_rms_norm(&o, &gate, &w, 1e-6, &mut want);
        let mut got = vec![f32::NAN; groups * dim];
        let p = GatedRmsnormParams {
            o: addr(o.as_ptr()),
            gate: addr(gate.as_ptr()),
            w: addr(w.as_ptr()),
            out: addr(got.as_mut_ptr()),
            groups: groups as u32,
            dim: dim as u32,
            eps: 1e-6,
            pad_: 0,
        };
        // SAFETY: every buffer holds groups × dim (w: dim) values and outlives the launch.
        unsafe { kimi_kpl_host::gated_rmsnorm_f32(Launch { grid: groups as u32, block: 2 * wave, wave }, p) };
        close(&got, &want, 1e-5, &format!("gated rmsnorm wave {wave}"));
    }
}

#[test]
fn situ_glu_matches_the_cpu_backend_with_and_without_the_up_cap() {
    let mut rng = StdRng::seed_from_u64(3);
    for wave in WAVES {
        for linear_beta in [Some(25.0f32), None] {
            let n = 1000;
            // Past ±β and ±β_lin too, where the caps bend.
            let mut gate = randn(&mut rng, n, 40.0);
            let up = randn(&mut rng, n, 60.0);
            let mut want = gate.clone();
            CpuBackend.situ_glu(&mut want, &up, Situ { beta: 4.0, linear_beta });
            let p = SituParams {
                gate: addr(gate.as_mut_ptr()),
                up: addr(up.as_ptr()),
                n: n as u32,
                beta: 4.0,
                linear_beta: linear_beta.unwrap_or(0.0),
                has_linear_beta: linear_beta.is_some() as u32,
            };
            // A grid smaller than the values: the grid-stride loop covers the rest.
            // SAFETY: gate and up hold n values and outlive the launch.
            unsafe { kimi_kpl_host::situ_glu_f32(Launch { grid: 3, block: wave, wave }, p) };
            close(&gate, &want, 2e-5, &format!("situ wave {wave} cap {linear_beta:?}"));
        }
    }
}

#[test]
fn embedding_gathers_bf16_rows_like_the_cpu_backend() {
    let mut rng = StdRng::seed_from_u64(4);
    let (vocab, cols) = (50usize, 70usize);
    let table: Vec<u16> = randn(&mut rng, vocab * cols, 1.0).iter().map(|v| f32_to_bf16_bits(*v)).collect();
    let ids: Vec<u32> = vec![0, 49, 7, 7, 13];
    let m = Matrix::Bf16(Bf16Matrix::new(&table, vocab, cols));
    let mut want = vec![0f32; ids.len() * cols];
    CpuBackend.embedding(&m, &ids, &mut want);
    for wave in WAVES {
        let mut got = vec![f32::NAN; ids.len() * cols];
        let p = EmbeddingParams {
            table: addr(table.as_ptr()),
            ids: addr(ids.as_ptr()),
            out: addr(got.as_mut_ptr()),
            tokens: ids.len() as u32,
            cols: cols as u32,
        };
        // SAFETY: the table holds vocab × cols values, every id is below vocab, got holds
        // tokens × cols; all outlive the launch.
        unsafe { kimi_kpl_host::embedding_bf16(Launch { grid: 2, block: 2 * wave, wave }, p) };
        assert_eq!(got, want, "embedding wave {wave}: a gather is exact");
    }
}

#[test]
fn kda_decode_updates_each_slot_like_the_cpu_backend() {
    use kimi_kernels::{KdaInputs, KdaParams, SeqSpan};
    use kimi_kpl_host::host_backend;
    let mut rng = StdRng::seed_from_u64(5);
    // Three sequences decoding one token each; head_dim 40 (not a multiple of the wave).
    let (seqs, heads, dim) = (3usize, 2usize, 40usize);
    let width = heads * dim;
    let (q, k, v, z) = (
        randn(&mut rng, seqs * width, 2.0),
        randn(&mut rng, seqs * width, 2.0),
        randn(&mut rng, seqs * width, 2.0),
        randn(&mut rng, seqs * width, 2.0),
    );
    let beta_logits = randn(&mut rng, seqs * heads, 3.0);
    let a_exp: Vec<f32> = (0..heads).map(|i| 1.0 + i as f32).collect();
    let dt_bias = randn(&mut rng, width, 0.5);
    let p = KdaParams { heads, head_dim: dim, a_exp: &a_exp, dt_bias: &dt_bias, lower_bound: -5.0 };
    let x = KdaInputs { q: &q, k: &k, v: &v, z: &z, beta_logits: &beta_logits };
    let spans: Vec<SeqSpan> = (0..seqs).map(|i| SeqSpan { start: i, len: 1, pos: 5 + i }).collect();
    let states: Vec<Vec<f32>> = (0..seqs).map(|_| randn(&mut rng, heads * dim * dim, 1.0)).collect();
    let mut want_states = states.clone();
    let mut want = vec![0f32; seqs * width];
    {
        let mut slots: Vec<KdaSlot<'_>> = want_states.iter_mut().map(|s| KdaSlot::new(s)).collect();
        CpuBackend.kda_recurrence(&p, &x, &spans, &mut slots, &mut want);
    }
    for wave in WAVES {
        let mut got_states = states.clone();
        let mut got = vec![f32::NAN; seqs * width];
        {
            let mut slots: Vec<KdaSlot<'_>> = got_states.iter_mut().map(|s| KdaSlot::new(s)).collect();
            host_backend(wave).kda_recurrence(&p, &x, &spans, &mut slots, &mut got);
        }
        close(&got, &want, 1e-5, &format!("kda decode output, wave {wave}"));
        for (g, w) in got_states.iter().zip(&want_states) {
            close(g, w, 1e-5, &format!("kda decode state, wave {wave}"));
        }
    }
}

#[test]
fn attn_res_mix_matches_the_cpu_backend() {
    use kimi_kpl_host::host_backend;
    let mut rng = StdRng::seed_from_u64(6);
    let (tokens, dim) = (5usize, 130usize);
    for n in [1usize, 3, 9] {
        let cands: Vec<Vec<f32>> = (0..n).map(|i| randn(&mut rng, tokens * dim, 1.0 + i as f32)).collect();
        let refs: Vec<&[f32]> = cands.iter().map(|c| c.as_slice()).collect();
        let query = randn(&mut rng, dim, 0.2);
        let mut want = vec![0f32; tokens * dim];
        CpuBackend.attn_res_mix(&query, 1e-6, &refs, &mut want);
        for wave in WAVES {
            let mut got = vec![f32::NAN; tokens * dim];
            host_backend(wave).attn_res_mix(&query, 1e-6, &refs, &mut got);
            close(&got, &want, 1e-5, &format!("attn_res {n} candidates wave {wave}"));
        }
    }
}

#[test]
fn moe_route_selects_and_weighs_like_the_cpu_backend() {
    use kimi_kernels::RouterParams;
    use kimi_kpl_host::host_backend;
    let mut rng = StdRng::seed_from_u64(7);
    for (experts, top_k, tokens) in [(16usize, 4usize, 3usize), (896, 16, 2), (8, 8, 2), (100, 1, 4)] {
        let mut logits = randn(&mut rng, tokens * experts, 3.0);
        // A tie: the lower expert must win it.
        logits[1] = logits[0];
        let bias = randn(&mut rng, experts, 0.1);
        for renormalize in [true, false] {
            let p = RouterParams { bias: &bias, top_k, renormalize, scaling: 2.5 };
            let want = CpuBackend.moe_route(&logits, tokens, &p);
            for wave in WAVES {
                let got = host_backend(wave).moe_route(&logits, tokens, &p);
                let what = format!("route E {experts} k {top_k} wave {wave}");
                assert_eq!(got.ids, want.ids, "{what}: ids");
                close(&got.scores, &want.scores, 1e-6, &format!("{what}: scores"));
                close(&got.weights, &want.weights, 1e-6, &format!("{what}: weights"));
                for (a, b) in got.margins.iter().zip(&want.margins) {
                    assert!(a.is_nan() && b.is_nan() || (a - b).abs() <= 1e-6, "{what}: margin {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn kda_conv_continues_each_sequence_like_the_cpu_backend() {
    use kimi_kernels::SeqSpan;
    use kimi_kpl_host::host_backend;
    let mut rng = StdRng::seed_from_u64(8);
    // A prefill chunk of 5 rows, a decode row and an empty sequence; 70 channels, kernel 4.
    let (channels, kernel) = (70usize, 4usize);
    let spans = [
        SeqSpan { start: 0, len: 5, pos: 3 },
        SeqSpan { start: 5, len: 1, pos: 9 },
        SeqSpan { start: 6, len: 0, pos: 2 },
    ];
    let x = randn(&mut rng, 6 * channels, 2.0);
    let taps = randn(&mut rng, channels * kernel, 1.0);
    let frames: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, (kernel - 1) * channels, 1.0)).collect();
    let (mut want, mut want_frames) = (x.clone(), frames.clone());
    {
        let mut f: Vec<&mut [f32]> = want_frames.iter_mut().map(|f| f.as_mut_slice()).collect();
        CpuBackend.kda_conv(&mut want, &spans, &mut f, &taps, kernel);
    }
    for wave in WAVES {
        let (mut got, mut got_frames) = (x.clone(), frames.clone());
        {
            let mut f: Vec<&mut [f32]> = got_frames.iter_mut().map(|f| f.as_mut_slice()).collect();
            host_backend(wave).kda_conv(&mut got, &spans, &mut f, &taps, kernel);
        }
        close(&got, &want, 1e-5, &format!("kda conv rows, wave {wave}"));
        for (g, w) in got_frames.iter().zip(&want_frames) {
            assert_eq!(g, w, "kda conv windows, wave {wave}: raw inputs, exact");
        }
    }
}

/// SwiGLU, GELU (both forms) and the table-driven RoPE (whole heads, and the interleaved rope
/// lanes of the DSpark draft with host-built tables), through the GPU backend over the host build
/// (`host_backend`), against the CPU backend at both waves.
#[test]
fn glu_gelu_and_rope_match_the_cpu_backend() {
    use kimi_kernels::Gelu;
    use kimi_kpl_host::host_backend;
    let mut rng = StdRng::seed_from_u64(11);
    for wave in WAVES {
        let kb = host_backend(wave);
        let n = 1001;
        let (gate, up) = (randn(&mut rng, n, 8.0), randn(&mut rng, n, 3.0));
        let (mut got, mut want) = (gate.clone(), gate.clone());
        kb.silu_glu(&mut got, &up);
        CpuBackend.silu_glu(&mut want, &up);
        close(&got, &want, 1e-5, &format!("silu_glu wave {wave}"));
        for kind in [Gelu::Tanh, Gelu::Erf] {
            let (mut got, mut want) = (gate.clone(), gate.clone());
            kb.gelu(&mut got, kind);
            CpuBackend.gelu(&mut want, kind);
            close(&got, &want, 2e-6, &format!("gelu {kind:?} wave {wave}"));
        }
        // 2-D RoPE tables over whole heads: 7 rows, 3 heads of 24 lanes.
        let (rows, heads, hd) = (7, 3, 24);
        let x = randn(&mut rng, rows * heads * hd, 2.0);
        let angles = randn(&mut rng, rows * hd / 2, 50.0);
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let (mut got, mut want) = (x.clone(), x.clone());
        kb.rope_cos_sin(&mut got, &cos, &sin, heads, hd);
        CpuBackend.rope_cos_sin(&mut want, &cos, &sin, heads, hd);
        close(&got, &want, 1e-6, &format!("rope_cos_sin wave {wave}"));
        // Interleaved rope lanes 8..16 of heads of 20, positions far apart, a YaRN magnitude.
        let positions = [0usize, 5, 4095, 77];
        let inv_freq = [1.0f32, 0.1, 0.01, 0.001];
        let x = randn(&mut rng, positions.len() * 2 * 20, 2.0);
        let (mut got, mut want) = (x.clone(), x.clone());
        kb.rope_interleaved(&mut got, &positions, 2, 20, 8, &inv_freq, 1.07);
        CpuBackend.rope_interleaved(&mut want, &positions, 2, 20, 8, &inv_freq, 1.07);
        close(&got, &want, 1e-6, &format!("rope_interleaved wave {wave}"));
    }
}

/// The matrix-core product on the emulated instructions: at wave 64 gfx950's
/// `v_mfma_f32_16x16x32_bf16` (16×16 tiles, K steps of 32), at wave 32 sm_90's `mma.m16n8k16`
/// (16×8 tiles, K steps of 16), each emulated from its ISA lane table written element → lane.
/// The kernel indexes its fragments through kpl's lane → element helpers, so a wrong entry in
/// either statement of a layout (or a kernel that ignores them) gives wrong products here. Ragged
/// shapes: partial row, column and K tiles, one row, blocks of two waves with a spare wave.
#[test]
fn mma_gemm_on_the_emulated_matrix_cores_matches_the_cpu_backend() {
    let mut rng = StdRng::seed_from_u64(0x6d6d61);
    for wave in WAVES {
        let (tm, tn) = if wave == 64 { (16, 16) } else { (16, 8) };
        for (m, n, k) in [(16usize, 16usize, 32usize), (19, 21, 40), (1, 33, 96), (35, 9, 16)] {
            let a: Vec<u16> = randn(&mut rng, m * k, 1.0).into_iter().map(f32_to_bf16_bits).collect();
            let b: Vec<u16> = randn(&mut rng, n * k, 1.0).into_iter().map(f32_to_bf16_bits).collect();
            let af: Vec<f32> = a.iter().map(|&x| f32::from_bits((x as u32) << 16)).collect();
            let mut want = vec![0f32; m * n];
            CpuBackend.matmul(&Matrix::Bf16(Bf16Matrix::new(&b, n, k)), &af, m, &mut want);
            let mut got = vec![f32::NAN; m * n];
            let tiles = m.div_ceil(tm) * n.div_ceil(tn);
            let p = kimi_kernels::gpu::abi::MmaGemmParams {
                a: addr(a.as_ptr()),
                b: addr(b.as_ptr()),
                c: addr(got.as_mut_ptr()),
                m: m as u32,
                n: n as u32,
                k: k as u32,
                pad_: 0,
            };
            // SAFETY: a, b and got hold m·k, n·k and m·n values and outlive the launch.
            unsafe {
                kimi_kpl_host::mma_gemm_bf16(Launch { grid: tiles.div_ceil(2) as u32 + 1, block: 2 * wave, wave }, p)
            };
            close(&got, &want, 1e-5 * k as f32, &format!("mma {m}×{n}×{k} wave {wave}"));
        }
    }
}

/// The indexer's top-k select against the CPU backend's selection on the same scores: rows of
/// different lengths (NaN past a query's position), a page another rank holds (NaN), two pages
/// with the same keys (exact ties, broken towards the lower position), k below, near and above the
/// number of held positions, blocks of one and of four waves.
#[test]
fn topk_select_matches_the_cpu_indexer_selection() {
    let mut rng = StdRng::seed_from_u64(0x746f706b);
    let (heads, dim, page_tokens) = (2usize, 8usize, 16usize);
    let mut keys = randn(&mut rng, 8 * page_tokens * dim, 1.0);
    // Page 5 repeats page 1: equal scores at positions 16 apart.
    let (a, b) = keys.split_at_mut(5 * page_tokens * dim);
    b[..page_tokens * dim].copy_from_slice(&a[page_tokens * dim..2 * page_tokens * dim]);
    let page = |i: usize| &keys[i * page_tokens * dim..(i + 1) * page_tokens * dim];
    let empty: &[f32] = &[];
    let caches = [
        kimi_kernels::PagedRows {
            pages: vec![page(0), page(1), page(2), page(3), page(4), page(5), page(6)],
            page_tokens,
            width: dim,
        },
        kimi_kernels::PagedRows { pages: vec![page(7), empty, page(1)], page_tokens, width: dim },
    ];
    let rows = [(0usize, 100usize), (0, 37), (1, 40), (0, 0), (1, 5)];
    let n = 101;
    let q = randn(&mut rng, rows.len() * heads * dim, 1.0);
    let w = randn(&mut rng, rows.len() * heads, 1.0);
    // A k whose cut falls between two equal scores of row 0 (its duplicated pages).
    let all = CpuBackend.indexer_topk(&q, &w, heads, 0.5, 1000, &rows, &caches);
    let s0 = &all[0].scores;
    let mut order: Vec<usize> = (0..s0.len()).filter(|&i| !s0[i].is_nan()).collect();
    order.sort_by(|&a, &b| s0[b].total_cmp(&s0[a]).then(a.cmp(&b)));
    let tie = order.windows(2).position(|p| s0[p[0]] == s0[p[1]]).expect("duplicated keys tie") + 1;
    let mut ties = 0;
    for topk in [8usize, 31, tie, 1000] {
        let sel = CpuBackend.indexer_topk(&q, &w, heads, 0.5, topk, &rows, &caches);
        ties += sel.iter().filter(|s| s.margin == 0.0).count();
        let mut scores = vec![f32::NAN; rows.len() * n];
        for (r, s) in sel.iter().enumerate() {
            scores[r * n..r * n + s.scores.len()].copy_from_slice(&s.scores);
        }
        for wave in WAVES {
            for block in [wave, 4 * wave] {
                let mut out = vec![u32::MAX; rows.len() * topk];
                let mut count = vec![u32::MAX; rows.len()];
                let p = kimi_kernels::gpu::abi::TopkParams {
                    scores: addr(scores.as_ptr()),
                    out: addr(out.as_mut_ptr()),
                    count: addr(count.as_mut_ptr()),
                    rows: rows.len() as u32,
                    n: n as u32,
                    k: topk as u32,
                    pad_: 0,
                };
                // SAFETY: scores holds rows·n values, out rows·topk and count rows; all outlive it.
                unsafe { kimi_kpl_host::topk_select_f32(Launch { grid: rows.len() as u32, block, wave }, p) };
                for (r, s) in sel.iter().enumerate() {
                    let got: Vec<usize> =
                        out[r * topk..r * topk + count[r] as usize].iter().map(|&x| x as usize).collect();
                    assert_eq!(got, s.tokens, "row {r}, top {topk}, block {block}, wave {wave}");
                }
            }
        }
    }
    assert!(ties > 0, "a cut between equal scores was exercised");
}

/// The logits statistics (what a sampler call starts from) against the CPU's reductions: rows of
/// random logits at two temperatures, a row with NaNs and a tie for the maximum (the lowest index
/// wins), an all-NaN row and an all −∞ row, a row of 163,840 (the release vocabulary).
#[test]
fn logits_stats_match_the_cpu_reductions() {
    use kimi_kernels::cpu::reduce::{argmax, log_sum_exp};
    let mut rng = StdRng::seed_from_u64(0x6c6f67);
    for (rows, cols) in [(5usize, 1000usize), (1, 163_840)] {
        let mut x = randn(&mut rng, rows * cols, 8.0);
        if rows > 1 {
            x[3] = f32::NAN;
            x[10] = 20.0;
            x[700] = 20.0;
            x[cols..2 * cols].fill(f32::NAN);
            x[2 * cols..3 * cols].fill(f32::NEG_INFINITY);
        }
        for temperature in [1.0f32, 0.7] {
            for wave in WAVES {
                let (mut mx, mut am, mut lse) = (vec![0f32; rows], vec![u32::MAX; rows], vec![0f32; rows]);
                let p = kimi_kernels::gpu::abi::LogitsStatsParams {
                    logits: addr(x.as_ptr()),
                    max: addr(mx.as_mut_ptr()),
                    argmax: addr(am.as_mut_ptr()),
                    lse: addr(lse.as_mut_ptr()),
                    rows: rows as u32,
                    cols: cols as u32,
                    inv_temperature: 1.0 / temperature,
                    pad_: 0,
                };
                // SAFETY: x holds rows·cols values and each output rows; all outlive the launch.
                unsafe { kimi_kpl_host::logits_stats_f32(Launch { grid: rows as u32, block: 4 * wave, wave }, p) };
                for r in 0..rows {
                    let row = &x[r * cols..(r + 1) * cols];
                    let (i, m) = argmax(row);
                    let what = format!("row {r} of {cols}, T {temperature}, wave {wave}");
                    assert_eq!((am[r], mx[r].to_bits()), (i, m.to_bits()), "{what}: argmax");
                    let want = log_sum_exp(row, temperature);
                    assert!(
                        want.to_bits() == lse[r].to_bits() || (want - lse[r]).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{what}: log-sum-exp {} vs {want}",
                        lse[r]
                    );
                }
            }
        }
    }
}

/// FP8 activation quantisation against the CPU's E4M3 encoder, code for code: random rows, a zero
/// row, a row with NaN and ±∞ (its scale falls back to 1), a row of every E4M3 value times a
/// scale and the midpoints between neighbours (ties to even), values in the subnormal range.
#[test]
fn fp8_quantize_matches_the_cpu_encoder() {
    use kimi_kernels::cpu::fp8::{e4m3_to_f32, f32_to_e4m3};
    let mut rng = StdRng::seed_from_u64(0x667038);
    let cols = 300usize;
    let mut rows: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, cols, 5.0)).collect();
    rows.push(vec![0.0; cols]);
    let mut special = randn(&mut rng, cols, 1.0);
    special[0] = f32::NAN;
    special[1] = f32::INFINITY;
    special[2] = f32::NEG_INFINITY;
    rows.push(special);
    // Every finite code's value and the midpoints to the next, scaled so max|x| = 448 exactly.
    let mut grid: Vec<f32> = (0u8..0x7F).map(e4m3_to_f32).collect();
    let mids: Vec<f32> = grid.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    grid.extend(mids);
    grid.extend(grid.clone().iter().map(|v| -v));
    grid.resize(cols, 1e-4);
    rows.push(grid);
    let x: Vec<f32> = rows.concat();
    let n = rows.len();
    let mut want_codes = Vec::new();
    let mut want_scales = Vec::new();
    for row in &rows {
        let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if m > 0.0 && m.is_finite() { m / 448.0 } else { 1.0 };
        want_scales.push(s);
        want_codes.extend(row.iter().map(|v| f32_to_e4m3(v / s)));
    }
    for wave in WAVES {
        let (mut codes, mut scales) = (vec![0xAAu8; n * cols], vec![0f32; n]);
        let p = kimi_kernels::gpu::abi::Fp8QuantizeParams {
            x: addr(x.as_ptr()),
            codes: addr(codes.as_mut_ptr()),
            scales: addr(scales.as_mut_ptr()),
            rows: n as u32,
            cols: cols as u32,
        };
        // SAFETY: x and codes hold rows·cols values, scales rows; all outlive the launch.
        unsafe { kimi_kpl_host::fp8_quantize_f32(Launch { grid: n as u32, block: 2 * wave, wave }, p) };
        assert_eq!(scales, want_scales, "wave {wave}: scales");
        for (i, (g, w)) in codes.iter().zip(&want_codes).enumerate() {
            assert_eq!(g, w, "wave {wave}: row {}, column {}: value {}", i / cols, i % cols, x[i]);
        }
    }
}
