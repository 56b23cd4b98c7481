//! Finding a GPU at run time, with no link-time dependency on ROCm or CUDA: the vendor runtimes
//! are dlopened by their sonames (HIP: `libamdhip64.so.7`, then `.6`, `.5`; CUDA: the driver's
//! `libcuda.so.1`; collectives: `librccl.so.1`, `libnccl.so.2`), so one binary builds and runs
//! everywhere and a machine without them gets a message naming what was looked for.

use std::fmt;

use libloading::Library;

/// Which backend runs the model (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Hip,
    Cuda,
    /// A GPU whose backend is built, else the CPU.
    Auto,
}

impl BackendKind {
    pub fn parse(s: &str) -> Option<BackendKind> {
        match s {
            "cpu" => Some(BackendKind::Cpu),
            "hip" => Some(BackendKind::Hip),
            "cuda" => Some(BackendKind::Cuda),
            "auto" => Some(BackendKind::Auto),
            _ => None,
        }
    }
}

/// A vendor runtime API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Hip,
    Cuda,
}

impl Api {
    fn install_hint(self) -> &'static str {
        match self {
            Api::Hip => "install ROCm",
            Api::Cuda => "install the NVIDIA driver",
        }
    }
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Api::Hip => "HIP",
            Api::Cuda => "CUDA",
        })
    }
}

pub const HIP_LIBS: [&str; 4] = ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"];
const CUDA_LIBS: [&str; 2] = ["libcuda.so.1", "libcuda.so"];
/// RCCL first on AMD machines, NCCL on NVIDIA ones; both speak the NCCL API.
pub const COLLECTIVE_LIBS: [&str; 4] = ["librccl.so.1", "librccl.so", "libnccl.so.2", "libnccl.so"];

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProbe {
    pub api: Api,
    pub library: String,
    pub devices: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--backend: no {api} runtime on this machine: looked for {looked} ({hint}, or run with --backend cpu)", hint = api.install_hint())]
    NoRuntime { api: Api, looked: String },
    #[error("--backend: {api}: {library} lacks {symbol} (run with --backend cpu)")]
    Symbol { api: Api, library: String, symbol: &'static str },
    #[error("--backend: {api}: {call} in {library} failed with code {code}: no usable device (run with --backend cpu)")]
    Call { api: Api, library: String, call: &'static str, code: i32 },
    #[error("--backend: {api}: {library} loaded, but it sees no device (run with --backend cpu)")]
    NoDevice { api: Api, library: String },
    #[error(
        "{api}: {devices} device(s) through {library}, but serving on the {api} backend is not wired yet (its launcher and the staged GPU backend run in `kimi-host kernels check`); run with --backend cpu"
    )]
    NotBuilt { api: Api, library: String, devices: i32 },
}

/// The first library of `names` that loads.
fn open(names: &[&str]) -> Option<(Library, String)> {
    names.iter().find_map(|n| {
        // SAFETY: loading a vendor runtime runs its initialisers; these are the vendors' own
        // libraries, looked up by their documented sonames.
        unsafe { Library::new(n) }.ok().map(|l| (l, n.to_string()))
    })
}

/// Counts HIP devices through the runtime (`hipGetDeviceCount`).
pub fn probe_hip() -> Result<DeviceProbe, DeviceError> {
    let (lib, library) =
        open(&HIP_LIBS).ok_or(DeviceError::NoRuntime { api: Api::Hip, looked: HIP_LIBS.join(", ") })?;
    type GetCount = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: hipGetDeviceCount(int*) -> hipError_t is the HIP runtime's C signature.
    let count: libloading::Symbol<'_, GetCount> = unsafe { lib.get(b"hipGetDeviceCount\0") }
        .map_err(|_| DeviceError::Symbol { api: Api::Hip, library: library.clone(), symbol: "hipGetDeviceCount" })?;
    let mut n = 0i32;
    // SAFETY: n is a valid out-pointer for the call's duration.
    let code = unsafe { count(&mut n) };
    if code != 0 {
        return Err(DeviceError::Call { api: Api::Hip, library, call: "hipGetDeviceCount", code });
    }
    if n <= 0 {
        return Err(DeviceError::NoDevice { api: Api::Hip, library });
    }
    Ok(DeviceProbe { api: Api::Hip, library, devices: n })
}

/// Counts CUDA devices through the driver API (`cuInit`, `cuDeviceGetCount`).
pub fn probe_cuda() -> Result<DeviceProbe, DeviceError> {
    let (lib, library) =
        open(&CUDA_LIBS).ok_or(DeviceError::NoRuntime { api: Api::Cuda, looked: CUDA_LIBS.join(", ") })?;
    type Init = unsafe extern "C" fn(u32) -> i32;
    type GetCount = unsafe extern "C" fn(*mut i32) -> i32;
    let sym = |symbol: &'static str| DeviceError::Symbol { api: Api::Cuda, library: library.clone(), symbol };
    // SAFETY: cuInit(unsigned) -> CUresult and cuDeviceGetCount(int*) -> CUresult are the driver
    // API's C signatures.
    let (init, count): (libloading::Symbol<'_, Init>, libloading::Symbol<'_, GetCount>) = unsafe {
        (
            lib.get(b"cuInit\0").map_err(|_| sym("cuInit"))?,
            lib.get(b"cuDeviceGetCount\0").map_err(|_| sym("cuDeviceGetCount"))?,
        )
    };
    // SAFETY: plain calls with a valid out-pointer.
    let code = unsafe { init(0) };
    if code != 0 {
        return Err(DeviceError::Call { api: Api::Cuda, library, call: "cuInit", code });
    }
    let mut n = 0i32;
    // SAFETY: as above.
    let code = unsafe { count(&mut n) };
    if code != 0 {
        return Err(DeviceError::Call { api: Api::Cuda, library, call: "cuDeviceGetCount", code });
    }
    if n <= 0 {
        return Err(DeviceError::NoDevice { api: Api::Cuda, library });
    }
    Ok(DeviceProbe { api: Api::Cuda, library, devices: n })
}

/// The collective library the GPU ranks would use, if any (its soname).
pub fn probe_collectives() -> Option<String> {
    open(&COLLECTIVE_LIBS).map(|(_, name)| name)
}

/// Resolves `--backend`: `Ok(None)` means the CPU backend. A named GPU backend without a device
/// (or, until its launcher lands, with one) is an error that says what was looked for; `auto`
/// falls back to the CPU, returning what it found in `notes`.
pub fn resolve(kind: BackendKind, notes: &mut Vec<String>) -> Result<Option<DeviceProbe>, DeviceError> {
    let not_built = |p: DeviceProbe| DeviceError::NotBuilt { api: p.api, library: p.library, devices: p.devices };
    match kind {
        BackendKind::Cpu => Ok(None),
        BackendKind::Hip => Err(not_built(probe_hip()?)),
        BackendKind::Cuda => Err(not_built(probe_cuda()?)),
        BackendKind::Auto => {
            for probe in [probe_hip(), probe_cuda()] {
                match probe {
                    Ok(p) => notes.push(format!("{}, but its backend is not built: using the CPU", not_built(p))),
                    Err(e) => notes.push(e.to_string()),
                }
            }
            Ok(None)
        }
    }
}
