//! `kimi-host speculate`: runs a DSpark golden case's procedure (`case.json` → `procedure`)
//! through the public model APIs — target prefill with aux taps, draft context rows, block pass,
//! Markov walks, one verify step per round with per-token KDA snapshots, acceptance, rollback —
//! and names every tensor it computes as the golden does. Inputs taken from the case: the prompt,
//! the block width and temperatures, and the stored uniforms of the sampled rounds.

use std::path::Path;

use anyhow::{Context, Result, bail};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::Deserialize;

use kimi_host::engine::speculative::{DraftProbs, Verdict, argmax, softmax, verify_greedy, verify_rejection};
use kimi_host::model::batch::AuxTap;
use kimi_host::model::dspark::{DraftCache, DsparkDraft, Pick};
use kimi_host::model::trace::TraceTensor;
use kimi_host::model::{LogitsFor, Model, SeqInput, SequenceState, Trace};

#[derive(Deserialize)]
struct CaseWire {
    run: RunWire,
}

#[derive(Deserialize)]
struct RunWire {
    #[serde(rename = "block_size_T")]
    block_size: usize,
    temperatures: Temperatures,
    outcome: OutcomeWire,
}

#[derive(Deserialize)]
struct Temperatures {
    sample: f32,
    greedy_draft_t1: f32,
}

#[derive(Deserialize)]
struct OutcomeWire {
    greedy: Vec<serde_json::Value>,
}

/// The stored inputs of a case (`golden.safetensors`).
struct Inputs {
    bytes: Vec<u8>,
}

impl Inputs {
    fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.bytes).context("golden.safetensors")
    }

    fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let st = self.tensors()?;
        let t = st.tensor(name).with_context(|| format!("input `{name}`"))?;
        if t.dtype() != Dtype::F32 {
            bail!("input `{name}` is {:?}, expected F32", t.dtype());
        }
        Ok(t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    fn ids(&self, name: &str) -> Result<Vec<u32>> {
        let st = self.tensors()?;
        let t = st.tensor(name).with_context(|| format!("input `{name}`"))?;
        if t.dtype() != Dtype::I64 {
            bail!("input `{name}` is {:?}, expected I64", t.dtype());
        }
        t.data()
            .chunks_exact(8)
            .map(|b| {
                let v = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                u32::try_from(v).with_context(|| format!("`{name}` holds {v}, not a token id"))
            })
            .collect()
    }
}

fn ids_i64(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&x| x as i64).collect()
}

/// One cached target call over `ids`, tapping the draft's layers: (logits `[n, V]`, aux `[n, taps·d]`).
fn target_step(
    model: &Model,
    draft: &DsparkDraft,
    state: &mut SequenceState,
    ids: &[u32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut aux = Vec::new();
    let mut input = SeqInput::new(ids, state, LogitsFor::AllTokens);
    input.aux = Some(AuxTap { layers: draft.taps(), rows: &mut aux });
    let logits = model.forward_batch(&mut [input], None)?.pop().unwrap_or_default();
    Ok((logits, aux))
}

/// Every KDA layer's recurrent and conv state, as the goldens lay them out (`[H, K, V]`; conv
/// `[P, W]` with column W − 1 the newest input; column 0 — the input W tokens back, which no
/// later step reads and no state keeps — is NaN).
fn record_kda(tr: &mut Trace, prefix: &str, model: &Model, get: &dyn Fn(usize) -> Option<KdaCopy>) {
    if model.ranks().len() > 1 {
        // Each rank holds its heads' part of a KDA state; the goldens' whole-state tensors are
        // recorded at --tensor-parallel 1 only.
        return;
    }
    let c = model.text_config();
    let (h, k, p, w) = (c.kda.num_heads, c.kda.head_dim, c.kda_projection_dim(), c.kda.conv_kernel);
    for i in 0..c.num_layers {
        let Some(s) = get(i) else { continue };
        tr.f32(format!("{prefix}layer{i}.recurrent_state"), &[h, k, k], &s.recurrent);
        for (b, x) in ["q", "k", "v"].iter().enumerate() {
            let frames = &s.conv[b];
            let mut out = vec![f32::NAN; p * w];
            for ch in 0..p {
                for j in 1..w {
                    out[ch * w + j] = frames[(j - 1) * p + ch];
                }
            }
            tr.f32(format!("{prefix}layer{i}.conv_state.{x}"), &[p, w], &out);
        }
    }
}

struct KdaCopy {
    recurrent: Vec<f32>,
    conv: [Vec<f32>; 3],
}

fn copy_of(s: kimi_host::model::state::KdaState<'_>) -> KdaCopy {
    KdaCopy {
        recurrent: s.recurrent.to_vec(),
        conv: [s.conv_frames(0).to_vec(), s.conv_frames(1).to_vec(), s.conv_frames(2).to_vec()],
    }
}

/// Stacks per-token tensors `[n, …]` of the same names into one (`a.b.x` of each j → `a.b.x`).
fn stack(tr: &mut Trace, parts: Vec<Trace>, prefix: &str) {
    let Some(first) = parts.first() else { return };
    for name in first.tensors.keys() {
        let mut data = Vec::new();
        let mut shape = Vec::new();
        for p in &parts {
            if let Some(TraceTensor::F32 { shape: s, data: d }) = p.tensors.get(name) {
                shape = s.clone();
                data.extend_from_slice(d);
            }
        }
        let mut full = vec![parts.len()];
        full.extend(shape);
        tr.f32(format!("{prefix}{name}"), &full, &data);
    }
}

fn record_verdict(tr: &mut Trace, pre: &str, v: &Verdict, drafts: &[u32]) {
    tr.i64(format!("{pre}accepted_length"), &[1], vec![v.accepted as i64]);
    tr.i64(format!("{pre}next_token"), &[1], vec![v.next as i64]);
    let committed: Vec<u32> = drafts[..v.accepted].iter().copied().chain([v.next]).collect();
    tr.i64(format!("{pre}committed_tokens"), &[committed.len()], ids_i64(&committed));
    if !v.final_probs.is_empty() {
        tr.f32(format!("{pre}accept_ratio"), &[v.ratios.len()], &v.ratios);
        tr.i64(format!("{pre}accept_tests"), &[v.tests.len()], v.tests.clone());
        tr.f32(format!("{pre}final_probs"), &[v.final_probs.len()], &v.final_probs);
    }
}

/// Runs the case in `case_dir` with `model` (its target) and `draft`.
pub fn run_case(model: &Model, draft: &DsparkDraft, case_dir: &Path) -> Result<Trace> {
    let case_path = case_dir.join("case.json");
    let text = std::fs::read_to_string(&case_path).with_context(|| format!("reading {}", case_path.display()))?;
    let mut de = serde_json::Deserializer::from_str(&text);
    let case: CaseWire = serde_path_to_error::deserialize(&mut de)
        .with_context(|| format!("{}: not a DSpark case", case_path.display()))?;
    let golden = case_dir.join("golden.safetensors");
    let inputs = Inputs { bytes: std::fs::read(&golden).with_context(|| format!("reading {}", golden.display()))? };
    let t = case.run.block_size;
    let rounds = case.run.outcome.greedy.len();
    let v = model.text_config().vocab_size;
    let be = model.backend();
    let mut tr = Trace::default();

    // 1–2. Target prefill with aux taps; the anchor.
    let prompt = inputs.ids("prompt.input_ids")?;
    if prompt.is_empty() {
        bail!("the case's prompt is empty");
    }
    tr.i64("prompt.input_ids", &[prompt.len()], ids_i64(&prompt));
    let mut prefilled = model.new_state();
    let (logits, aux) = target_step(model, draft, &mut prefilled, &prompt)?;
    let width = aux.len() / prompt.len();
    tr.f32("target.prefill.logits", &[prompt.len(), v], &logits);
    tr.f32("target.prefill.aux_hidden", &[prompt.len(), width], &aux);
    let first_anchor = argmax(&logits[(prompt.len() - 1) * v..]) as u32;
    tr.i64("round1.anchor", &[1], vec![first_anchor as i64]);
    tr.i64("round1.anchor_position", &[1], vec![prompt.len() as i64]);

    let mut greedy_round1: Option<(Vec<u32>, Vec<f32>)> = None;
    for mode in ["greedy", "sample"] {
        let mut state = prefilled.fork()?;
        let mut cache: DraftCache = draft.new_cache(&model.default_arenas().pages)?;
        let mut anchor = first_anchor;
        let mut new_aux = aux.clone();
        for round in 1..=rounds {
            let shared = round == 1;
            let pre = format!("{mode}.round{round}.");
            // Round 1's context and block pass are the same in both modes: recorded once.
            let block_pre = if shared { "round1.".to_string() } else { pre.clone() };
            if !shared {
                tr.i64(format!("{pre}anchor"), &[1], vec![anchor as i64]);
                tr.i64(format!("{pre}anchor_position"), &[1], vec![state.len as i64]);
                tr.f32(format!("{pre}context_aux_hidden_new"), &[new_aux.len() / width, width], &new_aux);
            }
            let mut rec = if shared && mode != "greedy" { None } else { Some(&mut tr) };
            // 3. Context rows for the newly committed positions.
            draft.extend_context(model, &mut cache, &new_aux, rec.as_deref_mut(), &block_pre)?;
            if let Some(tr) = rec.as_deref_mut() {
                for i in 0..draft.layers() {
                    let rows = cache.rows(i);
                    tr.f32(format!("{block_pre}layer{i}.context_rows"), &[cache.len(), draft.row_width()], &rows);
                }
            }
            // 4. Block pass.
            let block = draft.block(model, &mut cache, anchor, t, rec, &block_pre)?;
            // 5. Markov walk.
            let (u_draft, u_accept, u_final) = if mode == "sample" {
                (
                    inputs.f32(&format!("{pre}u_draft"))?,
                    inputs.f32(&format!("{pre}u_accept"))?,
                    inputs.f32(&format!("{pre}u_final"))?,
                )
            } else {
                (Vec::new(), Vec::new(), Vec::new())
            };
            let pick = if mode == "sample" {
                Pick::Sample { temperature: case.run.temperatures.sample, uniforms: &u_draft }
            } else {
                Pick::Greedy
            };
            let walk = draft.walk(be, &block, pick)?;
            tr.i64(format!("{pre}draft_tokens"), &[t], ids_i64(&walk.tokens));
            tr.f32(format!("{pre}markov_logits"), &[t, v], &walk.logits);
            tr.f32(format!("{pre}draft_probs"), &[t, v], &walk.probs);
            if let Some(c) = draft.confidence(be, &block, &walk) {
                tr.f32(format!("{pre}confidence_logits"), &[t], &c);
            }
            if mode == "sample" {
                tr.f32(format!("{pre}u_draft"), &[u_draft.len()], &u_draft);
                tr.f32(format!("{pre}u_accept"), &[u_accept.len()], &u_accept);
                tr.f32(format!("{pre}u_final"), &[u_final.len()], &u_final);
            }
            // 6. Verify [x0, x1..xT] in one cached step, a KDA snapshot per row.
            let verify: Vec<u32> = std::iter::once(anchor).chain(walk.tokens.iter().copied()).collect();
            let start = state.len;
            state.begin_verify(verify.len())?;
            let (vlogits, vaux) = target_step(model, draft, &mut state, &verify)?;
            tr.i64(format!("{pre}verify_input_ids"), &[verify.len()], ids_i64(&verify));
            tr.i64(
                format!("{pre}verify_positions"),
                &[verify.len()],
                (start..start + verify.len()).map(|p| p as i64).collect(),
            );
            tr.f32(format!("{pre}verify_logits"), &[verify.len(), v], &vlogits);
            tr.f32(format!("{pre}verify_aux_hidden"), &[verify.len(), width], &vaux);
            if mode == "greedy" && round == 1 {
                let per_token: Vec<Trace> = (0..verify.len())
                    .map(|j| {
                        let mut one = Trace::default();
                        record_kda(&mut one, "", model, &|i| state.kda_snapshot(i, j).map(copy_of));
                        one
                    })
                    .collect();
                stack(&mut tr, per_token, &format!("{pre}kda_per_token."));
                greedy_round1 = Some((walk.tokens.clone(), vlogits.clone()));
            }
            // 7. Accept / reject.
            let verdict = if mode == "sample" {
                let probs: Vec<f32> =
                    vlogits.chunks_exact(v).flat_map(|row| softmax(row, case.run.temperatures.sample)).collect();
                tr.f32(format!("{pre}target_probs"), &[verify.len(), v], &probs);
                let uf = *u_final.first().context("u_final is empty")?;
                verify_rejection(&walk.tokens, DraftProbs::Rows(&walk.probs), &probs, &u_accept, uf, v)
            } else {
                verify_greedy(&walk.tokens, &vlogits, v)
            };
            record_verdict(&mut tr, &pre, &verdict, &walk.tokens);
            // 8. Roll back: keep [x0, accepted drafts]; the next round's context is their aux.
            state.accept(verify.len(), verdict.accepted + 1)?;
            if round == 1 {
                let mut after = Trace::default();
                record_kda(&mut after, "", model, &|i| state.kda(i).map(copy_of));
                for (name, tensor) in after.tensors {
                    if let TraceTensor::F32 { shape, data } = tensor {
                        tr.f32(format!("{pre}state_after_accept.{}", name.replacen('.', ".kda.", 1)), &shape, &data);
                    }
                }
            }
            new_aux = vaux[..(verdict.accepted + 1) * width].to_vec();
            anchor = verdict.next;
        }
    }

    // Greedy round 1's drafts verified losslessly at temperature 1 with one-hot draft rows.
    let (drafts, vlogits) = greedy_round1.context("the case has no greedy round")?;
    let probs: Vec<f32> =
        vlogits.chunks_exact(v).flat_map(|row| softmax(row, case.run.temperatures.greedy_draft_t1)).collect();
    let u_accept = inputs.f32("greedy_draft_t1.u_accept")?;
    let u_final = inputs.f32("greedy_draft_t1.u_final")?;
    let uf = *u_final.first().context("greedy_draft_t1.u_final is empty")?;
    let verdict = verify_rejection(&drafts, DraftProbs::OneHot, &probs, &u_accept, uf, v);
    tr.f32("greedy_draft_t1.u_accept", &[u_accept.len()], &u_accept);
    tr.f32("greedy_draft_t1.u_final", &[u_final.len()], &u_final);
    record_verdict(&mut tr, "greedy_draft_t1.", &verdict, &drafts);
    Ok(tr)
}

/// Writes every tensor of `tr` to `out` (F32 and I64, the golden's dtypes).
pub fn write_trace(tr: &Trace, out: &Path) -> Result<()> {
    let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in &tr.tensors {
        match t {
            TraceTensor::F32 { shape, data } => bufs.push((
                name.clone(),
                Dtype::F32,
                shape.clone(),
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )),
            TraceTensor::I64 { shape, data } => bufs.push((
                name.clone(),
                Dtype::I64,
                shape.clone(),
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )),
            TraceTensor::U8 { shape, data } => bufs.push((name.clone(), Dtype::U8, shape.clone(), data.clone())),
        }
    }
    let views = bufs
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}
