//! One ThreadSanitizer pass over every kernel (at wave 32 and 64): the kernels and kpl's host
//! runtime built with `-fsanitize=thread` into a small driver (`tsan/driver.cpp`), which must run
//! clean. Skipped, saying so, only where the compiler has no TSan runtime.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn kernels_run_clean_under_thread_sanitizer() {
    let kernels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = kernels.join("../target/kpl-tsan-driver");
    let mut cmd = Command::new(std::env::var("CXX").unwrap_or_else(|_| "g++".into()));
    cmd.args(["-std=c++20", "-O1", "-g", "-pthread", "-fsanitize=thread", "-DKPL_CPU", "-I"])
        .arg(kernels.join("include"))
        .args(["-x", "c++"]);
    let mut ops: Vec<PathBuf> = std::fs::read_dir(kernels.join("ops"))
        .expect("kernels/ops")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    ops.sort();
    cmd.args(&ops).arg(kernels.join("kpl-host/tsan/driver.cpp")).arg("-o").arg(&bin);
    let built = cmd.output().expect("a C++ compiler");
    if !built.status.success() {
        let err = String::from_utf8_lossy(&built.stderr);
        if err.contains("tsan") {
            eprintln!("SKIPPED: no ThreadSanitizer runtime:\n{err}");
            return;
        }
        panic!("building the TSan driver failed:\n{err}");
    }
    let run = Command::new(&bin).env("TSAN_OPTIONS", "halt_on_error=1 exitcode=66").output().expect("run driver");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success() && !err.contains("ThreadSanitizer"), "TSan found a problem:\n{err}");
    assert!(String::from_utf8_lossy(&run.stdout).contains("wave 32 and 64"));
}
