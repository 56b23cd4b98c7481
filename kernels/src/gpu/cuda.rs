//! Launching the built kernels on an NVIDIA GPU (feature `cuda`): cudarc dlopens the driver
//! (`libcuda.so.1`) at run time, so nothing here needs CUDA to build, and a machine without it
//! gets the probe's message. [`CudaKernels::open`] loads every sm_90 artifact the manifest lists
//! — the kpl kernels' PTX (the driver's JIT assigns registers) and the Triton kernels' cubins —
//! and launches them: a kpl kernel with its one parameter struct, a Triton kernel with its
//! arguments one by one plus the two scratch pointers Triton's launcher passes (null: the kernels
//! use none, as the manifest's build recorded).
//!
//! This is what `kimi-host kernels check --backend cuda` (and `scripts/device-check.sh`) runs on
//! a lent GPU. Nothing in this file has run on hardware yet.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

/// A device buffer (cudarc's), for callers of [`CudaKernels`].
pub use cudarc::driver::CudaSlice as DeviceBuffer;

use super::abi;
use super::manifest::Manifest;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("kernel manifest {path}: {msg}")]
    Manifest { path: String, msg: String },
    #[error("no sm_90 build of kernel {0} in the manifest")]
    Missing(String),
}

fn driver(e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

// SAFETY: each is a plain #[repr(C)] struct of integers, laid out as its C mirror in abi.h (a
// test compares the sizes against every compiled kernel's parameter size).
unsafe impl DeviceRepr for abi::RmsnormParams {}
unsafe impl DeviceRepr for abi::GluParams {}
unsafe impl DeviceRepr for abi::EmbeddingParams {}
unsafe impl DeviceRepr for abi::KdaDecodeParams {}
unsafe impl DeviceRepr for abi::MmaGemmParams {}
unsafe impl DeviceRepr for abi::TopkParams {}
unsafe impl DeviceRepr for abi::LogitsStatsParams {}

/// One argument of a Triton kernel.
#[derive(Clone, Copy, Debug)]
pub enum TritonArg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// The device, its stream and every loaded kernel.
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<String, (CudaFunction, u32)>,
    _modules: Vec<Arc<CudaModule>>,
    /// The device's name and memory, for reports.
    pub device: String,
}

impl CudaKernels {
    /// Opens device 0 and loads the sm_90 kernels of the manifest in `dir`
    /// (`scripts/build-gpu-kernels.sh`'s output).
    pub fn open(dir: &Path) -> Result<CudaKernels, CudaError> {
        let path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| CudaError::Manifest { path: path.display().to_string(), msg: e.to_string() })?;
        let manifest =
            Manifest::parse(&text).map_err(|msg| CudaError::Manifest { path: path.display().to_string(), msg })?;
        let ctx = CudaContext::new(0).map_err(driver)?;
        let device = format!("{} ({} MiB)", ctx.name().map_err(driver)?, ctx.total_mem().map_err(driver)? >> 20);
        let stream = ctx.default_stream();
        let mut modules: HashMap<String, Arc<CudaModule>> = HashMap::new();
        let mut functions = HashMap::new();
        for k in manifest.kernels.iter().filter(|k| k.arch == "sm_90") {
            let module = match modules.get(&k.file) {
                Some(m) => m.clone(),
                None => {
                    let bytes = std::fs::read(dir.join(&k.file)).map_err(|e| CudaError::Manifest {
                        path: dir.join(&k.file).display().to_string(),
                        msg: e.to_string(),
                    })?;
                    let image = if k.file.ends_with(".ptx") {
                        Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
                    } else {
                        Ptx::from_binary(bytes)
                    };
                    let m = ctx.load_module(image).map_err(driver)?;
                    modules.insert(k.file.clone(), m.clone());
                    m
                }
            };
            // Triton names its entry point after the Python function.
            let entry = k.name.strip_prefix("triton_").unwrap_or(&k.name);
            let f = module.load_function(entry).map_err(driver)?;
            functions.insert(k.name.clone(), (f, k.lds.unwrap_or(0)));
        }
        Ok(CudaKernels { ctx, stream, functions, _modules: modules.into_values().collect(), device })
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(driver)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros(n).map_err(driver)
    }

    pub fn download<T: DeviceRepr + Clone + Default>(&self, d: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(d).map_err(driver)
    }

    /// The device address of `d`, for a parameter struct. All work runs on one stream, in
    /// order, so no cross-stream tracking is needed.
    pub fn addr<T>(&self, d: &CudaSlice<T>) -> u64 {
        let (ptr, _sync) = d.device_ptr(&self.stream);
        ptr
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver)
    }

    fn function(&self, name: &str) -> Result<&(CudaFunction, u32), CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::Missing(name.to_string()))
    }

    /// Launches kpl kernel `name` on `grid` blocks of `block` threads with its parameter struct.
    ///
    /// # Safety
    /// Every device address in `p` must point at device memory valid for the kernel's reads
    /// and writes (as its struct in `abi.h` says) until the stream has run it.
    pub unsafe fn launch_kpl<P: DeviceRepr>(&self, name: &str, grid: u32, block: u32, p: &P) -> Result<(), CudaError> {
        let (f, _) = self.function(name)?;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(f);
        b.arg(p);
        // SAFETY: the caller vouches for the addresses; the struct is the kernel's by-value param.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver)
    }

    /// Launches Triton kernel `name` (its manifest name, `triton_…`) on `grid` programs of
    /// `num_warps` warps with `args` in its signature's order.
    ///
    /// # Safety
    /// As [`CudaKernels::launch_kpl`], for every pointer argument.
    pub unsafe fn launch_triton(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        num_warps: u32,
        args: &[TritonArg],
    ) -> Result<(), CudaError> {
        let (f, shared) = self.function(name)?;
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (32 * num_warps, 1, 1), shared_mem_bytes: *shared };
        let null = 0u64;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                TritonArg::Ptr(p) => b.arg(p),
                TritonArg::I32(v) => b.arg(v),
                TritonArg::F32(v) => b.arg(v),
            };
        }
        // Triton's launcher appends the global and profile scratch pointers.
        b.arg(&null).arg(&null);
        // SAFETY: the caller vouches for the pointer arguments.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver)
    }

    /// The context, for callers that need more of cudarc.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
