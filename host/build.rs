//! Builds the standard plugins (`../plugins`, a wasm32-wasip2 workspace) and leaves the
//! components in OUT_DIR, where `src/plugins/builtin.rs` embeds them as `builtin:<name>`. The
//! deliberately misbehaving `test_hostile.wasm` is built too but embedded only by the tests
//! (`tests/suite/common`); `bench soak` reads it from the plugins' target directory.

use std::path::PathBuf;
use std::process::Command;

/// Components produced by the plugins workspace (crate name with `_`).
const PLUGINS: &[&str] =
    &["sampler_standard", "policy_limits", "policy_kimi_vendor", "template_kimi_k3", "grammar_kimi_k3", "test_hostile"];

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let plugins = manifest_dir.join("../plugins");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=../wit");
    println!("cargo:rerun-if-changed=../plugins/Cargo.toml");
    println!("cargo:rerun-if-changed=../plugins/Cargo.lock");
    for entry in std::fs::read_dir(&plugins).expect("read plugins/").flatten() {
        if entry.path().is_dir() && entry.file_name() != "target" {
            println!("cargo:rerun-if-changed={}", entry.path().join("src").display());
            println!("cargo:rerun-if-changed={}", entry.path().join("Cargo.toml").display());
        }
    }
    ensure_wasm_target();
    // A target dir of its own: the outer cargo holds the workspace's build lock.
    let target_dir = plugins.join("target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&plugins)
        .args(["build", "--release", "--locked", "--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's flags and wrappers are for the host target, not for wasm.
    for var in
        ["CARGO_ENCODED_RUSTFLAGS", "RUSTFLAGS", "CARGO_BUILD_TARGET", "CARGO_TARGET_DIR", "RUSTC_WORKSPACE_WRAPPER"]
    {
        cmd.env_remove(var);
    }
    let status = cmd.status().expect("run cargo for the plugins workspace");
    if !status.success() {
        panic!(
            "building the standard plugins failed (they need the wasm32-wasip2 target: \
             `rustup target add wasm32-wasip2`, which rust-toolchain.toml requests)"
        );
    }
    for name in PLUGINS {
        let src = target_dir.join("wasm32-wasip2/release").join(format!("{name}.wasm"));
        std::fs::copy(&src, out.join(format!("{name}.wasm"))).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    }
}

/// Installs the wasm32-wasip2 target through rustup when this toolchain lacks it (a fresh
/// machine), so `cargo test` needs no manual step.
fn ensure_wasm_target() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(&rustc).args(["--print", "sysroot"]).output();
    let Ok(out) = sysroot else { return };
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if sysroot.join("lib/rustlib/wasm32-wasip2").exists() {
        return;
    }
    let mut cmd = Command::new("rustup");
    cmd.args(["target", "add", "wasm32-wasip2"]);
    if let Ok(tc) = std::env::var("RUSTUP_TOOLCHAIN") {
        cmd.args(["--toolchain", &tc]);
    }
    let _ = cmd.status();
}
