//! Weight handles and the loader interface shared by every module.
//!
//! Modules describe what they need through a [`TensorSource`]; the same loading code either maps
//! a real checkpoint ([`CheckpointSource`]) or only records names and shapes ([`NameRecorder`],
//! used by `inspect` to check a shard index without weights). So the name map cannot drift from
//! the loader.

use kimi_kernels::{Backend, Bf16Matrix, F32Matrix, Matrix, Mxfp4Matrix, PackedMatrix};

use super::checkpoint::{Checkpoint, Dtype, TensorBytes};
use super::error::ModelError;
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
        if matches!(self.store, WeightStore::Absent) {
            return;
        }
        self.prepared = be.prepare_matrix(&self.m());
        if self.prepared.is_some() {
            match &self.store {
                WeightStore::Bf16(b) | WeightStore::F32(b) => b.release_pages(),
                WeightStore::Mxfp4 { packed, scales } => {
                    packed.release_pages();
                    scales.release_pages();
                }
                WeightStore::Absent => {}
            }
        }
    }

    pub fn is_mxfp4(&self) -> bool {
        matches!(self.store, WeightStore::Mxfp4 { .. })
    }

    /// `out[t, :] = W x[t, :]` for `tokens` rows of `x`, on `be`, into a buffer from `sc`.
    pub fn matmul<'s>(&self, be: &dyn Backend, sc: &'s Scratch, x: &[f32], tokens: usize) -> Buf<'s> {
        let mut out = sc.for_overwrite(tokens * self.rows);
        be.matmul(&self.for_matmul(), x, tokens, &mut out);
        out
    }
}

/// What a module needs from a checkpoint.
pub trait TensorSource {
    /// A BF16 or F32 matrix stored `[rows, cols]`.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError>;
    /// A routed-expert matrix `<base>.weight` (BF16/F32) or `<base>.weight_packed` +
    /// `<base>.weight_scale` (MXFP4), decided by which names the checkpoint has.
    fn expert_matrix(&mut self, base: &str, rows: usize, cols: usize) -> Result<Weight, ModelError>;
    /// A small tensor of the given shape, widened to f32.
    fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError>;
}

const FLOATS: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

pub struct CheckpointSource<'a> {
    pub ck: &'a Checkpoint,
}

impl TensorSource for CheckpointSource<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let info = self.ck.expect(name, &[rows, cols], &[Dtype::Bf16, Dtype::F32])?;
        let bytes = self.ck.bytes(info);
        let store = if info.dtype == Dtype::Bf16 { WeightStore::Bf16(bytes) } else { WeightStore::F32(bytes) };
        Ok(Weight { rows, cols, store, prepared: None })
    }

    fn expert_matrix(&mut self, base: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let packed_name = format!("{base}.weight_packed");
        if !self.ck.contains(&packed_name) {
            return self.matrix(&format!("{base}.weight"), rows, cols);
        }
        if !cols.is_multiple_of(32) {
            return Err(ModelError::Shape {
                name: packed_name,
                expected: vec![rows, cols / 2],
                found: vec![rows, cols / 2],
            });
        }
        let p = self.ck.expect(&packed_name, &[rows, cols / 2], &[Dtype::U8])?;
        let s = self.ck.expect(&format!("{base}.weight_scale"), &[rows, cols / 32], &[Dtype::U8])?;
        Ok(Weight {
            rows,
            cols,
            store: WeightStore::Mxfp4 { packed: self.ck.bytes(p), scales: self.ck.bytes(s) },
            prepared: None,
        })
    }

    fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let info = self.ck.expect(name, shape, &FLOATS)?;
        Ok(self.ck.read_f32(info))
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
        self.tensors.push(RecordedTensor { name, shape, params, bytes, dtype });
    }
}

impl TensorSource for NameRecorder<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let n = (rows * cols) as u64;
        self.push(name.to_string(), vec![rows, cols], n, 2 * n, Dtype::Bf16);
        Ok(Weight { rows, cols, store: WeightStore::Absent, prepared: None })
    }

    fn expert_matrix(&mut self, base: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        if (self.packed)(base) {
            let n = (rows * cols) as u64;
            self.push(format!("{base}.weight_packed"), vec![rows, cols / 2], n, n / 2, Dtype::U8);
            self.push(format!("{base}.weight_scale"), vec![rows, cols / 32], 0, n / 32, Dtype::U8);
            Ok(Weight { rows, cols, store: WeightStore::Absent, prepared: None })
        } else {
            self.matrix(&format!("{base}.weight"), rows, cols)
        }
    }

    fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let n: usize = shape.iter().product();
        // The release stores 2-D `*_res_proj` [1, d] in BF16; the 1-D and conv tensors in F32.
        let (bytes, dtype) =
            if name.ends_with("_res_proj.weight") { (2 * n, Dtype::Bf16) } else { (4 * n, Dtype::F32) };
        self.push(name.to_string(), shape.to_vec(), n as u64, bytes as u64, dtype);
        Ok(vec![0.0; n])
    }
}
