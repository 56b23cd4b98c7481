//! Launching the built kernels on an NVIDIA GPU (feature `cuda`): cudarc dlopens the driver
//! (`libcuda.so.1`) at run time, so nothing here needs CUDA to build, and a machine without it
//! gets the probe's message. [`CudaKernels::open`] loads every sm_90 artifact the manifest lists
//! — the kpl kernels' PTX (the driver's JIT assigns registers) and the Triton kernels' cubins —
//! and implements [`GpuDevice`] on the context's null stream, through the driver's own calls.
//!
//! This is what `kimi-host kernels check --backend cuda` (and `scripts/device-check.sh`) runs on
//! a lent GPU. Nothing in this file has run on hardware yet.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, result};
use cudarc::nvrtc::Ptx;

use super::device::{GpuDevice, GpuError, KernelArg, read_manifest};
use super::manifest::KernelEntry;

fn driver(call: &'static str) -> impl FnOnce(result::DriverError) -> GpuError {
    move |e| GpuError::Call { api: "CUDA", call, message: format!("{e:?}") }
}

/// Shared memory a block may take without opting in (`cuFuncSetAttribute`).
const DEFAULT_SHARED: u32 = 48 * 1024;

/// Device `ordinal`, its stream and every loaded sm_90 kernel.
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<String, (CudaFunction, KernelEntry)>,
    _modules: Vec<Arc<CudaModule>>,
    device: String,
}

impl CudaKernels {
    /// Opens device `ordinal` and loads the sm_90 kernels of the manifest in `dir`
    /// (`scripts/build-gpu-kernels.sh`'s output).
    pub fn open(dir: &Path, ordinal: usize) -> Result<CudaKernels, GpuError> {
        let manifest = read_manifest(dir)?;
        let ctx = CudaContext::new(ordinal).map_err(driver("cuCtxCreate"))?;
        let device = format!(
            "{} ({} MiB, sm_90)",
            ctx.name().map_err(driver("cuDeviceGetName"))?,
            ctx.total_mem().map_err(driver("cuDeviceTotalMem"))? >> 20
        );
        let stream = ctx.default_stream();
        let mut modules: HashMap<String, Arc<CudaModule>> = HashMap::new();
        let mut functions = HashMap::new();
        for k in manifest.kernels.iter().filter(|k| k.arch == "sm_90") {
            let module = match modules.get(&k.file) {
                Some(m) => m.clone(),
                None => {
                    let path = dir.join(&k.file);
                    let bytes = std::fs::read(&path)
                        .map_err(|e| GpuError::Manifest { path: path.display().to_string(), msg: e.to_string() })?;
                    let image = if k.file.ends_with(".ptx") {
                        Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
                    } else {
                        Ptx::from_binary(bytes)
                    };
                    let m = ctx.load_module(image).map_err(driver("cuModuleLoadData"))?;
                    modules.insert(k.file.clone(), m.clone());
                    m
                }
            };
            // Triton names its entry point after the Python function.
            let entry = k.name.strip_prefix("triton_").unwrap_or(&k.name);
            let f = module.load_function(entry).map_err(driver("cuModuleGetFunction"))?;
            // A Triton kernel's dynamic shared memory past 48 KiB must be opted into.
            if let Some(lds) = k.lds.filter(|&l| k.source == "triton" && l > DEFAULT_SHARED) {
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, lds as i32)
                    .map_err(driver("cuFuncSetAttribute"))?;
            }
            functions.insert(k.name.clone(), (f, k.clone()));
        }
        Ok(CudaKernels { ctx, stream, functions, _modules: modules.into_values().collect(), device })
    }

    /// The context, for callers that need more of cudarc (the collectives).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the context current on the calling thread (the driver's calls below need it).
    fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }
}

impl GpuDevice for CudaKernels {
    fn describe(&self) -> String {
        format!("{} through the CUDA driver", self.device)
    }

    fn arch(&self) -> &str {
        "sm_90"
    }

    fn wave(&self) -> u32 {
        32
    }

    fn kernel(&self, name: &str) -> Option<&KernelEntry> {
        self.functions.get(name).map(|(_, e)| e)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        self.bind()?;
        let bytes = bytes.max(1);
        // SAFETY: a fresh allocation, zeroed over exactly its size before anyone reads it.
        unsafe {
            let p = result::malloc_sync(bytes).map_err(driver("cuMemAlloc"))?;
            result::memset_d8_sync(p, 0, bytes).map_err(driver("cuMemsetD8"))?;
            Ok(p)
        }
    }

    unsafe fn free(&self, ptr: u64) {
        // cuMemFree does not wait for queued kernels that may still use the memory.
        if self.synchronize().is_ok() {
            // SAFETY: the caller passes a pointer from alloc, once; nothing queued uses it now.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }

    unsafe fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the caller vouches for dst's size; a synchronous copy on the legacy stream is
        // ordered after the launches queued on it (the context's default stream is that stream).
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(driver("cuMemcpyHtoD"))
    }

    unsafe fn copy_out(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.synchronize()?;
        // SAFETY: the caller vouches for src's size; dst is a live host slice.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(driver("cuMemcpyDtoH"))
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
            .ok_or_else(|| GpuError::Missing { name: name.to_string(), arch: "sm_90".to_string() })?;
        self.bind()?;
        let mut params: Vec<*mut std::ffi::c_void> = args.iter().map(KernelArg::value_ptr).collect();
        // SAFETY: the function's module is alive (held by self); params point at the argument
        // values, alive for the call (the driver copies them when it queues the launch); the
        // caller vouches for the addresses.
        unsafe {
            result::launch_kernel(f.cu_function(), grid, (block, 1, 1), shared, self.stream.cu_stream(), &mut params)
        }
        .map_err(driver("cuLaunchKernel"))
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }
}
