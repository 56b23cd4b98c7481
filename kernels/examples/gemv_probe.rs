// Temporary probe: GEMV GB/s on packed BF16 / MXFP4 weights streaming from DRAM.
use kimi_kernels::{Backend, Bf16Matrix, CpuBackend, Matrix, Mxfp4Matrix};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::var("T").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    for &(rows, cols, n) in &[(2048usize, 2048usize, 24usize), (9728, 2048, 6), (512, 1024, 400), (32768, 2048, 2)] {
        // BF16
        let ws: Vec<_> = (0..n)
            .map(|k| {
                let w: Vec<u16> = (0..rows * cols).map(|i| 0x3c00 + ((i + k) * 7919 % 1024) as u16).collect();
                CpuBackend.prepare_matrix(&Matrix::Bf16(Bf16Matrix::new(&w, rows, cols))).unwrap()
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
        let mut out = vec![0f32; rows];
        let bytes = rows * cols * 2 * n;
        let mut best = 0f64;
        for _ in 0..5 {
            let t = Instant::now();
            rayon::scope(|_| {
                for w in &ws {
                    CpuBackend.matmul(&Matrix::Packed(w), &x, 1, &mut out);
                }
            });
            best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        println!("bf16  {rows}x{cols} x{n}: {best:.1} GB/s ({:.0} MB)", bytes as f64 / 1e6);
        drop(ws);
        // MXFP4
        let ws: Vec<_> = (0..n)
            .map(|k| {
                let p: Vec<u8> = (0..rows * cols / 2).map(|i| ((i + k) * 131 % 251) as u8).collect();
                let s: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 8) as u8).collect();
                CpuBackend.prepare_matrix(&Matrix::Mxfp4(Mxfp4Matrix::new(&p, &s, rows, cols))).unwrap()
            })
            .collect();
        let bytes = (rows * cols / 2 + rows * cols / 32) * n;
        let mut best = 0f64;
        for _ in 0..5 {
            let t = Instant::now();
            rayon::scope(|_| {
                for w in &ws {
                    CpuBackend.matmul(&Matrix::Packed(w), &x, 1, &mut out);
                }
            });
            best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        println!("mxfp4 {rows}x{cols} x{n}: {best:.1} GB/s ({:.0} MB)", bytes as f64 / 1e6);
    }
    let words = vec![1u64; 1 << 26];
    let mut best = 0f64;
    use rayon::prelude::*;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = words.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        std::hint::black_box(s);
        best = best.max((8usize << 26) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    println!("read bandwidth {best:.1} GB/s");
}
