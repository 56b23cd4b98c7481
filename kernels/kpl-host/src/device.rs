//! [`HostDevice`]: the kpl kernels' host build behind the same [`GpuDevice`] interface the CUDA and
//! HIP runtimes implement. "Device" memory is host memory, copies are `memcpy`, and a launch runs
//! the kernel's host build by name (each GPU thread a std::thread, at the device's wave size).
//! So [`GpuBackend`](kimi_kernels::gpu::backend::GpuBackend) over it runs, in CI, the very op
//! mapping, staging and launch checks the GPU backends run on a device.
//!
//! Triton kernels have no host build; the backend keeps their ops on the CPU here, unless the
//! device is made [`HostDevice::with_triton`]: then each Triton launch is written out as the Rust
//! side made it (kernel, grid, arguments, every buffer a pointer argument addresses) and replayed
//! in Triton's interpreter (`kernels/triton/replay.py --serve`, one Python process for the
//! device's launches; slow, for tests), and the buffers are read back — so the launchers' argument lists, strides and grids are
//! checked on the CPU.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::Pod;
use kimi_kernels::gpu::abi::{
    AttnResParams, EmbeddingParams, Fp8QuantizeParams, GatedRmsnormParams, GeluParams, GluParams, KdaConvParams,
    KdaDecodeParams, LogitsStatsParams, MmaGemmParams, MoeRouteParams, RmsnormParams, RopeTableParams, SituParams,
    TopkParams,
};
use kimi_kernels::gpu::device::{GpuDevice, GpuError, KernelArg};
use kimi_kernels::gpu::manifest::KernelEntry;
use parking_lot::Mutex;

use crate::Launch;

/// Every kpl kernel of the host build: its name and its parameter struct's size as the C side
/// compiled it.
fn kernels() -> Vec<(&'static str, usize)> {
    // SAFETY: the size functions take nothing and return a constant.
    unsafe {
        vec![
            ("kpl_rmsnorm_f32", crate::kpl_abi_size_kpl_rmsnorm_f32() as usize),
            ("kpl_gated_rmsnorm_f32", crate::kpl_abi_size_kpl_gated_rmsnorm_f32() as usize),
            ("kpl_situ_glu_f32", crate::kpl_abi_size_kpl_situ_glu_f32() as usize),
            ("kpl_embedding_bf16", crate::kpl_abi_size_kpl_embedding_bf16() as usize),
            ("kpl_kda_decode_f32", crate::kpl_abi_size_kpl_kda_decode_f32() as usize),
            ("kpl_attn_res_mix_f32", crate::kpl_abi_size_kpl_attn_res_mix_f32() as usize),
            ("kpl_moe_route_f32", crate::kpl_abi_size_kpl_moe_route_f32() as usize),
            ("kpl_kda_conv_f32", crate::kpl_abi_size_kpl_kda_conv_f32() as usize),
            ("kpl_silu_glu_f32", crate::kpl_abi_size_kpl_silu_glu_f32() as usize),
            ("kpl_gelu_f32", crate::kpl_abi_size_kpl_gelu_f32() as usize),
            ("kpl_rope_table_f32", crate::kpl_abi_size_kpl_rope_table_f32() as usize),
            ("kpl_mma_gemm_bf16", crate::kpl_abi_size_kpl_mma_gemm_bf16() as usize),
            ("kpl_topk_select_f32", crate::kpl_abi_size_kpl_topk_select_f32() as usize),
            ("kpl_logits_stats_f32", crate::kpl_abi_size_kpl_logits_stats_f32() as usize),
            ("kpl_fp8_quantize_f32", crate::kpl_abi_size_kpl_fp8_quantize_f32() as usize),
        ]
    }
}

/// The kpl kernels on the host at one wave size (see the module's note).
pub struct HostDevice {
    wave: u32,
    entries: HashMap<String, KernelEntry>,
    /// Live allocations by address.
    memory: Mutex<HashMap<u64, Allocation>>,
    /// The interpreter Triton launches are replayed in, if any.
    triton: Option<TritonReplay>,
    /// Launches by kernel name (tests check which kernels a model ran).
    launched: Mutex<HashMap<String, usize>>,
}

/// One allocation: u64 words, so any Pod type is aligned in them, and the bytes asked for.
struct Allocation {
    words: Box<[u64]>,
    bytes: usize,
}

/// The interpreter's replay server (`replay.py --serve`): one Python process for every launch
/// of this device, so Triton is imported once.
struct TritonReplay {
    server: Mutex<ReplayServer>,
}

struct ReplayServer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl ReplayServer {
    /// Sends one launch directory and waits for the answer.
    fn replay(&mut self, dir: &Path) -> Result<(), String> {
        writeln!(self.stdin, "{}", dir.display()).and_then(|()| self.stdin.flush()).map_err(|e| e.to_string())?;
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).map_err(|e| e.to_string())?;
        match answer.trim_end() {
            "ok" => Ok(()),
            "" => Err(format!("the replay server exited ({:?})", self.child.try_wait())),
            other => Err(other.trim_start_matches("error ").to_string()),
        }
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Replayed launches in this process: each gets its own directory, whichever device made it.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

impl HostDevice {
    /// The host build at `wave` lanes a wave (32 as sm_90, 64 as gfx950).
    pub fn new(wave: u32) -> HostDevice {
        let entries = kernels()
            .into_iter()
            .map(|(name, size)| {
                let e = KernelEntry {
                    name: name.to_string(),
                    arch: "host".to_string(),
                    file: String::new(),
                    params_size: size,
                    vgpr: None,
                    agpr: None,
                    sgpr: None,
                    ptx_regs: None,
                    lds: None,
                    spills: None,
                    sgpr_spills: None,
                    source: "kpl".to_string(),
                    signature: None,
                    num_warps: None,
                };
                (name.to_string(), e)
            })
            .collect();
        HostDevice { wave, entries, memory: Mutex::new(HashMap::new()), triton: None, launched: Mutex::default() }
    }

    /// The host build plus every Triton kernel, replayed in the interpreter of `python` (a
    /// Python with the pinned `triton` and `numpy`: `scripts/gpu-tools.sh`'s).
    pub fn with_triton(wave: u32, python: &Path) -> Result<HostDevice, String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../triton/replay.py");
        let out = Command::new(python)
            .arg(&script)
            .arg("--signatures")
            .output()
            .map_err(|e| format!("{}: {e}", python.display()))?;
        if !out.status.success() {
            return Err(format!("replay.py --signatures: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let sigs: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&out.stdout).map_err(|e| format!("replay.py --signatures: {e}"))?;
        let mut dev = HostDevice::new(wave);
        for (name, v) in sigs {
            let entry = KernelEntry {
                name: name.clone(),
                arch: "host".to_string(),
                file: String::new(),
                params_size: 0,
                vgpr: None,
                agpr: None,
                sgpr: None,
                ptx_regs: None,
                lds: Some(0),
                spills: None,
                sgpr_spills: None,
                source: "triton".to_string(),
                signature: v["signature"].as_str().map(str::to_string),
                num_warps: v["num_warps"].as_u64().map(|w| w as u32),
            };
            dev.entries.insert(name, entry);
        }
        let mut child = Command::new(python)
            .arg(&script)
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", python.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the replay server's pipes".into());
        };
        let server = ReplayServer { child, stdin, stdout: BufReader::new(stdout) };
        dev.triton = Some(TritonReplay { server: Mutex::new(server) });
        Ok(dev)
    }

    /// The allocation holding `addr`: its base, and the offset of `addr` in it.
    fn find(&self, addr: u64) -> Option<(u64, u64)> {
        let mem = self.memory.lock();
        mem.iter()
            .find(|(base, a)| addr >= **base && addr < **base + a.bytes.max(1) as u64)
            .map(|(b, _)| (*b, addr - b))
    }

    /// Writes a Triton launch out, replays it in the interpreter and reads its buffers back.
    fn replay_triton(
        &self,
        r: &TritonReplay,
        name: &str,
        grid: (u32, u32, u32),
        args: &[KernelArg<'_>],
    ) -> Result<(), GpuError> {
        let fail = |msg: String| GpuError::Launch { name: name.to_string(), msg };
        let n = LAUNCHES.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kimi-triton-replay-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
        let mut bases: Vec<u64> = Vec::new();
        let mut json_args = Vec::new();
        for a in args {
            json_args.push(match *a {
                KernelArg::Ptr(0) => serde_json::json!({ "null": true }),
                KernelArg::Ptr(p) => {
                    let (base, offset) =
                        self.find(p).ok_or_else(|| fail(format!("pointer {p:#x} is in no allocation")))?;
                    let i = bases.iter().position(|&b| b == base).unwrap_or_else(|| {
                        bases.push(base);
                        bases.len() - 1
                    });
                    serde_json::json!({ "buf": i, "offset": offset })
                }
                KernelArg::I32(v) => serde_json::json!({ "i32": v }),
                KernelArg::F32(v) => serde_json::json!({ "f32": v }),
                KernelArg::Struct(_) => return Err(fail("a Triton kernel takes no struct".into())),
            });
        }
        let mut buffers = Vec::new();
        for (i, &base) in bases.iter().enumerate() {
            let file = format!("b{i}.bin");
            let mem = self.memory.lock();
            let Allocation { words, bytes } = &mem[&base];
            let data: &[u8] = &bytemuck::cast_slice::<u64, u8>(words)[..*bytes];
            std::fs::write(dir.join(&file), data).map_err(|e| fail(e.to_string()))?;
            buffers.push(serde_json::json!({ "file": file }));
        }
        let launch = serde_json::json!({ "kernel": name, "grid": [grid.0, grid.1, grid.2], "args": json_args, "buffers": buffers });
        std::fs::write(dir.join("launch.json"), launch.to_string()).map_err(|e| fail(e.to_string()))?;
        if let Err(e) = r.server.lock().replay(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(fail(format!("the interpreter's replay failed: {e}")));
        }
        for (i, &base) in bases.iter().enumerate() {
            let data = std::fs::read(dir.join(format!("b{i}.bin"))).map_err(|e| fail(e.to_string()))?;
            let mut mem = self.memory.lock();
            let a = mem.get_mut(&base).ok_or_else(|| fail("an allocation was freed during the launch".into()))?;
            if data.len() != a.bytes {
                return Err(fail(format!("buffer {i} came back with {} bytes, not {}", data.len(), a.bytes)));
            }
            bytemuck::cast_slice_mut::<u64, u8>(&mut a.words)[..data.len()].copy_from_slice(&data);
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// How many times each kernel was launched.
    pub fn launches(&self) -> HashMap<String, usize> {
        self.launched.lock().clone()
    }

    /// Bytes the live allocations hold (a test checks a backend frees what it staged).
    pub fn allocated(&self) -> usize {
        self.memory.lock().values().map(|a| a.words.len() * 8).sum()
    }
}

/// The struct argument of a kpl launch, as `P`.
fn params<P: Pod>(name: &str, args: &[KernelArg<'_>]) -> Result<P, GpuError> {
    match args {
        [KernelArg::Struct(b)] if b.len() == size_of::<P>() => Ok(bytemuck::pod_read_unaligned(b)),
        _ => {
            Err(GpuError::Launch { name: name.to_string(), msg: "a kpl kernel takes its one parameter struct".into() })
        }
    }
}

impl GpuDevice for HostDevice {
    fn describe(&self) -> String {
        format!("kpl host kernels (wave {})", self.wave)
    }

    fn arch(&self) -> &str {
        "host"
    }

    fn wave(&self) -> u32 {
        self.wave
    }

    fn parallel_blocks(&self) -> u32 {
        // Every GPU thread is a host thread: a few blocks cover a grid-stride kernel.
        8
    }

    fn kernel(&self, name: &str) -> Option<&KernelEntry> {
        self.entries.get(name)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        let words = vec![0u64; bytes.div_ceil(8).max(1)].into_boxed_slice();
        let p = words.as_ptr() as u64;
        self.memory.lock().insert(p, Allocation { words, bytes });
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64) {
        self.memory.lock().remove(&ptr);
    }

    unsafe fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: the caller vouches that dst addresses src.len() bytes of an allocation made
        // here; a host slice never overlaps one.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as usize as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn copy_out(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        // SAFETY: as copy_in, the other way (launches here finish before they return).
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        _shared: u32,
        args: &[KernelArg<'_>],
    ) -> Result<(), GpuError> {
        *self.launched.lock().entry(name.to_string()).or_default() += 1;
        if let (Some(r), Some(e)) = (&self.triton, self.entries.get(name))
            && e.source == "triton"
        {
            return self.replay_triton(r, name, grid, args);
        }
        if grid.1 != 1 || grid.2 != 1 || block == 0 || !block.is_multiple_of(self.wave) {
            return Err(GpuError::Launch {
                name: name.to_string(),
                msg: format!("grid {grid:?} × block {block}: kpl kernels take a 1-D grid of whole waves"),
            });
        }
        let l = Launch { grid: grid.0, block, wave: self.wave };
        // SAFETY (every arm): the caller vouches for the addresses in the struct (allocations made
        // here or host memory valid for the kernel); the struct is the kernel's own type.
        unsafe {
            match name {
                "kpl_rmsnorm_f32" => crate::rmsnorm_f32(l, params::<RmsnormParams>(name, args)?),
                "kpl_gated_rmsnorm_f32" => crate::gated_rmsnorm_f32(l, params::<GatedRmsnormParams>(name, args)?),
                "kpl_situ_glu_f32" => crate::situ_glu_f32(l, params::<SituParams>(name, args)?),
                "kpl_embedding_bf16" => crate::embedding_bf16(l, params::<EmbeddingParams>(name, args)?),
                "kpl_kda_decode_f32" => crate::kda_decode_f32(l, params::<KdaDecodeParams>(name, args)?),
                "kpl_attn_res_mix_f32" => crate::attn_res_mix_f32(l, params::<AttnResParams>(name, args)?),
                "kpl_moe_route_f32" => crate::moe_route_f32(l, params::<MoeRouteParams>(name, args)?),
                "kpl_kda_conv_f32" => crate::kda_conv_f32(l, params::<KdaConvParams>(name, args)?),
                "kpl_silu_glu_f32" => crate::silu_glu_f32(l, params::<GluParams>(name, args)?),
                "kpl_gelu_f32" => crate::gelu_f32(l, params::<GeluParams>(name, args)?),
                "kpl_rope_table_f32" => crate::rope_table_f32(l, params::<RopeTableParams>(name, args)?),
                "kpl_mma_gemm_bf16" => crate::mma_gemm_bf16(l, params::<MmaGemmParams>(name, args)?),
                "kpl_topk_select_f32" => crate::topk_select_f32(l, params::<TopkParams>(name, args)?),
                "kpl_logits_stats_f32" => crate::logits_stats_f32(l, params::<LogitsStatsParams>(name, args)?),
                "kpl_fp8_quantize_f32" => crate::fp8_quantize_f32(l, params::<Fp8QuantizeParams>(name, args)?),
                _ => return Err(GpuError::Missing { name: name.to_string(), arch: "host".to_string() }),
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        Ok(())
    }
}
