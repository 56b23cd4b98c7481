//! The Triton kernels (`kernels/triton/`) run on the CPU by Triton's interpreter (numpy only, every
//! buffer ending at a guard page) against the Rust CPU backend: this test writes cases — inputs,
//! the CPU backend's outputs and an error bound per element — and `kernels/triton/check.py`
//! launches each kernel on them. Shapes are small and ragged (partial row, column and K tiles, one
//! token, several K steps), with MXFP4 scale bytes 0, 254 and 255, a zero FP8 row and an empty
//! expert group. Skipped, saying so, only when the tools' venv cannot be installed (no PyPI, a full
//! disk).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kimi_kernels::cpu::fp8::{e4m3_to_f32, f32_to_e4m3, quantize_rows as fp8_rows};
use kimi_kernels::cpu::mxfp4::quantize_rows as mxfp4_rows;
use kimi_kernels::{Backend, Bf16Matrix, CpuBackend, Fp8Matrix, Matrix, Mxfp4Matrix, f32_to_bf16_bits};
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Deterministic values in about [-1, 1].
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn bf16(x: f32) -> f32 {
    f32::from_bits((f32_to_bf16_bits(x) as u32) << 16)
}

/// What the BF16 / MXFP4 products multiply for an f32 activation: its BF16 `hi + lo` split.
fn bf16x2(x: f32) -> f32 {
    let hi = bf16(x);
    hi + bf16(x - hi)
}

/// A tensor file of a case.
enum Data {
    F32(Vec<f32>),
    U8(Vec<u8>),
    Bf16(Vec<u16>),
    I32(Vec<i32>),
}

struct Case {
    name: String,
    kernel: &'static str,
    params: serde_json::Value,
    inputs: Vec<(&'static str, Data, Vec<usize>)>,
    outputs: Vec<Output>,
}

/// An output the kernel writes: the CPU backend's values and the allowed |Δ| per element.
struct Output {
    name: &'static str,
    want: Vec<f32>,
    bound: Vec<f32>,
    shape: Vec<usize>,
}

/// The single output `y` of a product, its bound 1e-5 of Σ|terms| (f32 rounding of another
/// summation order stays well inside).
fn product(want: Vec<f32>, bound: Vec<f32>, shape: Vec<usize>) -> Vec<Output> {
    vec![Output { name: "y", want, bound, shape }]
}

impl Case {
    fn write(&self, dir: &Path) {
        let d = dir.join(&self.name);
        std::fs::create_dir_all(&d).expect("case dir");
        let mut inputs = serde_json::Map::new();
        for (name, data, shape) in &self.inputs {
            let (dtype, bytes, bf16): (&str, Vec<u8>, bool) = match data {
                Data::F32(v) => ("f32", v.iter().flat_map(|x| x.to_le_bytes()).collect(), false),
                Data::U8(v) => ("u8", v.clone(), false),
                Data::Bf16(v) => ("u16", v.iter().flat_map(|x| x.to_le_bytes()).collect(), true),
                Data::I32(v) => ("i32", v.iter().flat_map(|x| x.to_le_bytes()).collect(), false),
            };
            std::fs::write(d.join(format!("{name}.bin")), bytes).expect("write input");
            inputs.insert(
                name.to_string(),
                json!({"file": format!("{name}.bin"), "dtype": dtype, "shape": shape, "bf16": bf16}),
            );
        }
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut outputs = serde_json::Map::new();
        for o in &self.outputs {
            assert_eq!(o.want.len(), o.shape.iter().product::<usize>(), "{}: {}", self.name, o.name);
            std::fs::write(d.join(format!("{}.want.bin", o.name)), f32s(&o.want)).expect("want");
            std::fs::write(d.join(format!("{}.bound.bin", o.name)), f32s(&o.bound)).expect("bound");
            outputs.insert(
                o.name.to_string(),
                json!({
                    "want": {"file": format!("{}.want.bin", o.name), "dtype": "f32", "shape": o.shape},
                    "bound": {"file": format!("{}.bound.bin", o.name), "dtype": "f32", "shape": o.shape},
                }),
            );
        }
        let case = json!({
            "name": self.name, "kernel": self.kernel, "params": self.params, "inputs": inputs, "outputs": outputs,
        });
        std::fs::write(d.join("case.json"), case.to_string()).expect("case.json");
    }
}

/// 1e-5 · Σ_c |w[r, c] x[t, c]| per output (f32 accumulation in another order stays well inside).
fn bound(w: &[f32], x: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for t in 0..m {
        for r in 0..n {
            let s: f64 = (0..k).map(|c| (w[r * k + c] as f64 * x[t * k + c] as f64).abs()).sum();
            out[t * n + r] = (1e-5 * s) as f32 + 1e-30;
        }
    }
    out
}

fn blocks(bk: usize) -> serde_json::Value {
    json!({"block_m": 16, "block_n": 32, "block_k": bk})
}

fn with_blocks(mut p: serde_json::Value, bk: usize) -> serde_json::Value {
    for (k, v) in blocks(bk).as_object().expect("object") {
        p[k] = v.clone();
    }
    p
}

fn bf16_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    for (m, n, k) in [(1, 33, 64), (3, 37, 96), (17, 64, 160)] {
        let w: Vec<u16> = rng.vec(n * k).into_iter().map(f32_to_bf16_bits).collect();
        let x = rng.vec(m * k);
        // The matrix cores see BF16 activations: the reference gets the same rounded values.
        let xr: Vec<f32> = x.iter().map(|&v| bf16x2(v)).collect();
        let mut want = vec![0f32; m * n];
        CpuBackend.matmul(&Matrix::Bf16(Bf16Matrix::new(&w, n, k)), &xr, m, &mut want);
        let wf: Vec<f32> = w.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
        out.push(Case {
            name: format!("bf16_m{m}_n{n}_k{k}"),
            kernel: "matmul_bf16",
            params: with_blocks(json!({"m": m, "n": n, "k": k}), 64),
            inputs: vec![("x", Data::F32(x), vec![m, k]), ("w", Data::Bf16(w), vec![n, k])],
            outputs: product(want, bound(&wf, &xr, n, k, m), vec![m, n]),
        });
    }
}

/// An MXFP4 matrix from random values, with scale bytes at the edges of the E8M0 range in some
/// rows: 0 (2⁻¹²⁷), 254 (2¹²⁷, with one small code so the row stays finite) and 255 (NaN).
fn mxfp4_matrix(rng: &mut Rng, n: usize, k: usize, edges: bool) -> (Vec<u8>, Vec<u8>) {
    let (mut q, mut s) = mxfp4_rows(&rng.vec(n * k), n, k);
    if edges && n >= 3 {
        s[0] = 0;
        let g = k / 32;
        q[k / 2..k / 2 + 16].fill(0);
        q[k / 2] = 0x01; // one 0.5 in the group
        s[g] = 254;
        s[2 * g + g - 1] = 255;
    }
    (q, s)
}

fn mxfp4_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    for (m, n, k, bk) in [(1, 33, 64, 64), (3, 65, 96, 64), (17, 40, 160, 32)] {
        let (q, s) = mxfp4_matrix(rng, n, k, true);
        let x = rng.vec(m * k);
        let xr: Vec<f32> = x.iter().map(|&v| bf16x2(v)).collect();
        let mat = Mxfp4Matrix::new(&q, &s, n, k);
        let mut want = vec![0f32; m * n];
        CpuBackend.matmul(&Matrix::Mxfp4(mat), &xr, m, &mut want);
        let wf: Vec<f32> = mat.to_f32().into_iter().map(|v| if v.is_nan() { 0.0 } else { v }).collect();
        out.push(Case {
            name: format!("mxfp4_m{m}_n{n}_k{k}_bk{bk}"),
            kernel: "matmul_mxfp4",
            params: with_blocks(json!({"m": m, "n": n, "k": k}), bk),
            inputs: vec![
                ("x", Data::F32(x), vec![m, k]),
                ("wq", Data::U8(q), vec![n, k / 2]),
                ("ws", Data::U8(s), vec![n, k / 32]),
            ],
            outputs: product(want, bound(&wf, &xr, n, k, m), vec![m, n]),
        });
    }
}

fn fp8_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    for (m, n, k) in [(1, 33, 64), (5, 48, 96)] {
        let mut wv = rng.vec(n * k);
        wv[..k].fill(0.0); // a zero row: scale 1, every code 0
        // Row 1: one large value and the rest 10⁻⁵ of it, so its codes reach E4M3's subnormals.
        for v in &mut wv[k + 1..2 * k] {
            *v *= 1e-5;
        }
        wv[k] = 1.0;
        let (wq, ws) = fp8_rows(&wv, n, k);
        let mut x = rng.vec(m * k);
        // Token 0 the same way.
        for v in &mut x[1..k] {
            *v *= 1e-5;
        }
        x[0] = -1.0;
        let mut want = vec![0f32; m * n];
        CpuBackend.matmul(&Matrix::Fp8(Fp8Matrix::new(&wq, &ws, n, k)), &x, m, &mut want);
        // The tokens' codes and scales as the CPU product forms them (ATOM's ptpc_fp8).
        let mut xq = vec![0u8; m * k];
        let mut xs = vec![1f32; m];
        for t in 0..m {
            let row = &x[t * k..(t + 1) * k];
            let mx = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            if mx > 0.0 {
                xs[t] = mx / 448.0;
            }
            for (c, v) in row.iter().enumerate() {
                xq[t * k + c] = f32_to_e4m3(v / xs[t]);
            }
        }
        let wf: Vec<f32> = (0..n * k).map(|i| e4m3_to_f32(wq[i]) * ws[i / k]).collect();
        let xf: Vec<f32> = (0..m * k).map(|i| e4m3_to_f32(xq[i]) * xs[i / k]).collect();
        out.push(Case {
            name: format!("fp8_m{m}_n{n}_k{k}"),
            kernel: "matmul_fp8",
            params: with_blocks(json!({"m": m, "n": n, "k": k}), 64),
            inputs: vec![
                ("xq", Data::U8(xq), vec![m, k]),
                ("xs", Data::F32(xs), vec![m]),
                ("wq", Data::U8(wq), vec![n, k]),
                ("ws", Data::F32(ws), vec![n]),
            ],
            outputs: product(want, bound(&wf, &xf, n, k, m), vec![m, n]),
        });
    }
}

/// Grouped MoE over MXFP4 experts: 20 tokens, 2 choices each, routed unevenly — expert 0 takes
/// 18 pairs (two row tiles), expert 2 none.
fn moe_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    let (experts, n, k, tokens) = (5usize, 48usize, 96usize, 20usize);
    let mats: Vec<(Vec<u8>, Vec<u8>)> = (0..experts).map(|_| mxfp4_matrix(rng, n, k, false)).collect();
    let x = rng.vec(tokens * k);
    let xr: Vec<f32> = x.iter().map(|&v| bf16x2(v)).collect();
    let mut pairs: Vec<(usize, usize)> = Vec::new(); // (expert, token)
    for t in 0..tokens {
        let a = if t < 18 { 0 } else { 1 };
        let b = [1, 3, 4][t % 3];
        pairs.push((a, t));
        pairs.push((b, t));
    }
    pairs.sort();
    let mut offsets = vec![0i32; experts + 1];
    for &(e, _) in &pairs {
        offsets[e + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    assert_eq!(offsets[3] - offsets[2], 0, "expert 2 is empty");
    let rows: Vec<i32> = pairs.iter().map(|p| p.1 as i32).collect();
    let p = pairs.len();
    let mut want = vec![0f32; p * n];
    let mut bnd = vec![0f32; p * n];
    for (i, &(e, t)) in pairs.iter().enumerate() {
        let mat = Mxfp4Matrix::new(&mats[e].0, &mats[e].1, n, k);
        CpuBackend.matmul(&Matrix::Mxfp4(mat), &xr[t * k..(t + 1) * k], 1, &mut want[i * n..(i + 1) * n]);
        bnd[i * n..(i + 1) * n].copy_from_slice(&bound(&mat.to_f32(), &xr[t * k..(t + 1) * k], n, k, 1));
    }
    let wq: Vec<u8> = mats.iter().flat_map(|m| m.0.clone()).collect();
    let ws: Vec<u8> = mats.iter().flat_map(|m| m.1.clone()).collect();
    out.push(Case {
        name: "moe_mxfp4_e5_t20".into(),
        kernel: "moe_mxfp4",
        params: with_blocks(json!({"experts": experts, "n": n, "k": k}), 64),
        inputs: vec![
            ("x", Data::F32(x), vec![tokens, k]),
            ("rows", Data::I32(rows), vec![p]),
            ("offsets", Data::I32(offsets), vec![experts + 1]),
            ("wq", Data::U8(wq), vec![experts, n, k / 2]),
            ("ws", Data::U8(ws), vec![experts, n, k / 32]),
        ],
        outputs: product(want, bnd, vec![p, n]),
    });
}

/// The CPU backend's view of sequences whose rows live in `arena` pages (`[pages, page_tokens,
/// width]`) through page tables (−1: a page another context-parallel rank holds).
fn paged<'a>(
    tables: &[&[i32]],
    arena: &'a [f32],
    page_tokens: usize,
    width: usize,
) -> Vec<kimi_kernels::PagedRows<'a>> {
    let page = page_tokens * width;
    tables
        .iter()
        .map(|t| kimi_kernels::PagedRows {
            pages: t.iter().map(|&p| if p < 0 { &arena[..0] } else { &arena[p as usize * page..][..page] }).collect(),
            page_tokens,
            width,
        })
        .collect()
}

/// The page tables as the kernels take them: `[sequences, max_pages]`, −1 past each table.
fn table_matrix(tables: &[&[i32]], max_pages: usize) -> Vec<i32> {
    let mut m = vec![-1i32; tables.len() * max_pages];
    for (s, t) in tables.iter().enumerate() {
        m[s * max_pages..s * max_pages + t.len()].copy_from_slice(t);
    }
    m
}

/// Absorbed MLA decode over a paged latent arena (pages out of order; a hole another
/// context-parallel rank holds; sequences of 1, 40 and 65 tokens; queries mid-sequence and inside
/// the hole's span), whole (one split) and split three ways then merged.
fn mla_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    let (heads, rank, rope, page_tokens, pages) = (5usize, 48usize, 8usize, 16usize, 12usize);
    let w = rank + rope;
    let arena = rng.vec(pages * page_tokens * w);
    let max_pages = 6;
    // Page tables, −1 for a hole.
    let tables: [&[i32]; 3] = [&[3], &[0, 7, 2, 9, 5], &[1, -1, 4]];
    let rows = [(0usize, 0usize), (1, 64), (2, 39), (1, 20), (2, 20)];
    let tokens = rows.len();
    let q = rng.vec(tokens * heads * w);
    let scale = 0.3f32;
    let caches = paged(&tables, &arena, page_tokens, w);
    let mut ctx = vec![0f32; tokens * heads * rank];
    let mut lse = vec![0f32; tokens * heads];
    CpuBackend.mla_attention(&q, heads, rank, scale, &rows, &caches, None, &mut ctx, Some(&mut lse));
    let table = table_matrix(&tables, max_pages);
    for (splits, split_tokens) in [(1usize, 80usize), (3, 32)] {
        out.push(Case {
            name: format!("mla_decode_splits{splits}"),
            kernel: "mla_decode",
            params: json!({
                "tokens": tokens, "heads": heads, "rank": rank, "rope": rope, "page_tokens": page_tokens,
                "max_pages": max_pages, "split_tokens": split_tokens, "splits": splits, "scale": scale,
                "block_h": 16, "block_s": 16, "r_pad": 64, "p_pad": 16,
            }),
            inputs: vec![
                ("q", Data::F32(q.clone()), vec![tokens, heads, w]),
                ("cache", Data::F32(arena.clone()), vec![pages, page_tokens, w]),
                ("table", Data::I32(table.clone()), vec![tables.len(), max_pages]),
                ("seq", Data::I32(rows.iter().map(|r| r.0 as i32).collect()), vec![tokens]),
                ("pos", Data::I32(rows.iter().map(|r| r.1 as i32).collect()), vec![tokens]),
            ],
            outputs: vec![
                // Contexts are convex combinations of rows in [-1, 1]; scores stay O(1).
                Output {
                    name: "ctx",
                    want: ctx.clone(),
                    bound: vec![2e-5; ctx.len()],
                    shape: vec![tokens, heads, rank],
                },
                Output {
                    name: "lse",
                    bound: lse.iter().map(|l| 1e-5 * (1.0 + l.abs())).collect(),
                    want: lse.clone(),
                    shape: vec![tokens, heads],
                },
            ],
        });
    }
}

/// The K3.1 indexer's scores over a paged key arena (a hole another rank holds; sequences of 1,
/// 40 and 65 tokens; positions past each query's own are −∞), against the scores the CPU
/// backend's `indexer_topk` ranks.
fn indexer_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    let (heads, dim, page_tokens, pages, max_pages, s_max) = (4usize, 24usize, 16usize, 12usize, 6usize, 80usize);
    let keys = rng.vec(pages * page_tokens * dim);
    let tables: [&[i32]; 3] = [&[3], &[0, 7, 2, 9, 5], &[1, -1, 4]];
    let rows = [(0usize, 0usize), (1, 64), (2, 39), (1, 20), (2, 20)];
    let tokens = rows.len();
    let q = rng.vec(tokens * heads * dim);
    let w = rng.vec(tokens * heads);
    let scale = 0.25f32;
    let caches = paged(&tables, &keys, page_tokens, dim);
    let sel = CpuBackend.indexer_topk(&q, &w, heads, scale, 8, &rows, &caches);
    let mut want = vec![f32::NEG_INFINITY; tokens * s_max];
    let mut bnd = vec![0f32; tokens * s_max];
    for (t, &(seq, pos)) in rows.iter().enumerate() {
        want[t * s_max..t * s_max + pos + 1].copy_from_slice(&sel[t].scores);
        for s in 0..=pos {
            if caches[seq].holds(s) {
                let k = caches[seq].row(s);
                let terms: f64 = (0..heads)
                    .map(|j| {
                        let qj = &q[(t * heads + j) * dim..][..dim];
                        (w[t * heads + j] * scale).abs() as f64
                            * qj.iter().zip(k).map(|(a, b)| (a * b).abs() as f64).sum::<f64>()
                    })
                    .sum();
                bnd[t * s_max + s] = (1e-5 * terms) as f32 + 1e-30;
            }
        }
    }
    let table = table_matrix(&tables, max_pages);
    out.push(Case {
        name: "indexer_scores".into(),
        kernel: "indexer_scores",
        params: json!({
            "tokens": tokens, "heads": heads, "dim": dim, "page_tokens": page_tokens, "max_pages": max_pages,
            "s_max": s_max, "scale": scale, "block_h": 16, "block_s": 16, "d_pad": 32,
        }),
        inputs: vec![
            ("q", Data::F32(q), vec![tokens, heads, dim]),
            ("w", Data::F32(w), vec![tokens, heads]),
            ("keys", Data::F32(keys), vec![pages, page_tokens, dim]),
            ("table", Data::I32(table), vec![tables.len(), max_pages]),
            ("seq", Data::I32(rows.iter().map(|r| r.0 as i32).collect()), vec![tokens]),
            ("pos", Data::I32(rows.iter().map(|r| r.1 as i32).collect()), vec![tokens]),
        ],
        outputs: vec![Output { name: "scores", want, bound: bnd, shape: vec![tokens, s_max] }],
    });
}

/// KDA's chunked prefill over a varlen batch (sequences of 40, 17 and 1 tokens: full, partial
/// and single-token chunks of 16), strong and weak per-key decays, from a nonzero state, against
/// the CPU backend's chunked form (`kda_prefill`, chunks of 64 in sub-chunks of 16).
fn kda_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    let (heads, dk, dv) = (2usize, 24usize, 20usize);
    let lens = [40usize, 17, 1];
    let tokens: usize = lens.iter().sum();
    let normalize = |v: &mut [f32]| {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        v.iter_mut().for_each(|x| *x /= n);
    };
    let scale = 1.0 / (dk as f32).sqrt();
    let mut q = rng.vec(tokens * heads * dk);
    let mut k = rng.vec(tokens * heads * dk);
    for r in 0..tokens * heads {
        normalize(&mut q[r * dk..(r + 1) * dk]);
        q[r * dk..(r + 1) * dk].iter_mut().for_each(|x| *x *= scale);
        normalize(&mut k[r * dk..(r + 1) * dk]);
    }
    let v = rng.vec(tokens * heads * dv);
    // Log decays lower_bound · σ(z) with lower_bound −5: some near 0, some strong.
    let g: Vec<f32> = rng.vec(tokens * heads * dk).iter().map(|z| -5.0 / (1.0 + (-4.0 * z).exp())).collect();
    let beta: Vec<f32> = rng.vec(tokens * heads).iter().map(|z| 1.0 / (1.0 + (-2.0 * z).exp())).collect();
    let state0: Vec<f32> = rng.vec(lens.len() * heads * dk * dv).iter().map(|x| 0.5 * x).collect();
    let mut state = state0.clone();
    let mut o = vec![0f32; tokens * heads * dv];
    let mut t0 = 0;
    for (s, &n) in lens.iter().enumerate() {
        for h in 0..heads {
            // The head's rows, contiguous, as the CPU routine takes them.
            let gather = |x: &[f32], w: usize| -> Vec<f32> {
                (t0..t0 + n).flat_map(|t| x[(t * heads + h) * w..][..w].to_vec()).collect()
            };
            let (qh, kh, vh, gh) = (gather(&q, dk), gather(&k, dk), gather(&v, dv), gather(&g, dk));
            let bh: Vec<f32> = (t0..t0 + n).map(|t| beta[t * heads + h]).collect();
            let mut oh = vec![0f32; n * dv];
            let st = &mut state[(s * heads + h) * dk * dv..][..dk * dv];
            kimi_kernels::cpu::kda::kda_prefill(st, &qh, &kh, &vh, &gh, &bh, &mut oh, dk, dv);
            for i in 0..n {
                o[((t0 + i) * heads + h) * dv..][..dv].copy_from_slice(&oh[i * dv..(i + 1) * dv]);
            }
        }
        t0 += n;
    }
    let mut cu = vec![0i32];
    for &n in &lens {
        cu.push(cu.last().copied().unwrap_or(0) + n as i32);
    }
    let rel = |w: &[f32]| -> Vec<f32> { w.iter().map(|x| 2e-5 * (1.0 + x.abs())).collect() };
    out.push(Case {
        name: "kda_chunk_prefill".into(),
        kernel: "kda_chunk_prefill",
        params: json!({
            "sequences": lens.len(), "heads": heads, "k": dk, "v": dv, "chunk": 16, "block_k": 16, "block_v": 16,
        }),
        inputs: vec![
            ("q", Data::F32(q), vec![tokens, heads, dk]),
            ("k", Data::F32(k), vec![tokens, heads, dk]),
            ("v", Data::F32(v), vec![tokens, heads, dv]),
            ("g", Data::F32(g), vec![tokens, heads, dk]),
            ("beta", Data::F32(beta), vec![tokens, heads]),
            ("state0", Data::F32(state0), vec![lens.len(), heads, dk, dv]),
            ("cu", Data::I32(cu), vec![lens.len() + 1]),
        ],
        outputs: vec![
            Output { name: "out", bound: rel(&o), want: o, shape: vec![tokens, heads, dv] },
            Output { name: "state", bound: rel(&state), want: state, shape: vec![lens.len(), heads, dk, dv] },
        ],
    });
}

/// The vision tower's block-diagonal attention: three spans (17, 1 and 40 rows: partial, single
/// and multi-block query and key tiles) with a row in no span between them (zeros), against the
/// CPU backend's `attention_varlen`.
fn attention_cases(rng: &mut Rng, out: &mut Vec<Case>) {
    let (heads, dim) = (3usize, 24usize);
    let spans = [(0usize, 17usize), (18, 1), (19, 40)];
    let rows = 59;
    let (q, k, v) = (rng.vec(rows * heads * dim), rng.vec(rows * heads * dim), rng.vec(rows * heads * dim));
    let scale = 1.0 / (dim as f32).sqrt();
    let ss: Vec<kimi_kernels::SeqSpan> =
        spans.iter().map(|&(start, len)| kimi_kernels::SeqSpan { start, len, pos: 0 }).collect();
    let mut want = vec![0f32; rows * heads * dim];
    CpuBackend.attention_varlen(&q, &k, &v, heads, dim, &ss, scale, &mut want);
    out.push(Case {
        name: "attention_varlen".into(),
        kernel: "attention_varlen",
        params: json!({"heads": heads, "dim": dim, "scale": scale, "block_m": 16, "block_n": 16, "d_pad": 32}),
        inputs: vec![
            ("q", Data::F32(q), vec![rows, heads, dim]),
            ("k", Data::F32(k), vec![rows, heads, dim]),
            ("v", Data::F32(v), vec![rows, heads, dim]),
            ("starts", Data::I32(spans.iter().map(|s| s.0 as i32).collect()), vec![spans.len()]),
            ("lens", Data::I32(spans.iter().map(|s| s.1 as i32).collect()), vec![spans.len()]),
        ],
        // Convex combinations of values in [-1, 1].
        outputs: vec![Output { name: "out", bound: vec![2e-5; want.len()], want, shape: vec![rows, heads, dim] }],
    });
}

/// The tools' Python, installed once for every test here (they run in parallel); `None` (the test
/// skips, saying why) when the machine cannot install them.
fn tools_python() -> Option<String> {
    static PYTHON: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let tools = Command::new("bash").arg(root().join("scripts/gpu-tools.sh")).output().expect("bash");
            if !tools.status.success() {
                let err = String::from_utf8_lossy(&tools.stderr);
                // 75: the tools could not be installed (no PyPI, a full disk), the machine's fault.
                if tools.status.code() == Some(75) {
                    eprintln!("SKIPPED: the GPU tools' venv (triton, numpy) could not be installed:\n{err}");
                    return None;
                }
                panic!("scripts/gpu-tools.sh failed:\n{err}");
            }
            Some(String::from_utf8_lossy(&tools.stdout).trim().to_string())
        })
        .clone()
}

#[test]
fn triton_kernels_match_the_cpu_backend_in_the_interpreter() {
    let Some(python) = tools_python() else { return };
    let dir = root().join("target/triton-cases");
    let _ = std::fs::remove_dir_all(&dir);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cases = Vec::new();
    bf16_cases(&mut rng, &mut cases);
    mxfp4_cases(&mut rng, &mut cases);
    fp8_cases(&mut rng, &mut cases);
    moe_cases(&mut rng, &mut cases);
    mla_cases(&mut rng, &mut cases);
    indexer_cases(&mut rng, &mut cases);
    kda_cases(&mut rng, &mut cases);
    attention_cases(&mut rng, &mut cases);
    for c in &cases {
        c.write(&dir);
    }
    // The interpreter runs the kernels in Python; a hang (a loop that never ends) must not stall CI.
    let mut child = Command::new(&python)
        .arg(root().join("kernels/triton/check.py"))
        .arg(&dir)
        .env("TRITON_INTERPRET", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("check.py ran past 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let run = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&run.stdout);
    print!("{stdout}");
    assert!(
        run.status.success(),
        "Triton kernels disagree with the CPU backend (status {:?}; a signal means a guard page was hit):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains(&format!("{n} of {n} Triton cases match", n = cases.len())), "{stdout}");
}

/// The GPU backend's own Triton launches — its argument lists, strides, grids and resident
/// weights, as a GPU would receive them — replayed in the interpreter (`HostDevice::with_triton`),
/// against the CPU backend: BF16 and MXFP4 products with partial tiles in every dimension and
/// several K steps, MXFP4 scale bytes 0, 254 and 255 (NaN), each weight multiplied twice (the
/// second time from its resident copy).
#[test]
fn gpu_backend_triton_launches_match_the_cpu_backend_in_the_interpreter() {
    use kimi_kernels::gpu::backend::GpuBackend;
    let Some(python) = tools_python() else { return };
    let dev = std::sync::Arc::new(kimi_kpl_host::HostDevice::with_triton(64, Path::new(&python)).expect("signatures"));
    let be = GpuBackend::new(dev.clone());
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let check = |name: &str, w: &Matrix<'_>, x: &[f32], m: usize| {
        let n = w.rows();
        // The tensor cores take activations as BF16 hi + lo; so does the reference here.
        let xr: Vec<f32> = x.iter().map(|&v| bf16x2(v)).collect();
        let mut want = vec![0f32; m * n];
        CpuBackend.matmul(w, &xr, m, &mut want);
        for round in 0..2 {
            let mut got = vec![f32::NAN; m * n];
            be.matmul(w, x, m, &mut got);
            // A NaN scale (E8M0 255) makes its row NaN on both sides; every other value is finite.
            assert!(got.iter().zip(&want).all(|(g, w)| g.is_nan() == w.is_nan()), "{name}, round {round}: NaNs");
            assert!(got.iter().all(|g| g.is_nan() || g.is_finite()), "{name}, round {round}: infinities");
            let worst = got
                .iter()
                .zip(&want)
                .filter(|(_, w)| !w.is_nan())
                .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "{name}, round {round}: |Δ| {worst}");
        }
    };
    let (m, n, k) = (19usize, 70usize, 160usize);
    let w: Vec<u16> = rng.vec(n * k).into_iter().map(f32_to_bf16_bits).collect();
    check("BF16 19×70×160", &Matrix::Bf16(Bf16Matrix::new(&w, n, k)), &rng.vec(m * k), m);
    let (m, n, k) = (5usize, 67usize, 288usize);
    let (q, sc) = mxfp4_matrix(&mut rng, n, k, true);
    check("MXFP4 5×67×288", &Matrix::Mxfp4(Mxfp4Matrix::new(&q, &sc, n, k)), &rng.vec(m * k), m);
    // Only the three weight buffers stay on the "device"; the staging was freed.
    let resident = [w.len() * 2, q.len(), sc.len()].iter().map(|b| b.div_ceil(8) * 8).sum::<usize>();
    assert_eq!(dev.allocated(), resident);
}

/// The GPU backend's MLA attention on `triton_mla_decode`, its page arena and table staged from
/// the sequences' pages, replayed in the interpreter against the CPU backend: two sequences, one
/// with a hole (a page another context-parallel rank holds), ragged heads, a token whose only
/// page is the hole (zero context, −∞ log-sum-exp).
#[test]
fn gpu_backend_mla_attention_matches_the_cpu_backend_in_the_interpreter() {
    use kimi_kernels::PagedRows;
    use kimi_kernels::gpu::backend::GpuBackend;
    let Some(python) = tools_python() else { return };
    let dev = std::sync::Arc::new(kimi_kpl_host::HostDevice::with_triton(64, Path::new(&python)).expect("signatures"));
    let be = GpuBackend::new(dev.clone());
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let (heads, rank, rope, page_tokens) = (3usize, 40usize, 8usize, 16usize);
    let width = rank + rope;
    let pages0: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(page_tokens * width)).collect();
    let page1 = rng.vec(page_tokens * width);
    let caches = [
        PagedRows { pages: pages0.iter().map(|p| &p[..]).collect(), page_tokens, width },
        PagedRows { pages: vec![&[][..], &page1[..]], page_tokens, width },
    ];
    let rows = [(0usize, 35usize), (1, 20), (0, 47), (1, 5), (0, 0)];
    let q = rng.vec(rows.len() * heads * width);
    let scale = 1.0 / (width as f32).sqrt();
    let (mut want, mut want_lse) = (vec![0f32; rows.len() * heads * rank], vec![0f32; rows.len() * heads]);
    CpuBackend.mla_attention(&q, heads, rank, scale, &rows, &caches, None, &mut want, Some(&mut want_lse));
    let (mut got, mut got_lse) = (vec![f32::NAN; want.len()], vec![f32::NAN; want_lse.len()]);
    be.mla_attention(&q, heads, rank, scale, &rows, &caches, None, &mut got, Some(&mut got_lse));
    let close = |g: &[f32], w: &[f32], what: &str| {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert!(g == w || (g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
        }
    };
    close(&got, &want, "ctx");
    close(&got_lse, &want_lse, "lse");
    assert!(want_lse[3 * heads..4 * heads].iter().all(|l| *l == f32::NEG_INFINITY), "the hole-only token");
    // Without the log-sum-exp output too (the usual, single-rank call).
    let mut got = vec![f32::NAN; want.len()];
    be.mla_attention(&q, heads, rank, scale, &rows, &caches, None, &mut got, None);
    close(&got, &want, "ctx without lse");
    assert_eq!(dev.allocated(), 0, "the staging was freed");
}

/// The GPU backend's indexer (scores on `triton_indexer_scores`, the top-k on the host), vision
/// attention and context-parallel merge, replayed in the interpreter, against the CPU backend:
/// the indexer over two sequences with a hole and a cut inside a page, attention over ragged
/// spans with a row in none, the merge with a partial that holds nothing.
#[test]
fn gpu_backend_indexer_vision_attention_and_merge_match_the_cpu_backend_in_the_interpreter() {
    use kimi_kernels::gpu::backend::GpuBackend;
    use kimi_kernels::{PagedRows, SeqSpan};
    let Some(python) = tools_python() else { return };
    let dev = std::sync::Arc::new(kimi_kpl_host::HostDevice::with_triton(64, Path::new(&python)).expect("signatures"));
    let be = GpuBackend::new(dev.clone());
    let mut rng = Rng(0x0bad_cafe_f00d_1234);
    let close = |g: &[f32], w: &[f32], what: &str| {
        assert_eq!(g.len(), w.len(), "{what}");
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            let same = g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= 2e-5 * (1.0 + w.abs());
            assert!(same, "{what}[{i}]: {g} vs {w}");
        }
    };
    // Indexer: 3 heads of 24, 16-position pages; sequence 1's first page is another rank's.
    let (heads, d, page_tokens) = (3usize, 24usize, 16usize);
    let pages0: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(page_tokens * d)).collect();
    let page1 = rng.vec(page_tokens * d);
    let keys = [
        PagedRows { pages: pages0.iter().map(|p| &p[..]).collect(), page_tokens, width: d },
        PagedRows { pages: vec![&[][..], &page1[..]], page_tokens, width: d },
    ];
    let rows = [(0usize, 40usize), (1, 25), (0, 3), (1, 7)];
    let q = rng.vec(rows.len() * heads * d);
    let w = rng.vec(rows.len() * heads);
    let want = CpuBackend.indexer_topk(&q, &w, heads, 0.2, 9, &rows, &keys);
    let got = be.indexer_topk(&q, &w, heads, 0.2, 9, &rows, &keys);
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "token {t}: selection");
        close(&g.scores, &w.scores, &format!("token {t}: scores"));
    }
    // Vision attention: 2 heads of 20, spans of 70 (two row blocks), 1 and 5 rows, row 76 in none.
    let (heads, dim) = (2usize, 20usize);
    let spans = [
        SeqSpan { start: 0, len: 70, pos: 0 },
        SeqSpan { start: 70, len: 1, pos: 0 },
        SeqSpan { start: 71, len: 5, pos: 0 },
    ];
    let n = 77 * heads * dim;
    let (q, k, v) = (rng.vec(n), rng.vec(n), rng.vec(n));
    let (mut want, mut got) = (vec![0f32; n], vec![f32::NAN; n]);
    CpuBackend.attention_varlen(&q, &k, &v, heads, dim, &spans, 0.3, &mut want);
    be.attention_varlen(&q, &k, &v, heads, dim, &spans, 0.3, &mut got);
    close(&got, &want, "attention_varlen");
    // Merge: three partials of 4 rows × 40, the second holding nothing for row 2.
    let (rows, width) = (4usize, 40usize);
    let parts: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(rows * width)).collect();
    let mut lses: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(rows).into_iter().map(|x| x * 4.0).collect()).collect();
    lses[1][2] = f32::NEG_INFINITY;
    let pr: Vec<&[f32]> = parts.iter().map(|p| &p[..]).collect();
    let lr: Vec<&[f32]> = lses.iter().map(|l| &l[..]).collect();
    let (mut want, mut got) = (vec![0f32; rows * width], vec![f32::NAN; rows * width]);
    CpuBackend.attention_merge(&pr, &lr, width, &mut want);
    be.attention_merge(&pr, &lr, width, &mut got);
    close(&got, &want, "attention_merge");
    assert_eq!(dev.allocated(), 0, "the staging was freed");
}

/// The GPU backend's routed experts (three grouped MXFP4 products around SiTU) replayed in the
/// interpreter against the CPU backend: all experts local, and one rank's share under expert
/// parallelism (choices of other ranks' experts add nothing), with an expert no token chose.
#[test]
fn gpu_backend_moe_experts_match_the_cpu_backend_in_the_interpreter() {
    use kimi_kernels::gpu::backend::GpuBackend;
    use kimi_kernels::{ExpertMatrices, Routing, SituParams};
    let Some(python) = tools_python() else { return };
    let dev = std::sync::Arc::new(kimi_kpl_host::HostDevice::with_triton(64, Path::new(&python)).expect("signatures"));
    let be = GpuBackend::new(dev.clone());
    let mut rng = Rng(0x5eed_0fe8_e77e_5700);
    let (n_exp, lat, inter, tokens, top_k) = (4usize, 64usize, 96usize, 5usize, 2usize);
    let mats: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..n_exp)
        .map(|_| {
            [
                mxfp4_matrix(&mut rng, inter, lat, false),
                mxfp4_matrix(&mut rng, inter, lat, false),
                mxfp4_matrix(&mut rng, lat, inter, false),
            ]
        })
        .collect();
    let experts: Vec<ExpertMatrices<'_>> = mats
        .iter()
        .map(|[w1, w3, w2]| ExpertMatrices {
            w1: Matrix::Mxfp4(Mxfp4Matrix::new(&w1.0, &w1.1, inter, lat)),
            w3: Matrix::Mxfp4(Mxfp4Matrix::new(&w3.0, &w3.1, inter, lat)),
            w2: Matrix::Mxfp4(Mxfp4Matrix::new(&w2.0, &w2.1, lat, inter)),
        })
        .collect();
    // Expert 2 is never chosen.
    let ids = vec![0, 3, 1, 0, 3, 1, 0, 1, 3, 0];
    let weights: Vec<f32> = (0..tokens * top_k).map(|i| 0.3 + 0.1 * i as f32).collect();
    let routing = Routing { ids, weights, scores: Vec::new(), margins: vec![0.0; tokens], top_k };
    let z: Vec<f32> = rng.vec(tokens * lat).into_iter().map(|v| v * 2.0).collect();
    let act = SituParams { beta: 1.0, linear_beta: Some(0.5) };
    for (first, local) in [(0usize, 0..n_exp), (1, 1..3)] {
        let (mut want, mut got) = (vec![0f32; tokens * lat], vec![f32::NAN; tokens * lat]);
        CpuBackend.moe_experts(&experts[local.clone()], first, &routing, &z, &[], act, &mut want);
        be.moe_experts(&experts[local.clone()], first, &routing, &z, &[], act, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "experts {local:?} [{i}]: {g} vs {w}");
        }
    }
    assert!(dev.launches().get("triton_moe_mxfp4").is_some_and(|&n| n == 6), "{:?}", dev.launches());
}

/// The GPU backend's KDA over packed prefill spans (40, 17, 1 tokens and an empty one: the chunked
/// Triton kernel, its per-token preparation on the host) replayed in the interpreter against the
/// CPU backend, outputs and states; then a decode step (the kpl kernel) from those states.
#[test]
fn gpu_backend_kda_prefill_matches_the_cpu_backend_in_the_interpreter() {
    use kimi_kernels::gpu::backend::GpuBackend;
    use kimi_kernels::{KdaInputs, KdaParams, KdaSlot, SeqSpan};
    let Some(python) = tools_python() else { return };
    let dev = std::sync::Arc::new(kimi_kpl_host::HostDevice::with_triton(32, Path::new(&python)).expect("signatures"));
    let be = GpuBackend::new(dev.clone());
    let mut rng = Rng(0x7a11_c0de_0000_0042);
    let (h, k) = (2usize, 24usize);
    let width = h * k;
    let a_exp: Vec<f32> = (0..h).map(|i| 0.5 + i as f32).collect();
    let dt_bias = rng.vec(width);
    let p = KdaParams { heads: h, head_dim: k, a_exp: &a_exp, dt_bias: &dt_bias, lower_bound: -5.0 };
    let close = |g: &[f32], w: &[f32], what: &str| {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert!((g - w).abs() <= 2e-5 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
        }
    };
    let states0: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(h * k * k).into_iter().map(|x| 0.3 * x).collect()).collect();
    let (mut want_states, mut got_states) = (states0.clone(), states0.clone());
    for lens in [vec![40usize, 17, 1, 0], vec![1, 1, 1, 1]] {
        let tokens: usize = lens.iter().sum();
        let mut at = 0;
        let spans: Vec<SeqSpan> = lens
            .iter()
            .map(|&len| {
                let s = SeqSpan { start: at, len, pos: 3 };
                at += len;
                s
            })
            .collect();
        let (q, kk, v, z) =
            (rng.vec(tokens * width), rng.vec(tokens * width), rng.vec(tokens * width), rng.vec(tokens * width));
        let beta = rng.vec(tokens * h);
        let x = KdaInputs { q: &q, k: &kk, v: &v, z: &z, beta_logits: &beta };
        let (mut want, mut got) = (vec![0f32; tokens * width], vec![f32::NAN; tokens * width]);
        let mut slots: Vec<KdaSlot<'_>> = want_states.iter_mut().map(|s| KdaSlot::new(s)).collect();
        CpuBackend.kda_recurrence(&p, &x, &spans, &mut slots, &mut want);
        let mut slots: Vec<KdaSlot<'_>> = got_states.iter_mut().map(|s| KdaSlot::new(s)).collect();
        be.kda_recurrence(&p, &x, &spans, &mut slots, &mut got);
        close(&got, &want, &format!("{lens:?}: out"));
        close(&got_states.concat(), &want_states.concat(), &format!("{lens:?}: states"));
    }
    let runs = dev.launches();
    assert!(runs.get("triton_kda_chunk_prefill") == Some(&1) && runs.get("kpl_kda_decode_f32") == Some(&1), "{runs:?}");
}
