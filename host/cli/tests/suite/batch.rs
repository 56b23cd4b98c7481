//! Batch invariance of the batched forward: a sequence's logits computed inside a mixed batch —
//! other sequences prefilling and decoding, random chunk sizes, sequences joining and leaving —
//! equal its logits computed alone (same chunks, a batch of one) within 1e-5, and greedy decoding
//! picks the same tokens. On all three golden models.

use crate::common::{Golden, max_abs_diff};
use kimi_host::model::{LogitsFor, Model, SeqInput, SequenceState};

/// A small deterministic generator (the test must not depend on a seed source).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One forward call of one sequence inside the batch.
struct Call {
    ids: Vec<u32>,
    logits_for: LogitsFor,
    logits: Vec<f32>,
    /// A decode step: `ids` is the token greedy decoding chose from the previous call.
    decode: bool,
}

struct Live {
    prompt: Vec<u32>,
    prefilled: usize,
    decode_left: usize,
    next: Option<u32>,
    state: SequenceState,
    joins_at: usize,
    id: usize,
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn check_model(name: &str, seed: u64) {
    let g = Golden::open(name);
    let model = Model::load(&g.dir).expect("golden model loads");
    let v = model.text_config().vocab_size;
    let mut rng = Lcg(seed);
    let n = 6;
    let mut live: Vec<Live> = (0..n)
        .map(|id| Live {
            prompt: (0..3 + rng.below(14)).map(|_| rng.below(v) as u32).collect(),
            prefilled: 0,
            decode_left: 2 + rng.below(6),
            next: None,
            state: model.new_state(),
            joins_at: rng.below(5),
            id,
        })
        .collect();
    let mut recorded: Vec<Vec<Call>> = (0..n).map(|_| Vec::new()).collect();
    let mut step = 0;
    let mut widest = 0;
    while !live.is_empty() {
        // This step's entries: decoding sequences feed their last token; prefilling ones a random
        // chunk; some that joined sit this step out.
        let mut ids_per: Vec<(usize, Vec<u32>, LogitsFor)> = Vec::new();
        for (k, s) in live.iter().enumerate() {
            if s.joins_at > step || rng.below(5) == 0 {
                continue;
            }
            let (ids, lf) = if s.prefilled < s.prompt.len() {
                let take = (1 + rng.below(7)).min(s.prompt.len() - s.prefilled);
                let lf = if rng.below(2) == 0 { LogitsFor::AllTokens } else { LogitsFor::LastToken };
                (s.prompt[s.prefilled..s.prefilled + take].to_vec(), lf)
            } else {
                (vec![s.next.expect("a decoding sequence has a next token")], LogitsFor::LastToken)
            };
            ids_per.push((k, ids, lf));
        }
        widest = widest.max(ids_per.len());
        let outs = {
            let mut states: Vec<Option<&mut SequenceState>> = live.iter_mut().map(|s| Some(&mut s.state)).collect();
            let mut inputs: Vec<SeqInput<'_>> = ids_per
                .iter()
                .map(|(k, ids, lf)| SeqInput::new(ids, states[*k].take().expect("once per step"), *lf))
                .collect();
            model.forward_batch(&mut inputs, None).expect("batched forward")
        };
        for ((k, ids, lf), logits) in ids_per.into_iter().zip(outs) {
            let s = &mut live[k];
            let rows = if lf == LogitsFor::AllTokens { ids.len() } else { 1 };
            assert_eq!(logits.len(), rows * v, "{name}: logits rows of sequence {}", s.id);
            let decode = s.prefilled == s.prompt.len();
            if decode {
                s.decode_left -= 1;
            } else {
                s.prefilled += ids.len();
            }
            if s.prefilled == s.prompt.len() {
                s.next = Some(argmax(&logits[logits.len() - v..]));
            }
            recorded[s.id].push(Call { ids, logits_for: lf, logits, decode });
        }
        live.retain(|s| s.prefilled < s.prompt.len() || s.decode_left > 0);
        step += 1;
    }
    assert!(widest >= 3, "{name}: the schedule never mixed three sequences in a step");

    // Each sequence alone, with the same chunks: the same logits, so the same greedy tokens.
    let mut worst = 0f32;
    for (id, calls) in recorded.iter().enumerate() {
        let mut state = model.new_state();
        for (c, call) in calls.iter().enumerate() {
            let alone = model.forward(&call.ids, &mut state, call.logits_for, None).expect("alone");
            let d = max_abs_diff(&alone, &call.logits);
            worst = worst.max(d);
            assert!(d <= 1e-5, "{name}: sequence {id} call {c}: batched vs alone max |Δ| {d}");
            if let Some(next) = calls.get(c + 1).filter(|n| n.decode) {
                assert_eq!(next.ids[0], argmax(&alone[alone.len() - v..]), "{name}: sequence {id}: greedy token");
            }
        }
    }
    eprintln!("{name}: batched vs alone, worst max |Δ| {worst:.2e} over {n} sequences");
}

#[test]
fn a_sequence_in_a_mixed_batch_matches_itself_alone_k3_tiny() {
    check_model("k3-tiny", 1);
}

#[test]
fn a_sequence_in_a_mixed_batch_matches_itself_alone_k3_tiny_mxfp4() {
    check_model("k3-tiny-mxfp4", 2);
}

#[test]
fn a_sequence_in_a_mixed_batch_matches_itself_alone_k31_tiny_indexer() {
    check_model("k31-tiny-indexer", 3);
}

/// Steps of a shape seen before take every activation buffer from the model's pool: the second
/// identical mixed step (a prefill chunk beside decodes) creates no new buffer.
#[test]
fn a_repeated_step_allocates_no_new_buffers() {
    let g = Golden::open("k31-tiny-indexer");
    let model = Model::load(&g.dir).expect("golden model loads");
    let mut states: Vec<SequenceState> = (0..3).map(|_| model.new_state()).collect();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 7 % 50) as u32 + 1).collect();
    let mut created = Vec::new();
    for round in 0..3 {
        let (a, rest) = states.split_at_mut(1);
        let (b, c) = rest.split_at_mut(1);
        let chunk = &prompt[round * 8..round * 8 + 8];
        let mut batch = [
            SeqInput::new(chunk, &mut a[0], LogitsFor::LastToken),
            SeqInput::new(&[5], &mut b[0], LogitsFor::LastToken),
            SeqInput::new(&[9], &mut c[0], LogitsFor::LastToken),
        ];
        model.forward_batch(&mut batch, None).expect("step runs");
        created.push(model.scratch().created());
    }
    assert!(created[0] > 0, "the first step fills the pool");
    assert_eq!(created[1], created[2], "a repeated step created buffers: {created:?}");
}
