//! Matrix products on Intel AMX tiles (`amx_bf16`, `tdpbf16ps`) over the packed panels of BF16
//! weights, where the CPU has them (Sapphire Rapids and later), and over MXFP4 weights packed
//! for the tiles (`--mxfp4-tiles`): their codes widen to BF16 weight tiles on the fly, exactly
//! (every E2M1 value times a scale in `TILE_SCALES` is a normal BF16 number). By default MXFP4
//! stays on the register-decoding f32 path (`packed`), faster at one token (see
//! `PackedData::Mxfp4Tiles`).
//!
//! **Activations.** The tiles multiply BF16 by BF16 into f32. BF16 activations alone move the
//! goldens' logits by about 1.4 (their tolerance is 0.013: router choices flip), so each f32
//! activation is split into three BF16 parts `x = h + m + l` (8 + 8 + 8 significant bits: exact
//! for normal values), held as three rows of the activation tile. Each part's product with a
//! BF16 weight is exact in f32, the tile accumulates every row over the columns in f32, and the
//! output is `(C_h + C_m) + C_l`: f32-accumulation accuracy, like the f32 chains. A tile row costs
//! the same whether it holds one token or five, so the split is free in memory-bound decode and
//! triples only the tile work of a prefill, which still runs several times faster than f32 FMA.
//!
//! **Weights.** A BF16 panel's 16 column pairs × 16 rows (1 KB) are already an AMX weight tile
//! (16 rows of pairs, each 16 output rows × 2 values), so BF16 tiles load straight from the
//! panels.
//!
//! **Invariance.** Every token count takes this path on a CPU that has it (one token is one tile
//! row group like any other), and a token's outputs depend only on its own rows, so a sequence's
//! results are the same alone or in any batch. They differ from the f32 chains by rounding;
//! `KIMI_SIMD=avx512` (or lower) turns the tiles off.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::aligned::AlignedVec;
use super::disjoint::DisjointOut;
use super::kept::KeptBuffers;
use super::packed::{BATCHED_TILE_TOKENS, Mxfp4Tiles, PANEL, PackedData, PackedMatrix, TILE_PAIRS};

/// Tokens in one activation tile: three rows each (h, m, l), at most 16 rows.
const TILE_TOKENS: usize = 5;
/// Output panels (16 rows each) one task accumulates together: four accumulator tiles.
const GROUP_PANELS: usize = 4;
/// Below this many multiply-adds a call runs on the calling thread.
const SERIAL_WORK: usize = 1 << 16;
/// BF16 values in one tile row (64 bytes).
const TILE_COLS: usize = 2 * TILE_PAIRS;

/// Whether the AMX tiles are in use: the CPU has AMX-BF16 (and AVX-512 BW / BF16 for the
/// conversions), Linux granted the tile data state, and `KIMI_SIMD` does not cap below it.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let capped = std::env::var("KIMI_SIMD").is_ok_and(|v| v != "amx");
        !capped && detect()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    let vector = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16");
    let leaf7 = vector && __cpuid_count(0, 0).eax >= 7;
    // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let amx = leaf7 && {
        let edx = __cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    };
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA); a kernel without AMX support refuses it.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permitted state.
    amx && unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Whether [`matmul`] takes `w`: AMX on, and BF16 or MXFP4 in the tile layout.
pub fn takes(w: &PackedMatrix) -> bool {
    matches!(w.data, PackedData::Bf16(_) | PackedData::Mxfp4Tiles { .. }) && enabled()
}

/// Whether a product of `tokens` tokens over `w` runs on the tiles: every product over a matrix
/// [`takes`] does, and one over MXFP4 packed for batched tiles does from
/// [`BATCHED_TILE_TOKENS`] tokens (`Mxfp4Tiles::Batched`).
pub fn takes_for(w: &PackedMatrix, tokens: usize) -> bool {
    match w.data {
        PackedData::Mxfp4 { tile_rule, .. } => {
            tile_rule == Mxfp4Tiles::Batched && tokens >= BATCHED_TILE_TOKENS && enabled()
        }
        _ => takes(w),
    }
}

/// Whether [`matmul_many`] may run `w` at all: a matrix [`takes`], or MXFP4 packed with a tile
/// rule (its caller decided the tokens take the tiles: `takes_for`, or a sequence's run).
fn runs(w: &PackedMatrix) -> bool {
    match w.data {
        PackedData::Mxfp4 { tile_rule, .. } => tile_rule != Mxfp4Tiles::Never && enabled(),
        _ => takes(w),
    }
}

thread_local! {
    /// The calling thread's split activations, `[token tile][block][16 rows][32]` BF16.
    static SPLIT: KeptBuffers<AlignedVec<u16>> = const { KeptBuffers::new() };
}

/// `out[t, r] = Σ_c W[r, c] · x[t, c]` on the tiles; see the module documentation.
pub fn matmul(w: &PackedMatrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    matmul_many(&[w], x, tokens, &mut [out]);
}

/// Most products [`matmul_many`] takes in one call.
pub const MANY: usize = 8;

/// `outs[i][t, r] = Σ_c W_i[r, c] · x[t, c]` for up to [`MANY`] matrices over the same
/// activations: the activations are split once, and every matrix's row groups are the tasks of
/// one parallel loop, so the products share one hand-off and one tail instead of one each. Each
/// output is the same bits as [`matmul`] of its matrix alone.
pub fn matmul_many(ws: &[&PackedMatrix], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
    assert!(ws.len() <= MANY, "amx matmul_many: {} matrices, at most {MANY}", ws.len());
    assert_eq!(ws.len(), outs.len(), "amx matmul_many: {} matrices, {} outputs", ws.len(), outs.len());
    let Some(cols) = ws.first().map(|w| w.cols) else { return };
    // Every group task of matrix i is one of starts[i]..starts[i + 1].
    let mut starts = [0usize; MANY + 1];
    let mut ptrs = [None; MANY];
    let mut work = 0usize;
    for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        assert!(runs(w), "packed_amx::matmul on a matrix it does not take");
        assert_eq!(w.cols, cols, "amx matmul_many: matrix {i} has {} columns, the first {cols}", w.cols);
        assert_eq!(out.len(), tokens * w.rows, "amx matmul: out has {} values, want {tokens}×{}", out.len(), w.rows);
        starts[i + 1] = starts[i] + w.rows.div_ceil(PANEL).div_ceil(GROUP_PANELS);
        ptrs[i] = Some(DisjointOut::new(out));
        work += w.rows * cols * tokens;
    }
    assert_eq!(x.len(), tokens * cols, "amx matmul: x has {} values, want {tokens}×{cols}", x.len());
    let tasks = starts[ws.len()];
    if tokens == 0 || tasks == 0 {
        return;
    }
    let blocks = cols.div_ceil(TILE_COLS);
    let tiles = tokens.div_ceil(TILE_TOKENS);
    // Taken, not borrowed: while this thread waits for the groups below it may run another
    // product (a stolen job of a nested parallel loop).
    let mut buf = SPLIT.with(KeptBuffers::take);
    let need = tiles * blocks * PANEL * TILE_COLS;
    buf.reserve_len(need);
    let split = &mut buf[..need];
    let per_tile = blocks * PANEL * TILE_COLS;
    // SAFETY (both): `enabled()` (checked by `takes`) includes AVX-512 F / BW / BF16; each
    // chunk is one token tile's blocks and `x` holds its tokens.
    let one = |(tile, dst): (usize, &mut [u16])| unsafe {
        let t0 = tile * TILE_TOKENS;
        let nt = TILE_TOKENS.min(tokens - t0);
        x86::split_activations(&x[t0 * cols..(t0 + nt) * cols], nt, cols, dst)
    };
    if tiles > 1 && tokens * cols >= SERIAL_WORK / 4 {
        split.par_chunks_mut(per_tile).enumerate().for_each(one);
    } else {
        split.chunks_mut(per_tile).enumerate().for_each(one);
    }
    let split: &[u16] = split;
    let run = |task: usize| {
        // The matrix whose groups hold `task` (at most MANY to scan).
        let i = (0..ws.len()).rfind(|&i| starts[i] <= task).unwrap_or(0);
        if let Some(out) = ptrs[i] {
            // SAFETY: AMX and AVX-512 are enabled; each group task writes only its own rows of
            // its own matrix's output.
            unsafe { x86::group(ws[i], split, tokens, task - starts[i], out) };
        }
    };
    if work < SERIAL_WORK || tasks == 1 || rayon::current_num_threads() == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
    SPLIT.with(|s| s.give(buf));
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{GROUP_PANELS, PANEL, PackedData, PackedMatrix, TILE_COLS, TILE_PAIRS, TILE_TOKENS};
    use crate::cpu::aligned::AlignedVec;
    use crate::cpu::disjoint::DisjointOut;
    use crate::cpu::kept::KeptBuffers;
    use crate::cpu::mxfp4::E2M1;

    /// The tile palette: tmm0–3 accumulators (`rows` × 16 f32), tmm4–5 activations (`rows` ×
    /// 32 BF16), tmm6–7 weights (16 pairs × 16 output rows × 2).
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        fn new(rows: usize) -> TileConfig {
            let mut c = [0u8; 64];
            c[0] = 1;
            for t in 0..8 {
                c[16 + 2 * t] = 64;
                c[48 + t] = if t >= 6 { TILE_PAIRS as u8 } else { rows as u8 };
            }
            TileConfig(c)
        }
    }

    /// Loads `cfg` into this thread's tile registers.
    unsafe fn configure(cfg: &TileConfig) {
        // SAFETY (caller): AMX enabled; the config is 64 aligned bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    }

    /// Zeroes accumulator `c` (0–3).
    unsafe fn zero(c: usize) {
        macro_rules! z {
            ($($i:literal)*) => {
                match c {
                    // SAFETY (caller): tiles configured.
                    $($i => unsafe { asm!(concat!("tilezero tmm", $i), options(nostack, nomem)) },)*
                    _ => unreachable!("accumulators are tmm0-3"),
                }
            };
        }
        z!(0 1 2 3)
    }

    /// Loads tile `t` (4–7) from `p`, rows of 64 bytes.
    unsafe fn load(t: usize, p: *const u16) {
        macro_rules! l {
            ($($i:literal)*) => {
                match t {
                    // SAFETY (caller): tiles configured; `p` holds the configured rows × 64 bytes.
                    $($i => unsafe {
                        asm!(concat!("tileloadd tmm", $i, ", [{p} + {s}*1]"), p = in(reg) p, s = in(reg) 64usize,
                            options(nostack, readonly))
                    },)*
                    _ => unreachable!("operands are tmm4-7"),
                }
            };
        }
        l!(4 5 6 7)
    }

    /// Accumulator `c` (0–3) += activations `a` (4–5) × weights `b` (6–7).
    unsafe fn dot(c: usize, a: usize, b: usize) {
        macro_rules! d {
            ($(($c:literal $a:literal $b:literal))*) => {
                match (c, a, b) {
                    // SAFETY (caller): tiles configured and loaded.
                    $(($c, $a, $b) => unsafe {
                        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
                    },)*
                    _ => unreachable!("tdpbf16ps over tmm0-3, tmm4-5, tmm6-7"),
                }
            };
        }
        d!((0 4 6) (0 4 7) (0 5 6) (0 5 7) (1 4 6) (1 4 7) (1 5 6) (1 5 7)
           (2 4 6) (2 4 7) (2 5 6) (2 5 7) (3 4 6) (3 4 7) (3 5 6) (3 5 7))
    }

    /// Stores accumulator `c` (0–3) to `p` (rows of 64 bytes).
    unsafe fn store(c: usize, p: *mut f32) {
        macro_rules! s {
            ($($i:literal)*) => {
                match c {
                    // SAFETY (caller): tiles configured; `p` holds the configured rows × 64 bytes.
                    $($i => unsafe {
                        asm!(concat!("tilestored [{p} + {s}*1], tmm", $i), p = in(reg) p, s = in(reg) 64usize,
                            options(nostack))
                    },)*
                    _ => unreachable!("accumulators are tmm0-3"),
                }
            };
        }
        s!(0 1 2 3)
    }

    /// Blocks ahead of the one multiplied whose weight tiles a decode prefetches.
    const PREFETCH_BLOCKS: usize = 4;

    /// Prefetches the 16 cache lines of the weight tile at `p` into L1.
    #[inline(always)]
    unsafe fn prefetch_tile(p: *const u16) {
        for r in 0..TILE_PAIRS {
            // SAFETY: a prefetch never faults; `p` lies inside the panel being read.
            unsafe { _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(64 * r)) };
        }
    }

    unsafe fn release() {
        // SAFETY (caller): AMX enabled.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Splits one token tile's activations (`tokens` ≤ 5 rows of `x`) into BF16 `h + m + l`,
    /// padded with zeros to whole 32-column blocks: `split[block][3j + part][32]` for token `j`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn split_activations(x: &[f32], tokens: usize, cols: usize, split: &mut [u16]) {
        let blocks = cols.div_ceil(TILE_COLS);
        let widen = |b: __m256bh| -> __m512 {
            // SAFETY: __m256bh and __m256i are the same 32 bytes.
            let raw: __m256i = unsafe { std::mem::transmute(b) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        };
        for t in 0..tokens {
            let (tile, j) = (t / TILE_TOKENS, t % TILE_TOKENS);
            let row = &x[t * cols..(t + 1) * cols];
            for b in 0..blocks {
                let at = ((tile * blocks + b) * PANEL + 3 * j) * TILE_COLS;
                for half in 0..2 {
                    let c0 = b * TILE_COLS + 16 * half;
                    let n = cols.saturating_sub(c0).min(16);
                    let mask: __mmask16 = if n >= 16 { 0xffff } else { (1u16 << n) - 1 };
                    // SAFETY: the mask limits the load to the row's columns c0..c0+n.
                    let v = unsafe { _mm512_maskz_loadu_ps(mask, row.as_ptr().add(c0.min(cols))) };
                    let h = _mm512_cvtneps_pbh(v);
                    let r = _mm512_sub_ps(v, widen(h));
                    let m = _mm512_cvtneps_pbh(r);
                    let l = _mm512_cvtneps_pbh(_mm512_sub_ps(r, widen(m)));
                    for (part, p) in [h, m, l].into_iter().enumerate() {
                        let dst = &mut split[at + part * TILE_COLS + 16 * half..][..16];
                        // SAFETY: 16 u16 fit in `dst`.
                        unsafe {
                            _mm256_storeu_si256(
                                dst.as_mut_ptr() as *mut __m256i,
                                std::mem::transmute::<__m256bh, __m256i>(p),
                            )
                        };
                    }
                }
            }
        }
    }

    /// One task: panels `4g..4g+4` (rows `64g..`) for every token.
    ///
    /// One token tile (decode) streams the panels through the weight tiles against one
    /// activation tile. Several run 2 × 2 blocks (two token tiles × two panels: each loaded tile
    /// feeds two products), since loading a tile costs about as much as a product on it. Every
    /// accumulator sums the same blocks in the same order either way.
    ///
    /// SAFETY (caller): AMX and AVX-512 F / BW enabled; `split` from [`split_activations`] for
    /// these tokens and the matrix's columns; `out` has `tokens × rows` values and this task
    /// alone writes rows `64g..64g+64`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn group(w: &PackedMatrix, split: &[u16], tokens: usize, g: usize, out: DisjointOut) {
        let (rows, cols) = (w.rows, w.cols);
        let blocks = cols.div_ceil(TILE_COLS);
        let p0 = g * GROUP_PANELS;
        let np = GROUP_PANELS.min(rows.div_ceil(PANEL) - p0);
        let tiles = tokens.div_ceil(TILE_TOKENS);
        let mut acc = [[0f32; PANEL]; PANEL];
        // Accumulator `c` holds token tile `tile` × panel `p0 + i`: into the output.
        let mut finish = |c: usize, tile: usize, i: usize| {
            // SAFETY: acc is 16 rows of 64 bytes; the output rows are this task's.
            unsafe { store(c, acc.as_mut_ptr() as *mut f32) };
            let nt = TILE_TOKENS.min(tokens - tile * TILE_TOKENS);
            let r0 = (p0 + i) * PANEL;
            let n = PANEL.min(rows - r0);
            let lanes: __mmask16 = if n == PANEL { 0xffff } else { (1u16 << n) - 1 };
            for j in 0..nt {
                let t = tile * TILE_TOKENS + j;
                // SAFETY: rows 3j..3j+2 of acc; lanes < n land on rows r0.. of token t < tokens,
                // this task's rows.
                unsafe {
                    let part = |k: usize| _mm512_loadu_ps(acc[3 * j + k].as_ptr());
                    let sum = _mm512_add_ps(_mm512_add_ps(part(0), part(1)), part(2));
                    _mm512_mask_storeu_ps(out.at(t * rows + r0), lanes, sum);
                }
            }
        };
        let a_at = |tile: usize, b: usize| split.as_ptr().wrapping_add((tile * blocks + b) * PANEL * TILE_COLS);
        // SAFETY (whole block): every tile operation follows a `configure`; pointers stay inside
        // `split` (tile < tiles, b < blocks) and the panels (i < np, b < blocks).
        unsafe {
            match &w.data {
                PackedData::Bf16(v) => {
                    let stride = w.panel_pairs();
                    let b_at = |i: usize, b: usize| v.as_ptr().add(((p0 + i) * stride + b * TILE_PAIRS) * PANEL * 2);
                    if tiles == 1 {
                        configure(&TileConfig::new(3 * tokens));
                        (0..np).for_each(|i| zero(i));
                        for b in 0..blocks {
                            load(4, a_at(0, b));
                            for i in 0..np {
                                // A tile load waits on its cache misses in order; the weights
                                // stream from memory here, so fetch a few blocks ahead.
                                if b + PREFETCH_BLOCKS < blocks {
                                    prefetch_tile(b_at(i, b + PREFETCH_BLOCKS));
                                }
                                load(6 + i % 2, b_at(i, b));
                                dot(i, 4, 6 + i % 2);
                            }
                        }
                        (0..np).for_each(|i| finish(i, 0, i));
                    } else {
                        blocks_2x2(tiles, np, blocks, a_at, b_at, &mut finish);
                    }
                }
                PackedData::Mxfp4Tiles { codes, scales } => {
                    let (pairs, groups) = (w.pairs(), cols / TILE_COLS);
                    let code_at = |i: usize, b: usize| codes.as_ptr().add(((p0 + i) * pairs + b * TILE_PAIRS) * PANEL);
                    let scale_at = |i: usize, b: usize| scales.as_ptr().add(((p0 + i) * groups + b) * PANEL);
                    let lut = _mm512_loadu_si512(MXFP4_TILE_LUT.0.as_ptr() as *const __m512i);
                    if tiles == 1 {
                        // One token tile: each block's weight tiles are widened as they stream,
                        // the task's panels chunk by chunk, into staging tiles (two sets, so a
                        // block's widening need not wait for the last block's tile loads).
                        let mut stage =
                            [Stage([[0; TILE_WORDS]; GROUP_PANELS]), Stage([[0; TILE_WORDS]; GROUP_PANELS])];
                        configure(&TileConfig::new(3 * tokens));
                        (0..np).for_each(|i| zero(i));
                        for b in 0..blocks {
                            let st = &mut stage[b % 2];
                            let base = st.0.as_mut_ptr() as *mut u16;
                            let dst_at = |i: usize| base.add(i * TILE_WORDS);
                            widen_mxfp4_blocks(np, &|i| code_at(i, b), &|i| scale_at(i, b), lut, &dst_at);
                            load(4, a_at(0, b));
                            for i in 0..np {
                                load(6 + i % 2, st.0[i].as_ptr());
                                dot(i, 4, 6 + i % 2);
                            }
                        }
                        (0..np).for_each(|i| finish(i, 0, i));
                    } else {
                        // Several token tiles: the task's panels are widened once into BF16
                        // weight tiles, then multiplied as BF16 panels are.
                        let widen = |b: usize, dst_at: &dyn Fn(usize) -> *mut u16| {
                            // Inside the enclosing unsafe block: block b of this task's panels, whole tiles.
                            widen_mxfp4_blocks(np, &|i| code_at(i, b), &|i| scale_at(i, b), lut, dst_at)
                        };
                        widened_2x2(tiles, np, blocks, a_at, widen, &mut finish);
                    }
                }
                PackedData::Mxfp4 { nibbles, scales, .. } => {
                    // Batched tiles (`takes_for`, or a sequence's run): the task's panels
                    // are widened once from the register layout, then multiplied as BF16
                    // panels are. The same weight tiles as the tile layout's, so the same bits.
                    let (pairs, groups) = (w.pairs(), cols / TILE_COLS);
                    let code_at =
                        |i: usize, b: usize| nibbles.as_ptr().add(((p0 + i) * pairs + b * TILE_PAIRS) * PANEL);
                    let scale_at = |i: usize, b: usize| scales.as_ptr().add(((p0 + i) * groups + b) * PANEL);
                    let lut = _mm512_loadu_si512(MXFP4_TILE_LUT.0.as_ptr() as *const __m512i);
                    let widen = |b: usize, dst_at: &dyn Fn(usize) -> *mut u16| {
                        // Inside the enclosing unsafe block: block b of this task's panels, whole tiles.
                        widen_mxfp4_register_blocks(np, &|i| code_at(i, b), &|i| scale_at(i, b), lut, dst_at)
                    };
                    widened_2x2(tiles, np, blocks, a_at, widen, &mut finish);
                }
                PackedData::Fp8 { .. } => unreachable!("FP8 matrices never run on the tiles"),
            }
            release();
        }
    }

    /// BF16 values in one weight tile (16 rows of 32).
    const TILE_WORDS: usize = TILE_PAIRS * TILE_COLS;

    /// One widened weight tile per panel of a task, each on its own cache lines (an unaligned
    /// tile load costs several times an aligned one).
    #[repr(C, align(64))]
    struct Stage([[u16; TILE_WORDS]; GROUP_PANELS]);

    thread_local! {
        /// A task's MXFP4 panels widened to BF16 weight tiles, `[panel][block][tile]`.
        static WIDE_TILES: KeptBuffers<AlignedVec<u16>> = const { KeptBuffers::new() };
    }

    /// 32 lookup entries (a code's low 4 bits, repeated: `vpermw` reads 5 index bits) holding
    /// each E2M1 value as BF16 bits with the exponent raised by 126, and ±0 as 0. Subtracting
    /// `(253 − s) << 7` with unsigned saturation then scales a value by 2^(s − 127) and keeps
    /// zeros zero, one instruction for both: for s in `TILE_SCALES` the raised exponent never
    /// borrows into the sign and the result's exponent stays normal.
    #[repr(C, align(64))]
    struct TileLut([u16; 32]);

    static MXFP4_TILE_LUT: TileLut = {
        let mut t = [0u16; 32];
        let mut e = 0;
        while e < 32 {
            let k = e & 15;
            let magnitude = (E2M1[k & 7].to_bits() >> 16) as u16;
            if magnitude != 0 {
                t[e] = (magnitude + (126 << 7)) | if k & 8 != 0 { 0x8000 } else { 0 };
            }
            e += 1;
        }
        TileLut(t)
    };

    /// Widens block `b`'s 32 columns of `np` panels — each 256 code bytes in the `Mxfp4Tiles`
    /// layout and its 16 rows' scales — into their BF16 weight tiles (16 rows of 32 values at
    /// `dst_at(i)`): per 32 code bytes, two lookups give two tile rows, each scaled by one
    /// saturating subtract. The panels go chunk by chunk, so their code streams are read side
    /// by side (a panel at a time streamed measurably slower from memory).
    ///
    /// SAFETY (caller): AVX-512 F / BW enabled; for i < np ≤ GROUP_PANELS, `code_at(i)` holds
    /// 256 bytes, `scale_at(i)` 16 and `dst_at(i)` 512 values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn widen_mxfp4_blocks(
        np: usize,
        code_at: &dyn Fn(usize) -> *const u8,
        scale_at: &dyn Fn(usize) -> *const u8,
        lut: __m512i,
        dst_at: &dyn Fn(usize) -> *mut u16,
    ) {
        // SAFETY: the reads and writes stay inside the ranges the caller gives.
        unsafe {
            let down = scale_subtrahends(np, scale_at);
            for c in 0..TILE_PAIRS / 2 {
                for (i, &d) in down.iter().enumerate().take(np) {
                    let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(code_at(i).add(32 * c) as *const __m256i));
                    let low = _mm512_subs_epu16(_mm512_permutexvar_epi16(w, lut), d);
                    let high = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(w), lut), d);
                    let dst = dst_at(i);
                    _mm512_storeu_si512(dst.add(2 * c * TILE_COLS) as *mut __m512i, low);
                    _mm512_storeu_si512(dst.add((2 * c + 1) * TILE_COLS) as *mut __m512i, high);
                }
            }
        }
    }

    /// Each of `np` panels' 16 row scales (E8M0, at `scale_at(i)`) as the tile lookup's
    /// subtrahend `(253 − s) << 7`, row r's in both of its lanes (2r, 2r + 1).
    ///
    /// SAFETY (caller): AVX-512 F / BW enabled; `scale_at(i)` holds 16 bytes for i < np ≤
    /// GROUP_PANELS.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn scale_subtrahends(np: usize, scale_at: &dyn Fn(usize) -> *const u8) -> [__m512i; GROUP_PANELS] {
        let mut down = [_mm512_setzero_si512(); GROUP_PANELS];
        for (i, d) in down.iter_mut().enumerate().take(np) {
            // SAFETY: 16 scale bytes, as the caller promises.
            let s = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(scale_at(i) as *const __m128i) });
            let s = _mm512_or_si512(s, _mm512_slli_epi32::<16>(s));
            *d = _mm512_slli_epi16::<7>(_mm512_sub_epi16(_mm512_set1_epi16(253), s));
        }
        down
    }

    /// Widens a task's `np` panels block by block (`widen(b, dst_at)` writes block b's weight
    /// tile of panel i at `dst_at(i)`) into BF16 weight tiles kept per thread, then runs
    /// [`blocks_2x2`] over them.
    ///
    /// SAFETY (caller): as [`blocks_2x2`]; `widen` writes whole tiles at the pointers it gets.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn widened_2x2(
        tiles: usize,
        np: usize,
        blocks: usize,
        a_at: impl Fn(usize, usize) -> *const u16,
        widen: impl Fn(usize, &dyn Fn(usize) -> *mut u16),
        finish: &mut impl FnMut(usize, usize, usize),
    ) {
        let mut wide = WIDE_TILES.with(KeptBuffers::take);
        wide.reserve_len(np * blocks * TILE_WORDS);
        let base = wide.as_mut_ptr();
        for b in 0..blocks {
            widen(b, &|i| base.wrapping_add((i * blocks + b) * TILE_WORDS));
        }
        let base = wide.as_ptr();
        let b_at = |i: usize, b: usize| base.wrapping_add((i * blocks + b) * TILE_WORDS);
        // SAFETY: forwarded from the caller; `wide` holds np × blocks whole tiles.
        unsafe { blocks_2x2(tiles, np, blocks, a_at, b_at, finish) };
        WIDE_TILES.with(|w| w.give(wide));
    }

    /// [`widen_mxfp4_blocks`] from the register layout (`PackedData::Mxfp4`): block `b` of a
    /// panel is 16 column pairs × 16 rows of bytes (pair-major, 256 bytes), each byte holding a
    /// row's even column in its low nibble and its odd column in its high one. Per two pairs:
    /// the 32 bytes widen to words, their low and high nibbles interleave into the two tile rows
    /// (`vpermt2w`), and each row takes the lookup and the scale as in the tile layout.
    ///
    /// SAFETY (caller): as [`widen_mxfp4_blocks`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn widen_mxfp4_register_blocks(
        np: usize,
        code_at: &dyn Fn(usize) -> *const u8,
        scale_at: &dyn Fn(usize) -> *const u8,
        lut: __m512i,
        dst_at: &dyn Fn(usize) -> *mut u16,
    ) {
        // Lane l of a tile row: row l / 2's low nibble (even l) or high nibble (odd l); index bit
        // 5 picks the high-nibble source. The second row of a pair of pairs reads words 16..32.
        const fn interleave(first: u16) -> [u16; 32] {
            let mut idx = [0u16; 32];
            let mut l = 0;
            while l < 32 {
                idx[l] = first + (l / 2) as u16 + if l % 2 == 1 { 32 } else { 0 };
                l += 1;
            }
            idx
        }
        static ROWS: [[u16; 32]; 2] = [interleave(0), interleave(16)];
        // SAFETY: the reads and writes stay inside the ranges the caller gives.
        unsafe {
            let even = _mm512_loadu_si512(ROWS[0].as_ptr() as *const __m512i);
            let odd = _mm512_loadu_si512(ROWS[1].as_ptr() as *const __m512i);
            let low_bits = _mm512_set1_epi16(15);
            let down = scale_subtrahends(np, scale_at);
            for c in 0..TILE_PAIRS / 2 {
                for (i, &d) in down.iter().enumerate().take(np) {
                    let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(code_at(i).add(32 * c) as *const __m256i));
                    let (lo, hi) = (_mm512_and_si512(w, low_bits), _mm512_srli_epi16::<4>(w));
                    let first = _mm512_permutex2var_epi16(lo, even, hi);
                    let second = _mm512_permutex2var_epi16(lo, odd, hi);
                    let first = _mm512_subs_epu16(_mm512_permutexvar_epi16(first, lut), d);
                    let second = _mm512_subs_epu16(_mm512_permutexvar_epi16(second, lut), d);
                    let dst = dst_at(i);
                    _mm512_storeu_si512(dst.add(2 * c * TILE_COLS) as *mut __m512i, first);
                    _mm512_storeu_si512(dst.add((2 * c + 1) * TILE_COLS) as *mut __m512i, second);
                }
            }
        }
    }

    /// Token tiles in pairs × panels in pairs: accumulators 0 (x, a), 1 (y, a), 2 (x, b),
    /// 3 (y, b) over every block, activations in tmm4–5 and weights in tmm6–7. Partial token
    /// tiles run as whole ones (their extra rows are never read back).
    ///
    /// The tile addressing is generic, not `dyn`, so it compiles into the loop instead of a call
    /// per tile load.
    ///
    /// SAFETY (caller): as [`group`]; `a_at(tile, b)` and `b_at(i, b)` point at whole tiles.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn blocks_2x2(
        tiles: usize,
        np: usize,
        blocks: usize,
        a_at: impl Fn(usize, usize) -> *const u16,
        b_at: impl Fn(usize, usize) -> *const u16,
        finish: &mut impl FnMut(usize, usize, usize),
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            configure(&TileConfig::new(3 * TILE_TOKENS));
            for x in (0..tiles).step_by(2) {
                let two_tiles = x + 1 < tiles;
                for a in (0..np).step_by(2) {
                    let two_panels = a + 1 < np;
                    let used = |c: usize| (c.is_multiple_of(2) || two_tiles) && (c < 2 || two_panels);
                    (0..4).filter(|&c| used(c)).for_each(|c| zero(c));
                    for b in 0..blocks {
                        load(4, a_at(x, b));
                        load(6, b_at(a, b));
                        dot(0, 4, 6);
                        if two_tiles {
                            load(5, a_at(x + 1, b));
                            dot(1, 5, 6);
                        }
                        if two_panels {
                            load(7, b_at(a + 1, b));
                            dot(2, 4, 7);
                            if two_tiles {
                                dot(3, 5, 7);
                            }
                        }
                    }
                    (0..4).filter(|&c| used(c)).for_each(|c| finish(c, x + c % 2, a + c / 2));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bf16Matrix, Matrix, f32_to_bf16_bits};

    /// f32 values over many binades, signs and a few zeros: the split must keep every bit.
    fn activations(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let m = f32::from_bits(0x3f80_0000 | (s >> 9)) - 1.5;
                if i % 11 == 0 { 0.0 } else { m * 2f32.powi((i as i32 % 60) - 30) }
            })
            .collect()
    }

    /// The three-part split is exact: an identity weight returns every activation bit for bit,
    /// for each token of a batch whose tile count and column count leave partial tiles.
    #[test]
    fn an_identity_weight_returns_the_activations_exactly() {
        if !enabled() {
            eprintln!("skipped: this CPU has no AMX tiles (or KIMI_SIMD caps them)");
            return;
        }
        for n in [32usize, 80] {
            let mut bits = vec![0u16; n * n];
            for r in 0..n {
                bits[r * n + r] = f32_to_bf16_bits(1.0);
            }
            let p = PackedMatrix::pack(&Matrix::Bf16(Bf16Matrix::new(&bits, n, n))).expect("packs");
            assert!(takes(&p));
            for tokens in [1usize, 4, 7, 13] {
                let x = activations(tokens * n, 7 + tokens as u32);
                let mut out = vec![f32::NAN; tokens * n];
                matmul(&p, &x, tokens, &mut out);
                for (i, (o, v)) in out.iter().zip(&x).enumerate() {
                    assert_eq!(o.to_bits(), v.to_bits(), "{n} columns, {tokens} tokens: value {i}: {o} vs {v}");
                }
            }
        }
    }

    /// Products started from inside a parallel loop (as the MoE's expert jobs do) may run on a
    /// thread that is itself waiting in a product: each gives the bits it gives alone.
    #[test]
    fn nested_parallel_products_match_serial_ones() {
        use rayon::prelude::*;
        if !enabled() {
            eprintln!("skipped: this CPU has no AMX tiles (or KIMI_SIMD caps them)");
            return;
        }
        let (rows, cols) = (256usize, 256usize);
        let vals = activations(rows * cols, 5);
        let bits: Vec<u16> = vals.iter().map(|v| f32_to_bf16_bits(*v)).collect();
        let p = PackedMatrix::pack(&Matrix::Bf16(Bf16Matrix::new(&bits, rows, cols))).expect("packs");
        let inputs: Vec<(usize, Vec<f32>)> =
            (0..12).map(|i| (1 + i % 7, activations((1 + i % 7) * cols, 11 + i as u32))).collect();
        let product = |(t, x): &(usize, Vec<f32>)| {
            let mut out = vec![0f32; t * rows];
            matmul(&p, x, *t, &mut out);
            out
        };
        let alone: Vec<Vec<f32>> = inputs.iter().map(product).collect();
        let nested: Vec<Vec<f32>> = inputs.par_iter().map(product).collect();
        for (i, (a, b)) in alone.iter().zip(&nested).enumerate() {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "product {i} differs when nested");
        }
    }
}
