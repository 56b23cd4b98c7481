//! Helpers shared by the kernel test binaries.

/// Re-runs the calling test binary with each lower SIMD level forced (`KIMI_SIMD`), so the AVX2
/// and scalar paths are checked on a machine that would otherwise always take AVX-512 — and, on
/// a CPU with AMX tiles, the AVX-512 path without them. `skip` is the calling test's own name; a
/// forced run returns at once.
pub fn rerun_at_every_simd_level(skip: &str) {
    if std::env::var_os("KIMI_SIMD").is_some() {
        return; // already a forced run
    }
    let exe = std::env::current_exe().expect("test binary path");
    let below_amx = kimi_kernels::amx_enabled().then_some("avx512");
    for level in below_amx.into_iter().chain(["avx2", "scalar"]) {
        let out = std::process::Command::new(&exe)
            .env("KIMI_SIMD", level)
            .args(["--skip", skip, "--test-threads", "2"])
            .output()
            .expect("re-run the tests");
        assert!(
            out.status.success(),
            "tests fail with KIMI_SIMD={level}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
