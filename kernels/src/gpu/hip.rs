//! Launching the built kernels on an AMD GPU through the HIP runtime, dlopened by soname
//! (`libamdhip64.so.7`, `.6`, `.5`): one binary runs across ROCm 6 and 7 and builds without ROCm.
//! That is why this is a small FFI of our own rather than `hip-sys`, which links one ROCm at build
//! time. [`HipKernels::open`] loads the code objects of the first AMD architecture in the manifest
//! the device accepts (`gfx950` for MI355X, then `gfx942`; `KIMI_HIP_ARCH` forces one) — kpl
//! kernels and Triton's — and implements [`GpuDevice`] on the null stream.
//!
//! Nothing in this file has run on hardware yet; without ROCm, `open` says which names it looked
//! for.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::path::Path;

use libloading::Library;

use super::device::{GpuDevice, GpuError, KernelArg, read_manifest};
use super::manifest::KernelEntry;
use super::runtime::{Api, DeviceError, HIP_LIBS};

type HipError = c_int;
type Module = *mut c_void;
type Function = *mut c_void;
/// `hipErrorNoBinaryForGpu`: a code object for another architecture.
const NO_BINARY_FOR_GPU: HipError = 209;
/// `hipErrorInvalidImage`.
const INVALID_IMAGE: HipError = 200;

/// The runtime's entry points (C signatures from `hip_runtime_api.h`).
struct HipApi {
    _lib: Library,
    library: String,
    init: unsafe extern "C" fn(c_uint) -> HipError,
    set_device: unsafe extern "C" fn(c_int) -> HipError,
    device_count: unsafe extern "C" fn(*mut c_int) -> HipError,
    device_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    total_mem: unsafe extern "C" fn(*mut usize, c_int) -> HipError,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
    free: unsafe extern "C" fn(*mut c_void) -> HipError,
    memset: unsafe extern "C" fn(*mut c_void, c_int, usize) -> HipError,
    htod: unsafe extern "C" fn(*mut c_void, *const c_void, usize) -> HipError,
    dtoh: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> HipError,
    synchronize: unsafe extern "C" fn() -> HipError,
    module_load_data: unsafe extern "C" fn(*mut Module, *const c_void) -> HipError,
    module_unload: unsafe extern "C" fn(Module) -> HipError,
    module_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> HipError,
    #[allow(clippy::type_complexity)]
    launch: unsafe extern "C" fn(
        Function,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> HipError,
    error_string: unsafe extern "C" fn(HipError) -> *const c_char,
}

impl HipApi {
    fn load() -> Result<HipApi, DeviceError> {
        let (lib, library) = HIP_LIBS
            .iter()
            .find_map(|n| {
                // SAFETY: loading the HIP runtime runs its initialisers; it is looked up by its
                // documented sonames.
                unsafe { Library::new(n) }.ok().map(|l| (l, n.to_string()))
            })
            .ok_or(DeviceError::NoRuntime { api: Api::Hip, looked: HIP_LIBS.join(", ") })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is the HIP runtime's, and the field it is stored in has the
                // C signature `hip_runtime_api.h` declares for it.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| DeviceError::Symbol {
                    api: Api::Hip,
                    library: library.clone(),
                    symbol: $name,
                })?;
                *s
            }};
        }
        Ok(HipApi {
            init: sym!("hipInit"),
            set_device: sym!("hipSetDevice"),
            device_count: sym!("hipGetDeviceCount"),
            device_name: sym!("hipDeviceGetName"),
            total_mem: sym!("hipDeviceTotalMem"),
            malloc: sym!("hipMalloc"),
            free: sym!("hipFree"),
            memset: sym!("hipMemset"),
            htod: sym!("hipMemcpyHtoD"),
            dtoh: sym!("hipMemcpyDtoH"),
            synchronize: sym!("hipDeviceSynchronize"),
            module_load_data: sym!("hipModuleLoadData"),
            module_unload: sym!("hipModuleUnload"),
            module_function: sym!("hipModuleGetFunction"),
            launch: sym!("hipModuleLaunchKernel"),
            error_string: sym!("hipGetErrorString"),
            library,
            _lib: lib,
        })
    }

    fn check(&self, call: &'static str, code: HipError) -> Result<(), GpuError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { (self.error_string)(code) };
        let message = if text.is_null() {
            format!("code {code}")
        } else {
            // SAFETY: non-null, NUL-terminated, static (above).
            format!("{} (code {code})", unsafe { CStr::from_ptr(text) }.to_string_lossy())
        };
        Err(GpuError::Call { api: "HIP", call, message })
    }
}

/// An AMD GPU with one architecture's kernels loaded.
pub struct HipKernels {
    api: HipApi,
    ordinal: c_int,
    arch: String,
    modules: Vec<Module>,
    functions: HashMap<String, (Function, KernelEntry)>,
    device: String,
}

// SAFETY: the module and function handles are process-wide HIP objects, usable from any thread
// once the thread has selected the device (every call does, through `bind`).
unsafe impl Send for HipKernels {}
// SAFETY: as above; HIP's runtime calls are thread-safe.
unsafe impl Sync for HipKernels {}

impl HipKernels {
    /// Opens device `ordinal` and loads the kernels of the manifest in `dir`
    /// (`scripts/build-gpu-kernels.sh`'s output) built for its architecture.
    pub fn open(dir: &Path, ordinal: usize) -> Result<HipKernels, GpuError> {
        let api = HipApi::load()?;
        // SAFETY: plain runtime calls with valid out-pointers.
        unsafe {
            api.check("hipInit", (api.init)(0))?;
            let mut n = 0;
            api.check("hipGetDeviceCount", (api.device_count)(&mut n))?;
            if n <= 0 {
                return Err(DeviceError::NoDevice { api: Api::Hip, library: api.library.clone() }.into());
            }
            if ordinal >= n as usize {
                return Err(GpuError::Call {
                    api: "HIP",
                    call: "hipSetDevice",
                    message: format!("device {ordinal} asked for, {n} present"),
                });
            }
        }
        let ordinal = ordinal as c_int;
        let mut name = [0 as c_char; 256];
        let mut mem = 0usize;
        // SAFETY: the buffers are valid for the lengths passed.
        unsafe {
            api.check("hipSetDevice", (api.set_device)(ordinal))?;
            api.check("hipDeviceGetName", (api.device_name)(name.as_mut_ptr(), name.len() as c_int, ordinal))?;
            api.check("hipDeviceTotalMem", (api.total_mem)(&mut mem, ordinal))?;
        }
        // SAFETY: hipDeviceGetName wrote a NUL-terminated string into the zeroed buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let manifest = read_manifest(dir)?;
        let archs: Vec<String> = match std::env::var("KIMI_HIP_ARCH") {
            Ok(a) => vec![a],
            Err(_) => vec!["gfx950".into(), "gfx942".into()],
        };
        let mut tried = Vec::new();
        for arch in &archs {
            let entries: Vec<KernelEntry> = manifest.kernels.iter().filter(|k| &k.arch == arch).cloned().collect();
            if entries.is_empty() {
                tried.push(format!("{arch}: not in the manifest"));
                continue;
            }
            match load(&api, dir, &entries) {
                Ok((modules, functions)) => {
                    let device = format!("{name} ({} MiB, {arch})", mem >> 20);
                    return Ok(HipKernels { api, ordinal, arch: arch.clone(), modules, functions, device });
                }
                Err(LoadError::WrongArch(code)) => {
                    tried.push(format!("{arch}: the device refused its code objects (code {code})"))
                }
                Err(LoadError::Other(e)) => return Err(e),
            }
        }
        Err(GpuError::Call {
            api: "HIP",
            call: "hipModuleLoadData",
            message: format!("no kernel build this device ({name}) accepts: {}", tried.join("; ")),
        })
    }

    /// Selects this device on the calling thread (HIP's current device is per thread).
    fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: a plain runtime call.
        self.api.check("hipSetDevice", unsafe { (self.api.set_device)(self.ordinal) })
    }
}

enum LoadError {
    WrongArch(HipError),
    Other(GpuError),
}

type Loaded = (Vec<Module>, HashMap<String, (Function, KernelEntry)>);

/// Loads the code objects of `entries` and looks their functions up; on any failure unloads what
/// it loaded.
fn load(api: &HipApi, dir: &Path, entries: &[KernelEntry]) -> Result<Loaded, LoadError> {
    let mut modules = Vec::new();
    let r = load_into(api, dir, entries, &mut modules);
    if r.is_err() {
        unload(api, &mut modules);
    }
    r.map(|functions| (modules, functions))
}

fn load_into(
    api: &HipApi,
    dir: &Path,
    entries: &[KernelEntry],
    modules: &mut Vec<Module>,
) -> Result<HashMap<String, (Function, KernelEntry)>, LoadError> {
    let mut by_file: HashMap<String, Module> = HashMap::new();
    let mut functions = HashMap::new();
    for k in entries {
        let module = match by_file.get(&k.file) {
            Some(m) => *m,
            None => {
                let path = dir.join(&k.file);
                let bytes = std::fs::read(&path).map_err(|e| {
                    LoadError::Other(GpuError::Manifest { path: path.display().to_string(), msg: e.to_string() })
                })?;
                let mut m: Module = std::ptr::null_mut();
                // SAFETY: `bytes` is a whole code object, alive for the call (HIP copies it).
                let code = unsafe { (api.module_load_data)(&mut m, bytes.as_ptr().cast()) };
                if code == NO_BINARY_FOR_GPU || code == INVALID_IMAGE {
                    return Err(LoadError::WrongArch(code));
                }
                api.check("hipModuleLoadData", code).map_err(LoadError::Other)?;
                modules.push(m);
                by_file.insert(k.file.clone(), m);
                m
            }
        };
        // Triton names its entry point after the Python function.
        let entry = k.name.strip_prefix("triton_").unwrap_or(&k.name);
        let c = CString::new(entry).map_err(|_| {
            LoadError::Other(GpuError::Manifest { path: k.file.clone(), msg: format!("kernel name {entry:?}") })
        })?;
        let mut f: Function = std::ptr::null_mut();
        // SAFETY: the module is loaded; c is NUL-terminated.
        let code = unsafe { (api.module_function)(&mut f, module, c.as_ptr()) };
        api.check("hipModuleGetFunction", code).map_err(LoadError::Other)?;
        functions.insert(k.name.clone(), (f, k.clone()));
    }
    Ok(functions)
}

fn unload(api: &HipApi, modules: &mut Vec<Module>) {
    for m in modules.drain(..) {
        // SAFETY: each module was loaded once and is unloaded once.
        unsafe { (api.module_unload)(m) };
    }
}

impl Drop for HipKernels {
    fn drop(&mut self) {
        let _ = self.bind();
        self.functions.clear();
        unload(&self.api, &mut self.modules);
    }
}

impl GpuDevice for HipKernels {
    fn describe(&self) -> String {
        format!("{} through {}", self.device, self.api.library)
    }

    fn arch(&self) -> &str {
        &self.arch
    }

    fn wave(&self) -> u32 {
        // CDNA (gfx9xx) runs wave64; the kpl kernels and Triton's builds for it assume so.
        64
    }

    fn kernel(&self, name: &str) -> Option<&KernelEntry> {
        self.functions.get(name).map(|(_, e)| e)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        self.bind()?;
        let bytes = bytes.max(1);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; the memset covers exactly the allocation.
        unsafe {
            self.api.check("hipMalloc", (self.api.malloc)(&mut p, bytes))?;
            self.api.check("hipMemset", (self.api.memset)(p, 0, bytes))?;
        }
        Ok(p as u64)
    }

    unsafe fn free(&self, ptr: u64) {
        if self.bind().is_ok() {
            // SAFETY: the caller passes a pointer from alloc, once; hipFree waits for the device.
            unsafe { (self.api.free)(ptr as *mut c_void) };
        }
    }

    unsafe fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the caller vouches for dst's size; src is a live host slice. A host-to-device
        // copy from pageable memory is ordered after the null stream's queued work.
        self.api.check("hipMemcpyHtoD", unsafe { (self.api.htod)(dst as *mut c_void, src.as_ptr().cast(), src.len()) })
    }

    unsafe fn copy_out(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.synchronize()?;
        // SAFETY: the caller vouches for src's size; dst is a live host slice.
        self.api
            .check("hipMemcpyDtoH", unsafe { (self.api.dtoh)(dst.as_mut_ptr().cast(), src as *mut c_void, dst.len()) })
    }

    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[KernelArg<'_>],
    ) -> Result<(), GpuError> {
        let (f, _) = self
            .functions
            .get(name)
            .ok_or_else(|| GpuError::Missing { name: name.to_string(), arch: self.arch.clone() })?;
        self.bind()?;
        let mut params: Vec<*mut c_void> = args.iter().map(KernelArg::value_ptr).collect();
        // SAFETY: the function is loaded; params point at the argument values, alive for the call
        // (HIP copies them when it queues the launch); the caller vouches for the addresses.
        let code = unsafe {
            (self.api.launch)(
                *f,
                grid.0,
                grid.1,
                grid.2,
                block,
                1,
                1,
                shared,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.api.check("hipModuleLaunchKernel", code)
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: a plain runtime call.
        self.api.check("hipDeviceSynchronize", unsafe { (self.api.synchronize)() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without ROCm the launcher says which runtime names it looked for (with it, the probe's
    /// own test covers the rest).
    #[test]
    fn without_rocm_open_names_the_runtimes_it_looked_for() {
        match HipKernels::open(Path::new("/nonexistent"), 0) {
            Err(GpuError::Runtime(DeviceError::NoRuntime { looked, .. })) => {
                assert!(looked.contains("libamdhip64.so.7") && looked.contains("libamdhip64.so.6"), "{looked}")
            }
            Err(e) => eprintln!("a HIP runtime is installed here: {e}"),
            Ok(_) => eprintln!("a HIP device is present here"),
        }
    }
}
