#![recursion_limit = "256"]

//! kimi-host: an inference host for the Kimi-K3 model family.
//!
//! Today: the text model on the CPU (`model`). The tokenizer, plugin runtime, engine and server
//! follow (see the repository README).

pub mod bench;
pub mod bench_plugins;
pub mod bench_serve;
pub mod bench_soak;
pub mod bench_tokenizer;
pub mod engine;
pub mod grammar;
pub mod inspect;
pub mod model;
pub mod plugins;
pub mod server;
pub mod tokenizer;
