//! The ahead-of-time build: every kernel of `kernels/ops/` compiles for gfx950, gfx942 and sm_90
//! with the pinned clang of PyPI's ziglang (no GPU, ROCm or CUDA), its parameter struct has the
//! size of its Rust mirror on every target, and no AMD build spills. Skipped, saying so, only
//! when the ziglang venv cannot be installed (no PyPI).

use std::path::PathBuf;
use std::process::Command;

use kimi_kernels::gpu::abi::{
    AttnResParams, EmbeddingParams, GatedRmsnormParams, KdaConvParams, KdaDecodeParams, MoeRouteParams, RmsnormParams,
    SituParams,
};
use kimi_kernels::gpu::manifest::Manifest;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn every_kernel_compiles_for_gfx950_gfx942_and_sm_90() {
    let out = root().join("target/gpu-kernels-test");
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new("bash").arg(root().join("scripts/build-gpu-kernels.sh")).arg(&out).output().expect("bash");
    let stderr = String::from_utf8_lossy(&run.stderr);
    if !run.status.success() {
        if stderr.contains("pip") || stderr.contains("ziglang") && stderr.contains("No matching distribution") {
            eprintln!("SKIPPED: the ziglang venv could not be installed:\n{stderr}");
            return;
        }
        panic!("build-gpu-kernels.sh failed:\n{}\n{stderr}", String::from_utf8_lossy(&run.stdout));
    }
    let text = std::fs::read_to_string(out.join("manifest.json")).expect("manifest");
    let m = Manifest::parse(&text).expect("manifest parses");
    print!("{m}");
    let want = [
        ("kpl_rmsnorm_f32", size_of::<RmsnormParams>()),
        ("kpl_gated_rmsnorm_f32", size_of::<GatedRmsnormParams>()),
        ("kpl_situ_glu_f32", size_of::<SituParams>()),
        ("kpl_embedding_bf16", size_of::<EmbeddingParams>()),
        ("kpl_kda_decode_f32", size_of::<KdaDecodeParams>()),
        ("kpl_attn_res_mix_f32", size_of::<AttnResParams>()),
        ("kpl_moe_route_f32", size_of::<MoeRouteParams>()),
        ("kpl_kda_conv_f32", size_of::<KdaConvParams>()),
        ("kpl_silu_glu_f32", size_of::<kimi_kernels::gpu::abi::GluParams>()),
        ("kpl_gelu_f32", size_of::<kimi_kernels::gpu::abi::GeluParams>()),
        ("kpl_rope_table_f32", size_of::<kimi_kernels::gpu::abi::RopeTableParams>()),
    ];
    for arch in ["gfx950", "gfx942", "sm_90"] {
        for (name, size) in want {
            let k = m
                .kernels
                .iter()
                .find(|k| k.name == name && k.arch == arch)
                .unwrap_or_else(|| panic!("{name} was not built for {arch}"));
            assert_eq!(k.params_size, size, "{name} on {arch}: parameter struct size");
            assert!(out.join(&k.file).is_file(), "{}", k.file);
            if arch != "sm_90" {
                assert_eq!(k.spills, Some(0), "{name} on {arch} spills");
                assert!(k.vgpr.is_some_and(|v| v > 0) && k.sgpr.is_some(), "{name} on {arch}: register counts");
            } else {
                assert!(k.ptx_regs.is_some_and(|r| r > 0));
            }
        }
    }
    // gfx950 builds are real code objects (ELF, machine AMDGPU = 224).
    let co = std::fs::read(out.join("gfx950/rmsnorm.co")).expect("code object");
    assert_eq!(&co[..4], b"\x7fELF");
    assert_eq!(u16::from_le_bytes([co[18], co[19]]), 224, "EM_AMDGPU");
    let ptx = std::fs::read_to_string(out.join("sm_90/rmsnorm.ptx")).expect("ptx");
    assert!(ptx.contains(".target sm_90") && ptx.contains("bar.sync"));
}
