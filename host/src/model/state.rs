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

/// `PAGE_TOKENS` tokens' latent rows and indexer keys of one MLA layer.
#[derive(Clone, Debug, Default)]
pub struct LatentPage {
    rows: Vec<f32>,
    keys: Vec<f32>,
}

/// Latent rows of one MLA layer: `[c (kv_lora_rank, normed) | k_pe (raw)]` per token, plus the
/// K3.1 indexer key per token, in fixed-size pages addressed through a page table. A fork (a
/// clone) shares every page by reference count; the first write to a shared page — only the
/// partly filled last one is ever written again — copies it, so sequences that share a prompt
/// never see each other's later tokens.
#[derive(Clone, Debug)]
pub struct LatentCache {
    pages: Vec<Arc<LatentPage>>,
    len: usize,
    pub width: usize,
    pub index_dim: usize,
}

impl LatentCache {
    pub fn new(c: &TextConfig) -> LatentCache {
        LatentCache {
            pages: Vec::new(),
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
    /// without an indexer).
    pub fn push(&mut self, c: &[f32], k_pe: &[f32], key: &[f32]) {
        debug_assert_eq!(c.len() + k_pe.len(), self.width);
        debug_assert_eq!(key.len(), self.index_dim);
        if self.len.is_multiple_of(PAGE_TOKENS) {
            self.pages.push(Arc::new(LatentPage {
                rows: Vec::with_capacity(PAGE_TOKENS * self.width),
                keys: Vec::with_capacity(PAGE_TOKENS * self.index_dim),
            }));
        }
        let Some(last) = self.pages.last_mut() else { return };
        let page = Arc::make_mut(last);
        page.rows.extend_from_slice(c);
        page.rows.extend_from_slice(k_pe);
        page.keys.extend_from_slice(key);
        self.len += 1;
    }

    pub fn row(&self, s: usize) -> &[f32] {
        let at = (s % PAGE_TOKENS) * self.width;
        &self.pages[s / PAGE_TOKENS].rows[at..at + self.width]
    }

    pub fn index_key(&self, s: usize) -> &[f32] {
        let at = (s % PAGE_TOKENS) * self.index_dim;
        &self.pages[s / PAGE_TOKENS].keys[at..at + self.index_dim]
    }

    /// The latent rows through the page table, for the backend's attention.
    pub fn rows_view(&self) -> PagedRows<'_> {
        PagedRows {
            pages: self.pages.iter().map(|p| p.rows.as_slice()).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.width,
        }
    }

    /// The indexer keys through the page table, for the backend's indexer.
    pub fn keys_view(&self) -> PagedRows<'_> {
        PagedRows {
            pages: self.pages.iter().map(|p| p.keys.as_slice()).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.index_dim,
        }
    }

    /// Every row, `[len, width]` (tests and tools).
    pub fn rows(&self) -> Vec<f32> {
        self.pages.iter().flat_map(|p| p.rows.iter().copied()).collect()
    }

    /// Every indexer key, `[len, index_dim]` (tests and tools).
    pub fn index_keys(&self) -> Vec<f32> {
        self.pages.iter().flat_map(|p| p.keys.iter().copied()).collect()
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
    /// A fresh state whose KDA slot comes from `arena`; a full fixed arena is an error.
    pub fn new_in(c: &TextConfig, arena: &Arc<SlotArena>) -> Result<SequenceState, ModelError> {
        let need = kda_slot_floats(c);
        if arena.slot_floats() != need {
            return Err(ModelError::StateMismatch { layer: 0 });
        }
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
                MixerKind::Mla => LayerState::Mla(LatentCache::new(c)),
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

    fn cache() -> LatentCache {
        LatentCache { pages: Vec::new(), len: 0, width: 3, index_dim: 1 }
    }

    fn push(c: &mut LatentCache, t: usize) {
        let v = t as f32;
        c.push(&[v, v + 0.5], &[-v], &[10.0 * v]);
    }

    #[test]
    fn a_fork_shares_full_pages_and_copies_on_write() {
        let mut a = cache();
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
    }
}
