//! The integration tests, as one binary: a module per area (one link of wasmtime, llguidance and
//! axum instead of one per file). `cargo test -p kimi-host-cli --test suite <filter>` runs a part, e.g.
//! `hardening::` or `fuzz::`.

mod common;

mod batch;
mod chat_parser;
mod cli;
mod constrained;
mod dspark;
mod engine;
mod examples;
mod fp8;
mod fuzz;
mod golden_chat;
mod golden_model;
mod golden_mxfp4;
mod golden_tokenizer;
mod grammar;
mod grammar_direct;
mod hardening;
mod loading;
mod parallel;
mod plan;
mod plugins;
mod policies;
mod prefix_cache;
mod sampling_core;
mod serve;
mod template_plugin;
mod tokenizer_stream;
mod vision;
