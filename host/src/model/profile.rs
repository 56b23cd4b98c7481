//! Wall time per kind of op over forward steps (`bench forward --json` reports the shares, so a
//! regression in one kind of op is visible). Each top-level op of a step runs alone (its work is
//! threaded inside), so wall time per section adds up to the step.

use std::time::{Duration, Instant};

/// The kinds of op a step is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Embedding,
    AttnRes,
    Norm,
    Kda,
    Mla,
    DenseMlp,
    Moe,
    LmHead,
    /// Residual adds, state bookkeeping, gathering rows.
    Other,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::AttnRes => "attn_res",
            OpKind::Norm => "norm",
            OpKind::Kda => "kda",
            OpKind::Mla => "mla",
            OpKind::DenseMlp => "dense_mlp",
            OpKind::Moe => "moe",
            OpKind::LmHead => "lm_head",
            OpKind::Other => "other",
        }
    }
}

pub const OP_KINDS: [OpKind; 9] = [
    OpKind::Embedding,
    OpKind::AttnRes,
    OpKind::Norm,
    OpKind::Kda,
    OpKind::Mla,
    OpKind::DenseMlp,
    OpKind::Moe,
    OpKind::LmHead,
    OpKind::Other,
];

/// Accumulated wall time per [`OpKind`].
#[derive(Clone, Debug, Default)]
pub struct OpTimes {
    times: [Duration; OP_KINDS.len()],
}

impl OpTimes {
    pub fn add(&mut self, kind: OpKind, d: Duration) {
        self.times[kind as usize] += d;
    }

    pub fn get(&self, kind: OpKind) -> Duration {
        self.times[kind as usize]
    }

    pub fn total(&self) -> Duration {
        self.times.iter().sum()
    }

    /// Each kind's fraction of the total, in [`OP_KINDS`] order.
    pub fn shares(&self) -> Vec<(OpKind, f64)> {
        let total = self.total().as_secs_f64().max(1e-12);
        OP_KINDS.iter().map(|&k| (k, self.get(k).as_secs_f64() / total)).collect()
    }
}

/// Times sections of one step when a profile is wanted; free otherwise.
pub(crate) struct Laps<'a> {
    times: Option<&'a mut OpTimes>,
    last: Option<Instant>,
}

impl<'a> Laps<'a> {
    pub(crate) fn new(times: Option<&'a mut OpTimes>) -> Laps<'a> {
        let last = times.as_ref().map(|_| Instant::now());
        Laps { times, last }
    }

    /// Books the time since the previous lap to `kind`.
    pub(crate) fn lap(&mut self, kind: OpKind) {
        if let (Some(t), Some(last)) = (self.times.as_deref_mut(), self.last.as_mut()) {
            let now = Instant::now();
            t.add(kind, now - *last);
            *last = now;
        }
    }
}
