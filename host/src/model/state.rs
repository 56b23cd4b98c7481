//! Per-sequence inference state: what a request carries between forward calls.
//!
//! KDA layers keep a fixed-size recurrent state and a short-convolution window; MLA layers keep
//! one latent row per token (and, for K3.1, one indexer key per token). Nothing else persists:
//! the AttnRes blocks are rebuilt in every call.

use std::sync::Arc;

use kimi_kernels::PagedRows;

use super::config::{MixerKind, TextConfig};

/// Recurrent + convolution state of one KDA layer.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// S per head, key-major `[H, K, V]` (the math layout; fla stores the transpose).
    pub recurrent: Vec<f32>,
    /// The last `W − 1` pre-convolution inputs of q, k and v: `[3][W − 1][P]`, oldest frame first.
    pub conv: Vec<f32>,
    pub frames: usize,
    pub channels: usize,
}

impl KdaState {
    pub fn new(c: &TextConfig) -> KdaState {
        let p = c.kda_projection_dim();
        let frames = c.kda.conv_kernel - 1;
        KdaState {
            recurrent: vec![0.0; c.kda.num_heads * c.kda.head_dim * c.kda.head_dim],
            conv: vec![0.0; 3 * frames * p],
            frames,
            channels: p,
        }
    }

    /// Frames of one branch (0 = q, 1 = k, 2 = v), `[W − 1][P]`.
    pub fn conv_frames(&self, branch: usize) -> &[f32] {
        let n = self.frames * self.channels;
        &self.conv[branch * n..(branch + 1) * n]
    }

    pub fn conv_frames_mut(&mut self, branch: usize) -> &mut [f32] {
        let n = self.frames * self.channels;
        &mut self.conv[branch * n..(branch + 1) * n]
    }

    pub fn bytes(&self) -> usize {
        4 * (self.recurrent.len() + self.conv.len())
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
    Kda(KdaState),
    Mla(LatentCache),
}

/// Everything one sequence carries between calls.
#[derive(Clone, Debug)]
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub len: usize,
}

impl SequenceState {
    pub fn new(c: &TextConfig) -> SequenceState {
        let layers = c
            .layer_kinds
            .iter()
            .map(|k| match k {
                MixerKind::Kda => LayerState::Kda(KdaState::new(c)),
                MixerKind::Mla => LayerState::Mla(LatentCache::new(c)),
            })
            .collect();
        SequenceState { layers, len: 0 }
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

    pub fn kda(&self, layer: usize) -> Option<&KdaState> {
        match self.layers.get(layer) {
            Some(LayerState::Kda(s)) => Some(s),
            _ => None,
        }
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
