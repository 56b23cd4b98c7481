//! The backend seam (as candle's `BackendStorage`): every numeric op the Kimi model runs is declared
//! once here and implemented once per backend. Model code holds a `&dyn Backend` and never names a
//! backend's own functions.
//!
//! Ops take a whole step's flat batch (`[tokens, …]` rows of every sequence) and read per-sequence
//! state through slot and page tables ([`SeqSpan`], [`PagedRows`], KDA slots), the way device
//! kernels will. Activations are host-memory `f32` slices today: the CPU backend is the reference;
//! a device backend adds its buffer type here when it lands (issue: GPU backend).

use crate::{Matrix, PackedMatrix};

/// Where one sequence's rows lie in a step's flat batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// First row of this sequence in the batch.
    pub start: usize,
    /// Rows (new tokens) of this sequence.
    pub len: usize,
    /// Tokens the sequence held before this step: the absolute position of its first new token.
    pub pos: usize,
}

impl SeqSpan {
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// One sequence's cached rows of one layer through its page table: row `s` lives in
/// `pages[s / page_tokens]` at `(s % page_tokens) * width`. Under context parallelism the table
/// has holes — empty pages another rank holds — and ops skip the positions in them.
#[derive(Clone, Debug)]
pub struct PagedRows<'a> {
    pub pages: Vec<&'a [f32]>,
    pub page_tokens: usize,
    pub width: usize,
}

impl<'a> PagedRows<'a> {
    /// Whether this table holds position `s` (not a hole).
    pub fn holds(&self, s: usize) -> bool {
        self.pages.get(s / self.page_tokens).is_some_and(|p| !p.is_empty())
    }

    pub fn row(&self, s: usize) -> &'a [f32] {
        let at = (s % self.page_tokens) * self.width;
        &self.pages[s / self.page_tokens][at..at + self.width]
    }
}

/// The SiTU GLU activation's constants (spec §2.6).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SituParams {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

/// One KDA layer's per-head constants (spec §2.4).
#[derive(Clone, Copy, Debug)]
pub struct KdaParams<'a> {
    pub heads: usize,
    pub head_dim: usize,
    /// `exp(A_log[h])` per head.
    pub a_exp: &'a [f32],
    /// `[heads · head_dim]`.
    pub dt_bias: &'a [f32],
    pub lower_bound: f32,
}

/// The step's KDA projections, each `[tokens, heads · head_dim]` except `beta_logits`
/// (`[tokens, heads]`); q, k and v are already through the short convolution.
#[derive(Clone, Copy, Debug)]
pub struct KdaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Gate pre-activations (`f_b(f_a x)`).
    pub z: &'a [f32],
    pub beta_logits: &'a [f32],
}

/// One sequence's KDA recurrent state for a step: its slot region `[heads, K, V]` and, for a
/// speculative verify, one buffer per new token that receives the state after that token (the
/// next round resumes from the last accepted one instead of recomputing or undoing anything).
#[derive(Debug)]
pub struct KdaSlot<'a> {
    pub state: &'a mut [f32],
    /// Empty, or one `[heads, K, V]` buffer per token of the sequence's span.
    pub after_token: Vec<&'a mut [f32]>,
}

impl<'a> KdaSlot<'a> {
    /// A slot without per-token snapshots.
    pub fn new(state: &'a mut [f32]) -> KdaSlot<'a> {
        KdaSlot { state, after_token: Vec::new() }
    }
}

/// The indexer's decision for one query token (K3.1, spec §5).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Selected past positions, ascending.
    pub tokens: Vec<usize>,
    /// I(t, s) for every candidate s ≤ t.
    pub scores: Vec<f32>,
    /// I(k-th) − I((k+1)-th); NaN when nothing is pruned.
    pub margin: f32,
}

/// Which GELU: the tanh approximation (`gelu_pytorch_tanh`) or the exact erf form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gelu {
    Tanh,
    Erf,
}

/// The router's decision for a step's tokens (spec §2.7).
#[derive(Clone, Debug, Default)]
pub struct Routing {
    /// Experts by descending selection score, `[tokens, top_k]`.
    pub ids: Vec<usize>,
    /// Their weights (renormalised and scaled), `[tokens, top_k]`.
    pub weights: Vec<f32>,
    /// σ(logits) for all experts, `[tokens, E]`.
    pub scores: Vec<f32>,
    /// k-th minus (k+1)-th biased selection score per token (NaN when every expert is chosen).
    pub margins: Vec<f32>,
    pub top_k: usize,
}

/// The router's constants.
#[derive(Clone, Copy, Debug)]
pub struct RouterParams<'a> {
    /// `e_score_correction_bias`: added for selection only.
    pub bias: &'a [f32],
    pub top_k: usize,
    pub renormalize: bool,
    pub scaling: f32,
}

/// One routed expert's weights: `w2 · SiTU(w1 z, w3 z)`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrices<'a> {
    pub w1: Matrix<'a>,
    pub w2: Matrix<'a>,
    pub w3: Matrix<'a>,
}

/// Every op of the model. Shapes are row-major; `tokens` is the step's batch rows.
pub trait Backend: Send + Sync {
    /// What this backend runs on (for logs and benches), e.g. `cpu (Avx512, 8 threads)`.
    fn describe(&self) -> String;

    /// This backend's layout of a weight for [`Backend::matmul`], made once at load, or `None` to
    /// read the stored format (the CPU backend packs BF16 and MXFP4 into 16-row panels; every
    /// product over it sums each output the same way whatever the batch: fused multiply-add
    /// chains over 16-column blocks, the blocks added pairwise).
    fn prepare_matrix(&self, w: &Matrix<'_>) -> Option<PackedMatrix>;

    /// `out[t, r] = Σ_c W[r, c] · x[t, c]`, one read of W for all tokens.
    fn matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]);

    /// [`Backend::matmul`] of each of `ws` over the same `x` (`outs[i]` for `ws[i]`): the
    /// projections that share an input (KDA's q / k / v / gates, an MLP's gate and up) as one
    /// op, so a backend can split the activations once and run every matrix's rows in one
    /// parallel launch. Each output must equal `matmul` of its matrix alone.
    fn matmul_many(&self, ws: &[Matrix<'_>], x: &[f32], tokens: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many: {} matrices, {} outputs", ws.len(), outs.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, tokens, out);
        }
    }

    /// `out[t, c] = Σ_r x[t, r] · W[r, c]` (absorbed MLA queries).
    fn matmul_transposed(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]);

    /// Rows `ids` of `table`, widened to f32: `out[t] = table[ids[t]]`.
    fn embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]);

    /// `out = w · x / rms(x)` per row of `w.len()` values.
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]);

    /// `out = (x − mean) / std · w + b` per row of `w.len()` values.
    fn layer_norm(&self, x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]);

    /// `gate ← SiLU(gate) · up` in place (SwiGLU, the DSpark draft's MLP).
    fn silu_glu(&self, gate: &mut [f32], up: &[f32]);

    /// Rotary embedding on interleaved pairs (GPT-J / DeepSeek `is_neox_style=False`): `x` is
    /// `[positions.len(), heads, head_stride]`; in each head, lanes `offset + 2i` and
    /// `offset + 2i + 1` turn by `positions[t] · inv_freq[i]` (the angle and its cos / sin in
    /// f32), scaled by `magnitude` (YaRN's cos/sin factor).
    #[allow(clippy::too_many_arguments)]
    fn rope_interleaved(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        head_stride: usize,
        offset: usize,
        inv_freq: &[f32],
        magnitude: f32,
    );

    /// Rotary embedding from per-row tables: `x` is `[rows, heads, head_stride]`; in each head,
    /// lanes `2i` and `2i + 1` turn by the angle whose cosine and sine are `cos[t, i]` and
    /// `sin[t, i]` (`[rows, pairs]`; the vision tower's 2-D RoPE, whose angles mix column and row).
    fn rope_cos_sin(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize);

    /// `x ← GELU(x)` in place, in the given form.
    fn gelu(&self, x: &mut [f32], kind: Gelu);

    /// Dense non-causal attention inside each span (block-diagonal over a packed batch of items,
    /// the vision tower's): `q`, `k`, `v` and `out` are `[rows, heads, dim]`; row `t` of span
    /// `s` attends over every row of `s` with `softmax(scale · q·k)`. Rows in no span get zeros.
    #[allow(clippy::too_many_arguments)]
    fn attention_varlen(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        dim: usize,
        spans: &[SeqSpan],
        scale: f32,
        out: &mut [f32],
    );

    /// `acc += x`.
    fn add(&self, acc: &mut [f32], x: &[f32]);

    /// `x *= σ(gate)` (MLA's output gate).
    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]);

    /// `gate ← SiTU(gate, up)` in place.
    fn situ_glu(&self, gate: &mut [f32], up: &[f32], act: SituParams);

    /// AttnRes (spec §2.3): per token, a softmax over the candidates of
    /// `query · cand / rms(cand)`, then their weighted sum. `query` already holds the norm weight.
    fn attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]);

    /// KDA's causal depthwise convolution + SiLU over each sequence's rows of `x` (`[tokens, P]`)
    /// in place, continuing from and updating that sequence's `frames` (`[kernel − 1, P]`).
    /// `taps` is `[P, kernel]`, oldest first.
    fn kda_conv(&self, x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize);

    /// KDA's delta rule over the step (spec §2.4): per sequence and head, L2-normalised q (scaled)
    /// and k, gates `lower_bound · σ(a_exp · (z + dt_bias))`, β = σ(beta_logits), then the
    /// recurrence (one token) or the chunked form (many) on that sequence's recurrent slot
    /// `slots[s]` (`[heads, K, V]`). A slot with per-token buffers runs its tokens one by one
    /// and copies the state after each into them. Writes the core output `[tokens, heads · V]`.
    fn kda_recurrence(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    );

    /// Per head of `dim` values: `out = w · o / rms(o) · σ(gate)` (KDA's output norm).
    fn gated_rms_norm(&self, o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]);

    /// MLA query absorption per head: `q` `[tokens, heads, nope + rope]` → `out`
    /// `[tokens, heads, rank + rope]` = `[W_UKᵀ q_nope | q_pe]`, W_UK from `kv_b_proj`
    /// (`w_kv`, `[heads · (nope + v_dim), rank]`).
    #[allow(clippy::too_many_arguments)]
    fn mla_absorb(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        q: &[f32],
        out: &mut [f32],
    );

    /// MLA value lift per head: `ctx` `[tokens, heads, rank]` → `out` `[tokens, heads · v_dim]`
    /// = W_UV ctx, W_UV from `kv_b_proj`.
    #[allow(clippy::too_many_arguments)]
    fn mla_lift(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        ctx: &[f32],
        out: &mut [f32],
    );

    /// Absorbed MLA attention (spec §2.5) over paged latent rows `[c (rank) | k_pe]`: token `t`
    /// of sequence `rows[t].0` at position `rows[t].1`, head `h`, attends with query
    /// `q[t, h]` (`width` = rank + rope values) over `selected[t]` (or every position ≤ its own)
    /// of `caches[seq]` that the page table holds, and writes the latent context `ctx[t, h]`
    /// (`rank` values). With `lse` (`[tokens, heads]`) it also writes the log-sum-exp of the
    /// scaled scores (−∞ and a zero context when no position is held): a context-parallel
    /// partial for [`Backend::attention_merge`].
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &[f32],
        heads: usize,
        rank: usize,
        scale: f32,
        rows: &[(usize, usize)],
        caches: &[PagedRows<'_>],
        selected: Option<&[Selection]>,
        ctx: &mut [f32],
        lse: Option<&mut [f32]>,
    );

    /// Merges context-parallel attention partials exactly: per row of `width` values,
    /// `out = Σ_r e^{lse_r − m} part_r / Σ_r e^{lse_r − m}` with `m = max_r lse_r`, in part order.
    /// `parts[r]` is `[rows, width]` and `lses[r]` `[rows]`.
    fn attention_merge(&self, parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]);

    /// K3.1 indexer (spec §5): for query token `t` (sequence `rows[t].0`, position `rows[t].1`),
    /// `I(t, s) = Σ_j w[t, j] · scale · relu(q[t, j] · key[s])` over that sequence's keys
    /// `s ≤ pos` the page table holds (NaN scores for its holes), and the top `topk` of them
    /// (ties to the lower position).
    #[allow(clippy::too_many_arguments)]
    fn indexer_topk(
        &self,
        q: &[f32],
        w: &[f32],
        heads: usize,
        scale: f32,
        topk: usize,
        rows: &[(usize, usize)],
        keys: &[PagedRows<'_>],
    ) -> Vec<Selection>;

    /// Sigmoid router with selection bias: `logits` is `[tokens, E]`.
    fn moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing;

    /// Routed experts (grouped: each expert's weights read once for all the tokens routed to
    /// it): `out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(z[t])`, summed in expert-id order.
    /// `experts` holds experts `first..first + experts.len()` (all of them, or one rank's under
    /// expert parallelism); choices of other experts contribute nothing here. `spans` say which
    /// sequence each token belongs to (a token in none is a sequence of its own): a backend may
    /// compute a sequence's several tokens at one expert another way (the CPU's AMX tiles), but
    /// a token's result must depend only on its own sequence's tokens.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        experts: &[ExpertMatrices<'_>],
        first: usize,
        routing: &Routing,
        z: &[f32],
        spans: &[SeqSpan],
        act: SituParams,
        out: &mut [f32],
    );
}
