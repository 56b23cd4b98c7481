//! Per-sequence inference state: what a request carries between forward calls.
//!
//! KDA layers keep a fixed-size recurrent state and a short-convolution window, all of a
//! sequence's in one slot of a preallocated arena (`slots`); MLA layers keep one latent row per
//! token (and, for K3.1, one indexer key per token) in fixed-size pages. Nothing else persists:
//! the AttnRes blocks are rebuilt in every call.

use std::sync::Arc;

use kimi_kernels::PagedRows;

use super::config::{MixerKind, TextConfig};
use super::error::ModelError;
use super::slots::{Slot, SlotArena};

/// Where one KDA layer's state lies in its sequence's slot: the recurrent matrices `[H, K, V]`
/// (key-major, the math layout; fla stores the transpose), then the last `W − 1`
/// pre-convolution inputs of q, k and v, `[3][W − 1][P]`, oldest frame first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaLayout {
    offset: usize,
    recurrent: usize,
    pub frames: usize,
    pub channels: usize,
}

impl KdaLayout {
    fn conv(&self) -> usize {
        3 * self.frames * self.channels
    }

    fn floats(&self) -> usize {
        self.recurrent + self.conv()
    }
}

/// One KDA layer's state, read through its slot.
#[derive(Debug)]
pub struct KdaState<'a> {
    pub recurrent: &'a [f32],
    conv: &'a [f32],
    pub frames: usize,
    pub channels: usize,
}

impl KdaState<'_> {
    /// Frames of one branch (0 = q, 1 = k, 2 = v), `[W − 1][P]`.
    pub fn conv_frames(&self, branch: usize) -> &[f32] {
        let n = self.frames * self.channels;
        &self.conv[branch * n..(branch + 1) * n]
    }
}

/// One KDA layer's state, written through its slot.
#[derive(Debug)]
pub struct KdaStateMut<'a> {
    pub recurrent: &'a mut [f32],
    conv: &'a mut [f32],
    pub frames: usize,
    pub channels: usize,
}

impl KdaStateMut<'_> {
    pub fn conv_frames_mut(&mut self, branch: usize) -> &mut [f32] {
        let n = self.frames * self.channels;
        &mut self.conv[branch * n..(branch + 1) * n]
    }
}

/// Tokens per latent-cache page.
pub const PAGE_TOKENS: usize = 16;

/// Values of one latent page: `PAGE_TOKENS` latent rows, then `PAGE_TOKENS` indexer keys.
pub fn latent_page_floats(c: &TextConfig) -> usize {
    PAGE_TOKENS * (c.latent_width() + c.indexer.as_ref().map_or(0, |i| i.head_dim))
}

/// Latent rows of one MLA layer: `[c (kv_lora_rank, normed) | k_pe (raw)]` per token, plus the
/// K3.1 indexer key per token, in fixed-size pages leased from a page arena and addressed through
/// a page table. A fork (a clone) shares every page by reference count; the first write to a
/// shared page — only the partly filled last one is ever written again — copies it into a new
/// page, so sequences that share a prompt never see each other's later tokens.
#[derive(Clone, Debug)]
pub struct LatentCache {
    pages: Vec<Arc<Slot>>,
    arena: Arc<SlotArena>,
    len: usize,
    pub width: usize,
    pub index_dim: usize,
}

impl LatentCache {
    /// An empty cache whose pages come from `arena` (pages of [`latent_page_floats`] values).
    pub fn new(c: &TextConfig, arena: &Arc<SlotArena>) -> LatentCache {
        LatentCache {
            pages: Vec::new(),
            arena: arena.clone(),
            len: 0,
            width: c.latent_width(),
            index_dim: c.indexer.as_ref().map_or(0, |i| i.head_dim),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends one token: its normed latent `c`, its raw `k_pe` and its indexer key (empty
    /// without an indexer). A full fixed arena is an error.
    pub fn push(&mut self, c: &[f32], k_pe: &[f32], key: &[f32]) -> Result<(), ModelError> {
        debug_assert_eq!(c.len() + k_pe.len(), self.width);
        debug_assert_eq!(key.len(), self.index_dim);
        if self.len.is_multiple_of(PAGE_TOKENS) {
            self.pages.push(Arc::new(self.arena.acquire()?));
        }
        let Some(last) = self.pages.last_mut() else { return Ok(()) };
        if Arc::get_mut(last).is_none() {
            // Shared with a fork: this sequence writes into its own copy from here on.
            *last = Arc::new(last.try_clone()?);
        }
        let Some(page) = Arc::get_mut(last) else { return Ok(()) };
        let at = self.len % PAGE_TOKENS;
        let (w, kd) = (self.width, self.index_dim);
        let floats = page.floats_mut();
        floats[at * w..at * w + c.len()].copy_from_slice(c);
        floats[at * w + c.len()..(at + 1) * w].copy_from_slice(k_pe);
        floats[PAGE_TOKENS * w + at * kd..PAGE_TOKENS * w + (at + 1) * kd].copy_from_slice(key);
        self.len += 1;
        Ok(())
    }

    pub fn row(&self, s: usize) -> &[f32] {
        let at = (s % PAGE_TOKENS) * self.width;
        &self.pages[s / PAGE_TOKENS].floats()[at..at + self.width]
    }

    pub fn index_key(&self, s: usize) -> &[f32] {
        let at = PAGE_TOKENS * self.width + (s % PAGE_TOKENS) * self.index_dim;
        &self.pages[s / PAGE_TOKENS].floats()[at..at + self.index_dim]
    }

    /// The latent rows through the page table, for the backend's attention.
    pub fn rows_view(&self) -> PagedRows<'_> {
        let rows = PAGE_TOKENS * self.width;
        PagedRows {
            pages: self.pages.iter().map(|p| &p.floats()[..rows]).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.width,
        }
    }

    /// The indexer keys through the page table, for the backend's indexer.
    pub fn keys_view(&self) -> PagedRows<'_> {
        let rows = PAGE_TOKENS * self.width;
        PagedRows {
            pages: self.pages.iter().map(|p| &p.floats()[rows..]).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.index_dim,
        }
    }

    /// Every row, `[len, width]` (tests and tools).
    pub fn rows(&self) -> Vec<f32> {
        (0..self.len).flat_map(|s| self.row(s).iter().copied()).collect()
    }

    /// Every indexer key, `[len, index_dim]` (tests and tools).
    pub fn index_keys(&self) -> Vec<f32> {
        (0..self.len).flat_map(|s| self.index_key(s).iter().copied()).collect()
    }

    /// Pages this cache holds.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Pages held by reference together with `other` (the same memory, not equal copies).
    pub fn shared_pages(&self, other: &LatentCache) -> usize {
        self.pages.iter().zip(&other.pages).filter(|(a, b)| Arc::ptr_eq(a, b)).count()
    }

    fn reserve_pages(&mut self, tokens: usize) {
        let pages = tokens.div_ceil(PAGE_TOKENS);
        self.pages.reserve_exact(pages.saturating_sub(self.pages.len()));
    }
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Kda(KdaLayout),
    Mla(LatentCache),
}

/// Where sequence state comes from: KDA slots and latent pages, each a preallocated arena (the
/// engine's, fixed at start-up) or a growable one (tools, tests).
#[derive(Clone)]
pub struct StateArenas {
    pub slots: Arc<SlotArena>,
    pub pages: Arc<SlotArena>,
}

impl StateArenas {
    /// Arenas that grow on demand.
    pub fn growable(c: &TextConfig) -> StateArenas {
        StateArenas {
            slots: SlotArena::growable(kda_slot_floats(c)),
            pages: SlotArena::growable(latent_page_floats(c)),
        }
    }

    /// Exactly `slots` KDA slots and `pages` latent pages, allocated now.
    pub fn fixed(c: &TextConfig, slots: usize, pages: usize) -> Result<StateArenas, ModelError> {
        Ok(StateArenas {
            slots: SlotArena::fixed(kda_slot_floats(c), slots)?,
            pages: SlotArena::fixed(latent_page_floats(c), pages)?,
        })
    }
}

/// Values of one sequence's KDA slot for this model (every KDA layer's state).
pub fn kda_slot_floats(c: &TextConfig) -> usize {
    let per_layer = c.kda.num_heads * c.kda.head_dim * c.kda.head_dim
        + 3 * c.kda.conv_kernel.saturating_sub(1) * c.kda_projection_dim();
    per_layer * c.layer_kinds.iter().filter(|k| matches!(k, MixerKind::Kda)).count()
}

/// Everything one sequence carries between calls: a KDA slot leased from a [`SlotArena`]
/// (every KDA layer's state) and each MLA layer's paged latent cache.
#[derive(Debug)]
pub struct SequenceState {
    slot: Option<Slot>,
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub len: usize,
}

impl SequenceState {
    /// A fresh state whose KDA slot comes from `arenas.slots` and whose latent pages will come
    /// from `arenas.pages`; a full fixed arena is an error.
    pub fn new_in(c: &TextConfig, arenas: &StateArenas) -> Result<SequenceState, ModelError> {
        let need = kda_slot_floats(c);
        if arenas.slots.slot_floats() != need || arenas.pages.slot_floats() != latent_page_floats(c) {
            return Err(ModelError::StateMismatch { layer: 0 });
        }
        let arena = &arenas.slots;
        let slot = if need > 0 { Some(arena.acquire()?) } else { None };
        let (h, k) = (c.kda.num_heads, c.kda.head_dim);
        let mut offset = 0;
        let layers = c
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                MixerKind::Kda => {
                    let l = KdaLayout {
                        offset,
                        recurrent: h * k * k,
                        frames: c.kda.conv_kernel.saturating_sub(1),
                        channels: c.kda_projection_dim(),
                    };
                    offset += l.floats();
                    LayerState::Kda(l)
                }
                MixerKind::Mla => LayerState::Mla(LatentCache::new(c, &arenas.pages)),
            })
            .collect();
        Ok(SequenceState { slot, layers, len: 0 })
    }

    /// A state with no layers and no slot: a place to hold until a fork fills it.
    pub fn empty() -> SequenceState {
        SequenceState { slot: None, layers: Vec::new(), len: 0 }
    }

    /// A copy for another sequence (`n > 1`): a new KDA slot from the same arena with this one's
    /// values, and every latent page shared by reference (copied only when written).
    pub fn fork(&self) -> Result<SequenceState, ModelError> {
        let slot = match &self.slot {
            Some(s) => Some(s.try_clone()?),
            None => None,
        };
        Ok(SequenceState { slot, layers: self.layers.clone(), len: self.len })
    }

    /// Sizes every page table for `tokens` tokens up front (pages themselves are fixed-size and
    /// allocated as tokens arrive), so a sequence never holds more than its reservation says.
    pub fn reserve_tokens(&mut self, tokens: usize) {
        for l in &mut self.layers {
            if let LayerState::Mla(c) = l {
                c.reserve_pages(tokens);
            }
        }
    }

    /// The slot this state's KDA layers live in (its index is the slot-table entry).
    pub fn slot(&self) -> Option<&Slot> {
        self.slot.as_ref()
    }

    pub fn kda(&self, layer: usize) -> Option<KdaState<'_>> {
        let (Some(LayerState::Kda(l)), Some(slot)) = (self.layers.get(layer), &self.slot) else { return None };
        let floats = slot.floats().get(l.offset..l.offset + l.floats())?;
        let (recurrent, conv) = floats.split_at(l.recurrent);
        Some(KdaState { recurrent, conv, frames: l.frames, channels: l.channels })
    }

    pub fn kda_mut(&mut self, layer: usize) -> Option<KdaStateMut<'_>> {
        let (Some(LayerState::Kda(l)), Some(slot)) = (self.layers.get(layer), &mut self.slot) else { return None };
        let l = *l;
        let floats = slot.floats_mut().get_mut(l.offset..l.offset + l.floats())?;
        let (recurrent, conv) = floats.split_at_mut(l.recurrent);
        Some(KdaStateMut { recurrent, conv, frames: l.frames, channels: l.channels })
    }

    pub fn mla(&self, layer: usize) -> Option<&LatentCache> {
        match self.layers.get(layer) {
            Some(LayerState::Mla(s)) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(arena: &Arc<SlotArena>) -> LatentCache {
        LatentCache { pages: Vec::new(), arena: arena.clone(), len: 0, width: 3, index_dim: 1 }
    }

    fn push(c: &mut LatentCache, t: usize) {
        let v = t as f32;
        c.push(&[v, v + 0.5], &[-v], &[10.0 * v]).expect("room in the arena");
    }

    #[test]
    fn a_fork_shares_full_pages_and_copies_on_write() {
        let arena = SlotArena::fixed(PAGE_TOKENS * 4, 3).expect("small arena");
        let mut a = cache(&arena);
        for t in 0..PAGE_TOKENS + 5 {
            push(&mut a, t);
        }
        let mut b = a.clone();
        assert_eq!(a.shared_pages(&b), 2, "a fork starts with every page shared");
        for t in 100..104 {
            push(&mut b, t);
        }
        push(&mut a, 7);
        assert_eq!(a.shared_pages(&b), 1, "the written partial page was copied, the full one stays shared");
        assert_eq!(a.row(PAGE_TOKENS + 5), &[7.0, 7.5, -7.0]);
        assert_eq!(b.row(PAGE_TOKENS + 5), &[100.0, 100.5, -100.0]);
        assert_eq!(a.index_key(3), &[30.0]);
        assert_eq!(b.row(PAGE_TOKENS + 4), a.row(PAGE_TOKENS + 4));
        assert_eq!(b.len(), PAGE_TOKENS + 9);
        assert_eq!(b.rows().len(), 3 * b.len());
        assert_eq!(arena.in_use(), 3, "the full page shared, the partial one copied once");
        assert!(matches!(cache(&arena).push(&[0.0, 0.0], &[0.0], &[0.0]), Err(ModelError::StateSlotsFull { .. })));
        drop((a, b));
        assert_eq!(arena.in_use(), 0, "dropping the caches returns every page");
    }
}
