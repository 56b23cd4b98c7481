//! `kimi-kernels`: every numeric op the Kimi engine runs, declared once in the [`Backend`] trait.
//!
//! Today only the CPU backend exists (`cpu`, [`CpuBackend`]): runtime-dispatched AVX-512 / AVX2
//! code with a scalar fallback, threaded with rayon. Weights stay in their stored formats (BF16,
//! MXFP4; never dequantised up front): the backend repacks the ones it multiplies by into 16-row
//! panels at load (`cpu::packed`, the same bytes), where every output of a product is one fused
//! multiply-add chain, so results do not depend on the batch. Accumulation is always f32.

pub mod backend;
pub mod comm;
pub mod cpu;
pub mod gpu;
pub mod profiled;

pub use backend::{
    Backend, ExpertMatrices, Gelu, KdaInputs, KdaParams, KdaSlot, PagedRows, RouterParams, Routing, Selection, SeqSpan,
    SituParams,
};
pub use comm::{CommStats, Communicator, ThreadComm};
pub use cpu::aligned::AlignedVec;
pub use cpu::backend::CpuBackend;
/// Storage-format encoders (for writing checkpoints, e.g. the embedded tiny model).
pub use cpu::bf16::f32_to_bf16_bits;
pub use cpu::mxfp4::{quantize_row as mxfp4_quantize_row, quantize_rows as mxfp4_quantize_rows};
pub use profiled::{OpStat, ProfiledBackend};

pub use cpu::bf16::Bf16Matrix;
pub use cpu::fp8::{Fp8Matrix, f32_to_e4m3, quantize_rows as fp8_quantize_rows};
pub use cpu::mxfp4::Mxfp4Matrix;
pub use cpu::packed::{BATCHED_TILE_TOKENS, Mxfp4Tiles, PackedMatrix, mxfp4_on_tiles, mxfp4_tiles, set_mxfp4_tiles};
pub use cpu::packed_amx::enabled as amx_enabled;
pub use cpu::simd::{SimdLevel, simd_level};
pub use cpu::unit_rates::{UnitRates, measure as measure_unit_rates, read_sum};

/// A weight matrix `[rows, cols]` (PyTorch `[out, in]`) in one of the stored formats.
#[derive(Clone, Copy, Debug)]
pub enum Matrix<'a> {
    Bf16(Bf16Matrix<'a>),
    F32(F32Matrix<'a>),
    Mxfp4(Mxfp4Matrix<'a>),
    /// E4M3 with a scale per row (a dense weight requantised at load, `--fp8-dense`).
    Fp8(Fp8Matrix<'a>),
    /// A BF16 or MXFP4 weight repacked at load for the CPU products ([`PackedMatrix`]).
    Packed(&'a PackedMatrix),
}

/// A plain f32 matrix `[rows, cols]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct F32Matrix<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Matrix<'a> {
    pub fn rows(&self) -> usize {
        match self {
            Matrix::Bf16(m) => m.rows,
            Matrix::F32(m) => m.rows,
            Matrix::Mxfp4(m) => m.rows,
            Matrix::Fp8(m) => m.rows,
            Matrix::Packed(m) => m.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Matrix::Bf16(m) => m.cols,
            Matrix::F32(m) => m.cols,
            Matrix::Mxfp4(m) => m.cols,
            Matrix::Fp8(m) => m.cols,
            Matrix::Packed(m) => m.cols,
        }
    }

    /// `out[t, r] = Σ_c self[r, c] · x[t, c]` for `t` in `0..tokens` (y = W x per token).
    pub fn matmul(&self, x: &[f32], tokens: usize, out: &mut [f32]) {
        cpu::gemm::matmul(self, x, tokens, out)
    }

    /// Bytes a product over this matrix reads: its stored (or packed) weights and scales.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Bf16(m) => 2 * m.data.len(),
            Matrix::F32(m) => 4 * m.data.len(),
            Matrix::Mxfp4(m) => m.packed.len() + m.scales.len(),
            Matrix::Fp8(m) => m.data.len() + 4 * m.scales.len(),
            Matrix::Packed(m) => m.bytes(),
        }
    }

    /// The weight's format, for reports: `bf16`, `f32`, `mxfp4`, `fp8`, or a packed layout's.
    pub fn format(&self) -> &'static str {
        match self {
            Matrix::Bf16(_) => "bf16",
            Matrix::F32(_) => "f32",
            Matrix::Mxfp4(_) => "mxfp4",
            Matrix::Fp8(_) => "fp8",
            Matrix::Packed(m) => m.format(),
        }
    }

    /// Rows `start..start+len` as a matrix of their own (a view, no copy).
    pub fn row_range(&self, start: usize, len: usize) -> Matrix<'a> {
        match self {
            Matrix::Bf16(m) => Matrix::Bf16(m.row_range(start, len)),
            Matrix::F32(m) => Matrix::F32(F32Matrix {
                data: &m.data[start * m.cols..(start + len) * m.cols],
                rows: len,
                cols: m.cols,
            }),
            Matrix::Mxfp4(m) => Matrix::Mxfp4(m.row_range(start, len)),
            Matrix::Fp8(m) => Matrix::Fp8(m.row_range(start, len)),
            // Packing is for products only; weights read by row ranges (MLA's kv_b) stay stored.
            Matrix::Packed(_) => panic!("row_range of a packed matrix: keep this weight in its stored format"),
        }
    }

    /// Writes row `r` as f32 into `out` (`cols` values).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Matrix::Bf16(m) => m.row_to_f32(r, out),
            Matrix::F32(m) => out.copy_from_slice(&m.data[r * m.cols..(r + 1) * m.cols]),
            Matrix::Mxfp4(m) => m.row_to_f32(r, out),
            Matrix::Fp8(m) => m.row_to_f32(r, out),
            Matrix::Packed(m) => m.row_to_f32(r, out),
        }
    }

    /// `out[t, c] = Σ_r x[t, r] · self[r, c]` (y = Wᵀ x per token); used by absorbed MLA.
    pub fn matmul_transposed(&self, x: &[f32], tokens: usize, out: &mut [f32]) {
        cpu::gemm::matmul_transposed(self, x, tokens, out)
    }

    /// `out[c] = Σ_r x[r] · self[r, c]` (y = Wᵀ x), single vector.
    pub fn matvec_transposed(&self, x: &[f32], out: &mut [f32]) {
        cpu::gemm::matvec_transposed(self, x, out)
    }
}
