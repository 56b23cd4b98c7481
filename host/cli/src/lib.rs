//! What only the `kimi-host` command line needs: the benches (each prints ratios against a
//! baseline measured in the same run) and `inspect`. Kept out of the `kimi-host` library so the
//! server does not link the native baselines (`kimi-sampling-core`, `kimi-xtml`).

pub mod alloc_count;
pub mod bench;
pub mod bench_plugins;
pub mod bench_serve;
pub mod bench_soak;
pub mod bench_tokenizer;
pub mod bench_vision;
pub mod device_check;
pub mod inspect;
pub mod plan;
pub mod speculate;
pub mod vision;
