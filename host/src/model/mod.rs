//! The Kimi-K3 / K3.1 text model on the CPU: config, checkpoint, weights and the forward pass.

pub mod attn_res;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod dspark;
pub mod error;
pub mod forward;
pub mod indexer;
pub mod kda;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod plan;
pub mod profile;
pub mod scratch;
pub mod shard;
pub mod slots;
pub mod state;
pub mod tiny;
pub mod trace;
pub mod vision;
pub mod weights;

pub use batch::{BatchLayout, SeqInput, Span};
pub use config::{ModelConfig, TextConfig};
pub use error::ModelError;
pub use forward::{LogitsFor, Model, Parallelism, WeightFormat};
pub use scratch::{Buf, Scratch};
pub use slots::SlotArena;
pub use state::{SequenceState, StateArenas};
pub use trace::Trace;
