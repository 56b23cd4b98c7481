//! The manifest `scripts/build-gpu-kernels.sh` writes beside the code objects: per kernel and
//! architecture, the file, the parameter struct's size (so a loader can refuse a mismatched
//! artifact) or a Triton kernel's signature, registers, LDS and spills, and the compilers.

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
pub struct Manifest {
    pub compiler: String,
    pub kernels: Vec<KernelEntry>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct KernelEntry {
    pub name: String,
    pub arch: String,
    pub file: String,
    /// Bytes of the by-value parameter struct, read from the compiled code.
    pub params_size: usize,
    /// AMD: `.vgpr_count`, `.agpr_count`, `.sgpr_count`; NVIDIA PTX: virtual registers (the
    /// driver's JIT assigns the real ones).
    pub vgpr: Option<u32>,
    pub agpr: Option<u32>,
    pub sgpr: Option<u32>,
    pub ptx_regs: Option<u32>,
    /// Workgroup (shared) memory in bytes.
    pub lds: Option<u32>,
    /// VGPRs spilled to scratch memory (AMD); `None` where the compiler does not say (PTX).
    pub spills: Option<u32>,
    /// SGPRs spilled to lanes of spare VGPRs (AMD; no memory traffic).
    #[serde(default)]
    pub sgpr_spills: Option<u32>,
    /// `kpl` (kernels/ops, one parameter struct) or `triton` (kernels/triton).
    #[serde(default)]
    pub source: String,
    /// A Triton kernel's argument types in order (it takes them one by one, not as a struct;
    /// `params_size` is 0).
    #[serde(default)]
    pub signature: Option<String>,
    /// A Triton kernel's warps (waves) a program: its launch block is `num_warps × wave`.
    #[serde(default)]
    pub num_warps: Option<u32>,
}

impl Manifest {
    pub fn parse(text: &str) -> Result<Manifest, String> {
        serde_json::from_str(text).map_err(|e| format!("kernel manifest: {e}"))
    }
}

impl std::fmt::Display for Manifest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "compiler: {}", self.compiler)?;
        writeln!(
            f,
            "{:<26} {:<7} {:>7} {:>5} {:>5} {:>5} {:>8} {:>6} {:>7} {:>11}",
            "kernel", "arch", "params", "vgpr", "agpr", "sgpr", "ptx regs", "lds", "spills", "sgpr→vgpr"
        )?;
        let opt = |v: Option<u32>| v.map_or("-".to_string(), |v| v.to_string());
        for k in &self.kernels {
            writeln!(
                f,
                "{:<26} {:<7} {:>7} {:>5} {:>5} {:>5} {:>8} {:>6} {:>7} {:>11}",
                k.name,
                k.arch,
                k.params_size,
                opt(k.vgpr),
                opt(k.agpr),
                opt(k.sgpr),
                opt(k.ptx_regs),
                opt(k.lds),
                opt(k.spills),
                opt(k.sgpr_spills)
            )?;
        }
        Ok(())
    }
}
