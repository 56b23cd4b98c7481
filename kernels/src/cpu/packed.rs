//! Weights repacked once at load into 16-row panels, and the matrix product over them.
//!
//! A panel holds rows `16p..16p+16` column pair by column pair: for each pair of columns the 16
//! rows' two values sit side by side (BF16: 32 × 16 bits, one 512-bit register; MXFP4: the 16 rows'
//! stored bytes, whose low and high nibbles are already the pair). The product broadcasts a
//! token's column value and multiplies it into 16 rows at once. Every output is defined bit for
//! bit: one fused multiply-add chain from 0 per block of 16 columns in order, and the blocks'
//! sums added pairwise (the sum of n blocks is the sum of the first 2^k, 2^k the largest power of
//! two below n, plus the sum of the rest) — no horizontal sums, and the same arithmetic for any
//! number of tokens, threads or SIMD level: a token's result is bit-identical alone or in a batch.
//! The blocks make a row-parallel product exact under tensor parallelism: a rank whose columns
//! are whole blocks sums exactly the blocks one rank would, and the ranks' pairwise all-reduce
//! (`comm::ThreadComm`) adds those sums as the one rank's pairwise sum does (whenever the ranks
//! hold power-of-two counts of whole blocks). They also sum more accurately than one long chain.
//! On a CPU with AMX tiles, BF16 products run in `packed_amx` over these same panels instead (a
//! BF16 panel's 32-column block is a weight tile; the panels are padded to whole blocks). A CPU
//! with AVX-512-BF16 but no AMX stays on these f32 chains: `vdpbf16ps` would need two BF16 parts
//! per activation and issues far slower than FMA (`unit_rates`).
//! The packed copy takes the same bytes as the stored weight (BF16 2 bytes a value, MXFP4 half a
//! byte plus a scale byte per 32, FP8 a byte plus an f32 scale per row), padded to whole panels.
//!
//! FP8 (`--fp8-dense`) panels hold the E4M3 codes as column pairs like BF16. A code's bits shifted
//! into an f32's exponent and mantissa fields are its value times 2^−120 (subnormal codes
//! included), so decoding is two shifts and two masks per pair; the product runs the chain over
//! those values and each token's activation codes (ATOM's per-token `ptpc_fp8` quantisation),
//! then scales by 2^120, the row's scale and the token's scale.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};

use rayon::prelude::*;

use super::aligned::AlignedVec;
use super::disjoint::DisjointOut;
use super::fp8::{E4M3_MAX, f32_to_e4m3};
use super::mxfp4::{E2M1, GROUP, Mxfp4Matrix, e8m0_to_f32};
use super::simd::{SimdLevel, simd_level};
use crate::Matrix;

/// Rows per panel (one 512-bit register of f32).
pub const PANEL: usize = 16;
/// Column pairs in one AMX weight tile (32 columns: 16 tile rows of 16 panel rows × 2 BF16).
pub const TILE_PAIRS: usize = 16;
/// Panels one task computes together (64 rows: 4 × 16 accumulators per token).
const GROUP_PANELS: usize = 4;
/// Tokens multiplied together against a panel group.
const TOKEN_TILE: usize = 4;
/// Tokens the register-decoding path multiplies together: more than [`TOKEN_TILE`] run two
/// panels at a time (2 × 8 accumulators fit the registers), so a panel's weights are decoded
/// once for eight tokens instead of twice.
const DIRECT_TOKENS: usize = 8;
/// The register-decoding path's outputs: `[panel][token][row]`.
type DirectTile = [[f32; PANEL]; DIRECT_TOKENS];
/// From this many tokens a panel group is widened to f32 once instead of decoded per token tile
/// (measured: at 8 tokens decoding in registers is still faster).
const WIDEN_FROM: usize = 12;
/// Below this many multiply-adds a call runs on the calling thread.
const SERIAL_WORK: usize = 1 << 16;
/// Column pairs in one block of a product's definition (module docs): 16 columns, half an
/// MXFP4 scale group, so a block has one scale.
pub const BLOCK_PAIRS: usize = 8;
const _: () = assert!(GROUP.is_multiple_of(2 * BLOCK_PAIRS), "an MXFP4 scale group is whole blocks");
/// How far ahead of its reads a register product prefetches each panel's stream, in bytes.
/// A task reads four panels as four streams, over which the hardware prefetcher alone keeps
/// too few lines in flight. Measured on the 2-core race machine (512 MB of 2048 x 8192
/// products at one token, 2 threads, six alternating rounds in one process, medians): BF16
/// read 24.6 GB/s without it and 29.6 with it (a plain wide-load read: 30.8); MXFP4 19.3 and
/// 22.4. 512 B to 3 KB ahead measured alike.
const PREFETCH_BYTES: usize = 1024;
/// Levels of [`PairwiseSum`]: up to 2^32 blocks.
const LEVELS: usize = 32;

/// Block sums added pairwise as they complete, like a binary counter: level l holds the sum of
/// the last 2^l blocks not yet merged, and is set exactly when bit l of the count is. `T` is one
/// value or a register tile of them. The levels start uninitialised: a tile call makes one of
/// these per register tile, and clearing 32 levels of 1 KB each cost a fifth of a prefill.
pub(crate) struct PairwiseSum<T: Copy> {
    levels: [std::mem::MaybeUninit<T>; LEVELS],
    count: usize,
    zero: T,
}

impl<T: Copy> PairwiseSum<T> {
    #[inline(always)]
    pub(crate) fn new(zero: T) -> PairwiseSum<T> {
        PairwiseSum { levels: [const { std::mem::MaybeUninit::uninit() }; LEVELS], count: 0, zero }
    }

    /// Adds the next block's sum `v`, merging each completed pair (earlier sum on the left).
    #[inline(always)]
    pub(crate) fn push(&mut self, mut v: T, add: impl Fn(T, T) -> T) {
        let (mut c, mut l) = (self.count, 0);
        while c & 1 == 1 {
            // SAFETY: bit l of the count is set, so level l was written (see the type docs).
            v = add(unsafe { self.levels[l].assume_init() }, v);
            c >>= 1;
            l += 1;
        }
        self.levels[l].write(v);
        self.count += 1;
    }

    /// The sum of every block pushed: the partial levels, smallest (latest) first, each added
    /// to the right of the larger one before it.
    #[inline(always)]
    pub(crate) fn total(&self, add: impl Fn(T, T) -> T) -> T {
        let mut t: Option<T> = None;
        for l in 0..LEVELS {
            if self.count >> l & 1 == 1 {
                // SAFETY: bit l of the count is set, so level l was written.
                let level = unsafe { self.levels[l].assume_init() };
                t = Some(match t {
                    None => level,
                    Some(t) => add(level, t),
                });
            }
        }
        t.unwrap_or(self.zero)
    }
}

thread_local! {
    /// A panel group's weights widened to f32 (`[pair][panel][even 16 | odd 16]`), reused by
    /// every token tile of a call with many tokens. On cache lines: the widened weights are read
    /// as whole aligned lines (an unaligned buffer splits every load across two lines, measured
    /// at twice the step time).
    static WIDE: RefCell<AlignedVec<f32>> = RefCell::new(AlignedVec::default());
}

/// A weight in the panel layout, owned (built from a borrowed stored-format matrix).
#[derive(Debug)]
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub(crate) data: PackedData,
}

/// Every buffer starts on a cache line ([`AlignedVec`]): a 64-byte load or an AMX tile row of a
/// panel then never straddles two lines.
#[derive(Debug)]
pub(crate) enum PackedData {
    /// `[panel][pair][row][2]` bf16 bits; an odd last column is paired with a zero.
    Bf16(AlignedVec<u16>),
    /// `nibbles[panel][pair][row]` (column 2q low, 2q+1 high) and `scales[panel][group][row]`
    /// (E8M0); padding rows are zero codes under scale 2^0.
    /// `scaled_chain`: every row's scale exponents (the NaN code aside) lie within
    /// [`MAX_SCALE_SPAN`] of each other, so the register-decoding tiles may run the chain in
    /// scaled coordinates (see `tile_n`); other matrices always take the widened path.
    /// The default even where AMX is present: at one token the register path is faster
    /// (2 threads, 512 × 1024 expert matrix streamed from memory: 16.5 µs against 23 on the
    /// tiles), at several tokens per expert the tiles are (`Mxfp4Tiles`).
    /// `tile_rule`: which products widen these codes to weight tiles (`packed_amx`): the mode
    /// it was packed under ([`Mxfp4Tiles::PerSequence`] or [`Mxfp4Tiles::Batched`]) where every
    /// scale lies in [`TILE_SCALES`] on a CPU with the tiles, else [`Mxfp4Tiles::Never`].
    Mxfp4 { nibbles: AlignedVec<u8>, scales: Vec<u8>, scaled_chain: bool, tile_rule: Mxfp4Tiles },
    /// MXFP4 for the AMX tiles (`packed_amx`), taken at load when asked ([`set_mxfp4_on_tiles`]),
    /// the tiles are on and every scale lies in [`TILE_SCALES`]. 1024 × 2048, 2 threads, streamed:
    /// 1 token 82 against 59 µs on the registers, 8 tokens 131 against 164, 64 tokens 432
    /// against 1120. The same bytes as `Mxfp4`: each panel's 32-column block as 256 bytes that
    /// widen to its BF16 weight tile two tile rows at a time — byte `32c + j`
    /// holds lane `j` (row `j / 2`, column parity `j % 2`) of tile row `2c` in its low nibble and
    /// of tile row `2c + 1` in its high nibble — and `scales[panel][group][row]` as in `Mxfp4`.
    Mxfp4Tiles { codes: AlignedVec<u8>, scales: Vec<u8> },
    /// `codes[panel][pair][even 16 | odd 16]` E4M3 codes (an odd last column paired with code 0)
    /// and `scales[row]`, padded to whole panels.
    Fp8 { codes: AlignedVec<u8>, scales: Vec<f32> },
}

/// Where an E4M3 code's magnitude bits land in an f32 once shifted left by 20 (sign at bit 31).
const FP8_FIELDS: u32 = 0x87F0_0000;

/// 2^120: the E4M3 exponent bias (7) rebiased to f32's (127).
const FP8_REBIAS: f32 = f32::from_bits((127 + 120) << 23);

/// A code's value × 2^−120, by bits: `((b & 0x80) << 24) | ((b & 0x7F) << 20)`.
#[inline(always)]
fn fp8_raw(b: u8) -> f32 {
    let b = b as i8 as i32 as u32;
    f32::from_bits((b << 20) & FP8_FIELDS)
}

/// Largest spread of E8M0 exponents within a row for which a partial sum divided by one of its
/// group scales stays a normal float for any realistic activation (below ~2^60 · cols).
const MAX_SCALE_SPAN: u8 = 64;

/// How MXFP4 products use the AMX tiles (where the CPU has them and a matrix's scales fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mxfp4Tiles {
    /// Every product decodes in registers (`KIMI_MXFP4=registers`).
    Never,
    /// The default: where one sequence brings at least [`BATCHED_TILE_TOKENS`] tokens to one
    /// expert in a step (a prompt chunk, a long speculative verify), the routed experts run
    /// those tokens on the tiles, the register layout's codes widened to BF16 weight tiles;
    /// every other token decodes in registers. Which path a token takes depends only on its own
    /// sequence's tokens in the step, and each path computes a token from its own row alone, so
    /// a sequence's results are the same bits in any batch (for the same chunks). Medium model,
    /// 2 threads, one run against `Never`: prefill (128-token prompt) 216 → 298 tokens/s;
    /// decode, one token per sequence, unchanged.
    PerSequence,
    /// Opt-in (`KIMI_MXFP4=batched`): any product of at least [`BATCHED_TILE_TOKENS`] tokens
    /// (the tokens of all sequences routed to one expert) runs on the tiles as `PerSequence`
    /// runs a sequence's. Medium model, 2 threads, one run against `Never`: batch-64 decode
    /// 201 → 229 tokens/s, batch 1 unchanged. The cost: a token's results depend on how many
    /// others its experts see, by rounding (the paths agree to f32 accumulation accuracy).
    /// On the MXFP4 golden that moves a sequence's logits in a mixed batch by up to 1.5e-5
    /// against the same sequence alone, over the engine's 1e-5 batch-invariance bound, which is
    /// why it is not the default.
    Batched,
    /// Always (`--mxfp4-tiles`, `KIMI_MXFP4=tiles`): the tile layout, every token count on the
    /// tiles: bit-for-bit batch invariance with the tiles' speed at several tokens, one token
    /// a few percent slower.
    Always,
}

/// Fewest tokens a [`Mxfp4Tiles::Batched`] product runs on the tiles with: two activation
/// tiles (1024 × 2048, 2 threads, streamed: 8 tokens take 131 µs on the tiles against 164 in
/// registers, one token 82 against 59).
pub const BATCHED_TILE_TOKENS: usize = 6;

/// The [`Mxfp4Tiles`] mode for MXFP4 weights packed from now on: 0 unset (then the
/// environment's `KIMI_MXFP4`), 1 never, 2 always, 3 batched, 4 per sequence.
static MXFP4_TILES: AtomicU8 = AtomicU8::new(0);

/// Sets how MXFP4 weights packed from now on use the AMX tiles (see [`Mxfp4Tiles`]). Medium
/// model, 2 threads, against [`Mxfp4Tiles::Never`]: `Always` gives prefill +20 % (512-token
/// prompt), batch-64 decode +13 %, batch-1 decode −5 %.
pub fn set_mxfp4_tiles(mode: Mxfp4Tiles) {
    let v = match mode {
        Mxfp4Tiles::Never => 1,
        Mxfp4Tiles::Always => 2,
        Mxfp4Tiles::Batched => 3,
        Mxfp4Tiles::PerSequence => 4,
    };
    MXFP4_TILES.store(v, Ordering::Relaxed);
}

/// How MXFP4 weights packed now use the AMX tiles: as set, else `KIMI_MXFP4` (`registers`,
/// `tiles`, `batched`), else [`Mxfp4Tiles::PerSequence`].
pub fn mxfp4_tiles() -> Mxfp4Tiles {
    match MXFP4_TILES.load(Ordering::Relaxed) {
        0 => {
            let mode = match std::env::var("KIMI_MXFP4").as_deref() {
                Ok("tiles") => Mxfp4Tiles::Always,
                Ok("batched") => Mxfp4Tiles::Batched,
                Ok("registers") => Mxfp4Tiles::Never,
                _ => Mxfp4Tiles::PerSequence,
            };
            set_mxfp4_tiles(mode);
            mode
        }
        1 => Mxfp4Tiles::Never,
        2 => Mxfp4Tiles::Always,
        3 => Mxfp4Tiles::Batched,
        _ => Mxfp4Tiles::PerSequence,
    }
}

/// Whether MXFP4 weights packed now take the AMX tile layout ([`Mxfp4Tiles::Always`]).
pub fn mxfp4_on_tiles() -> bool {
    mxfp4_tiles() == Mxfp4Tiles::Always
}

/// E8M0 scales whose groups' values are all normal, finite BF16 numbers (the tiles read
/// subnormals as zero): 0.5 · 2^(s − 127) ≥ 2^−126 and 6 · 2^(s − 127) < 2^128, which also
/// keeps the tile decoder's biased lookup exact (see `packed_amx`).
pub(crate) const TILE_SCALES: std::ops::RangeInclusive<u8> = 2..=252;

/// Where column `c` of row `r` (within its panel) sits in an `Mxfp4Tiles` panel of `pairs`
/// column pairs: the byte and whether it is the high nibble.
pub(crate) fn tile_code_at(pairs: usize, p: usize, r: usize, c: usize) -> (usize, bool) {
    let (block, within) = (c / GROUP, c % GROUP);
    let (pair, odd) = (within / 2, within % 2);
    let byte = (p * pairs + block * TILE_PAIRS) * PANEL + (pair / 2) * 2 * PANEL + 2 * r + odd;
    (byte, pair % 2 == 1)
}

impl PackedMatrix {
    /// Repacks a BF16 or MXFP4 matrix; `None` for a format kept as stored (F32) or an empty one.
    /// MXFP4 takes the AMX tile layout where [`mxfp4_on_tiles`] asks for it.
    pub fn pack(m: &Matrix<'_>) -> Option<PackedMatrix> {
        PackedMatrix::pack_with(m, mxfp4_tiles())
    }

    /// [`PackedMatrix::pack`], MXFP4 on the AMX tiles as `mxfp4_tiles` says (where the CPU has
    /// them and every scale fits [`TILE_SCALES`]).
    pub fn pack_with(m: &Matrix<'_>, mxfp4_tiles: Mxfp4Tiles) -> Option<PackedMatrix> {
        let (rows, cols) = (m.rows(), m.cols());
        if rows == 0 || cols == 0 {
            // An empty shard (a rank with no rows of a small dimension): nothing to lay out.
            return None;
        }
        let panels = rows.div_ceil(PANEL);
        let pairs = cols.div_ceil(2);
        let data = match m {
            Matrix::Bf16(b) => {
                // Whole 32-column blocks per panel, so an AMX tile never reads past a panel.
                let stride = pairs.next_multiple_of(TILE_PAIRS);
                let mut out = AlignedVec::<u16>::zeroed(panels * stride * PANEL * 2);
                out.par_chunks_mut(stride * PANEL * 2).enumerate().for_each(|(p, panel)| {
                    for r in 0..PANEL.min(rows - p * PANEL) {
                        let row = b.row(p * PANEL + r);
                        for (c, &v) in row.iter().enumerate() {
                            panel[((c / 2) * PANEL + r) * 2 + c % 2] = v;
                        }
                    }
                });
                PackedData::Bf16(out)
            }
            Matrix::Mxfp4(q) => {
                let groups = cols / GROUP;
                let mut nibbles = AlignedVec::<u8>::zeroed(panels * pairs * PANEL);
                let mut scales = vec![127u8; panels * groups * PANEL];
                nibbles.par_chunks_mut(pairs * PANEL).zip(scales.par_chunks_mut(groups * PANEL)).enumerate().for_each(
                    |(p, (nib, sc))| {
                        for r in 0..PANEL.min(rows - p * PANEL) {
                            let (packed, s) = mxfp4_row(q, p * PANEL + r);
                            for (j, &b) in packed.iter().enumerate() {
                                nib[j * PANEL + r] = b;
                            }
                            for (g, &b) in s.iter().enumerate() {
                                sc[g * PANEL + r] = b;
                            }
                        }
                    },
                );
                let tiles_fit = mxfp4_tiles != Mxfp4Tiles::Never
                    && super::packed_amx::enabled()
                    && (0..rows).into_par_iter().all(|r| mxfp4_row(q, r).1.iter().all(|s| TILE_SCALES.contains(s)));
                if tiles_fit && mxfp4_tiles == Mxfp4Tiles::Always {
                    // The same codes, moved to the tile layout.
                    let mut codes = AlignedVec::<u8>::zeroed(nibbles.len());
                    let nibble = |b: u8, odd: usize| if odd == 1 { b >> 4 } else { b & 15 };
                    codes.par_chunks_mut(pairs * PANEL).zip(nibbles.par_chunks(pairs * PANEL)).for_each(
                        |(panel, nib)| {
                            // Byte j of a 32-byte chunk: lane j of tile rows (pairs) q and q + 1.
                            for (k, chunk) in panel.chunks_exact_mut(2 * PANEL).enumerate() {
                                let q = 2 * k;
                                for (j, out) in chunk.iter_mut().enumerate() {
                                    let (r, odd) = (j / 2, j % 2);
                                    let low = nibble(nib[q * PANEL + r], odd);
                                    let high = nibble(nib[(q + 1) * PANEL + r], odd);
                                    *out = low | high << 4;
                                }
                            }
                        },
                    );
                    return Some(PackedMatrix { rows, cols, data: PackedData::Mxfp4Tiles { codes, scales } });
                }
                let scaled_chain = (0..rows).into_par_iter().all(|r| {
                    let codes = mxfp4_row(q, r).1.iter().copied().filter(|&b| b != 255);
                    let (lo, hi) = codes.fold((u8::MAX, 0u8), |(lo, hi), b| (lo.min(b), hi.max(b)));
                    hi.saturating_sub(lo) <= MAX_SCALE_SPAN
                });
                let tile_rule = if tiles_fit { mxfp4_tiles } else { Mxfp4Tiles::Never };
                PackedData::Mxfp4 { nibbles, scales, scaled_chain, tile_rule }
            }
            Matrix::Fp8(f) => {
                let mut codes = AlignedVec::<u8>::zeroed(panels * pairs * PANEL * 2);
                codes.par_chunks_mut(pairs * PANEL * 2).enumerate().for_each(|(p, panel)| {
                    for r in 0..PANEL.min(rows - p * PANEL) {
                        let row = &f.data[(p * PANEL + r) * cols..(p * PANEL + r + 1) * cols];
                        for (c, &v) in row.iter().enumerate() {
                            panel[(c / 2 * 2 + c % 2) * PANEL + r] = v;
                        }
                    }
                });
                let mut scales = vec![1f32; panels * PANEL];
                scales[..rows].copy_from_slice(f.scales);
                PackedData::Fp8 { codes, scales }
            }
            Matrix::F32(_) | Matrix::Packed(_) => return None,
        };
        Some(PackedMatrix { rows, cols, data })
    }

    fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }

    /// Panel groups: the register products' tasks.
    fn groups(&self) -> usize {
        self.panels().div_ceil(GROUP_PANELS)
    }

    pub(crate) fn pairs(&self) -> usize {
        self.cols.div_ceil(2)
    }

    /// Column pairs a panel holds: BF16 panels are padded to whole [`TILE_PAIRS`] (zeros).
    pub(crate) fn panel_pairs(&self) -> usize {
        match self.data {
            PackedData::Bf16(_) => self.pairs().next_multiple_of(TILE_PAIRS),
            _ => self.pairs(),
        }
    }

    /// Whether products over this matrix run on AMX tiles (`packed_amx`) on this machine, at
    /// every token count.
    pub fn on_tiles(&self) -> bool {
        super::packed_amx::takes(self)
    }

    /// Whether a product of `tokens` tokens over this matrix runs on AMX tiles: as
    /// [`PackedMatrix::on_tiles`], or MXFP4 under [`Mxfp4Tiles::Batched`] from
    /// [`BATCHED_TILE_TOKENS`] tokens.
    pub fn on_tiles_for(&self, tokens: usize) -> bool {
        super::packed_amx::takes_for(self, tokens)
    }

    /// Whether a sequence's run of [`BATCHED_TILE_TOKENS`] or more tokens may take the AMX
    /// tiles over this matrix ([`Mxfp4Tiles::PerSequence`]; see `moe_experts`).
    pub fn takes_sequence_runs(&self) -> bool {
        matches!(self.data, PackedData::Mxfp4 { tile_rule: Mxfp4Tiles::PerSequence, .. })
            && super::packed_amx::enabled()
    }

    /// Bytes held (the stored weight's size, padded to whole panels).
    pub fn bytes(&self) -> usize {
        match &self.data {
            PackedData::Bf16(v) => 2 * v.len(),
            PackedData::Mxfp4 { nibbles, scales, .. } => nibbles.len() + scales.len(),
            PackedData::Mxfp4Tiles { codes, scales } => codes.len() + scales.len(),
            PackedData::Fp8 { codes, scales } => codes.len() + 4 * scales.len(),
        }
    }

    /// The packed layout's weight format, for reports.
    pub fn format(&self) -> &'static str {
        match &self.data {
            PackedData::Bf16(_) => "bf16 panels",
            PackedData::Mxfp4 { .. } => "mxfp4 panels",
            PackedData::Mxfp4Tiles { .. } => "mxfp4 tiles",
            PackedData::Fp8 { .. } => "fp8 panels",
        }
    }

    /// Row `r` as f32 (exact), for tools and tests.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let (p, lane) = (r / PANEL, r % PANEL);
        let pairs = self.pairs();
        let stride = self.panel_pairs();
        for (c, o) in out[..self.cols].iter_mut().enumerate() {
            *o = match &self.data {
                PackedData::Bf16(v) => {
                    f32::from_bits((v[((p * stride + c / 2) * PANEL + lane) * 2 + c % 2] as u32) << 16)
                }
                PackedData::Mxfp4 { nibbles, scales, .. } => {
                    let b = nibbles[(p * pairs + c / 2) * PANEL + lane];
                    let code = if c % 2 == 0 { b & 15 } else { b >> 4 };
                    let s = scales[(p * (self.cols / GROUP) + c / GROUP) * PANEL + lane];
                    E2M1[code as usize] * e8m0_to_f32(s)
                }
                PackedData::Mxfp4Tiles { codes, scales } => {
                    let (at, high) = tile_code_at(pairs, p, lane, c);
                    let code = if high { codes[at] >> 4 } else { codes[at] & 15 };
                    let s = scales[(p * (self.cols / GROUP) + c / GROUP) * PANEL + lane];
                    E2M1[code as usize] * e8m0_to_f32(s)
                }
                PackedData::Fp8 { codes, scales } => {
                    fp8_raw(codes[((p * pairs + c / 2) * 2 + c % 2) * PANEL + lane]) * FP8_REBIAS * scales[r]
                }
            };
        }
    }
}

/// The stored bytes of one MXFP4 row: `cols / 2` packed codes and `cols / 32` scales.
fn mxfp4_row<'a>(q: &Mxfp4Matrix<'a>, r: usize) -> (&'a [u8], &'a [u8]) {
    let (pb, sb) = (q.cols / 2, q.cols / GROUP);
    (&q.packed[r * pb..(r + 1) * pb], &q.scales[r * sb..(r + 1) * sb])
}

/// `out[t, r] = Σ_c W[r, c] · x[t, c]`, each output a multiply-add chain over each 16-column
/// block in order, the blocks added pairwise (module docs).
/// FP8 weights take each token's activations as E4M3 codes with one scale per token (see the
/// module's documentation).
pub fn matmul(w: &PackedMatrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), tokens * cols, "packed matmul: x has {} values, want {tokens}×{cols}", x.len());
    assert_eq!(out.len(), tokens * rows, "packed matmul: out has {} values, want {tokens}×{rows}", out.len());
    if tokens == 0 || rows == 0 {
        return;
    }
    let PackedData::Fp8 { scales, .. } = &w.data else {
        return matmul_chains(w, x, tokens, out);
    };
    // Each token's codes' values (|v| ≤ 448) and its scale max|x_t| / 448.
    let mut codes = vec![0f32; x.len()];
    let mut token_scale = vec![1f32; tokens];
    let quantise = |((row, c), s): ((&[f32], &mut [f32]), &mut f32)| *s = fp8_token_codes(row, c);
    if tokens > 1 && x.len() >= SERIAL_WORK / 4 {
        // A prefill's tokens are quantised on every thread (the rounding is scalar work).
        x.par_chunks_exact(cols)
            .zip(codes.par_chunks_exact_mut(cols))
            .zip(token_scale.par_iter_mut())
            .for_each(quantise);
    } else {
        x.chunks_exact(cols).zip(codes.chunks_exact_mut(cols)).zip(token_scale.iter_mut()).for_each(quantise);
    }
    matmul_chains(w, &codes, tokens, out);
    for (o, s) in out.chunks_exact_mut(rows).zip(&token_scale) {
        for (v, r) in o.iter_mut().zip(scales) {
            *v = *v * FP8_REBIAS * *r * *s;
        }
    }
}

/// One token's activations as E4M3 codes' values (`decode(f32_to_e4m3(v / s))`, |·| ≤ 448) into
/// `out`, and its scale `s = max|v| / 448` (1 for a zero or non-finite maximum; NaNs are skipped
/// by the maximum and become the code 0x7F, 480, as in [`f32_to_e4m3`]).
fn fp8_token_codes(row: &[f32], out: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time.
        return unsafe { x86::fp8_token_codes_avx512(row, out) };
    }
    fp8_token_codes_scalar(row, out)
}

fn fp8_token_codes_scalar(row: &[f32], out: &mut [f32]) -> f32 {
    let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = if m > 0.0 && m.is_finite() { m / E4M3_MAX } else { 1.0 };
    for (c, v) in out.iter_mut().zip(row) {
        *c = fp8_raw(f32_to_e4m3(v / s)) * FP8_REBIAS;
    }
    s
}

/// The chains of [`matmul`] over `x` as given.
fn matmul_chains(w: &PackedMatrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    if super::packed_amx::takes_for(w, tokens) {
        return super::packed_amx::matmul(w, x, tokens, out);
    }
    let groups = w.groups();
    // Every task writes a disjoint set of output columns (its own panel group's rows).
    let ptr = DisjointOut::new(out);
    let run = |g: usize| chains_group(w, x, tokens, ptr, g);
    if w.rows * w.cols * tokens < SERIAL_WORK || groups == 1 || rayon::current_num_threads() == 1 {
        (0..groups).for_each(run);
    } else {
        (0..groups).into_par_iter().for_each(run);
    }
}

/// Most matrices [`matmul_many`] takes in one call.
pub const MANY: usize = 8;

/// Whether [`matmul_many`] takes `w` for `tokens` tokens: a product on the registers (not the
/// AMX tiles) over activations as given (not FP8, whose products quantise them first).
pub fn runs_many(w: &PackedMatrix, tokens: usize) -> bool {
    !matches!(w.data, PackedData::Fp8 { .. }) && !super::packed_amx::takes_for(w, tokens)
}

/// [`matmul`] of up to [`MANY`] matrices (each one [`runs_many`] takes) over the same `x`, as
/// one parallel loop over every matrix's panel groups: the products share one hand-off and one
/// tail (a thread idles at each product's end only once), which matters in decode, where a
/// layer's projections are each a few hundred microseconds. Each output is the same bits as
/// [`matmul`] of its matrix alone (the same group function computes it).
pub fn matmul_many(ws: &[&PackedMatrix], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
    assert!(ws.len() <= MANY, "packed matmul_many: {} matrices, at most {MANY}", ws.len());
    assert_eq!(ws.len(), outs.len(), "packed matmul_many: {} matrices, {} outputs", ws.len(), outs.len());
    // Every group task of matrix i is one of starts[i]..starts[i + 1].
    let mut starts = [0usize; MANY + 1];
    let mut ptrs = [None; MANY];
    let mut work = 0usize;
    for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        assert!(runs_many(w, tokens), "packed matmul_many: matrix {i} is not a register product");
        assert_eq!(x.len(), tokens * w.cols, "packed matmul: x has {} values, want {tokens}×{}", x.len(), w.cols);
        assert_eq!(out.len(), tokens * w.rows, "packed matmul: out has {} values, want {tokens}×{}", out.len(), w.rows);
        starts[i + 1] = starts[i] + if tokens == 0 || w.rows == 0 { 0 } else { w.groups() };
        ptrs[i] = Some(DisjointOut::new(out));
        work += w.rows * w.cols * tokens;
    }
    let tasks = starts[ws.len()];
    let run = |task: usize| {
        // The matrix whose tasks hold `task` (the last start at or below it).
        let i = starts[1..=ws.len()].partition_point(|&s| s <= task);
        if let Some(ptr) = ptrs[i] {
            chains_group(ws[i], x, tokens, ptr, task - starts[i]);
        }
    };
    if work < SERIAL_WORK || tasks <= 1 || rayon::current_num_threads() == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Panel group `g` of `w`'s product over `tokens` tokens of `x`, written into its rows of `ptr`
/// (`[tokens, w.rows]`): the task both [`matmul_chains`] and [`matmul_many`] run.
fn chains_group(w: &PackedMatrix, x: &[f32], tokens: usize, ptr: DisjointOut, g: usize) {
    let (rows, cols) = (w.rows, w.cols);
    let p0 = g * GROUP_PANELS;
    let np = GROUP_PANELS.min(w.panels() - p0);
    // Writes the first `nt` tokens of each panel's outputs from token `t`.
    let store = |acc: &[[[f32; PANEL]; DIRECT_TOKENS]], t: usize, nt: usize| {
        for (i, panel) in acc.iter().enumerate().take(np) {
            let r0 = (p0 + i) * PANEL;
            let n = PANEL.min(rows - r0);
            for (j, lanes) in panel.iter().enumerate().take(nt) {
                // SAFETY: t + j < tokens and r0 + n <= rows; this task owns rows of panels
                // p0..p0+np.
                unsafe { std::ptr::copy_nonoverlapping(lanes.as_ptr(), ptr.at((t + j) * rows + r0), n) };
            }
        }
    };
    let direct_tiles = || {
        let mut t = 0;
        while t < tokens {
            let nt = DIRECT_TOKENS.min(tokens - t);
            let mut acc = [[[0f32; PANEL]; DIRECT_TOKENS]; GROUP_PANELS];
            let step = if nt <= TOKEN_TILE { np } else { 2 };
            for i0 in (0..np).step_by(step) {
                tile_direct(w, x, p0 + i0, step.min(np - i0), t, nt, &mut acc[i0..]);
            }
            store(&acc, t, nt);
            t += nt;
        }
    };
    let tiles = |wide: &[f32]| {
        let mut t = 0;
        while t < tokens {
            let nt = TOKEN_TILE.min(tokens - t);
            let mut acc = [[[0f32; PANEL]; TOKEN_TILE]; GROUP_PANELS];
            tile_wide(wide, cols, x, np, t, nt, &mut acc);
            for (i, panel) in acc.iter().enumerate().take(np) {
                let r0 = (p0 + i) * PANEL;
                let n = PANEL.min(rows - r0);
                for (j, lanes) in panel.iter().enumerate().take(nt) {
                    // SAFETY: t + j < tokens and r0 + n <= rows; this task owns rows of
                    // panels p0..p0+np.
                    unsafe { std::ptr::copy_nonoverlapping(lanes.as_ptr(), ptr.at((t + j) * rows + r0), n) };
                }
            }
            t += nt;
        }
    };
    let direct = match &w.data {
        PackedData::Bf16(_) | PackedData::Fp8 { .. } => true,
        PackedData::Mxfp4 { scaled_chain, .. } => *scaled_chain,
        PackedData::Mxfp4Tiles { .. } => false,
    };
    if tokens < WIDEN_FROM && simd_level() == SimdLevel::Avx512 && direct {
        // Few token tiles on AVX-512: decode in registers as they go.
        direct_tiles();
    } else {
        // Widen the group once, so the tiles only multiply (same values, so same chains; the
        // other SIMD levels always take this path).
        WIDE.with(|s| {
            let mut buf = s.borrow_mut();
            let need = w.pairs() * GROUP_PANELS * 2 * PANEL;
            buf.reserve_len(need);
            let wide = &mut buf[..need];
            widen(w, p0, np, wide);
            tiles(wide);
        });
    }
}

/// Writes panels `p0..p0+np`' values as f32, `[pair][panel (of GROUP_PANELS)][even 16 | odd 16]`.
fn widen(w: &PackedMatrix, p0: usize, np: usize, wide: &mut [f32]) {
    let pairs = w.pairs();
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time; `wide` holds pairs × GROUP_PANELS × 32
        // values and panels p0..p0+np exist.
        unsafe { x86::widen_avx512(w, p0, np, wide) };
        return;
    }
    for q in 0..pairs {
        for i in 0..np {
            let dst = &mut wide[(q * GROUP_PANELS + i) * 2 * PANEL..(q * GROUP_PANELS + i + 1) * 2 * PANEL];
            let (we, wo) = dst.split_at_mut(PANEL);
            decode_pair(w, p0 + i, q, we, wo);
        }
    }
}

/// Panel `p`'s values of column pair `q`: even columns into `we`, odd into `wo` (16 each).
fn decode_pair(w: &PackedMatrix, p: usize, q: usize, we: &mut [f32], wo: &mut [f32]) {
    let (cols, pairs) = (w.cols, w.pairs());
    match &w.data {
        PackedData::Bf16(v) => {
            let base = (p * w.panel_pairs() + q) * PANEL * 2;
            for r in 0..PANEL {
                we[r] = f32::from_bits((v[base + 2 * r] as u32) << 16);
                wo[r] = f32::from_bits((v[base + 2 * r + 1] as u32) << 16);
            }
        }
        PackedData::Mxfp4 { nibbles, scales, .. } => {
            let base = (p * pairs + q) * PANEL;
            let sbase = (p * (cols / GROUP) + 2 * q / GROUP) * PANEL;
            for r in 0..PANEL {
                let b = nibbles[base + r];
                let s = e8m0_to_f32(scales[sbase + r]);
                we[r] = E2M1[(b & 15) as usize] * s;
                wo[r] = E2M1[(b >> 4) as usize] * s;
            }
        }
        PackedData::Mxfp4Tiles { codes, scales } => {
            let sbase = (p * (cols / GROUP) + 2 * q / GROUP) * PANEL;
            for r in 0..PANEL {
                let s = e8m0_to_f32(scales[sbase + r]);
                for (c, o) in [(2 * q, &mut we[r]), (2 * q + 1, &mut wo[r])] {
                    let (at, high) = tile_code_at(pairs, p, r, c);
                    *o = E2M1[(if high { codes[at] >> 4 } else { codes[at] & 15 }) as usize] * s;
                }
            }
        }
        PackedData::Fp8 { codes, .. } => {
            let base = (p * pairs + q) * PANEL * 2;
            for r in 0..PANEL {
                we[r] = fp8_raw(codes[base + r]);
                wo[r] = fp8_raw(codes[base + PANEL + r]);
            }
        }
    }
}

/// [`tile`] over a widened group.
fn tile_wide(
    wide: &[f32],
    cols: usize,
    x: &[f32],
    np: usize,
    t0: usize,
    nt: usize,
    acc: &mut [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS],
) {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; `wide` holds the group's pairs and tokens
        // t0..t0+nt have `cols` values in x.
        SimdLevel::Avx512 => unsafe { x86::tile_wide_avx512(wide, cols, x, np, t0, nt, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; AVX2 + FMA detected.
        SimdLevel::Avx2 => unsafe { x86::tile_wide_fma(wide, cols, x, np, t0, nt, acc) },
        _ => tile_wide_generic(wide, cols, x, np, t0, nt, acc),
    }
}

#[inline(always)]
fn tile_wide_generic(
    wide: &[f32],
    cols: usize,
    x: &[f32],
    np: usize,
    t0: usize,
    nt: usize,
    acc: &mut [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS],
) {
    type Tile = [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS];
    let add = |mut a: Tile, b: Tile| {
        for (a, b) in a.iter_mut().flatten().flatten().zip(b.iter().flatten().flatten()) {
            *a += b;
        }
        a
    };
    let zero = [[[0f32; PANEL]; TOKEN_TILE]; GROUP_PANELS];
    let mut sum = PairwiseSum::new(zero);
    let mut block = zero;
    for q in 0..cols.div_ceil(2) {
        if q > 0 && q.is_multiple_of(BLOCK_PAIRS) {
            sum.push(block, add);
            block = zero;
        }
        let odd = 2 * q + 1 < cols;
        for j in 0..nt {
            let xe = x[(t0 + j) * cols + 2 * q];
            let xo = if odd { x[(t0 + j) * cols + 2 * q + 1] } else { 0.0 };
            for (i, a) in block.iter_mut().enumerate().take(np) {
                let at = (q * GROUP_PANELS + i) * 2 * PANEL;
                let (we, wo) = (&wide[at..at + PANEL], &wide[at + PANEL..at + 2 * PANEL]);
                for r in 0..PANEL {
                    let v = we[r].mul_add(xe, a[j][r]);
                    a[j][r] = if odd { wo[r].mul_add(xo, v) } else { v };
                }
            }
        }
    }
    sum.push(block, add);
    *acc = sum.total(add);
}

/// Accumulates panels `p0..p0+np` × tokens `t0..t0+nt` into `acc[panel][token][lane]`, decoding
/// the weights in registers: up to four panels of up to four tokens, or up to two panels of up
/// to [`DIRECT_TOKENS`]. `matmul` calls it only on AVX-512.
fn tile_direct(w: &PackedMatrix, x: &[f32], p0: usize, np: usize, t0: usize, nt: usize, acc: &mut [DirectTile]) {
    assert!(np <= acc.len() && nt <= DIRECT_TOKENS && (nt <= TOKEN_TILE || np <= 2), "tile_direct: {np} × {nt}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `matmul` takes this path only when AVX-512 was detected; it checked x's length, and
    // p0, np, t0, nt lie inside the matrix and the batch.
    unsafe {
        x86::tile_avx512(w, x, p0, np, t0, nt, acc)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, x, p0, t0);
        unreachable!("the register-decoding path runs on AVX-512 only")
    }
}

// Register tiles are indexed by constant ranges so that they unroll into named registers.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        BLOCK_PAIRS, DirectTile, E4M3_MAX, FP8_REBIAS, GROUP_PANELS, PANEL, PREFETCH_BYTES, PackedData, PackedMatrix,
        PairwiseSum, TOKEN_TILE, f32_to_e4m3, tile_wide_generic,
    };
    use crate::cpu::mxfp4::{E2M1, GROUP};

    /// Calls `$f::<NP, NT>(args)` for the run-time panel and token counts: fixed shapes let the
    /// accumulators live in registers, and the tails of a matrix or a batch pick smaller ones.
    macro_rules! by_shape {
        ($f:ident, $np:expr, $nt:expr, ($($arg:expr),*)) => {
            match ($np, $nt) {
                (1, 1) => $f::<1, 1>($($arg),*),
                (1, 2) => $f::<1, 2>($($arg),*),
                (1, 3) => $f::<1, 3>($($arg),*),
                (1, _) => $f::<1, 4>($($arg),*),
                (2, 1) => $f::<2, 1>($($arg),*),
                (2, 2) => $f::<2, 2>($($arg),*),
                (2, 3) => $f::<2, 3>($($arg),*),
                (2, _) => $f::<2, 4>($($arg),*),
                (3, 1) => $f::<3, 1>($($arg),*),
                (3, 2) => $f::<3, 2>($($arg),*),
                (3, 3) => $f::<3, 3>($($arg),*),
                (3, _) => $f::<3, 4>($($arg),*),
                (4, 1) => $f::<4, 1>($($arg),*),
                (4, 2) => $f::<4, 2>($($arg),*),
                (4, 3) => $f::<4, 3>($($arg),*),
                (_, _) => $f::<4, 4>($($arg),*),
            }
        };
    }

    /// [`tile_wide_generic`] compiled with FMA, for AVX2 machines.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_wide_fma(
        wide: &[f32],
        cols: usize,
        x: &[f32],
        np: usize,
        t0: usize,
        nt: usize,
        acc: &mut [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS],
    ) {
        tile_wide_generic(wide, cols, x, np, t0, nt, acc)
    }

    /// Decodes panels p0..p0+np into `wide` with the same instructions as the direct tiles.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_avx512(w: &PackedMatrix, p0: usize, np: usize, wide: &mut [f32]) {
        let (cols, pairs) = (w.cols, w.pairs());
        let base = wide.as_mut_ptr();
        let dst = |q: usize, i: usize| base.wrapping_add((q * GROUP_PANELS + i) * 2 * PANEL);
        unsafe {
            match &w.data {
                PackedData::Bf16(v) => {
                    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
                    for q in 0..pairs {
                        for i in 0..np {
                            let at = v.as_ptr().add(((p0 + i) * w.panel_pairs() + q) * PANEL * 2);
                            let raw = _mm512_loadu_si512(at as *const __m512i);
                            _mm512_storeu_ps(dst(q, i), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw)));
                            _mm512_storeu_ps(dst(q, i).add(PANEL), _mm512_castsi512_ps(_mm512_and_si512(raw, high)));
                        }
                    }
                }
                PackedData::Mxfp4 { nibbles, scales, .. } => {
                    let lut = _mm512_loadu_ps(E2M1.as_ptr());
                    let groups = cols / GROUP;
                    for i in 0..np {
                        let mut scale = _mm512_setzero_ps();
                        for q in 0..pairs {
                            if (2 * q).is_multiple_of(GROUP) {
                                let at = scales.as_ptr().add(((p0 + i) * groups + 2 * q / GROUP) * PANEL);
                                scale = e8m0x16(_mm_loadu_si128(at as *const __m128i));
                            }
                            let at = nibbles.as_ptr().add(((p0 + i) * pairs + q) * PANEL);
                            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
                            // vpermps reads only an index's low 4 bits: the low nibble as is.
                            let hi = _mm512_srli_epi32::<4>(b);
                            _mm512_storeu_ps(dst(q, i), _mm512_mul_ps(_mm512_permutexvar_ps(b, lut), scale));
                            _mm512_storeu_ps(
                                dst(q, i).add(PANEL),
                                _mm512_mul_ps(_mm512_permutexvar_ps(hi, lut), scale),
                            );
                        }
                    }
                }
                PackedData::Fp8 { codes, .. } => {
                    for q in 0..pairs {
                        for i in 0..np {
                            let (we, wo) = fp8_pair(codes.as_ptr().add(((p0 + i) * pairs + q) * PANEL * 2));
                            _mm512_storeu_ps(dst(q, i), we);
                            _mm512_storeu_ps(dst(q, i).add(PANEL), wo);
                        }
                    }
                }
                PackedData::Mxfp4Tiles { .. } => {
                    // Laid out for the AMX tiles, which take every product over it; decoded
                    // value by value should a product ever come here.
                    for q in 0..pairs {
                        for i in 0..np {
                            // SAFETY: `wide` holds pairs × GROUP_PANELS × 32 values (caller).
                            let (we, wo) = std::slice::from_raw_parts_mut(dst(q, i), 2 * PANEL).split_at_mut(PANEL);
                            super::decode_pair(w, p0 + i, q, we, wo);
                        }
                    }
                }
            }
        }
    }

    /// `a + b`, register by register.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn add_tiles<const NP: usize, const NT: usize>(a: [[__m512; NT]; NP], b: [[__m512; NT]; NP]) -> [[__m512; NT]; NP] {
        let mut out = a;
        for i in 0..NP {
            for j in 0..NT {
                out[i][j] = _mm512_add_ps(a[i][j], b[i][j]);
            }
        }
        out
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile_wide_avx512(
        wide: &[f32],
        cols: usize,
        x: &[f32],
        np: usize,
        t0: usize,
        nt: usize,
        acc: &mut [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { by_shape!(wide_n, np, nt, (wide, cols, x, t0, acc)) }
    }

    /// SAFETY (caller): AVX-512F available; `wide` holds the group; tokens t0..t0+NT in `x`.
    #[target_feature(enable = "avx512f")]
    unsafe fn wide_n<const NP: usize, const NT: usize>(
        wide: &[f32],
        cols: usize,
        x: &[f32],
        t0: usize,
        out: &mut [[[f32; PANEL]; TOKEN_TILE]; GROUP_PANELS],
    ) {
        let zero = [[_mm512_setzero_ps(); NT]; NP];
        let add = |a, b| add_tiles::<NP, NT>(a, b);
        let mut sum = PairwiseSum::new(zero);
        let xp = |j: usize, c: usize| x.as_ptr().wrapping_add((t0 + j) * cols + c);
        let (full, pairs) = (cols / 2, cols.div_ceil(2));
        unsafe {
            for q0 in (0..pairs).step_by(BLOCK_PAIRS) {
                let mut acc = zero;
                for q in q0..pairs.min(q0 + BLOCK_PAIRS) {
                    let at = |i: usize| wide.as_ptr().add((q * GROUP_PANELS + i) * 2 * PANEL);
                    for j in 0..NT {
                        let xe = _mm512_set1_ps(*xp(j, 2 * q));
                        for i in 0..NP {
                            acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(at(i)), xe, acc[i][j]);
                        }
                        if q < full {
                            let xo = _mm512_set1_ps(*xp(j, 2 * q + 1));
                            for i in 0..NP {
                                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(at(i).add(PANEL)), xo, acc[i][j]);
                            }
                        }
                    }
                }
                sum.push(acc, add);
            }
            let acc = sum.total(add);
            for i in 0..NP {
                for j in 0..NT {
                    _mm512_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j]);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512(
        w: &PackedMatrix,
        x: &[f32],
        p0: usize,
        np: usize,
        t0: usize,
        nt: usize,
        acc: &mut [DirectTile],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (np, nt) {
                (1, 5) => tile_n::<1, 5>(w, x, p0, t0, acc),
                (1, 6) => tile_n::<1, 6>(w, x, p0, t0, acc),
                (1, 7) => tile_n::<1, 7>(w, x, p0, t0, acc),
                (1, 8) => tile_n::<1, 8>(w, x, p0, t0, acc),
                (2, 5) => tile_n::<2, 5>(w, x, p0, t0, acc),
                (2, 6) => tile_n::<2, 6>(w, x, p0, t0, acc),
                (2, 7) => tile_n::<2, 7>(w, x, p0, t0, acc),
                (2, 8) => tile_n::<2, 8>(w, x, p0, t0, acc),
                _ => by_shape!(tile_n, np, nt, (w, x, p0, t0, acc)),
            }
        }
    }

    /// SAFETY (caller): AVX-512F available; panels p0..p0+NP exist; tokens t0..t0+NT have `cols`
    /// values each in `x`.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_n<const NP: usize, const NT: usize>(
        w: &PackedMatrix,
        x: &[f32],
        p0: usize,
        t0: usize,
        out: &mut [DirectTile],
    ) {
        let (cols, pairs) = (w.cols, w.pairs());
        let zero = [[_mm512_setzero_ps(); NT]; NP];
        let add = |a, b| add_tiles::<NP, NT>(a, b);
        let mut sum = PairwiseSum::new(zero);
        let xp = |j: usize, c: usize| x.as_ptr().wrapping_add((t0 + j) * cols + c);
        // Column pair q's weights (`we` even, `wo` odd, a register per panel) into every
        // accumulator's chain. A pair whose second column is padding is skipped rather than read
        // past the row, as the widened tile does, so both paths run the same chains.
        let full = cols / 2;
        let pair = |acc: &mut [[__m512; NT]; NP], we: &[__m512; NP], wo: &[__m512; NP], q: usize| {
            for j in 0..NT {
                // SAFETY: tokens t0..t0+NT have `cols` values in x, and 2q (2q + 1 below
                // `full`) is a column.
                let xe = _mm512_set1_ps(unsafe { *xp(j, 2 * q) });
                for i in 0..NP {
                    acc[i][j] = _mm512_fmadd_ps(we[i], xe, acc[i][j]);
                }
                if q < full {
                    // SAFETY: as above.
                    let xo = _mm512_set1_ps(unsafe { *xp(j, 2 * q + 1) });
                    for i in 0..NP {
                        acc[i][j] = _mm512_fmadd_ps(wo[i], xo, acc[i][j]);
                    }
                }
            }
        };
        unsafe {
            match &w.data {
                PackedData::Bf16(v) => {
                    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
                    let stride = w.panel_pairs();
                    let at = |p: usize, q: usize| v.as_ptr().add(((p0 + p) * stride + q) * PANEL * 2);
                    // A pair of a panel is one 64-byte line; the first lines are asked for before
                    // the loop, the rest as it goes.
                    let ahead = PREFETCH_BYTES / (PANEL * 4);
                    for i in 0..NP {
                        for q in 0..ahead.min(pairs) {
                            prefetch(at(i, q));
                        }
                    }
                    for q0 in (0..pairs).step_by(BLOCK_PAIRS) {
                        let mut acc = zero;
                        for q in q0..pairs.min(q0 + BLOCK_PAIRS) {
                            let mut we = [_mm512_setzero_ps(); NP];
                            let mut wo = [_mm512_setzero_ps(); NP];
                            if q + ahead < pairs {
                                for i in 0..NP {
                                    prefetch(at(i, q + ahead));
                                }
                            }
                            for i in 0..NP {
                                let raw = _mm512_loadu_si512(at(i, q) as *const __m512i);
                                we[i] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                                wo[i] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
                            }
                            pair(&mut acc, &we, &wo, q);
                        }
                        sum.push(acc, add);
                    }
                }
                PackedData::Fp8 { codes, .. } => {
                    let at = |p: usize, q: usize| codes.as_ptr().add(((p0 + p) * pairs + q) * PANEL * 2);
                    // Two pairs of a panel are one 64-byte line.
                    let ahead = PREFETCH_BYTES / (PANEL * 2);
                    for i in 0..NP {
                        for q in (0..ahead.min(pairs)).step_by(2) {
                            prefetch(at(i, q));
                        }
                    }
                    for q0 in (0..pairs).step_by(BLOCK_PAIRS) {
                        let mut acc = zero;
                        for q in q0..pairs.min(q0 + BLOCK_PAIRS) {
                            let mut we = [_mm512_setzero_ps(); NP];
                            let mut wo = [_mm512_setzero_ps(); NP];
                            if q % 2 == 0 && q + ahead < pairs {
                                for i in 0..NP {
                                    prefetch(at(i, q + ahead));
                                }
                            }
                            for i in 0..NP {
                                (we[i], wo[i]) = fp8_pair(at(i, q));
                            }
                            pair(&mut acc, &we, &wo, q);
                        }
                        sum.push(acc, add);
                    }
                }
                PackedData::Mxfp4 { nibbles, scales, .. } => {
                    // Each block's chain runs in its group's scaled coordinates: over the
                    // unscaled E2M1 codes, its sum then scaled by s. s is a power of two, so
                    // s · fma-chain(w, x) = fma-chain(w·s, x) exactly (while the partial sums
                    // stay normal floats): the same bits as the widened path, without a multiply
                    // per weight vector.
                    let lut = _mm512_loadu_ps(E2M1.as_ptr());
                    let groups = cols / GROUP;
                    let mut expo = [_mm512_setzero_ps(); NP];
                    let scaled = |acc: [[__m512; NT]; NP], expo: &[__m512; NP]| {
                        let mut out = acc;
                        for i in 0..NP {
                            for j in 0..NT {
                                out[i][j] = _mm512_scalef_ps(acc[i][j], expo[i]);
                            }
                        }
                        out
                    };
                    // MXFP4 columns come in groups of 32, so every block and pair is whole. Four
                    // pairs of a panel are one 64-byte line.
                    let ahead = PREFETCH_BYTES / PANEL;
                    for i in 0..NP {
                        for q in (0..ahead.min(pairs)).step_by(4) {
                            prefetch(nibbles.as_ptr().add(((p0 + i) * pairs + q) * PANEL));
                        }
                        prefetch(scales.as_ptr().add((p0 + i) * groups * PANEL));
                    }
                    for g in 0..groups {
                        for i in 0..NP {
                            let at = scales.as_ptr().add(((p0 + i) * groups + g) * PANEL);
                            expo[i] = e8m0_exponents(_mm_loadu_si128(at as *const __m128i));
                        }
                        for q0 in (g * GROUP / 2..(g + 1) * GROUP / 2).step_by(BLOCK_PAIRS) {
                            let mut acc = zero;
                            for q in q0..q0 + BLOCK_PAIRS {
                                let mut we = [_mm512_setzero_ps(); NP];
                                let mut wo = [_mm512_setzero_ps(); NP];
                                if q % 4 == 0 && q + ahead < pairs {
                                    for i in 0..NP {
                                        prefetch(nibbles.as_ptr().add(((p0 + i) * pairs + q + ahead) * PANEL));
                                    }
                                }
                                for i in 0..NP {
                                    let at = nibbles.as_ptr().add(((p0 + i) * pairs + q) * PANEL);
                                    let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
                                    // vpermps reads only an index's low 4 bits: the low nibble as is.
                                    we[i] = _mm512_permutexvar_ps(b, lut);
                                    wo[i] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), lut);
                                }
                                pair(&mut acc, &we, &wo, q);
                            }
                            sum.push(scaled(acc, &expo), add);
                        }
                    }
                }
                PackedData::Mxfp4Tiles { .. } => unreachable!("MXFP4 tile layouts are widened, never decoded here"),
            }
            let acc = sum.total(add);
            for i in 0..NP {
                for j in 0..NT {
                    _mm512_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j]);
                }
            }
        }
    }

    /// [`super::fp8_token_codes`] 16 values at a time: the maximum with `vmaxps` (which passes
    /// over NaNs as `f32::max` does), then E4M3 rounding on the value's own quantum (2^(e − 3),
    /// or 2^−9 below 2^−6): `roundscale(a / q) · q` rounds half to even like the scalar encoder,
    /// and 448 is on the grid, so clamping first is the encoder's saturation.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fp8_token_codes_avx512(row: &[f32], out: &mut [f32]) -> f32 {
        let n = row.len().min(out.len());
        let whole = n / 16 * 16;
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let mut vm = _mm512_setzero_ps();
        // SAFETY (all loads and stores): i + 16 <= whole <= n, inside both slices.
        unsafe {
            for i in (0..whole).step_by(16) {
                let v = _mm512_castsi512_ps(_mm512_and_si512(
                    _mm512_castps_si512(_mm512_loadu_ps(row.as_ptr().add(i))),
                    abs_mask,
                ));
                vm = _mm512_max_ps(v, vm);
            }
        }
        let m = row[whole..n].iter().fold(_mm512_reduce_max_ps(vm), |m, v| m.max(v.abs()));
        let s = if m > 0.0 && m.is_finite() { m / E4M3_MAX } else { 1.0 };
        let (vs, cap, small) = (_mm512_set1_ps(s), _mm512_set1_ps(E4M3_MAX), _mm512_set1_ps(1.0 / 64.0));
        let sub_quantum = _mm512_set1_ps(1.0 / 512.0);
        let exp_mask = _mm512_set1_epi32(0x7f80_0000);
        let sign_mask = _mm512_set1_epi32(i32::MIN);
        let nan_code = _mm512_set1_ps(super::fp8_raw(0x7F) * FP8_REBIAS);
        unsafe {
            for i in (0..whole).step_by(16) {
                let q = _mm512_div_ps(_mm512_loadu_ps(row.as_ptr().add(i)), vs);
                let qi = _mm512_castps_si512(q);
                let a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(qi, abs_mask)), cap);
                // 2^(e − 3) from a's exponent field, and its reciprocal 2^(3 − e); both exact.
                let e = _mm512_and_si512(_mm512_castps_si512(a), exp_mask);
                let quantum = _mm512_castsi512_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(3 << 23)));
                let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, small);
                let quantum = _mm512_mask_blend_ps(below, quantum, sub_quantum);
                let inv =
                    _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(254 << 23), _mm512_castps_si512(quantum)));
                let r = _mm512_mul_ps(
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(a, inv)),
                    quantum,
                );
                let signed = _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(qi, sign_mask));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(q, q);
                let v = _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(signed), nan_code);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
            }
        }
        for (c, v) in out[whole..n].iter_mut().zip(&row[whole..n]) {
            *c = super::fp8_raw(f32_to_e4m3(v / s)) * FP8_REBIAS;
        }
        s
    }

    /// A panel's column pair of E4M3 codes (`[even 16 | odd 16]`) → the two columns' values ×
    /// 2^−120: each code sign-extended to 32 bits and shifted left by 20 has its magnitude bits at
    /// 20..27 and a copy of its sign at 31; the mask keeps those.
    #[target_feature(enable = "avx512f")]
    unsafe fn fp8_pair(at: *const u8) -> (__m512, __m512) {
        let fields = _mm512_set1_epi32(super::FP8_FIELDS as i32);
        // SAFETY (caller): `at` points at 32 readable bytes.
        let (e, o) = unsafe { (_mm_loadu_si128(at as *const __m128i), _mm_loadu_si128(at.add(16) as *const __m128i)) };
        let we = _mm512_and_si512(_mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(e)), fields);
        let wo = _mm512_and_si512(_mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(o)), fields);
        (_mm512_castsi512_ps(we), _mm512_castsi512_ps(wo))
    }

    /// 16 E8M0 bytes → their exponents b − 127 as f32 (NaN for the NaN code 255), for
    /// `vscalefps`: scalef(v, b − 127) = v · 2^(b − 127), the code 0's 2^−127 included.
    #[target_feature(enable = "avx512f")]
    unsafe fn e8m0_exponents(b: __m128i) -> __m512 {
        let v = _mm512_cvtepu8_epi32(b);
        let e = _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(127)));
        let nan = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255));
        _mm512_mask_blend_ps(nan, e, _mm512_set1_ps(f32::NAN))
    }

    /// Asks for the line at `p` into L1 ahead of its read ([`super::PREFETCH_BYTES`]; the T0
    /// hint measured ahead of T1 and T2).
    #[inline(always)]
    fn prefetch<T>(p: *const T) {
        // SAFETY: a prefetch never faults, and callers pass addresses inside the panels read.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }

    /// 16 E8M0 bytes → 2^(b − 127) as f32, with the two special codes of `e8m0_to_f32`
    /// (0 → 2^−127, a subnormal; 255 → NaN).
    #[target_feature(enable = "avx512f")]
    unsafe fn e8m0x16(b: __m128i) -> __m512 {
        let v = _mm512_cvtepu8_epi32(b);
        let normal = _mm512_slli_epi32::<23>(v);
        let zero = _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512());
        let nan = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255));
        let r = _mm512_mask_blend_epi32(zero, normal, _mm512_set1_epi32(0x0040_0000));
        let r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0_0000));
        _mm512_castsi512_ps(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector E4M3 rounding of activations equals the scalar encoder's, bit for bit, over
    /// ties, both sides of the subnormal boundary, the saturation, signed zeros and NaNs.
    #[test]
    fn token_codes_match_the_scalar_encoder() {
        let mut v: Vec<f32> = Vec::new();
        let mut x = 0x1234_5678u32;
        for i in 0..4096 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Values spread over many binades, with an exact tie every so often.
            let r = (x as f32 / u32::MAX as f32 - 0.5) * 2f32.powi((i % 40) - 20);
            v.push(if i % 7 == 0 { (r * 64.0).round() / 64.0 } else { r });
        }
        v.extend([0.0, -0.0, 1.0 / 64.0, -1.0 / 64.0, 1.0 / 128.0, 0.017, 448.0, -448.0, 3.0, f32::NAN, 1e-30]);
        v.extend((0..64).map(|k| (k as f32 + 0.5) / 512.0));
        for (what, row) in [("mixed", v.clone()), ("with a huge value", [v.clone(), vec![3e30]].concat())] {
            let mut want = vec![0f32; row.len()];
            let mut got = vec![0f32; row.len()];
            let ws = fp8_token_codes_scalar(&row, &mut want);
            let gs = fp8_token_codes(&row, &mut got);
            assert_eq!(gs.to_bits(), ws.to_bits(), "{what}: scale");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}] = {}: {g} vs {w}", row[i]);
            }
        }
    }
}
