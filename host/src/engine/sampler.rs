//! What the engine needs from a sampler, in the engine's own terms: per-sequence state inside
//! the sampler, opened with the prompt, one batched `sample` call per step, each chosen token fed
//! back. The tenants' WebAssembly samplers implement it (`plugins::TenantSampler`); the engine
//! never sees a plugin or WIT type.

use std::sync::{Arc, Mutex};

/// Who a sequence belongs to, as its sampler is told.
#[derive(Clone, Debug, Default)]
pub struct SamplerRequest {
    pub tenant: String,
    pub request_id: String,
    pub model: String,
    /// The request's parameters as JSON (for samplers that read more than their own params).
    pub params_json: String,
}

/// How a sampler failure should reach the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplerErrorKind {
    /// The request asked for something the sampler refuses (bad parameters): 400.
    Request,
    /// The request's input exceeded a trusted sampler's limits: 400 `request_too_large`.
    TooLarge,
    /// The sampler is disabled for this tenant after repeated failures: 503.
    Disabled,
    /// The sampler failed (trap, timeout, bad result): 500.
    Internal,
}

#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct SamplerError {
    pub kind: SamplerErrorKind,
    pub message: String,
}

impl SamplerError {
    pub fn internal(message: impl Into<String>) -> SamplerError {
        SamplerError { kind: SamplerErrorKind::Internal, message: message.into() }
    }
}

/// One sequence's state inside a sampler (meaningful only to the sampler that opened it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SamplerSeq(pub u64);

pub trait Sampler: Send {
    /// For messages.
    fn name(&self) -> &str;
    /// Opens a sequence that has seen `prompt`, seeded with `seed`.
    fn open(
        &mut self,
        req: &SamplerRequest,
        params_json: &str,
        seed: u64,
        prompt: &[u32],
    ) -> Result<SamplerSeq, SamplerError>;
    /// A token (or that row's failure) for each (sequence, logits row) of this step.
    fn sample(&mut self, rows: &[(SamplerSeq, &[f32])]) -> Vec<Result<u32, SamplerError>>;
    /// Whether [`Sampler::distributions`] can answer, so speculative decoding may draw drafts
    /// from the sampler's own distribution (otherwise drafts are greedy and matched).
    fn describes_distributions(&self) -> bool {
        false
    }
    /// What `sample` would draw each row's token from, as whole-vocabulary probabilities
    /// (masked tokens 0), without changing `seq` or drawing from its randomness. `rows[i]` is
    /// (how many of `drafts` come before that row, the row's logits): the row scores the token
    /// after `seq`'s accepted tokens and those drafts. `Ok(None)`: not for these rows (the
    /// engine falls back to `sample`).
    fn distributions(
        &mut self,
        _seq: SamplerSeq,
        _drafts: &[u32],
        _rows: &[(usize, &[f32])],
    ) -> Result<Option<Vec<Vec<f32>>>, SamplerError> {
        Ok(None)
    }
    /// The token the engine kept for `seq`.
    fn accept(&mut self, seq: SamplerSeq, token: u32);
    /// Frees `seq` (finished, cancelled or failed).
    fn close(&mut self, seq: SamplerSeq);
}

/// A sampler shared by the requests that use it (one per tenant and plugin).
pub type SharedSampler = Arc<Mutex<dyn Sampler>>;
