//! Collectives across GPUs through NCCL (NVIDIA) or RCCL (AMD, the same C API), dlopened by
//! soname — no crate wraps RCCL, and the PyPI NCCL wheel ships only `libnccl.so.2`, a name cudarc's
//! loader misses — behind the same [`Communicator`] trait the CPU ranks use ([`crate::ThreadComm`]).
//!
//! [`NcclComm::group`] makes one communicator per local GPU (`ncclCommInitAll`: in-process ranks,
//! one thread each, as the engine drives them). The trait works on host slices, so each collective
//! stages through a device buffer on the rank's stream (copy in, collective, copy out); the
//! model's device backend will call the collectives on device buffers directly. Uneven parts
//! (a vocabulary split unevenly) are padded to the longest, as NCCL wants equal counts.
//!
//! Nothing in this file has run on a GPU; without the library, [`NcclComm::group`] says which
//! names it looked for.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use libloading::Library;
use parking_lot::Mutex;

use super::runtime::COLLECTIVE_LIBS;
use crate::comm::{CommStats, Communicator};

/// `ncclComm_t`.
type Comm = *mut c_void;
/// `ncclFloat32` and `ncclSum` in NCCL's (and RCCL's) enums.
const FLOAT32: c_int = 7;
const SUM: c_int = 0;

#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error("no NCCL / RCCL library on this machine: looked for {0}")]
    NoLibrary(String),
    #[error("{library} lacks {symbol}")]
    Symbol { library: String, symbol: &'static str },
    #[error("{call} failed: {message} (code {code})")]
    Call { call: &'static str, code: c_int, message: String },
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// The library's entry points (C signatures from `nccl.h`).
struct Api {
    _lib: Library,
    library: String,
    version: unsafe extern "C" fn(*mut c_int) -> c_int,
    init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> c_int,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int,
}

impl Api {
    fn load() -> Result<Api, NcclError> {
        let (lib, library) = COLLECTIVE_LIBS
            .iter()
            .find_map(|n| {
                // SAFETY: loading the vendor's collective library runs its initialisers; it is
                // looked up by its documented sonames.
                unsafe { Library::new(n) }.ok().map(|l| (l, n.to_string()))
            })
            .ok_or_else(|| NcclError::NoLibrary(COLLECTIVE_LIBS.join(", ")))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is its C signature in nccl.h (RCCL's is the same).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|_| NcclError::Symbol { library: library.clone(), symbol: $name })?
            };
        }
        Ok(Api {
            version: sym!("ncclGetVersion"),
            init_all: sym!("ncclCommInitAll"),
            destroy: sym!("ncclCommDestroy"),
            error_string: sym!("ncclGetErrorString"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            reduce_scatter: sym!("ncclReduceScatter"),
            broadcast: sym!("ncclBroadcast"),
            library,
            _lib: lib,
        })
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), NcclError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.error_string)(code) };
        let message = if p.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated (above).
            unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(NcclError::Call { call, code, message })
    }
}

/// The library's version (e.g. 22703 for 2.27.3) and soname, or why there is none.
pub fn probe() -> Result<(i32, String), NcclError> {
    let api = Api::load()?;
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    api.check("ncclGetVersion", unsafe { (api.version)(&mut v) })?;
    Ok((v, api.library))
}

/// One GPU rank's communicator (see the module docs).
pub struct NcclComm {
    api: Arc<Api>,
    comm: Comm,
    rank: usize,
    size: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    stats: Mutex<CommStats>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not overlap;
// this rank's collectives are issued by its own thread, in order (the trait's contract).
unsafe impl Send for NcclComm {}
// SAFETY: as above; the only shared mutable state is behind a mutex.
unsafe impl Sync for NcclComm {}

fn cuda(e: impl std::fmt::Debug) -> NcclError {
    NcclError::Cuda(format!("{e:?}"))
}

impl NcclComm {
    /// One communicator per local GPU `0..size`.
    pub fn group(size: usize) -> Result<Vec<NcclComm>, NcclError> {
        let api = Arc::new(Api::load()?);
        let devices: Vec<c_int> = (0..size as c_int).collect();
        let mut comms = vec![std::ptr::null_mut(); size];
        // SAFETY: `comms` has room for `size` handles and `devices` lists `size` ordinals.
        api.check("ncclCommInitAll", unsafe { (api.init_all)(comms.as_mut_ptr(), size as c_int, devices.as_ptr()) })?;
        comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let ctx = CudaContext::new(rank).map_err(cuda)?;
                let stream = ctx.default_stream();
                Ok(NcclComm {
                    api: api.clone(),
                    comm,
                    rank,
                    size,
                    ctx,
                    stream,
                    stats: Mutex::new(CommStats::default()),
                })
            })
            .collect()
    }

    fn upload(&self, host: &[f32], len: usize) -> Result<CudaSlice<f32>, NcclError> {
        self.ctx.bind_to_thread().map_err(cuda)?;
        let mut d = self.stream.alloc_zeros::<f32>(len.max(1)).map_err(cuda)?;
        if !host.is_empty() {
            let mut view = d.slice_mut(..host.len());
            self.stream.memcpy_htod(host, &mut view).map_err(cuda)?;
        }
        Ok(d)
    }

    fn download(&self, d: &CudaSlice<f32>, out: &mut [f32], from: usize) -> Result<(), NcclError> {
        let all = self.stream.clone_dtoh(d).map_err(cuda)?;
        out.copy_from_slice(&all[from..from + out.len()]);
        Ok(())
    }

    fn raw(&self) -> *mut c_void {
        self.stream.cu_stream() as *mut c_void
    }

    fn count(&self, f: impl FnOnce(&mut CommStats), bytes: usize) {
        let mut s = self.stats.lock();
        f(&mut s);
        s.bytes_sent += bytes as u64;
    }

    fn try_all_reduce(&self, buf: &mut [f32]) -> Result<(), NcclError> {
        let mut d = self.upload(buf, buf.len())?;
        {
            let (p, _r) = d.device_ptr_mut(&self.stream);
            // SAFETY: in place on a device buffer of buf.len() floats, on this rank's stream.
            self.api.check("ncclAllReduce", unsafe {
                (self.api.all_reduce)(
                    p as *const c_void,
                    p as *mut c_void,
                    buf.len(),
                    FLOAT32,
                    SUM,
                    self.comm,
                    self.raw(),
                )
            })?;
        }
        self.download(&d, buf, 0)
    }

    fn try_all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), NcclError> {
        // Equal parts for NCCL: every rank's part padded to the longest; the lengths first.
        let mut lens = vec![0f32; self.size];
        lens[self.rank] = local.len() as f32;
        self.try_all_reduce(&mut lens)?;
        let longest = lens.iter().fold(0f32, |m, &l| m.max(l)) as usize;
        let send = self.upload(local, longest)?;
        let recv = self.upload(&[], longest * self.size)?;
        {
            let (s, _r1) = send.device_ptr(&self.stream);
            let (r, _r2) = recv.device_ptr(&self.stream);
            // SAFETY: send holds `longest`, recv `longest · size` floats on this rank's device.
            self.api.check("ncclAllGather", unsafe {
                (self.api.all_gather)(s as *const c_void, r as *mut c_void, longest, FLOAT32, self.comm, self.raw())
            })?;
        }
        let all = self.stream.clone_dtoh(&recv).map_err(cuda)?;
        let mut at = 0;
        for (r, &l) in lens.iter().enumerate() {
            let l = l as usize;
            out[at..at + l].copy_from_slice(&all[r * longest..r * longest + l]);
            at += l;
        }
        Ok(())
    }

    fn try_reduce_scatter(&self, input: &[f32], counts: &[usize], out: &mut [f32]) -> Result<(), NcclError> {
        let longest = counts.iter().copied().max().unwrap_or(0);
        let mut padded = vec![0f32; longest * self.size];
        let mut at = 0;
        for (r, &c) in counts.iter().enumerate() {
            padded[r * longest..r * longest + c].copy_from_slice(&input[at..at + c]);
            at += c;
        }
        let send = self.upload(&padded, padded.len())?;
        let recv = self.upload(&[], longest)?;
        {
            let (s, _r1) = send.device_ptr(&self.stream);
            let (r, _r2) = recv.device_ptr(&self.stream);
            // SAFETY: send holds `longest · size`, recv `longest` floats on this rank's device.
            self.api.check("ncclReduceScatter", unsafe {
                (self.api.reduce_scatter)(
                    s as *const c_void,
                    r as *mut c_void,
                    longest,
                    FLOAT32,
                    SUM,
                    self.comm,
                    self.raw(),
                )
            })?;
        }
        self.download(&recv, out, 0)
    }

    fn try_broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), NcclError> {
        let mut d = self.upload(buf, buf.len())?;
        {
            let (p, _r) = d.device_ptr_mut(&self.stream);
            // SAFETY: in place on a device buffer of buf.len() floats.
            self.api.check("ncclBroadcast", unsafe {
                (self.api.broadcast)(
                    p as *const c_void,
                    p as *mut c_void,
                    buf.len(),
                    FLOAT32,
                    root as c_int,
                    self.comm,
                    self.raw(),
                )
            })?;
        }
        self.download(&d, buf, 0)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by ncclCommInitAll and is destroyed once.
        let _ = unsafe { (self.api.destroy)(self.comm) };
    }
}

/// A failed collective leaves the ranks out of step: like a panicking `ThreadComm`, it stops
/// this rank's step (the engine contains panics per step).
fn or_panic(what: &str, r: Result<(), NcclError>) {
    if let Err(e) = r {
        panic!("{what}: {e}");
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) {
        self.count(|s| s.all_reduces += 1, buf.len() * 4);
        or_panic("all-reduce", self.try_all_reduce(buf));
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) {
        self.count(|s| s.all_gathers += 1, local.len() * 4);
        or_panic("all-gather", self.try_all_gather(local, out));
    }

    fn reduce_scatter_sum(&self, input: &[f32], counts: &[usize], out: &mut [f32]) {
        self.count(|s| s.reduce_scatters += 1, input.len() * 4);
        or_panic("reduce-scatter", self.try_reduce_scatter(input, counts, out));
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) {
        self.count(|s| s.broadcasts += 1, if self.rank == root { buf.len() * 4 } else { 0 });
        or_panic("broadcast", self.try_broadcast(buf, root));
    }

    fn barrier(&self) {
        self.count(|s| s.barriers += 1, 0);
        let mut one = [0f32];
        or_panic("barrier", self.try_all_reduce(&mut one));
    }

    fn stats(&self) -> CommStats {
        *self.stats.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the library the group says which sonames it looked for (CI machines have none);
    /// with it (a GPU machine) the probe reads its version.
    #[test]
    fn a_machine_without_nccl_or_rccl_gets_the_names_looked_for() {
        match probe() {
            Ok((version, library)) => eprintln!("{library}: NCCL API version {version}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("librccl.so.1") && msg.contains("libnccl.so.2"), "{msg}");
                let group = NcclComm::group(2).err().map(|e| e.to_string()).unwrap_or_default();
                assert_eq!(group, msg);
            }
        }
    }
}
