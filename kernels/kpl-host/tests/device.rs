//! The device layer the GPU backends share (`kimi_kernels::gpu::device`, `GpuBackend`), over the
//! host build: launches refuse what would make a kernel read garbage, staging frees what it
//! allocates, and a resident weight follows its host memory.

use std::sync::Arc;

use kimi_kernels::gpu::abi::{GluParams, RmsnormParams};
use kimi_kernels::gpu::backend::GpuBackend;
use kimi_kernels::gpu::device::{GpuBuffer, GpuError, KernelArg, launch_kpl, launch_triton};
use kimi_kernels::{Backend, CpuBackend};
use kimi_kpl_host::HostDevice;

#[test]
fn a_kpl_launch_with_a_struct_of_another_size_is_refused() {
    let dev = HostDevice::new(32);
    let x = GpuBuffer::<f32>::upload(&dev, &[1.0, 2.0]).expect("upload");
    // A GluParams is 24 bytes; kpl_rmsnorm_f32 takes 40.
    let p = GluParams { gate: x.addr(), up: x.addr(), n: 2, pad_: 0 };
    // SAFETY: refused before anything runs.
    let err = unsafe { launch_kpl(&dev, "kpl_rmsnorm_f32", 1, 32, &p) }.expect_err("refused");
    assert!(matches!(err, GpuError::Launch { .. }), "{err}");
    assert!(err.to_string().contains("takes 40 bytes of parameters, the caller passed 24"), "{err}");
    // SAFETY: as above.
    let err = unsafe { launch_kpl(&dev, "kpl_no_such_kernel", 1, 32, &p) }.expect_err("refused");
    assert!(matches!(err, GpuError::Missing { .. }), "{err}");
}

#[test]
fn a_triton_launch_needs_the_kernel_and_its_argument_count() {
    let dev = HostDevice::new(64);
    // SAFETY: refused before anything runs (the host build has no Triton kernels).
    let err = unsafe { launch_triton(&dev, "triton_matmul_bf16", (1, 1, 1), &[KernelArg::I32(1)]) }.expect_err("no");
    assert!(matches!(err, GpuError::Missing { .. }), "{err}");
}

#[test]
fn a_kpl_launch_runs_through_device_buffers() {
    for wave in [32, 64] {
        let dev = HostDevice::new(wave);
        let (rows, cols) = (3usize, 70usize);
        let x: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32 / cols as f32).collect();
        let mut want = vec![0f32; rows * cols];
        CpuBackend.rms_norm(&x, &w, 1e-6, &mut want);
        let (dx, dw, dout) = (
            GpuBuffer::upload(&dev, &x).expect("x"),
            GpuBuffer::upload(&dev, &w).expect("w"),
            GpuBuffer::<f32>::zeros(&dev, rows * cols).expect("out"),
        );
        let p = RmsnormParams {
            x: dx.addr(),
            w: dw.addr(),
            out: dout.addr(),
            rows: rows as u32,
            cols: cols as u32,
            eps: 1e-6,
            pad_: 0,
        };
        // SAFETY: the buffers hold the sizes in p and outlive the launch.
        unsafe { launch_kpl(&dev, "kpl_rmsnorm_f32", rows as u32, wave, &p) }.expect("launch");
        let got = dout.download().expect("download");
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "wave {wave}: |Δ| {worst}");
        drop((dx, dw, dout));
        assert_eq!(dev.allocated(), 0, "every buffer freed");
    }
}

#[test]
fn the_backend_frees_its_staging_and_keeps_weights_resident_while_they_are_unchanged() {
    let dev = Arc::new(HostDevice::new(32));
    let be = GpuBackend::new(dev.clone());
    let cols = 96usize;
    let x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut w: Vec<f32> = (0..cols).map(|i| 1.0 + i as f32 * 0.01).collect();
    let (mut got, mut want) = (vec![0f32; 2 * cols], vec![0f32; 2 * cols]);
    be.rms_norm(&x, &w, 1e-6, &mut got);
    CpuBackend.rms_norm(&x, &w, 1e-6, &mut want);
    assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-5));
    // Only the norm's weight stays on the "device" (rounded up to whole words).
    assert_eq!(dev.allocated(), (cols * 4).div_ceil(8) * 8, "staging freed, the weight resident");
    // The same host memory now holds another weight: the backend must not use the stale copy.
    for v in w.iter_mut() {
        *v = -*v * 3.0;
    }
    be.rms_norm(&x, &w, 1e-6, &mut got);
    CpuBackend.rms_norm(&x, &w, 1e-6, &mut want);
    assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-5), "the changed weight was used");
    assert_eq!(dev.allocated(), (cols * 4).div_ceil(8) * 8, "the stale copy was freed");
    drop(be);
    assert_eq!(dev.allocated(), 0, "the backend frees its resident weights");
}
