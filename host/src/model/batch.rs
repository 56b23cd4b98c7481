//! The flat batch of one forward step (vLLM's flattened batch, llama.cpp's `llama_batch`): the
//! tokens of every sequence concatenated, decode tokens and prefill chunks alike. Token-wise ops
//! (projections, norms, MLP, MoE, AttnRes, LM head) run once over all of them; the mixer cores
//! read each token's sequence and position from here to find that sequence's state.

use super::forward::LogitsFor;
use super::state::SequenceState;

/// One sequence's part of a forward step: its next tokens and its state.
pub struct SeqInput<'a> {
    pub ids: &'a [u32],
    pub state: &'a mut SequenceState,
    pub logits: LogitsFor,
    /// Hidden states to hand a speculative draft (DSpark), or `None`.
    pub aux: Option<AuxTap<'a>>,
    /// Rows whose input embedding is given instead of looked up (image tokens), or `None`.
    pub embeds: Option<EmbedRows<'a>>,
}

/// Input embeddings that replace the looked-up ones at some of a sequence's step rows: the
/// vision projector's rows at the `<|media_pad|>` positions (spec `k3-dspark-vision.md` B.6).
#[derive(Clone, Copy, Debug)]
pub struct EmbedRows<'a> {
    /// Indices into the sequence's `ids` of this step, one per row of `rows`.
    pub at: &'a [usize],
    /// `[at.len(), hidden]`.
    pub rows: &'a [f32],
}

impl<'a> SeqInput<'a> {
    pub fn new(ids: &'a [u32], state: &'a mut SequenceState, logits: LogitsFor) -> SeqInput<'a> {
        SeqInput { ids, state, logits, aux: None, embeds: None }
    }
}

/// The target hidden states a DSpark draft reads (its `target_layer_ids`): for every row of the
/// sequence's step, each tapped layer's output — its AttnRes partial sum, the value the release
/// code's decoder layer returns (HF `hidden_states[l + 1]`) — concatenated in `layers` order.
/// The step appends `[rows, layers.len() · hidden]` to `rows`.
pub struct AuxTap<'a> {
    pub layers: &'a [usize],
    pub rows: &'a mut Vec<f32>,
}

/// Where one sequence's tokens lie in the flat batch (the backend's type: ops read it as is).
pub use kimi_kernels::SeqSpan as Span;

/// The shape of a step: per sequence its span, per token its sequence and position.
#[derive(Clone, Debug, Default)]
pub struct BatchLayout {
    pub spans: Vec<Span>,
    /// `(sequence, absolute position)` of every row.
    pub tokens: Vec<(usize, usize)>,
}

impl BatchLayout {
    /// Lays out `(new tokens, tokens already held)` per sequence, in order.
    pub fn new(seqs: impl IntoIterator<Item = (usize, usize)>) -> BatchLayout {
        let mut layout = BatchLayout::default();
        for (s, (len, pos)) in seqs.into_iter().enumerate() {
            layout.spans.push(Span { start: layout.tokens.len(), len, pos });
            layout.tokens.extend((0..len).map(|i| (s, pos + i)));
        }
        layout
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_sequences_in_order() {
        let l = BatchLayout::new([(2, 5), (0, 9), (1, 0)]);
        assert_eq!(
            l.spans,
            vec![
                Span { start: 0, len: 2, pos: 5 },
                Span { start: 2, len: 0, pos: 9 },
                Span { start: 2, len: 1, pos: 0 }
            ]
        );
        assert_eq!(l.tokens, vec![(0, 5), (0, 6), (2, 0)]);
    }
}
