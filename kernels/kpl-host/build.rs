//! Builds every `kernels/ops/*.cu` for the host (`-DKPL_CPU`, C++20 for std::barrier): each GPU
//! thread becomes a std::thread, so the same source that compiles for gfx950 and sm_90 runs here.

use std::path::PathBuf;

fn main() {
    let kernels = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir")).join("..");
    let ops = kernels.join("ops");
    let include = kernels.join("include");
    println!("cargo:rerun-if-changed={}", ops.display());
    println!("cargo:rerun-if-changed={}", include.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&ops)
        .expect("kernels/ops")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut build = cc::Build::new();
    build.cpp(true).std("c++20").define("KPL_CPU", None).include(&include).flag("-pthread").opt_level(2);
    // `.cu` is not C++ to the host compiler unless told.
    build.flag("-x").flag("c++");
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
        build.file(s);
    }
    build.compile("kpl_ops_host");
    println!("cargo:rustc-link-lib=stdc++");
    println!("cargo:rustc-link-lib=pthread");
}
