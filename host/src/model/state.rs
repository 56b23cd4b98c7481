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

/// One KDA layer's state after one token of a speculative verify, written through a snapshot
/// slot (the same layout as the sequence's own slot).
#[derive(Debug)]
pub struct KdaSnapshotMut<'a> {
    pub recurrent: &'a mut [f32],
    conv: &'a mut [f32],
}

/// One KDA layer's state, written through its slot, with the per-token snapshots of a
/// speculative verify (empty otherwise).
#[derive(Debug)]
pub struct KdaStateMut<'a> {
    pub recurrent: &'a mut [f32],
    conv: &'a mut [f32],
    pub frames: usize,
    pub channels: usize,
    pub after_token: Vec<KdaSnapshotMut<'a>>,
}

impl KdaStateMut<'_> {
    pub fn conv_frames_mut(&mut self, branch: usize) -> &mut [f32] {
        let n = self.frames * self.channels;
        &mut self.conv[branch * n..(branch + 1) * n]
    }

    /// Fills every snapshot's window of `branch` from the current frames and this step's
    /// pre-convolution rows `raw` (`[tokens, channels]`): after token j the window holds the
    /// last `frames` rows of `[frames; raw[..=j]]`. Call before the convolution advances the
    /// frames.
    pub fn snapshot_conv(&mut self, branch: usize, raw: &[f32]) {
        let (w, p) = (self.frames, self.channels);
        let n = w * p;
        let before = &self.conv[branch * n..(branch + 1) * n];
        for (j, snap) in self.after_token.iter_mut().enumerate() {
            let dst = &mut snap.conv[branch * n..(branch + 1) * n];
            // Rows j+1 .. j+1+w of the history [before (w rows); raw].
            for (r, row) in dst.chunks_exact_mut(p).enumerate() {
                let h = j + 1 + r;
                row.copy_from_slice(if h < w {
                    &before[h * p..(h + 1) * p]
                } else {
                    &raw[(h - w) * p..(h - w + 1) * p]
                });
            }
        }
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
///
/// Under context parallelism each of the `cp` ranks of a group holds every `cp`-th page (page
/// `p` on rank `p % cp`); the others are holes in its table, which the ops skip.
#[derive(Clone, Debug)]
pub struct LatentCache {
    pages: Vec<Option<Arc<Slot>>>,
    arena: Arc<SlotArena>,
    len: usize,
    pub width: usize,
    pub index_dim: usize,
    /// This cache's rank in its context-parallel group and the group's size.
    cp_rank: usize,
    cp: usize,
}

impl LatentCache {
    /// An empty cache whose pages come from `arena` (pages of [`latent_page_floats`] values),
    /// holding every page.
    pub fn new(c: &TextConfig, arena: &Arc<SlotArena>) -> LatentCache {
        LatentCache::context_parallel(c, arena, 0, 1)
    }

    /// An empty cache holding the pages of rank `rank` of a context-parallel group of `cp`.
    pub fn context_parallel(c: &TextConfig, arena: &Arc<SlotArena>, rank: usize, cp: usize) -> LatentCache {
        LatentCache {
            pages: Vec::new(),
            arena: arena.clone(),
            len: 0,
            width: c.latent_width(),
            index_dim: c.indexer.as_ref().map_or(0, |i| i.head_dim),
            cp_rank: rank,
            cp: cp.max(1),
        }
    }

    /// An empty cache of `width`-wide rows and no indexer keys in pages of `arena` (a DSpark
    /// draft's rows in the target's page pool), or `None` when a page cannot hold
    /// `PAGE_TOKENS` such rows.
    pub fn in_pages(arena: &Arc<SlotArena>, width: usize) -> Option<LatentCache> {
        (arena.slot_floats() >= PAGE_TOKENS * width).then(|| LatentCache {
            pages: Vec::new(),
            arena: arena.clone(),
            len: 0,
            width,
            index_dim: 0,
            cp_rank: 0,
            cp: 1,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this rank holds page `p`.
    fn holds_page(&self, p: usize) -> bool {
        p % self.cp == self.cp_rank
    }

    /// Whether this rank holds position `s`.
    pub fn holds(&self, s: usize) -> bool {
        self.holds_page(s / PAGE_TOKENS)
    }

    /// Extends the page table to cover page `p`: held pages from the arena, holes elsewhere.
    fn cover(&mut self, p: usize) -> Result<(), ModelError> {
        while self.pages.len() <= p {
            let next = self.pages.len();
            let page = if self.holds_page(next) { Some(Arc::new(self.arena.acquire()?)) } else { None };
            self.pages.push(page);
        }
        Ok(())
    }

    /// Appends one token: its normed latent `c`, its raw `k_pe` and its indexer key (empty
    /// without an indexer); a rank that does not hold the token's page only counts it. A full
    /// fixed arena is an error.
    pub fn push(&mut self, c: &[f32], k_pe: &[f32], key: &[f32]) -> Result<(), ModelError> {
        debug_assert_eq!(c.len() + k_pe.len(), self.width);
        debug_assert_eq!(key.len(), self.index_dim);
        let page = self.len / PAGE_TOKENS;
        self.cover(page)?;
        let Some(Some(slot)) = self.pages.get_mut(page) else {
            self.len += 1;
            return Ok(());
        };
        if Arc::get_mut(slot).is_none() {
            // Shared with a fork: this sequence writes into its own copy from here on.
            *slot = Arc::new(slot.try_clone()?);
        }
        let Some(page) = Arc::get_mut(slot) else { return Ok(()) };
        let at = self.len % PAGE_TOKENS;
        let (w, kd) = (self.width, self.index_dim);
        let floats = page.floats_mut();
        floats[at * w..at * w + c.len()].copy_from_slice(c);
        floats[at * w + c.len()..(at + 1) * w].copy_from_slice(k_pe);
        floats[PAGE_TOKENS * w + at * kd..PAGE_TOKENS * w + (at + 1) * kd].copy_from_slice(key);
        self.len += 1;
        Ok(())
    }

    fn page(&self, s: usize) -> &[f32] {
        match self.pages.get(s / PAGE_TOKENS) {
            Some(Some(p)) => p.floats(),
            _ => &[],
        }
    }

    /// Row `s` (empty when another context-parallel rank holds it).
    pub fn row(&self, s: usize) -> &[f32] {
        let at = (s % PAGE_TOKENS) * self.width;
        self.page(s).get(at..at + self.width).unwrap_or(&[])
    }

    /// Indexer key `s` (empty when another context-parallel rank holds it).
    pub fn index_key(&self, s: usize) -> &[f32] {
        let at = PAGE_TOKENS * self.width + (s % PAGE_TOKENS) * self.index_dim;
        self.page(s).get(at..at + self.index_dim).unwrap_or(&[])
    }

    /// The latent rows through the page table (holes empty), for the backend's attention.
    pub fn rows_view(&self) -> PagedRows<'_> {
        let rows = PAGE_TOKENS * self.width;
        PagedRows {
            pages: self.pages.iter().map(|p| p.as_ref().map_or(&[][..], |p| &p.floats()[..rows])).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.width,
        }
    }

    /// The indexer keys through the page table (holes empty), for the backend's indexer.
    pub fn keys_view(&self) -> PagedRows<'_> {
        let rows = PAGE_TOKENS * self.width;
        PagedRows {
            pages: self.pages.iter().map(|p| p.as_ref().map_or(&[][..], |p| &p.floats()[rows..])).collect(),
            page_tokens: PAGE_TOKENS,
            width: self.index_dim,
        }
    }

    /// Every held row, `[held, width]` (tests and tools).
    pub fn rows(&self) -> Vec<f32> {
        (0..self.len).filter(|&s| self.holds(s)).flat_map(|s| self.row(s).iter().copied()).collect()
    }

    /// Every held indexer key, `[held, index_dim]` (tests and tools).
    pub fn index_keys(&self) -> Vec<f32> {
        (0..self.len).filter(|&s| self.holds(s)).flat_map(|s| self.index_key(s).iter().copied()).collect()
    }

    /// Pages this cache holds.
    pub fn pages(&self) -> usize {
        self.pages.iter().flatten().count()
    }

    /// Pages held by reference together with `other` (the same memory, not equal copies).
    pub fn shared_pages(&self, other: &LatentCache) -> usize {
        self.pages
            .iter()
            .zip(&other.pages)
            .filter(|(a, b)| matches!((a, b), (Some(a), Some(b)) if Arc::ptr_eq(a, b)))
            .count()
    }

    /// Holds every page rows `..upto` need, each held page its own (not shared with a fork)
    /// from the current last one on, so pushing those rows cannot fail.
    fn prepare(&mut self, upto: usize) -> Result<(), ModelError> {
        if upto <= self.len {
            return Ok(());
        }
        let current = self.len / PAGE_TOKENS;
        if !self.len.is_multiple_of(PAGE_TOKENS)
            && let Some(Some(slot)) = self.pages.get_mut(current)
            && Arc::get_mut(slot).is_none()
        {
            *slot = Arc::new(slot.try_clone()?);
        }
        self.cover((upto - 1) / PAGE_TOKENS)
    }

    /// Drops every row from `len` on (a rejected speculative suffix); pages past the new end go
    /// back to the arena, and a shared page that is written again is copied first as usual.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.len = len;
        self.pages.truncate(len.div_ceil(PAGE_TOKENS));
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
    /// Arenas that grow on demand, for a model of `ranks` tensor-parallel ranks whose rank-local
    /// config is `c`.
    pub fn growable(c: &TextConfig, ranks: usize) -> StateArenas {
        StateArenas {
            slots: SlotArena::growable(ranks * kda_slot_floats(c)),
            pages: SlotArena::growable(latent_page_floats(c)),
        }
    }

    /// Exactly `slots` KDA slots (each holding every rank's part) and `pages` latent pages,
    /// allocated now.
    pub fn fixed(c: &TextConfig, ranks: usize, slots: usize, pages: usize) -> Result<StateArenas, ModelError> {
        Ok(StateArenas {
            slots: SlotArena::fixed(ranks * kda_slot_floats(c), slots)?,
            pages: SlotArena::fixed(latent_page_floats(c), pages)?,
        })
    }
}

/// Values of one rank's part of a sequence's KDA slot for this (rank-local) config.
pub fn kda_slot_floats(c: &TextConfig) -> usize {
    let per_layer = c.kda.num_heads * c.kda.head_dim * c.kda.head_dim
        + 3 * c.kda.conv_kernel.saturating_sub(1) * c.kda_projection_dim();
    per_layer * c.layer_kinds.iter().filter(|k| matches!(k, MixerKind::Kda)).count()
}

/// A slot's values split into `n` equal rank parts (empty parts for an empty slot).
fn split_ranks(n: usize, floats: &mut [f32]) -> Vec<&mut [f32]> {
    let per = floats.len() / n;
    let mut parts: Vec<&mut [f32]> =
        if per == 0 { (0..n).map(|_| &mut [][..]).collect() } else { floats.chunks_exact_mut(per).collect() };
    parts.resize_with(n, || &mut [][..]);
    parts
}

/// Everything one sequence carries between calls: a KDA slot leased from a [`SlotArena`] (every
/// KDA layer's state; under tensor parallelism each rank's heads in its own region of the slot,
/// rank-major) and each MLA layer's paged latent cache (one replica per rank, as on GPUs).
#[derive(Debug)]
pub struct SequenceState {
    slot: Option<Slot>,
    /// A speculative verify's per-token snapshot slots (see [`SequenceState::begin_verify`]).
    snapshots: Vec<Slot>,
    /// Per rank: every layer's state (KDA layouts within the rank's region, latent caches).
    ranks: Vec<Vec<LayerState>>,
    /// Tokens consumed so far.
    pub len: usize,
}

/// One rank's part of a sequence's state, for one step.
pub struct RankStateMut<'a> {
    floats: &'a mut [f32],
    /// This rank's part of each per-token snapshot slot (a speculative verify; else empty).
    snapshots: Vec<&'a mut [f32]>,
    pub layers: &'a mut [LayerState],
}

impl RankStateMut<'_> {
    pub fn kda_mut(&mut self, layer: usize) -> Option<KdaStateMut<'_>> {
        let Some(LayerState::Kda(l)) = self.layers.get(layer) else { return None };
        let l = *l;
        let floats = self.floats.get_mut(l.offset..l.offset + l.floats())?;
        let (recurrent, conv) = floats.split_at_mut(l.recurrent);
        let mut after_token = Vec::with_capacity(self.snapshots.len());
        for snap in self.snapshots.iter_mut() {
            let (recurrent, conv) = snap.get_mut(l.offset..l.offset + l.floats())?.split_at_mut(l.recurrent);
            after_token.push(KdaSnapshotMut { recurrent, conv });
        }
        Some(KdaStateMut { recurrent, conv, frames: l.frames, channels: l.channels, after_token })
    }

    pub fn mla_mut(&mut self, layer: usize) -> Option<&mut LatentCache> {
        match self.layers.get_mut(layer) {
            Some(LayerState::Mla(c)) => Some(c),
            _ => None,
        }
    }
}

impl SequenceState {
    /// A fresh state for `ranks` tensor-parallel ranks of rank-local config `c` (the latent
    /// caches of each group of `cp` consecutive ranks splitting the pages), whose KDA slot
    /// comes from `arenas.slots` and whose latent pages will come from `arenas.pages`; a full
    /// fixed arena is an error.
    pub fn new_in(c: &TextConfig, ranks: usize, cp: usize, arenas: &StateArenas) -> Result<SequenceState, ModelError> {
        let per_rank = kda_slot_floats(c);
        if arenas.slots.slot_floats() != ranks * per_rank || arenas.pages.slot_floats() != latent_page_floats(c) {
            return Err(ModelError::StateMismatch { layer: 0 });
        }
        let arena = &arenas.slots;
        let slot = if per_rank > 0 { Some(arena.acquire()?) } else { None };
        let (h, k) = (c.kda.num_heads, c.kda.head_dim);
        let rank_layers = |rank: usize| {
            let mut offset = 0;
            c.layer_kinds
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
                    MixerKind::Mla => {
                        LayerState::Mla(LatentCache::context_parallel(c, &arenas.pages, rank % cp.max(1), cp))
                    }
                })
                .collect::<Vec<_>>()
        };
        Ok(SequenceState { slot, snapshots: Vec::new(), ranks: (0..ranks.max(1)).map(rank_layers).collect(), len: 0 })
    }

    /// A state with no layers and no slot: a place to hold until a fork fills it.
    pub fn empty() -> SequenceState {
        SequenceState { slot: None, snapshots: Vec::new(), ranks: Vec::new(), len: 0 }
    }

    /// A copy for another sequence (`n > 1`): a new KDA slot from the same arena with this one's
    /// values, and every latent page shared by reference (copied only when written).
    pub fn fork(&self) -> Result<SequenceState, ModelError> {
        let slot = match &self.slot {
            Some(s) => Some(s.try_clone()?),
            None => None,
        };
        Ok(SequenceState { slot, snapshots: Vec::new(), ranks: self.ranks.clone(), len: self.len })
    }

    /// Sizes every page table for `tokens` tokens up front (pages themselves are fixed-size and
    /// allocated as tokens arrive), so a sequence never holds more than its reservation says.
    pub fn reserve_tokens(&mut self, tokens: usize) {
        for l in self.ranks.iter_mut().flatten() {
            if let LayerState::Mla(c) = l {
                c.reserve_pages(tokens);
            }
        }
    }

    /// Takes every page the next `tokens` tokens will write (and its own copy of a partly filled
    /// page shared with a fork), on every rank, so a step cannot run out of pages halfway (a
    /// rank stopping mid-step would leave the others waiting in a collective).
    pub fn prepare_pages(&mut self, tokens: usize) -> Result<(), ModelError> {
        let upto = self.len + tokens;
        for l in self.ranks.iter_mut().flatten() {
            if let LayerState::Mla(c) = l {
                c.prepare(upto)?;
            }
        }
        Ok(())
    }

    /// Tensor-parallel ranks this state was made for.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's layers (the whole model's at TP 1).
    pub fn layers(&self) -> &[LayerState] {
        self.ranks.first().map_or(&[], |r| &r[..])
    }

    /// Every rank's part, disjoint, for one step.
    pub fn ranks_mut(&mut self) -> Vec<RankStateMut<'_>> {
        let n = self.ranks.len().max(1);
        let parts = split_ranks(
            n,
            match &mut self.slot {
                Some(s) => s.floats_mut(),
                None => &mut [],
            },
        );
        // Per rank, its part of every snapshot slot.
        let mut snaps: Vec<Vec<&mut [f32]>> = (0..n).map(|_| Vec::new()).collect();
        for snap in self.snapshots.iter_mut() {
            for (r, part) in split_ranks(n, snap.floats_mut()).into_iter().enumerate() {
                snaps[r].push(part);
            }
        }
        parts
            .into_iter()
            .zip(snaps)
            .zip(self.ranks.iter_mut())
            .map(|((floats, snapshots), layers)| RankStateMut { floats, snapshots, layers })
            .collect()
    }

    /// Readies a speculative verify of the next `tokens` tokens: one snapshot slot per token from
    /// the state's arena (a full fixed arena is an error), which the step fills with every KDA
    /// layer's state after that token. [`SequenceState::accept`] then keeps a prefix.
    pub fn begin_verify(&mut self, tokens: usize) -> Result<(), ModelError> {
        self.snapshots.clear();
        if let Some(slot) = &self.slot {
            for _ in 0..tokens {
                self.snapshots.push(slot.lease_sibling()?);
            }
        }
        Ok(())
    }

    /// Snapshot slots held for the verify (tests and the pool's accounting).
    pub fn snapshot_slots(&self) -> usize {
        self.snapshots.len()
    }

    /// Rank 0's KDA state of `layer` after verify token `j` (tools and tests).
    pub fn kda_snapshot(&self, layer: usize, j: usize) -> Option<KdaState<'_>> {
        let (Some(LayerState::Kda(l)), Some(slot)) = (self.layers().get(layer), self.snapshots.get(j)) else {
            return None;
        };
        let floats = slot.floats().get(l.offset..l.offset + l.floats())?;
        let (recurrent, conv) = floats.split_at(l.recurrent);
        Some(KdaState { recurrent, conv, frames: l.frames, channels: l.channels })
    }

    /// Ends a speculative verify of `verified` tokens (the last step's) keeping the first `kept`
    /// (1 ≤ kept ≤ verified): the KDA state becomes the snapshot after token `kept − 1` — its
    /// slot is swapped in, nothing is recomputed or copied — and the latent caches drop the
    /// rejected rows. Every snapshot slot goes back to the arena.
    pub fn accept(&mut self, verified: usize, kept: usize) -> Result<(), ModelError> {
        if kept == 0 || kept > verified || verified > self.len {
            return Err(ModelError::Verify { verified, kept, held: self.len });
        }
        if self.slot.is_some() {
            if self.snapshots.len() != verified {
                return Err(ModelError::Verify { verified, kept, held: self.len });
            }
            if let (Some(slot), Some(snap)) = (self.slot.as_mut(), self.snapshots.get_mut(kept - 1)) {
                std::mem::swap(slot, snap);
            }
        }
        self.snapshots.clear();
        let len = self.len - (verified - kept);
        for l in self.ranks.iter_mut().flatten() {
            if let LayerState::Mla(c) = l {
                c.truncate(len);
            }
        }
        self.len = len;
        Ok(())
    }

    /// The slot this state's KDA layers live in (its index is the slot-table entry).
    pub fn slot(&self) -> Option<&Slot> {
        self.slot.as_ref()
    }

    /// Rank 0's KDA state of `layer` (the whole layer's at TP 1).
    pub fn kda(&self, layer: usize) -> Option<KdaState<'_>> {
        let (Some(LayerState::Kda(l)), Some(slot)) = (self.layers().get(layer), &self.slot) else { return None };
        let floats = slot.floats().get(l.offset..l.offset + l.floats())?;
        let (recurrent, conv) = floats.split_at(l.recurrent);
        Some(KdaState { recurrent, conv, frames: l.frames, channels: l.channels })
    }

    /// Rank 0's latent cache of `layer` (every rank holds the same rows).
    pub fn mla(&self, layer: usize) -> Option<&LatentCache> {
        match self.layers().get(layer) {
            Some(LayerState::Mla(s)) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(arena: &Arc<SlotArena>) -> LatentCache {
        LatentCache { pages: Vec::new(), arena: arena.clone(), len: 0, width: 3, index_dim: 1, cp_rank: 0, cp: 1 }
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
