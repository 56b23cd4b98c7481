#![recursion_limit = "256"]

//! kimi-host: an inference host for the Kimi-K3 model family.
//!
//! One request, top to bottom: `server` (OpenAI HTTP API, tenants, limits) → `engine`
//! (continuous batching over a state pool) → `model` (the K3 / K3.1 forward on the CPU kernels of
//! `kimi-kernels`) → `plugins` (tenants' sandboxed samplers, grammars, templates and policies),
//! with `tokenizer` and `grammar` (native constraint masks) beside them. The command line, its
//! benches and `inspect` live in the `kimi-host-cli` package (`host/cli`).

pub mod engine;
pub mod grammar;
pub mod model;
pub mod plugins;
pub mod server;
pub mod tokenizer;
pub mod util;
