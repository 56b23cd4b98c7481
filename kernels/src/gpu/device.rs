//! One interface over the GPU runtimes — CUDA's driver (through cudarc, [`super::cuda`]) and HIP's
//! runtime (dlopened, [`super::hip`]) — for everything above them: the device check and the
//! model's device backends. A [`GpuDevice`] holds the kernels of one architecture from the
//! manifest `scripts/build-gpu-kernels.sh` writes, device memory and one in-order stream.
//!
//! The two kinds of kernel are launched the way their builds expect: a kpl kernel
//! (`kernels/ops/*.cu`) takes one by-value parameter struct whose size the manifest recorded, so
//! [`launch_kpl`] refuses a struct of another size instead of letting the kernel read garbage; a
//! Triton kernel takes its arguments one by one plus the two scratch pointers Triton's own
//! launchers append (null: the kernels use none), on `num_warps` waves and the dynamic shared
//! memory its compiler asked for ([`launch_triton`]).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::path::Path;

use bytemuck::Pod;

use super::manifest::{KernelEntry, Manifest};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("{api}: {call} failed: {message}")]
    Call { api: &'static str, call: &'static str, message: String },
    #[error("kernel manifest {path}: {msg}")]
    Manifest { path: String, msg: String },
    #[error("no {arch} build of kernel {name} in the manifest")]
    Missing { name: String, arch: String },
    #[error("kernel {name}: {msg}")]
    Launch { name: String, msg: String },
    #[error(transparent)]
    Runtime(#[from] super::runtime::DeviceError),
}

/// One argument of a launch, by value.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A by-value struct (a kpl kernel's parameters), as its bytes.
    Struct(&'a [u8]),
    Ptr(u64),
    I32(i32),
    F32(f32),
}

impl KernelArg<'_> {
    /// Where the argument's value lies, as the runtimes' `void** kernelParams` want it: they copy
    /// every value when the launch is enqueued, so the pointers need to outlive only the call.
    pub fn value_ptr(&self) -> *mut c_void {
        match self {
            KernelArg::Struct(b) => b.as_ptr() as *mut c_void,
            KernelArg::Ptr(p) => p as *const u64 as *mut c_void,
            KernelArg::I32(v) => v as *const i32 as *mut c_void,
            KernelArg::F32(v) => v as *const f32 as *mut c_void,
        }
    }
}

/// A GPU with the kernels of its architecture loaded.
pub trait GpuDevice: Send + Sync {
    /// The device's name and memory, for reports.
    fn describe(&self) -> String;
    /// The manifest architecture whose builds are loaded (`sm_90`, `gfx950`, `gfx942`).
    fn arch(&self) -> &str;
    /// Lanes a wave: a Triton warp and a kpl wave (32 on NVIDIA, 64 on AMD CDNA).
    fn wave(&self) -> u32;
    /// Blocks that fill the device for a grid-stride kernel (the host build, where every GPU
    /// thread is a host thread, wants few).
    fn parallel_blocks(&self) -> u32 {
        1024
    }
    /// The loaded kernel's manifest entry.
    fn kernel(&self, name: &str) -> Option<&KernelEntry>;
    /// `bytes` of zeroed device memory (at least one byte is allocated); its device address.
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError>;
    /// Frees memory from [`GpuDevice::alloc`] once the work queued before has run.
    ///
    /// # Safety
    /// `ptr` came from this device's `alloc` and is freed once.
    unsafe fn free(&self, ptr: u64);
    /// Copies `src` to device address `dst`, after the work queued before.
    ///
    /// # Safety
    /// `dst` addresses at least `src.len()` bytes of this device's memory.
    unsafe fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), GpuError>;
    /// Copies device memory at `src` into `dst` once the work queued before has run.
    ///
    /// # Safety
    /// `src` addresses at least `dst.len()` bytes of this device's memory.
    unsafe fn copy_out(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError>;
    /// Queues kernel `name` on `grid` blocks of `block` threads with `shared` bytes of dynamic
    /// shared memory.
    ///
    /// # Safety
    /// `args` match the kernel's parameters, and every device address in them (or in a struct
    /// among them) is valid for the kernel's reads and writes until the stream has run it.
    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[KernelArg<'_>],
    ) -> Result<(), GpuError>;
    /// Waits for every queued launch and copy.
    fn synchronize(&self) -> Result<(), GpuError>;
}

/// Reads the manifest in `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, GpuError> {
    let path = dir.join("manifest.json");
    let manifest_error = |msg: String| GpuError::Manifest { path: path.display().to_string(), msg };
    let text = std::fs::read_to_string(&path).map_err(|e| manifest_error(e.to_string()))?;
    Manifest::parse(&text).map_err(manifest_error)
}

fn entry<'d>(dev: &'d dyn GpuDevice, name: &str) -> Result<&'d KernelEntry, GpuError> {
    dev.kernel(name).ok_or_else(|| GpuError::Missing { name: name.to_string(), arch: dev.arch().to_string() })
}

/// Launches kpl kernel `name` on `grid` blocks of `block` threads with its parameter struct,
/// after checking the struct's size against the size its build recorded.
///
/// # Safety
/// Every device address in `p` points at device memory valid for the kernel's reads and writes
/// (as its struct in `abi.h` says) until the stream has run it.
pub unsafe fn launch_kpl<P: Pod>(
    dev: &dyn GpuDevice,
    name: &str,
    grid: u32,
    block: u32,
    p: &P,
) -> Result<(), GpuError> {
    let k = entry(dev, name)?;
    if k.params_size != size_of::<P>() {
        return Err(GpuError::Launch {
            name: name.to_string(),
            msg: format!("its build takes {} bytes of parameters, the caller passed {}", k.params_size, size_of::<P>()),
        });
    }
    // SAFETY: the struct is the kernel's one by-value parameter (sizes checked above); the caller
    // vouches for the addresses inside it.
    unsafe { dev.launch(name, (grid, 1, 1), block, 0, &[KernelArg::Struct(bytemuck::bytes_of(p))]) }
}

/// Launches Triton kernel `name` (its manifest name, `triton_…`) on `grid` programs with `args`
/// in its signature's order, on the `num_warps` waves and the shared memory of its build.
///
/// # Safety
/// Every pointer argument addresses device memory valid for the kernel's reads and writes until
/// the stream has run it.
pub unsafe fn launch_triton(
    dev: &dyn GpuDevice,
    name: &str,
    grid: (u32, u32, u32),
    args: &[KernelArg<'_>],
) -> Result<(), GpuError> {
    let k = entry(dev, name)?;
    let want = k.signature.as_deref().map_or(0, |s| s.split(',').filter(|t| !t.is_empty()).count());
    if args.len() != want {
        return Err(GpuError::Launch {
            name: name.to_string(),
            msg: format!("its signature has {want} arguments, the caller passed {}", args.len()),
        });
    }
    let block = k.num_warps.unwrap_or(4) * dev.wave();
    let shared = k.lds.unwrap_or(0);
    let mut all = args.to_vec();
    // Triton's launchers append the global and profile scratch pointers.
    all.extend([KernelArg::Ptr(0), KernelArg::Ptr(0)]);
    // SAFETY: the argument count matches the signature; the caller vouches for the pointers.
    unsafe { dev.launch(name, grid, block, shared, &all) }
}

/// A typed device buffer, freed when dropped.
pub struct GpuBuffer<'d, T: Pod> {
    dev: &'d dyn GpuDevice,
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<'d, T: Pod> GpuBuffer<'d, T> {
    /// `len` zeroed values.
    pub fn zeros(dev: &'d dyn GpuDevice, len: usize) -> Result<GpuBuffer<'d, T>, GpuError> {
        let ptr = dev.alloc(len * size_of::<T>())?;
        Ok(GpuBuffer { dev, ptr, len, _t: PhantomData })
    }

    /// A copy of `host` on the device.
    pub fn upload(dev: &'d dyn GpuDevice, host: &[T]) -> Result<GpuBuffer<'d, T>, GpuError> {
        let b = GpuBuffer::zeros(dev, host.len())?;
        // SAFETY: the buffer holds host.len() values of T.
        unsafe { dev.copy_in(b.ptr, bytemuck::cast_slice(host))? };
        Ok(b)
    }

    /// The buffer's values once every queued launch has run.
    pub fn download(&self) -> Result<Vec<T>, GpuError> {
        let mut host = vec![T::zeroed(); self.len];
        // SAFETY: the buffer holds len values of T.
        unsafe { self.dev.copy_out(self.ptr, bytemuck::cast_slice_mut(&mut host))? };
        Ok(host)
    }

    /// Overwrites the buffer with `host` (the same length).
    pub fn write(&self, host: &[T]) -> Result<(), GpuError> {
        assert_eq!(host.len(), self.len, "GpuBuffer::write: length");
        // SAFETY: the buffer holds len values of T.
        unsafe { self.dev.copy_in(self.ptr, bytemuck::cast_slice(host)) }
    }

    /// The device address, for a parameter struct or a Triton argument.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: Pod> Drop for GpuBuffer<'_, T> {
    fn drop(&mut self) {
        // SAFETY: ptr came from this device's alloc and is freed only here.
        unsafe { self.dev.free(self.ptr) }
    }
}
