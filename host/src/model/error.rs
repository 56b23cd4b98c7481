//! Errors of model loading and running. Each names what was wrong: the config key, or the
//! tensor with the expected and the found value.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config key `{key}`: {msg}")]
    Config { key: String, msg: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("{path}: bad safetensors header: {msg}")]
    Header { path: String, msg: String },
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}`: expected dtype {expected}, found {found}")]
    Dtype { name: String, expected: String, found: String },
    #[error("tensor `{name}` in {path}: needs bytes up to {need} but the file has {have} (truncated file?)")]
    Truncated { name: String, path: String, need: u64, have: u64 },
    #[error("token id {id} is out of range for vocab size {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("sequence of {len} tokens exceeds max_position_embeddings {max}")]
    TooLong { len: usize, max: usize },
    #[error("a forward trace records one sequence, but the batch has {sequences}")]
    TraceNeedsOneSequence { sequences: usize },
    #[error("layer {layer}: the sequence state was built for another model")]
    StateMismatch { layer: usize },
    #[error("all {capacity} state slots of an arena (KDA slots or latent pages) are in use")]
    StateSlotsFull { capacity: usize },
    #[error("parallelism: {msg}")]
    Parallel { msg: String },
    #[error(
        "speculative verify: cannot keep {kept} of {verified} verified tokens (the sequence holds {held}, or the step did not verify them)"
    )]
    Verify { verified: usize, kept: usize, held: usize },
    #[error("speculative verify: {snapshots} snapshot slots were set aside for a step of {tokens} tokens")]
    VerifyShape { snapshots: usize, tokens: usize },
    #[error("cannot set aside {bytes} bytes of sequence-state memory (lower state_memory)")]
    StateAlloc { bytes: usize },
}

impl ModelError {
    pub fn config(key: &str, msg: impl Into<String>) -> Self {
        ModelError::Config { key: key.to_string(), msg: msg.into() }
    }
}
