//! Safetensors checkpoints, single-file or sharded (`model.safetensors.index.json`), memory-mapped.
//!
//! Headers are parsed and validated by the `safetensors` crate's `Metadata`; a truncated file or
//! a tensor whose shape does not match its bytes is still reported with the tensor's name. Tensor
//! bytes are never copied unless their offset is not aligned for their element type.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::tensor::Metadata;
use serde_json::Value;

use super::error::ModelError;

/// Stored element type (the subset of safetensors dtypes a Kimi checkpoint uses, plus a few for
/// clear error messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
    F64,
    U8,
    I8,
    I32,
    I64,
    Other,
}

impl From<safetensors::Dtype> for Dtype {
    fn from(d: safetensors::Dtype) -> Dtype {
        use safetensors::Dtype as S;
        match d {
            S::BF16 => Dtype::Bf16,
            S::F16 => Dtype::F16,
            S::F32 => Dtype::F32,
            S::F64 => Dtype::F64,
            S::U8 => Dtype::U8,
            S::I8 => Dtype::I8,
            S::I32 => Dtype::I32,
            S::I64 => Dtype::I64,
            _ => Dtype::Other,
        }
    }
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::Other => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I32 => "I32",
            Dtype::I64 => "I64",
            Dtype::Other => "other",
        }
    }
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range in the shard file.
    start: usize,
    end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

/// An open checkpoint: every tensor's location, and the shards mapped into memory.
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorInfo>,
}

/// Bytes of one tensor: borrowed from the map, or an owned copy when misaligned.
#[derive(Clone)]
pub enum TensorBytes {
    Mapped { map: Arc<Mmap>, start: usize, len: usize },
    Owned(Arc<Vec<u64>>, usize),
}

impl TensorBytes {
    pub fn bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, start, len } => &map[*start..*start + *len],
            TensorBytes::Owned(words, len) => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
        }
    }

    /// Tells the kernel these mapped pages will not be read soon, so they leave resident memory
    /// (a later read maps them from the file again, unchanged). Owned copies stay.
    pub fn release_pages(&self) {
        if let TensorBytes::Mapped { map, start, len } = self {
            // SAFETY: the map is a read-only file mapping; DONTNEED only drops its resident pages,
            // and any later read repopulates them from the same file, so every borrowed slice
            // keeps its contents. A failure (e.g. an unaligned range) just leaves pages resident.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, *start, *len) };
        }
    }

    /// Bytes `range` of this tensor: a narrower view of the same map (or owned copy).
    pub fn slice(&self, range: std::ops::Range<usize>) -> TensorBytes {
        match self {
            TensorBytes::Mapped { map, start, .. } => {
                TensorBytes::Mapped { map: map.clone(), start: start + range.start, len: range.len() }
            }
            TensorBytes::Owned(..) => TensorBytes::owned(&self.bytes()[range]),
        }
    }

    /// Bytes `cols` of every `row_bytes`-long row, copied side by side (a column shard: not
    /// contiguous in the file, so it is copied; only the copy stays resident).
    pub fn gather_columns(&self, row_bytes: usize, cols: std::ops::Range<usize>) -> TensorBytes {
        let b = self.bytes();
        let mut out = Vec::with_capacity(b.len() / row_bytes.max(1) * cols.len());
        for row in b.chunks_exact(row_bytes.max(1)) {
            out.extend_from_slice(&row[cols.clone()]);
        }
        TensorBytes::owned(&out)
    }

    /// Copies `bytes` into 8-aligned storage.
    fn owned(bytes: &[u8]) -> TensorBytes {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        TensorBytes::Owned(Arc::new(words), bytes.len())
    }
}

impl Checkpoint {
    /// Opens `<dir>/model.safetensors.index.json` (sharded) or `<dir>/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
            let map = parse_weight_map(&text, &index)?;
            let mut files: Vec<String> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            // Shards are files beside the index: a name that is a path could reach any file the
            // process can read.
            for f in &files {
                let mut parts = Path::new(f).components();
                let plain = matches!(parts.next(), Some(std::path::Component::Normal(_))) && parts.next().is_none();
                if !plain || f.contains(['/', '\\', '\0']) {
                    return Err(ModelError::Header {
                        path: index.display().to_string(),
                        msg: format!("shard name {f:?} is not a file name in the checkpoint directory"),
                    });
                }
            }
            let mut ck = Checkpoint { shards: Vec::new(), tensors: BTreeMap::new() };
            for f in &files {
                ck.add_shard(&dir.join(f))?;
            }
            // Every tensor the index names must be in the shard it names.
            for (name, file) in &map {
                let shard_path = dir.join(file);
                match ck.tensors.get(name) {
                    Some(info) if ck.shards[info.shard].path == shard_path => {}
                    _ => {
                        return Err(ModelError::Header {
                            path: shard_path.display().to_string(),
                            msg: format!(
                                "the index lists tensor `{name}` in this shard but its header does not contain it"
                            ),
                        });
                    }
                }
            }
            Ok(ck)
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::Io {
                    path: dir.display().to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "neither model.safetensors.index.json nor model.safetensors found",
                    ),
                });
            }
            let mut ck = Checkpoint { shards: Vec::new(), tensors: BTreeMap::new() };
            ck.add_shard(&single)?;
            Ok(ck)
        }
    }

    /// Opens one safetensors file on its own (goldens, single shards).
    pub fn open_file(path: &Path) -> Result<Checkpoint, ModelError> {
        let mut ck = Checkpoint { shards: Vec::new(), tensors: BTreeMap::new() };
        ck.add_shard(path)?;
        Ok(ck)
    }

    fn add_shard(&mut self, path: &Path) -> Result<(), ModelError> {
        let file = File::open(path).map_err(|e| io(path, e))?;
        // SAFETY: the checkpoint is treated as read-only; a file changed underneath is a user error
        // we cannot detect, as with every mmap-based loader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io(path, e))?;
        let p = path.display().to_string();
        let bad = |msg: String| ModelError::Header { path: p.clone(), msg };
        if map.len() < 8 {
            return Err(bad(format!("file has {} bytes, less than the 8-byte header length", map.len())));
        }
        let n = u64::from_le_bytes(map[..8].try_into().unwrap_or([0; 8])) as usize;
        if n > 100 << 20 || 8 + n > map.len() {
            return Err(bad(format!("header length {n} does not fit in the file's {} bytes", map.len())));
        }
        let header = &map[8..8 + n];
        // The crate's metadata parser checks dtypes, shape overflow, shape × dtype = byte span,
        // and that the spans tile the data section; its shape errors carry no tensor name, so
        // those are located by `name_the_bad_tensor` for the message.
        let meta: Metadata = serde_json::from_slice(header).map_err(|e| {
            bad(match name_the_bad_tensor(header) {
                Some(which) => which,
                None => format!("header: {e}"),
            })
        })?;
        let data_start = 8 + n;
        let shard = self.shards.len();
        for name in meta.offset_keys() {
            let Some(info) = meta.info(&name) else { continue };
            let (s, e) = info.data_offsets;
            let (Some(start), Some(end)) = (data_start.checked_add(s), data_start.checked_add(e)) else {
                return Err(bad(format!("tensor `{name}`: data_offsets ({s}, {e}) are too large")));
            };
            if end > map.len() {
                return Err(ModelError::Truncated { name, path: p.clone(), need: end as u64, have: map.len() as u64 });
            }
            let dtype = Dtype::from(info.dtype);
            self.tensors.insert(name, TensorInfo { dtype, shape: info.shape.clone(), shard, start, end });
        }
        self.shards.push(Shard { path: path.to_path_buf(), map: Arc::new(map) });
        Ok(())
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn tensors(&self) -> impl Iterator<Item = (&String, &TensorInfo)> {
        self.tensors.iter()
    }

    /// Looks a tensor up and checks its shape and dtype against what the model expects.
    pub fn expect(&self, name: &str, shape: &[usize], dtypes: &[Dtype]) -> Result<&TensorInfo, ModelError> {
        let info = self.tensors.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })?;
        if !dtypes.contains(&info.dtype) {
            let expected = dtypes.iter().map(|d| d.name()).collect::<Vec<_>>().join(" or ");
            return Err(ModelError::Dtype { name: name.to_string(), expected, found: info.dtype.name().to_string() });
        }
        if info.shape != shape {
            return Err(ModelError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        Ok(info)
    }

    /// The tensor's bytes, borrowed from the map when aligned for its element type.
    pub fn bytes(&self, info: &TensorInfo) -> TensorBytes {
        let shard = &self.shards[info.shard];
        let len = info.end - info.start;
        let ptr = shard.map[info.start..].as_ptr() as usize;
        if ptr.is_multiple_of(info.dtype.size().max(1)) {
            TensorBytes::Mapped { map: shard.map.clone(), start: info.start, len }
        } else {
            TensorBytes::owned(&shard.map[info.start..info.end])
        }
    }

    /// A small tensor widened to f32 (norm weights, biases, gates): BF16, F16 or F32 storage.
    pub fn read_f32(&self, info: &TensorInfo) -> Vec<f32> {
        let b = &self.shards[info.shard].map[info.start..info.end];
        match info.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(bytemuck::pod_read_unaligned(c))).collect(),
            Dtype::Bf16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F64 => {
                b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Little-endian i64 tensor (goldens store ids this way).
    pub fn read_i64(&self, info: &TensorInfo) -> Vec<i64> {
        let b = &self.shards[info.shard].map[info.start..info.end];
        b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()
    }

    /// Total tensor bytes by dtype.
    pub fn bytes_by_dtype(&self) -> BTreeMap<Dtype, u64> {
        let mut m = BTreeMap::new();
        for info in self.tensors.values() {
            *m.entry(info.dtype).or_insert(0) += info.nbytes() as u64;
        }
        m
    }
}

/// For a header the crate refused: the first tensor whose shape and dtype do not match its byte
/// span (or whose size overflows), described with its name.
fn name_the_bad_tensor(header: &[u8]) -> Option<String> {
    let entries: HashMap<String, Value> = serde_json::from_slice(header).ok()?;
    let mut names: Vec<&String> = entries.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    for name in names {
        let Ok(t) = serde_json::from_value::<safetensors::tensor::TensorInfo>(entries[name].clone()) else {
            return Some(format!("tensor `{name}` has no valid dtype, shape and data_offsets"));
        };
        let (s, e) = t.data_offsets;
        let bits =
            t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).and_then(|n| n.checked_mul(t.dtype.bitsize()));
        match bits {
            None => return Some(format!("tensor `{name}`: shape {:?} is too large", t.shape)),
            Some(b) if e < s || b.div_ceil(8) != e - s => {
                return Some(format!(
                    "tensor `{name}`: shape {:?} of {:?} needs {} bytes but data_offsets ({s}, {e}) span {}",
                    t.shape,
                    t.dtype,
                    b.div_ceil(8),
                    e.saturating_sub(s)
                ));
            }
            Some(_) => {}
        }
    }
    None
}

/// `model.safetensors.index.json`: which shard holds each tensor (other keys are ignored).
#[derive(serde::Deserialize)]
struct IndexWire {
    weight_map: BTreeMap<String, String>,
}

/// `weight_map` of a `model.safetensors.index.json` at `path` (named in the error).
pub fn parse_weight_map(text: &str, path: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let index: IndexWire = serde_path_to_error::deserialize(&mut de).map_err(|e| ModelError::Header {
        path: path.display().to_string(),
        msg: format!("{}: {}", e.path(), e.inner()),
    })?;
    Ok(index.weight_map)
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Io { path: path.display().to_string(), source: e }
}
