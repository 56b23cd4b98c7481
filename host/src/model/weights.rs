//! Weight handles and the loader interface shared by every module.
//!
//! Modules describe what they need through a [`TensorSource`]; the same loading code either maps
//! a real checkpoint ([`CheckpointSource`]) or only records names and shapes ([`NameRecorder`],
//! used by `inspect` to check a shard index without weights). So the name map cannot drift from
//! the loader.

use std::ops::Range;

use kimi_kernels::cpu::fp8::E4M3_MAX;
use kimi_kernels::{Backend, Bf16Matrix, F32Matrix, Fp8Matrix, Matrix, Mxfp4Matrix, PackedMatrix, f32_to_e4m3};

use super::checkpoint::{Checkpoint, Dtype, TensorBytes};
use super::error::ModelError;
use super::plan::fp8_dense_target;
use super::scratch::{Buf, Scratch};

/// A weight matrix `[rows, cols]` in its stored format.
pub struct Weight {
    pub rows: usize,
    pub cols: usize,
    store: WeightStore,
    /// The backend's own layout for products, made once at load ([`Weight::prepare`]).
    prepared: Option<PackedMatrix>,
}

enum WeightStore {
    Bf16(TensorBytes),
    F32(TensorBytes),
    Mxfp4 {
        packed: TensorBytes,
        scales: TensorBytes,
    },
    /// Requantised at load (`--fp8-dense`): E4M3 codes and one f32 scale per row. Once the
    /// backend has laid the weight out (`prepared`), the codes live only there: `codes` is
    /// emptied, so resident memory holds one copy.
    Fp8 {
        codes: Vec<u8>,
        scales: Vec<f32>,
    },
    /// Recorded by [`NameRecorder`]; never used for compute.
    Absent,
}

impl Weight {
    /// A borrowed view for the kernels.
    pub fn m(&self) -> Matrix<'_> {
        match &self.store {
            WeightStore::Bf16(b) => {
                // The checkpoint loader hands out 2-aligned bytes (copying when the file's are not),
                // and checked the byte span against the shape, so the cast cannot fail.
                let data: &[u16] = bytemuck::try_cast_slice(b.bytes()).unwrap_or(&[]);
                Matrix::Bf16(Bf16Matrix::new(data, self.rows, self.cols))
            }
            WeightStore::F32(b) => {
                let data: &[f32] = bytemuck::try_cast_slice(b.bytes()).unwrap_or(&[]);
                Matrix::F32(F32Matrix { data, rows: self.rows, cols: self.cols })
            }
            WeightStore::Mxfp4 { packed, scales } => {
                Matrix::Mxfp4(Mxfp4Matrix::new(packed.bytes(), scales.bytes(), self.rows, self.cols))
            }
            WeightStore::Fp8 { codes, scales } => Matrix::Fp8(Fp8Matrix::new(codes, scales, self.rows, self.cols)),
            WeightStore::Absent => panic!("weight placeholder from NameRecorder used for compute"),
        }
    }

    /// The matrix the products read: the backend's prepared layout when it made one.
    pub fn for_matmul(&self) -> Matrix<'_> {
        match &self.prepared {
            Some(p) => Matrix::Packed(p),
            None => self.m(),
        }
    }

    /// Lets `be` lay this weight out for its products (the CPU backend repacks BF16 and MXFP4
    /// into row panels). The stored bytes' pages are then handed back to the kernel: products
    /// never read them again, so resident memory holds one copy of the weight.
    pub fn prepare(&mut self, be: &dyn Backend) {
        match &self.store {
            WeightStore::Absent => return,
            // Requantised codes already handed to a layout: every backend lays its products out
            // as the CPU backend does today, so the panels stay.
            WeightStore::Fp8 { codes, .. } if codes.is_empty() && self.prepared.is_some() => return,
            _ => {}
        }
        self.prepared = be.prepare_matrix(&self.m());
        if self.prepared.is_some() {
            match &mut self.store {
                WeightStore::Bf16(b) | WeightStore::F32(b) => b.release_pages(),
                WeightStore::Mxfp4 { packed, scales } => {
                    packed.release_pages();
                    scales.release_pages();
                }
                WeightStore::Fp8 { codes, .. } => *codes = Vec::new(),
                WeightStore::Absent => {}
            }
        }
    }

    /// Bytes of the stored format this weight keeps (a rank's part, for a split weight).
    pub fn stored_bytes(&self) -> usize {
        match &self.store {
            WeightStore::Bf16(b) | WeightStore::F32(b) => b.bytes().len(),
            WeightStore::Mxfp4 { packed, scales } => packed.bytes().len() + scales.bytes().len(),
            // By the shape: the codes may live in the prepared layout by now.
            WeightStore::Fp8 { scales, .. } => self.rows * self.cols + 4 * scales.len(),
            WeightStore::Absent => 0,
        }
    }

    pub fn is_mxfp4(&self) -> bool {
        matches!(self.store, WeightStore::Mxfp4 { .. })
    }

    /// [`Weight::matmul`] of each of `ws` over the same `x`, as one backend op (the backend
    /// splits the activations once and runs every matrix's rows in one parallel launch).
    pub fn matmul_many<'s, const N: usize>(
        ws: [&Weight; N],
        be: &dyn Backend,
        sc: &'s Scratch,
        x: &[f32],
        tokens: usize,
    ) -> [Buf<'s>; N] {
        let mut outs = ws.map(|w| sc.for_overwrite(tokens * w.rows));
        let ms = ws.map(|w| w.for_matmul());
        let mut views = outs.each_mut().map(|b| &mut b[..]);
        be.matmul_many(&ms, x, tokens, &mut views);
        outs
    }

    /// `out[t, :] = W x[t, :]` for `tokens` rows of `x`, on `be`, into a buffer from `sc`.
    pub fn matmul<'s>(&self, be: &dyn Backend, sc: &'s Scratch, x: &[f32], tokens: usize) -> Buf<'s> {
        let mut out = sc.for_overwrite(tokens * self.rows);
        be.matmul(&self.for_matmul(), x, tokens, &mut out);
        out
    }
}

/// Which part of a stored matrix `[rows, cols]` a rank keeps (tensor parallelism).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Whole,
    /// Output rows (a column-parallel linear: heads, intermediate or vocabulary rows).
    Rows(Range<usize>),
    /// Input columns (a row-parallel linear, whose partial products are all-reduced).
    Cols(Range<usize>),
}

impl Part {
    /// The kept matrix's `[rows, cols]`.
    pub fn dims(&self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Part::Whole => (rows, cols),
            Part::Rows(r) => (r.len(), cols),
            Part::Cols(c) => (rows, c.len()),
        }
    }

    fn check(&self, name: &str, rows: usize, cols: usize) -> Result<(), ModelError> {
        let ok = match self {
            Part::Whole => true,
            Part::Rows(r) => r.start <= r.end && r.end <= rows,
            Part::Cols(c) => c.start <= c.end && c.end <= cols,
        };
        if ok { Ok(()) } else { Err(ModelError::config(name, format!("shard {self:?} outside [{rows}, {cols}]"))) }
    }
}

/// Bytes one rank took of one tensor (the loader's accounting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedTensor {
    pub name: String,
    /// The whole stored tensor.
    pub stored_bytes: usize,
    /// What this rank keeps of it, in the stored format.
    pub kept_bytes: usize,
    /// Whether the rank keeps a part (a split tensor) rather than the whole (replicated).
    pub split: bool,
    /// A matrix (kept in its stored format) rather than a small vector (widened to f32).
    pub matrix: bool,
    /// Rows of the kept part of a matrix (0 for a vector).
    pub kept_rows: usize,
}

/// What a module needs from a checkpoint.
pub trait TensorSource {
    /// `part` of a BF16 or F32 matrix stored `[rows, cols]`.
    fn matrix_part(&mut self, name: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError>;
    /// `part` of a routed-expert matrix `<base>.weight` (BF16/F32) or `<base>.weight_packed` +
    /// `<base>.weight_scale` (MXFP4), decided by which names the checkpoint has. MXFP4 columns
    /// are cut on 32-value block boundaries.
    fn expert_matrix_part(&mut self, base: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError>;
    /// Whether `<base>` is stored MXFP4 (its columns then split in 32-value blocks).
    fn expert_is_mxfp4(&self, base: &str) -> bool;
    /// Entries `first` (of the first dimension) of a small tensor of the given shape, widened
    /// to f32.
    fn vector_part(&mut self, name: &str, shape: &[usize], first: Range<usize>) -> Result<Vec<f32>, ModelError>;

    /// A whole BF16 or F32 tensor of rank ≥ 2 stored `shape`, seen as the matrix
    /// `[shape[0], product of the rest]` (a convolution kernel applied to flattened patches).
    fn matrix_shaped(&mut self, name: &str, shape: &[usize]) -> Result<Weight, ModelError>;

    /// A whole BF16 or F32 matrix.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        self.matrix_part(name, rows, cols, Part::Whole)
    }
    /// A whole routed-expert matrix.
    fn expert_matrix(&mut self, base: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        self.expert_matrix_part(base, rows, cols, Part::Whole)
    }
    /// A whole small tensor.
    fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.vector_part(name, shape, 0..shape.first().copied().unwrap_or(1))
    }
}

const FLOATS: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

/// Loads from a mapped checkpoint: a row part is a narrower view of the map, a column part a
/// copy of each row's slice; either way only the part stays resident. Records what it hands out.
pub struct CheckpointSource<'a> {
    pub ck: &'a Checkpoint,
    pub loaded: Vec<LoadedTensor>,
    /// Requantise the `--fp8-dense` linears ([`fp8_dense_target`]) to E4M3 at load.
    pub fp8_dense: bool,
}

impl<'a> CheckpointSource<'a> {
    pub fn new(ck: &'a Checkpoint) -> Self {
        CheckpointSource { ck, loaded: Vec::new(), fp8_dense: false }
    }

    /// `part` of the stored matrix `w` requantised to E4M3, each row's scale taken over the
    /// whole stored row (so a column shard gets the scale the unsharded weight has, as ATOM
    /// computes it before sharding).
    fn requantise(w: &Matrix<'_>, part: &Part) -> (Vec<u8>, Vec<f32>) {
        let (rows, cols) = (w.rows(), w.cols());
        let (rr, cc) = match part {
            Part::Whole => (0..rows, 0..cols),
            Part::Rows(r) => (r.clone(), 0..cols),
            Part::Cols(c) => (0..rows, c.clone()),
        };
        let mut codes = Vec::with_capacity(rr.len() * cc.len());
        let mut scales = Vec::with_capacity(rr.len());
        let mut row = vec![0f32; cols];
        for r in rr {
            w.row_to_f32(r, &mut row);
            let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if m > 0.0 && m.is_finite() { m / E4M3_MAX } else { 1.0 };
            codes.extend(row[cc.clone()].iter().map(|v| f32_to_e4m3(v / s)));
            scales.push(s);
        }
        (codes, scales)
    }

    fn record(&mut self, name: &str, stored: usize, kept: usize, split: bool, rows: Option<usize>) {
        let t = LoadedTensor {
            name: name.to_string(),
            stored_bytes: stored,
            kept_bytes: kept,
            split,
            matrix: rows.is_some(),
            kept_rows: rows.unwrap_or(0),
        };
        self.loaded.push(t);
    }

    /// `part` of `bytes`, rows of `row_bytes` holding `cols` logical columns (BF16: 2 bytes a
    /// column; MXFP4 packed: 2 columns a byte; MXFP4 scales: 32 columns a byte).
    fn cut(bytes: TensorBytes, row_bytes: usize, part: &Part, cols: usize) -> TensorBytes {
        match part {
            Part::Whole => bytes,
            Part::Rows(r) => bytes.slice(r.start * row_bytes..r.end * row_bytes),
            Part::Cols(c) => {
                let scale = |x: usize| x * row_bytes / cols.max(1);
                bytes.gather_columns(row_bytes, scale(c.start)..scale(c.end))
            }
        }
    }
}

impl TensorSource for CheckpointSource<'_> {
    fn matrix_part(&mut self, name: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError> {
        let info = self.ck.expect(name, &[rows, cols], &[Dtype::Bf16, Dtype::F32])?;
        part.check(name, rows, cols)?;
        if self.fp8_dense && fp8_dense_target(name) {
            let whole = Weight {
                rows,
                cols,
                store: if info.dtype == Dtype::Bf16 {
                    WeightStore::Bf16(self.ck.bytes(info))
                } else {
                    WeightStore::F32(self.ck.bytes(info))
                },
                prepared: None,
            };
            let (codes, scales) = Self::requantise(&whole.m(), &part);
            if let WeightStore::Bf16(b) | WeightStore::F32(b) = &whole.store {
                b.release_pages();
            }
            let (r, c) = part.dims(rows, cols);
            let w = Weight { rows: r, cols: c, store: WeightStore::Fp8 { codes, scales }, prepared: None };
            // The requantised weight is all that stays resident; its accounting is what it holds.
            self.record(name, info.nbytes(), w.stored_bytes(), part != Part::Whole, Some(r));
            return Ok(w);
        }
        let elem = info.dtype.size();
        let bytes = Self::cut(self.ck.bytes(info), cols * elem, &part, cols);
        let (r, c) = part.dims(rows, cols);
        let stored = info.nbytes();
        self.record(name, stored, bytes.bytes().len(), part != Part::Whole, Some(part.dims(rows, cols).0));
        let store = if info.dtype == Dtype::Bf16 { WeightStore::Bf16(bytes) } else { WeightStore::F32(bytes) };
        Ok(Weight { rows: r, cols: c, store, prepared: None })
    }

    fn matrix_shaped(&mut self, name: &str, shape: &[usize]) -> Result<Weight, ModelError> {
        let info = self.ck.expect(name, shape, &[Dtype::Bf16, Dtype::F32])?;
        let rows = shape.first().copied().unwrap_or(1);
        let cols = shape.iter().skip(1).product();
        let bytes = self.ck.bytes(info);
        self.record(name, info.nbytes(), bytes.bytes().len(), false, Some(rows));
        let store = if info.dtype == Dtype::Bf16 { WeightStore::Bf16(bytes) } else { WeightStore::F32(bytes) };
        Ok(Weight { rows, cols, store, prepared: None })
    }

    fn expert_matrix_part(&mut self, base: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError> {
        let packed_name = format!("{base}.weight_packed");
        if !self.ck.contains(&packed_name) {
            return self.matrix_part(&format!("{base}.weight"), rows, cols, part);
        }
        if !cols.is_multiple_of(32) {
            return Err(ModelError::Shape {
                name: packed_name,
                expected: vec![rows, cols / 2],
                found: vec![rows, cols / 2],
            });
        }
        part.check(base, rows, cols)?;
        if let Part::Cols(c) = &part
            && (!c.start.is_multiple_of(32) || !c.end.is_multiple_of(32))
        {
            return Err(ModelError::config(base, format!("MXFP4 columns split off a 32-value block: {c:?}")));
        }
        let p = self.ck.expect(&packed_name, &[rows, cols / 2], &[Dtype::U8])?;
        let scale_name = format!("{base}.weight_scale");
        let s = self.ck.expect(&scale_name, &[rows, cols / 32], &[Dtype::U8])?;
        let packed = Self::cut(self.ck.bytes(p), cols / 2, &part, cols);
        let scales = Self::cut(self.ck.bytes(s), cols / 32, &part, cols);
        let (stored_p, stored_s) = (p.nbytes(), s.nbytes());
        let split = part != Part::Whole;
        let kept_rows = Some(part.dims(rows, cols).0);
        self.record(&packed_name, stored_p, packed.bytes().len(), split, kept_rows);
        self.record(&scale_name, stored_s, scales.bytes().len(), split, kept_rows);
        let (r, c) = part.dims(rows, cols);
        Ok(Weight { rows: r, cols: c, store: WeightStore::Mxfp4 { packed, scales }, prepared: None })
    }

    fn expert_is_mxfp4(&self, base: &str) -> bool {
        self.ck.contains(&format!("{base}.weight_packed"))
    }

    fn vector_part(&mut self, name: &str, shape: &[usize], first: Range<usize>) -> Result<Vec<f32>, ModelError> {
        let info = self.ck.expect(name, shape, &FLOATS)?;
        let all = self.ck.read_f32(info);
        let lead = shape.first().copied().unwrap_or(1).max(1);
        let per = all.len() / lead;
        if first.start > first.end || first.end > lead {
            return Err(ModelError::config(name, format!("shard {first:?} outside the first dimension {lead}")));
        }
        let kept = all[first.start * per..first.end * per].to_vec();
        let split = first.len() != lead;
        self.record(name, info.nbytes(), info.nbytes() / lead * first.len(), split, None);
        Ok(kept)
    }
}

/// One tensor the model reads, as recorded by [`NameRecorder`].
#[derive(Clone, Debug)]
pub struct RecordedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Values of the logical (unpacked) tensor; 0 for an MXFP4 scale tensor.
    pub params: u64,
    /// Stored bytes under the release dtypes (BF16 matrices, F32 small tensors, MXFP4 experts).
    pub bytes: u64,
    pub dtype: Dtype,
    /// What a rank keeps of it (its shard's part; all of it when replicated or unsharded).
    pub kept: u64,
    /// Rows of the kept part (for per-row scales of a requantised matrix; 1 for a vector).
    pub kept_rows: u64,
}

/// Records names and shapes instead of loading. `packed(base)` says whether an expert matrix is
/// stored MXFP4.
pub struct NameRecorder<'p> {
    pub tensors: Vec<RecordedTensor>,
    pub packed: Box<dyn Fn(&str) -> bool + 'p>,
}

impl<'p> NameRecorder<'p> {
    pub fn new(packed: impl Fn(&str) -> bool + 'p) -> Self {
        NameRecorder { tensors: Vec::new(), packed: Box::new(packed) }
    }

    fn push(&mut self, name: String, shape: Vec<usize>, params: u64, bytes: u64, dtype: Dtype) {
        let kept_rows = if shape.len() == 2 { shape[0] as u64 } else { 1 };
        self.tensors.push(RecordedTensor { name, shape, params, bytes, dtype, kept: bytes, kept_rows });
    }

    /// Marks the last `n` recorded tensors as kept in the fraction `part` of `[rows, cols]` says.
    fn keep_part(&mut self, n: usize, rows: usize, cols: usize, part: &Part) {
        let (r, c) = part.dims(rows, cols);
        let whole = (rows * cols).max(1) as u64;
        let at = self.tensors.len().saturating_sub(n);
        for t in &mut self.tensors[at..] {
            t.kept = t.bytes * (r * c) as u64 / whole;
            t.kept_rows = r as u64;
        }
    }
}

impl TensorSource for NameRecorder<'_> {
    fn matrix_part(&mut self, name: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError> {
        let n = (rows * cols) as u64;
        self.push(name.to_string(), vec![rows, cols], n, 2 * n, Dtype::Bf16);
        self.keep_part(1, rows, cols, &part);
        let (rows, cols) = part.dims(rows, cols);
        Ok(Weight { rows, cols, store: WeightStore::Absent, prepared: None })
    }

    fn matrix_shaped(&mut self, name: &str, shape: &[usize]) -> Result<Weight, ModelError> {
        let n: usize = shape.iter().product();
        self.push(name.to_string(), shape.to_vec(), n as u64, 2 * n as u64, Dtype::Bf16);
        let rows = shape.first().copied().unwrap_or(1);
        Ok(Weight { rows, cols: n / rows.max(1), store: WeightStore::Absent, prepared: None })
    }

    fn expert_matrix_part(&mut self, base: &str, rows: usize, cols: usize, part: Part) -> Result<Weight, ModelError> {
        if (self.packed)(base) {
            let n = (rows * cols) as u64;
            self.push(format!("{base}.weight_packed"), vec![rows, cols / 2], n, n / 2, Dtype::U8);
            self.push(format!("{base}.weight_scale"), vec![rows, cols / 32], 0, n / 32, Dtype::U8);
            self.keep_part(2, rows, cols, &part);
            let (rows, cols) = part.dims(rows, cols);
            Ok(Weight { rows, cols, store: WeightStore::Absent, prepared: None })
        } else {
            self.matrix_part(&format!("{base}.weight"), rows, cols, part)
        }
    }

    fn expert_is_mxfp4(&self, base: &str) -> bool {
        (self.packed)(base)
    }

    fn vector_part(&mut self, name: &str, shape: &[usize], first: Range<usize>) -> Result<Vec<f32>, ModelError> {
        let n: usize = shape.iter().product();
        // The release stores 2-D `*_res_proj` [1, d] in BF16; the 1-D and conv tensors in F32.
        let (bytes, dtype) =
            if name.ends_with("_res_proj.weight") { (2 * n, Dtype::Bf16) } else { (4 * n, Dtype::F32) };
        self.push(name.to_string(), shape.to_vec(), n as u64, bytes as u64, dtype);
        let lead = shape.first().copied().unwrap_or(1).max(1);
        if let Some(t) = self.tensors.last_mut() {
            t.kept = t.bytes * first.len() as u64 / lead as u64;
            t.kept_rows = 1;
        }
        let per = n / lead;
        Ok(vec![0.0; first.len() * per])
    }
}
