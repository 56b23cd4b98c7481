//! The state pool: per-sequence model state (a KDA slot — recurrent matrices and conv windows for
//! every KDA layer — plus MLA latent / indexer-key pages) is reserved up front from a budget fixed
//! at start-up. A sequence reserves its slot and the pages for `prompt + max_tokens` on admission,
//! so it can never grow past what was granted; a request that does not fit waits, then gets 429.

use crate::model::TextConfig;
use crate::model::plan::{CacheDtype, cache_bytes_per_token, kda_state_bytes};

pub use crate::model::state::PAGE_TOKENS;

/// Bytes of state a sequence needs, from the model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateShape {
    /// One KDA slot: recurrent `[H, V, K]` f32 plus conv windows, summed over KDA layers.
    pub slot_bytes: usize,
    /// One page: `PAGE_TOKENS` latent rows and indexer keys, summed over MLA layers.
    pub page_bytes: usize,
}

impl StateShape {
    /// The same arithmetic as `kimi-host plan` (its per-sequence KDA state and per-token cache
    /// bytes, for this engine's f32 pages), so the pool, the arenas and the planner cannot drift
    /// apart: `c` is a rank's config (`Model::rank_config`), `ranks` the tensor-parallel ranks
    /// (each holds its heads' KDA state) and `cache_replicas` the copies of each latent page they
    /// hold between them (`Model::cache_replicas`: one per rank, or one per context-parallel group).
    pub fn of(c: &TextConfig, ranks: usize, cache_replicas: usize) -> StateShape {
        let (latent, index) = cache_bytes_per_token(c, CacheDtype::F32);
        StateShape {
            slot_bytes: ranks * kda_state_bytes(c) as usize,
            page_bytes: cache_replicas * PAGE_TOKENS * (latent + index) as usize,
        }
    }

    pub fn pages_for(tokens: usize) -> usize {
        tokens.div_ceil(PAGE_TOKENS)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum PoolError {
    #[error("state memory budget {budget} B cannot hold one sequence of {tokens} tokens ({need} B)")]
    TooSmall { budget: usize, tokens: usize, need: usize },
}

/// What one sequence holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reservation {
    pub slots: usize,
    pub pages: usize,
}

/// Slot and page accounting for the whole engine (owned by the engine thread). Slots and pages
/// share one byte budget; slots are also capped by `max_seqs`.
#[derive(Debug)]
pub struct StatePool {
    pub shape: StateShape,
    pub budget_bytes: usize,
    pub total_slots: usize,
    /// Pages the budget would hold with no slots taken (an upper bound, for metrics).
    pub total_pages: usize,
    /// Speculative tokens a sequence verifies per step (0: no speculation).
    spec_tokens: usize,
    used_slots: usize,
    used_pages: usize,
}

impl StatePool {
    /// Fails when the budget cannot hold one sequence of `min_tokens`.
    pub fn new(
        shape: StateShape,
        budget_bytes: usize,
        max_seqs: usize,
        min_tokens: usize,
    ) -> Result<StatePool, PoolError> {
        StatePool::speculative(shape, budget_bytes, max_seqs, min_tokens, 0)
    }

    /// A pool for sequences that verify `spec_tokens` drafts a step: each also holds one KDA
    /// snapshot slot per verified token (`spec_tokens + 1`) and pages for `spec_tokens` rows past
    /// its end (a verify writes them before the rejected ones are dropped).
    pub fn speculative(
        shape: StateShape,
        budget_bytes: usize,
        max_seqs: usize,
        min_tokens: usize,
        spec_tokens: usize,
    ) -> Result<StatePool, PoolError> {
        let per_seq = StatePool::slots_per_seq(spec_tokens);
        let need_one = per_seq * shape.slot_bytes + StateShape::pages_for(min_tokens + spec_tokens) * shape.page_bytes;
        if budget_bytes < need_one {
            return Err(PoolError::TooSmall { budget: budget_bytes, tokens: min_tokens, need: need_one });
        }
        let total_slots = max_seqs.saturating_mul(per_seq).min(budget_bytes / shape.slot_bytes.max(1)).max(per_seq);
        let total_pages = budget_bytes / shape.page_bytes.max(1);
        Ok(StatePool { shape, budget_bytes, total_slots, total_pages, spec_tokens, used_slots: 0, used_pages: 0 })
    }

    /// KDA slots one sequence holds: its own, plus a snapshot per verified token when speculating.
    fn slots_per_seq(spec_tokens: usize) -> usize {
        if spec_tokens == 0 { 1 } else { spec_tokens + 2 }
    }

    /// The reservation for `n` sequences sharing a `prompt`-token prefill and generating up to
    /// `max_tokens` each: the prompt's full pages once (the forks share them), and per sequence
    /// the pages from the prompt's partly filled last page (which each fork copies) to its end —
    /// plus, when speculating, the snapshot slots and the pages of the verify's overshoot.
    pub fn reservation(&self, n: usize, prompt: usize, max_tokens: usize) -> Reservation {
        let shared = prompt / PAGE_TOKENS;
        let end = prompt.saturating_add(max_tokens).saturating_add(self.spec_tokens);
        let own = StateShape::pages_for(end).saturating_sub(shared);
        Reservation {
            slots: n.saturating_mul(StatePool::slots_per_seq(self.spec_tokens)),
            pages: shared.saturating_add(n.saturating_mul(own)),
        }
    }

    /// Bytes a reservation stands for.
    pub fn bytes_of(&self, r: Reservation) -> usize {
        self.bytes(r)
    }

    fn bytes(&self, r: Reservation) -> usize {
        r.slots.saturating_mul(self.shape.slot_bytes).saturating_add(r.pages.saturating_mul(self.shape.page_bytes))
    }

    /// Whether `r` could ever fit (in an empty pool).
    pub fn could_fit(&self, r: Reservation) -> bool {
        r.slots <= self.total_slots && self.bytes(r) <= self.budget_bytes
    }

    pub fn try_reserve(&mut self, r: Reservation) -> bool {
        let bytes = self.used_bytes().saturating_add(self.bytes(r));
        if self.used_slots + r.slots <= self.total_slots && bytes <= self.budget_bytes {
            self.used_slots += r.slots;
            self.used_pages += r.pages;
            true
        } else {
            false
        }
    }

    pub fn release(&mut self, r: Reservation) {
        self.used_slots = self.used_slots.saturating_sub(r.slots);
        self.used_pages = self.used_pages.saturating_sub(r.pages);
    }

    pub fn used(&self) -> Reservation {
        Reservation { slots: self.used_slots, pages: self.used_pages }
    }

    pub fn used_bytes(&self) -> usize {
        self.used_slots * self.shape.slot_bytes + self.used_pages * self.shape.page_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_counts_what_the_arenas_hold() {
        use crate::model::state::{kda_slot_floats, latent_page_floats};
        let c = crate::model::config::parse_config(
            &crate::model::tiny::tiny_config(&crate::model::tiny::TinyOptions {
                seed: 0,
                k31: true,
                mxfp4: true,
                vision: false,
            })
            .to_string(),
        )
        .expect("tiny config")
        .text;
        let mla = c.num_mla_layers();
        let shape = StateShape::of(&c, 2, 2);
        assert_eq!(shape.slot_bytes, 2 * 4 * kda_slot_floats(&c));
        assert_eq!(shape.page_bytes, 2 * 4 * mla * latent_page_floats(&c));
    }

    #[test]
    fn reserves_within_the_budget_and_refuses_past_it() {
        let shape = StateShape { slot_bytes: 1000, page_bytes: 100 };
        let mut p = StatePool::new(shape, 10_000, 4, 16).expect("fits");
        assert_eq!(p.total_slots, 4);
        let r = p.reservation(1, 30, 3);
        assert_eq!(r, Reservation { slots: 1, pages: 3 });
        // Four forks of a 40-token prompt: its two full pages once, then each its own 3rd and 4th.
        assert_eq!(p.reservation(4, 40, 20), Reservation { slots: 4, pages: 2 + 4 * 2 });
        for _ in 0..4 {
            assert!(p.try_reserve(r));
        }
        assert!(!p.try_reserve(r), "slots exhausted");
        p.release(r);
        assert!(p.try_reserve(r));
        assert_eq!(p.used_bytes(), 4 * 1300);
        // Bytes run out before slots: 3 × (1000 + 10 pages × 100) > 10,000 − 0.
        let mut q = StatePool::new(shape, 5_000, 8, 16).expect("fits");
        let big = q.reservation(1, 10 * PAGE_TOKENS, 0);
        assert!(q.try_reserve(big) && q.try_reserve(big));
        assert!(!q.try_reserve(big), "budget exhausted");
        assert!(!q.could_fit(q.reservation(1, 40 * PAGE_TOKENS, 1)));
        assert!(StatePool::new(shape, 500, 4, 16).is_err());
    }

    #[test]
    fn speculating_sequences_reserve_their_snapshots_and_overshoot() {
        let shape = StateShape { slot_bytes: 1000, page_bytes: 100 };
        let p = StatePool::speculative(shape, 100_000, 4, 16, 3).expect("fits");
        // A slot and 3 + 1 snapshots per sequence; pages up to prompt + max_tokens + 3.
        assert_eq!(p.reservation(1, 30, 3), Reservation { slots: 5, pages: 3 });
        assert_eq!(p.reservation(2, 32, 0), Reservation { slots: 10, pages: 2 + 2 });
        assert_eq!(p.total_slots, 4 * 5, "max_seqs counts sequences, not their snapshots");
    }
}
