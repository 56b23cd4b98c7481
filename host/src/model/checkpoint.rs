//! Safetensors checkpoints, single-file or sharded (`model.safetensors.index.json`), memory-mapped.
//!
//! Headers are parsed here (not with `SafeTensors::deserialize`) so that a truncated file or a bad
//! entry is reported with the tensor's name. Tensor bytes are never copied unless their offset is
//! not aligned for their element type.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
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

impl Dtype {
    fn parse(s: &str) -> Dtype {
        match s {
            "BF16" => Dtype::Bf16,
            "F16" => Dtype::F16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "I32" => Dtype::I32,
            "I64" => Dtype::I64,
            _ => Dtype::Other,
        }
    }

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
            TensorBytes::Owned(words, len) => {
                // SAFETY: a Vec<u64> buffer viewed as its first `len` bytes.
                unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, *len) }
            }
        }
    }

    /// Copies `bytes` into 8-aligned storage.
    fn owned(bytes: &[u8]) -> TensorBytes {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: the destination holds at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr() as *mut u8, bytes.len()) };
        TensorBytes::Owned(Arc::new(words), bytes.len())
    }
}

impl Checkpoint {
    /// Opens `<dir>/model.safetensors.index.json` (sharded) or `<dir>/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
            let map =
                parse_weight_map(&text).map_err(|msg| ModelError::Header { path: index.display().to_string(), msg })?;
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
        let header: HashMap<String, Value> =
            serde_json::from_slice(&map[8..8 + n]).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let data_start = 8 + n;
        let shard = self.shards.len();
        for (name, entry) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype = entry
                .get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("tensor `{name}` has no dtype")))?;
            let shape: Vec<usize> = entry
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|x| x as usize)).collect())
                .ok_or_else(|| bad(format!("tensor `{name}` has no valid shape")))?;
            let offs: Vec<usize> = entry
                .get("data_offsets")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|x| x as usize)).collect())
                .filter(|v: &Vec<usize>| v.len() == 2 && v[0] <= v[1])
                .ok_or_else(|| bad(format!("tensor `{name}` has no valid data_offsets")))?;
            let dtype = Dtype::parse(dtype);
            // Checked: a hostile header's shape must not overflow the size arithmetic.
            let nbytes = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype.size()))
                .ok_or_else(|| bad(format!("tensor `{name}`: shape {shape:?} is too large")))?;
            if dtype != Dtype::Other && offs[1] - offs[0] != nbytes {
                return Err(bad(format!(
                    "tensor `{name}`: shape {shape:?} of {} needs {nbytes} bytes but data_offsets span {}",
                    dtype.name(),
                    offs[1] - offs[0]
                )));
            }
            let (Some(start), Some(end)) = (data_start.checked_add(offs[0]), data_start.checked_add(offs[1])) else {
                return Err(bad(format!("tensor `{name}`: data_offsets {offs:?} are too large")));
            };
            if end > map.len() {
                return Err(ModelError::Truncated { name, path: p.clone(), need: end as u64, have: map.len() as u64 });
            }
            self.tensors.insert(name, TensorInfo { dtype, shape, shard, start, end });
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
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
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

/// `weight_map` of a `model.safetensors.index.json`.
pub fn parse_weight_map(text: &str) -> Result<BTreeMap<String, String>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let wm = v.get("weight_map").and_then(Value::as_object).ok_or("no `weight_map` object")?;
    wm.iter()
        .map(|(k, f)| {
            f.as_str().map(|f| (k.clone(), f.to_string())).ok_or_else(|| format!("`{k}` maps to a non-string"))
        })
        .collect()
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Io { path: path.display().to_string(), source: e }
}
