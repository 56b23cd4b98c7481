//! The per-step kernels that split work by expert or head allocate a fixed handful of buffers
//! per call, not a few per expert or head: their temporaries live in per-thread buffers reused
//! from call to call (the engine-core rule that a step's scratch is not allocated op by op).
//! Counted with a wrapping global allocator, after a warm-up call fills the per-thread buffers.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kimi_kernels::cpu::mxfp4::quantize_rows;
use kimi_kernels::{
    Backend, Bf16Matrix, CpuBackend, ExpertMatrices, KdaInputs, KdaParams, KdaSlot, Matrix, Mxfp4Matrix, PagedRows,
    Routing, SeqSpan, SituParams,
};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count is global (the kernels' rayon workers allocate too), so tests take turns, each
/// holding its turn from its first allocation to its last.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocations of one run of `f`: the fewest over five runs after three warm-up runs. A rayon
/// worker that ran no job in the warm-ups fills its per-thread buffers later, and the pool may
/// allocate for its own bookkeeping now and then; an allocation a call makes every time shows in
/// every run.
fn allocations_of(mut f: impl FnMut()) -> usize {
    for _ in 0..3 {
        f();
    }
    (0..5)
        .map(|_| {
            let before = ALLOCATIONS.load(Ordering::Relaxed);
            f();
            ALLOCATIONS.load(Ordering::Relaxed) - before
        })
        .min()
        .unwrap_or(0)
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as f32 / u32::MAX as f32 - 0.5
        })
        .collect()
}

/// Allocations of one routed-experts call with `experts` experts, each token picking all of them.
fn moe_allocations(experts: usize) -> usize {
    let (lat, inter, tokens) = (64, 32, 3);
    let mut stores = Vec::new();
    for e in 0..experts {
        let w13 = values(inter * lat, e as u32);
        let (packed, scales) = quantize_rows(&w13, inter, lat);
        let w2: Vec<u16> =
            values(lat * inter, 100 + e as u32).iter().map(|&v| kimi_kernels::f32_to_bf16_bits(v)).collect();
        stores.push((packed, scales, w2));
    }
    let mats: Vec<ExpertMatrices<'_>> = stores
        .iter()
        .map(|(p, s, w2)| {
            let m = Matrix::Mxfp4(Mxfp4Matrix::new(p, s, inter, lat));
            ExpertMatrices { w1: m, w2: Matrix::Bf16(Bf16Matrix::new(w2, lat, inter)), w3: m }
        })
        .collect();
    let routing = Routing {
        ids: (0..tokens).flat_map(|_| 0..experts).collect(),
        weights: vec![0.5; tokens * experts],
        scores: vec![0.5; tokens * experts],
        margins: vec![f32::NAN; tokens],
        top_k: experts,
    };
    let z = values(tokens * lat, 7);
    let mut out = vec![0f32; tokens * lat];
    let act = SituParams { beta: 4.0, linear_beta: Some(25.0) };
    allocations_of(|| CpuBackend.moe_experts(&mats, 0, &routing, &z, &[], act, &mut out))
}

#[test]
fn routed_experts_allocate_the_same_few_buffers_for_any_expert_count() {
    let _turn = turn();
    let (few, many) = (moe_allocations(2), moe_allocations(16));
    assert!(many <= 12, "16 experts: {many} allocations in a call");
    assert_eq!(few, many, "allocations grow with the expert count: 2 experts {few}, 16 experts {many}");
}

/// Allocations of one absorb + attention + lift over `heads` heads.
fn mla_allocations(heads: usize) -> usize {
    let (rank, rope, nope, v_dim, tokens, positions) = (32, 8, 16, 16, 2, 5);
    let kv_b: Vec<u16> =
        values(heads * (nope + v_dim) * rank, 3).iter().map(|&v| kimi_kernels::f32_to_bf16_bits(v)).collect();
    let w_kv = Matrix::Bf16(Bf16Matrix::new(&kv_b, heads * (nope + v_dim), rank));
    let q = values(tokens * heads * (nope + rope), 4);
    let cache = values(positions * (rank + rope), 5);
    let pages = PagedRows { pages: vec![&cache[..]], page_tokens: positions, width: rank + rope };
    let rows = [(0usize, 3usize), (0, 4)];
    let mut q_abs = vec![0f32; tokens * heads * (rank + rope)];
    let mut ctx = vec![0f32; tokens * heads * rank];
    let mut lse = vec![0f32; tokens * heads];
    let mut out = vec![0f32; tokens * heads * v_dim];
    let caches = [pages];
    allocations_of(|| {
        CpuBackend.mla_absorb(&w_kv, heads, nope, v_dim, tokens, &q, &mut q_abs);
        CpuBackend.mla_attention(&q_abs, heads, rank, 0.1, &rows, &caches, None, &mut ctx, Some(&mut lse));
        CpuBackend.mla_lift(&w_kv, heads, nope, v_dim, tokens, &ctx, &mut out);
    })
}

#[test]
fn mla_heads_allocate_nothing_per_head() {
    let _turn = turn();
    let (few, many) = (mla_allocations(2), mla_allocations(16));
    assert_eq!(few, many, "allocations grow with the head count: 2 heads {few}, 16 heads {many}");
}

/// Allocations of one KDA decode step of two sequences over `heads` heads of width 128.
fn kda_decode_allocations(heads: usize) -> usize {
    let (k, seqs) = (128, 2);
    let width = heads * k;
    let a_exp = values(heads, 8).iter().map(|v| v.abs() + 0.5).collect::<Vec<f32>>();
    let dt_bias = values(width, 9);
    let p = KdaParams { heads, head_dim: k, a_exp: &a_exp, dt_bias: &dt_bias, lower_bound: -5.0 };
    let (q, kk, v, z) =
        (values(seqs * width, 10), values(seqs * width, 11), values(seqs * width, 12), values(seqs * width, 13));
    let beta_logits = values(seqs * heads, 14);
    let x = KdaInputs { q: &q, k: &kk, v: &v, z: &z, beta_logits: &beta_logits };
    let spans: Vec<SeqSpan> = (0..seqs).map(|s| SeqSpan { start: s, len: 1, pos: 10 }).collect();
    let mut states = vec![vec![0f32; heads * k * k]; seqs];
    let mut out = vec![0f32; seqs * width];
    allocations_of(|| {
        let mut slots: Vec<KdaSlot<'_>> = states.iter_mut().map(|s| KdaSlot::new(s)).collect();
        CpuBackend.kda_recurrence(&p, &x, &spans, &mut slots, &mut out);
    })
}

#[test]
fn kda_decode_allocates_nothing_per_head() {
    let _turn = turn();
    let (few, many) = (kda_decode_allocations(2), kda_decode_allocations(16));
    assert_eq!(few, many, "allocations grow with the head count: 2 heads {few}, 16 heads {many}");
}
