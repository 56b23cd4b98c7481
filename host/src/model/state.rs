//! Per-sequence inference state: what a request carries between forward calls.
//!
//! KDA layers keep a fixed-size recurrent state and a short-convolution window; MLA layers keep
//! one latent row per token (and, for K3.1, one indexer key per token). Nothing else persists:
//! the AttnRes blocks are rebuilt in every call.

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

/// Latent rows of one MLA layer: `[c (kv_lora_rank, normed) | k_pe (raw)]` per token, plus the
/// K3.1 indexer key per token.
#[derive(Clone, Debug)]
pub struct LatentCache {
    pub rows: Vec<f32>,
    pub width: usize,
    pub index_keys: Vec<f32>,
    pub index_dim: usize,
}

impl LatentCache {
    pub fn new(c: &TextConfig) -> LatentCache {
        LatentCache {
            rows: Vec::new(),
            width: c.latent_width(),
            index_keys: Vec::new(),
            index_dim: c.indexer.as_ref().map_or(0, |i| i.head_dim),
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len() / self.width
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn row(&self, s: usize) -> &[f32] {
        &self.rows[s * self.width..(s + 1) * self.width]
    }

    pub fn index_key(&self, s: usize) -> &[f32] {
        &self.index_keys[s * self.index_dim..(s + 1) * self.index_dim]
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

    /// Allocates room for `tokens` tokens in every latent cache up front, so a sequence's
    /// memory is what its pool reservation says (growth by doubling could take up to twice that).
    pub fn reserve_tokens(&mut self, tokens: usize) {
        for l in &mut self.layers {
            if let LayerState::Mla(c) = l {
                let rows = tokens.saturating_mul(c.width).saturating_sub(c.rows.len());
                c.rows.reserve_exact(rows);
                let keys = tokens.saturating_mul(c.index_dim).saturating_sub(c.index_keys.len());
                c.index_keys.reserve_exact(keys);
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
