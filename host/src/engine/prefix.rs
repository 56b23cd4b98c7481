//! Prefix caching that is safe for KDA (spec: issue "prefix caching"; ATOM turns it off for K3).
//!
//! A KDA layer's recurrent state cannot be cut at an arbitrary token, so the cache keeps whole
//! sequence states at block boundaries: when a caching request's prefill stops at a multiple of
//! [`BLOCK_TOKENS`] (the engine aligns its chunks to them), the state there is forked into the
//! cache — a copy of the KDA slot and every latent page shared by reference count (full pages,
//! never written again). A later request whose prompt starts with the same blocks forks the
//! deepest cached state and prefills only the rest. Cached states are never updated in place.
//!
//! Keys chain a SHA-256 over the partition salt and each block's token ids, so a prefix is
//! found only under the salt it was stored with: tenants never hit each other's prefixes unless
//! both opted into one shared partition, and a request's own `cache_salt` narrows it further.
//! Each cached state holds a pool reservation (its slot and the pages its last blocks added);
//! under pressure the least recently used are evicted before any request is refused.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::pool::{PAGE_TOKENS, Reservation, StatePool};
use crate::model::SequenceState;
use crate::model::dspark::DraftCache;

/// Tokens per cache block: four latent pages. The block only sets the hashing grain and where
/// prefill chunks may stop; KDA snapshots are taken at chunk ends that fall on a block.
pub const BLOCK_TOKENS: usize = 4 * PAGE_TOKENS;

type Key = [u8; 32];

struct Node {
    state: SequenceState,
    /// The draft's context rows for the same tokens (with speculative decoding).
    draft: Option<DraftCache>,
    reservation: Reservation,
    last_used: u64,
}

/// What a lookup found: a fork of the cached state and the prompt tokens it already holds.
pub struct Hit {
    pub state: SequenceState,
    /// The draft's context rows for those tokens (pages shared), when one was stored.
    pub draft: Option<DraftCache>,
    pub tokens: usize,
}

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub hits: u64,
    pub hit_tokens: u64,
    pub inserted: u64,
    pub evictions: u64,
    pub entries: usize,
    /// Reserved bytes of the cached states (KDA snapshots and the pages they added).
    pub bytes: usize,
}

#[derive(Default)]
pub struct PrefixCache {
    nodes: HashMap<Key, Node>,
    /// Block keys of prompts seen, with or without a stored state: where a new prompt leaves a
    /// seen path is where the next state is worth storing (the split point of SGLang's radix
    /// tree), e.g. the end of a system prompt that many conversations share.
    seen: std::collections::HashSet<Key>,
    tick: u64,
    stats: PrefixStats,
}

/// Most block keys remembered in `seen` (32 bytes each); past it the set starts over.
const MAX_SEEN: usize = 1 << 20;

/// The keys of `tokens`' full blocks under `salt`: `keys[i]` covers blocks `0..=i`.
fn block_keys(salt: &str, tokens: &[u32]) -> Vec<Key> {
    let mut prev: Key = Sha256::digest(salt.as_bytes()).into();
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(prev);
            for t in block {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            prev
        })
        .collect()
}

impl PrefixCache {
    pub fn stats(&self) -> PrefixStats {
        PrefixStats { entries: self.nodes.len(), ..self.stats }
    }

    /// The deepest cached state for a prompt under `salt`, forked (a KDA slot from the arena;
    /// pages shared). At least one prompt token is always left to prefill, so the request still
    /// gets its first logits from a forward. `None` on a miss, or when no slot is free.
    pub fn lookup(&mut self, salt: &str, prompt: &[u32]) -> Option<Hit> {
        let usable = prompt.len().saturating_sub(1);
        let keys = block_keys(salt, &prompt[..usable]);
        let (i, key) = keys.iter().enumerate().rev().find(|(_, k)| self.nodes.contains_key(*k))?;
        self.tick += 1;
        let node = self.nodes.get_mut(key)?;
        node.last_used = self.tick;
        let state = node.state.fork().ok()?;
        let draft = node.draft.clone();
        let tokens = (i + 1) * BLOCK_TOKENS;
        self.stats.hits += 1;
        self.stats.hit_tokens += tokens as u64;
        Some(Hit { state, draft, tokens })
    }

    /// Where a caching request's prefill should stop once to store a state: the deepest block
    /// boundary of its prompt (short of the final token, past `cached`) that an earlier prompt
    /// under `salt` also reached but where no state is stored — the point where the two part.
    /// Records the prompt's blocks as seen.
    pub fn split_point(&mut self, salt: &str, prompt: &[u32], cached: usize) -> Option<usize> {
        let usable = prompt.len().saturating_sub(1);
        let keys = block_keys(salt, &prompt[..usable]);
        let split = keys
            .iter()
            .enumerate()
            .take_while(|(_, k)| self.seen.contains(*k))
            .map(|(i, _)| (i + 1) * BLOCK_TOKENS)
            .last()
            .filter(|&b| b > cached && !self.nodes.contains_key(&keys[b / BLOCK_TOKENS - 1]));
        if self.seen.len() + keys.len() > MAX_SEEN {
            self.seen.clear();
        }
        self.seen.extend(keys);
        split
    }

    /// Caches `state`, which holds the first `state.len` tokens of `prompt` (a block boundary),
    /// under `salt`, reserving its slot and new pages in `pool` (evicting older entries if that
    /// is what it takes). With speculative decoding, `draft` holds the draft's context rows for the
    /// same tokens (shared by reference count; the pool's page size counts draft rows). Does
    /// nothing if the prefix is cached already or does not fit.
    pub fn insert(
        &mut self,
        pool: &mut StatePool,
        salt: &str,
        prompt: &[u32],
        state: &SequenceState,
        draft: Option<&DraftCache>,
    ) {
        let len = state.len;
        if len == 0 || !len.is_multiple_of(BLOCK_TOKENS) || len > prompt.len() {
            return;
        }
        if draft.is_some_and(|d| d.len() != len) {
            return;
        }
        let keys = block_keys(salt, &prompt[..len]);
        let Some(&key) = keys.last() else { return };
        self.tick += 1;
        if let Some(n) = self.nodes.get_mut(&key) {
            n.last_used = self.tick;
            return;
        }
        // Pages this entry adds beyond the deepest cached ancestor (those it shares are counted
        // there); its own slot.
        let parent = keys[..keys.len() - 1].iter().rposition(|k| self.nodes.contains_key(k)).map_or(0, |i| i + 1);
        let pages = (len - parent * BLOCK_TOKENS) / PAGE_TOKENS;
        let reservation = Reservation { slots: 1, pages };
        while !pool.try_reserve(reservation) {
            if !self.evict_one(pool) {
                return;
            }
        }
        match state.fork() {
            Ok(copy) => {
                let draft = draft.cloned();
                self.nodes.insert(key, Node { state: copy, draft, reservation, last_used: self.tick });
                self.stats.inserted += 1;
                self.stats.bytes += pool.bytes_of(reservation);
            }
            Err(_) => pool.release(reservation),
        }
    }

    /// Drops the least recently used entry and gives its reservation back; false when empty.
    pub fn evict_one(&mut self, pool: &mut StatePool) -> bool {
        let Some(key) = self.nodes.iter().min_by_key(|(_, n)| n.last_used).map(|(k, _)| *k) else {
            return false;
        };
        if let Some(n) = self.nodes.remove(&key) {
            pool.release(n.reservation);
            self.stats.bytes = self.stats.bytes.saturating_sub(pool.bytes_of(n.reservation));
            self.stats.evictions += 1;
        }
        true
    }

    /// Drops every entry.
    pub fn clear(&mut self, pool: &mut StatePool) {
        while self.evict_one(pool) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_blocks_under_their_salt() {
        let a: Vec<u32> = (0..3 * BLOCK_TOKENS as u32).collect();
        let mut b = a.clone();
        b[2 * BLOCK_TOKENS + 5] = 9999;
        let (ka, kb) = (block_keys("t", &a), block_keys("t", &b));
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[..2], kb[..2], "a shared prefix has the same keys");
        assert_ne!(ka[2], kb[2]);
        assert!(block_keys("u", &a).iter().zip(&ka).all(|(x, y)| x != y), "another salt shares nothing");
        assert_eq!(block_keys("t", &a[..BLOCK_TOKENS - 1]).len(), 0, "only full blocks");
    }

    #[test]
    fn the_split_point_is_where_a_prompt_leaves_a_seen_path() {
        let mut pc = PrefixCache::default();
        let shared: Vec<u32> = (0..2 * BLOCK_TOKENS as u32 + 10).collect();
        let with = |tail: u32| -> Vec<u32> {
            shared.iter().copied().chain((0..100).map(|i| 5000 + tail * 1000 + i)).collect()
        };
        assert_eq!(pc.split_point("t", &with(1), 0), None, "nothing seen yet");
        assert_eq!(pc.split_point("t", &with(2), 0), Some(2 * BLOCK_TOKENS), "the two share two blocks");
        assert_eq!(pc.split_point("u", &with(3), 0), None, "another partition saw nothing");
        assert_eq!(pc.split_point("t", &with(4), 2 * BLOCK_TOKENS), None, "already resumed there");
    }
}
