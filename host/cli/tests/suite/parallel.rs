//! Tensor parallelism on CPU ranks (threads): a model spread over N ranks gives the logits of
//! one rank, the same greedy tokens and indexer selections, and each rank holds only its shard
//! of the weights.
//!
//! The only arithmetic difference is where a row-parallel product's sum is cut: each rank sums
//! its columns, then the all-reduce adds the parts; and the MoE adds its experts' partial sums
//! on each rank before the all-reduce. These random models roughly double a perturbation per
//! layer (measured: 6e-7 → 3e-4 over 8 layers on k3-tiny at TP 2 when products were one chain
//! per output). The packed products sum 16-column blocks pairwise and the ranks' all-reduce adds
//! pairwise too, so a rank holding a power-of-two count of whole blocks reproduces one rank's sum
//! bit for bit; what is left (the MoE's and shared experts' order of adds, products on AMX
//! tiles, whose blocks are 32 columns accumulated in the tile) stays within the 1e-4 on
//! the goldens at every SIMD level (largest measured: 8.3e-5, k3-tiny-mxfp4 TP 2 prefill on the
//! AMX tiles; 6.2e-5 with AVX-512, 2.6e-5 with AVX2). Layer 0 is held to rounding level.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{Golden, max_abs_diff};
use kimi_host::model::forward::{Model, Parallelism};
use kimi_host::model::tiny::{TinyOptions, tiny_config, write_random_checkpoint};
use kimi_host::model::{LogitsFor, ModelError, SeqInput, Trace};

/// TP, EP and CP logits against one rank (see the module docs).
const LOGITS_TOL: f32 = 1e-4;
/// The host-built GPU kernels on TP ranks against the CPU on one: those kernels sum in their own
/// order (per warp and wave), not in the CPU's blocks, so only the goldens' scale applies.
const GPU_KERNELS_TOL: f32 = 1e-3;

/// Prefill of `prompt` (every position's logits), then greedy decode steps, with each decode
/// step's trace (the indexer's selections). Returns (prefill logits, decode logits, traces,
/// greedy tokens).
fn run(model: &Model, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<f32>, Vec<Trace>, Vec<u32>) {
    let v = model.text_config().vocab_size;
    let mut st = model.new_state();
    let prefill = model.forward(prompt, &mut st, LogitsFor::AllTokens, None).expect("prefill");
    let mut next = argmax(&prefill[prefill.len() - v..]);
    let (mut decode, mut traces, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..steps {
        tokens.push(next);
        let mut tr = Trace::default();
        let l = model.forward(&[next], &mut st, LogitsFor::LastToken, Some(&mut tr)).expect("decode");
        next = argmax(&l);
        decode.extend(l);
        traces.push(tr);
    }
    (prefill, decode, traces, tokens)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if *x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn selections(tr: &Trace, layers: usize) -> Vec<Vec<i64>> {
    (0..layers).filter_map(|i| tr.get_i64(&format!("index.layer{i}.selected")).map(|s| s.to_vec())).collect()
}

/// TP = `n` against TP = 1 on the model in `dir`: prefill and decode logits within 1e-4, the
/// same greedy tokens and indexer selections, a mixed two-sequence batch likewise, and the
/// loader's accounting of every rank's shard.
fn check_against_one_rank(dir: &Path, n: usize, prompt: &[u32]) -> (f32, f32) {
    let one = Model::load(dir).expect("model loads");
    let many = Model::load_with(dir, Parallelism::tensor(n)).expect("model loads on ranks");
    assert_eq!(many.ranks().len(), n);
    let layers = one.text_config().num_layers;
    let (p1, d1, t1, g1) = run(&one, prompt, 6);
    let (pn, dn, tn, gn) = run(&many, prompt, 6);
    let (dp, dd) = (max_abs_diff(&p1, &pn), max_abs_diff(&d1, &dn));
    assert!(dp <= LOGITS_TOL, "TP {n}: prefill logits differ by {dp}");
    assert!(dd <= LOGITS_TOL, "TP {n}: decode logits differ by {dd}");
    // Layer 0, before any amplification: rounding level.
    let trace = |m: &Model| {
        let mut tr = Trace::default();
        m.forward(prompt, &mut m.new_state(), LogitsFor::AllTokens, Some(&mut tr)).expect("traced prefill");
        tr
    };
    let (a, b) = (trace(&one), trace(&many));
    for key in ["embedding", "layer0.mixer_output", "layer0.ffn_output"] {
        let (x, y) = (a.get_f32(key).expect("traced"), b.get_f32(key).expect("traced"));
        let scale = x.iter().fold(1f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(x, y);
        assert!(d <= 4.0 * f32::EPSILON * scale * 8.0, "TP {n}: {key} differs by {d} (values up to {scale})");
    }
    assert_eq!(g1, gn, "TP {n}: greedy tokens");
    for (a, b) in t1.iter().zip(&tn) {
        assert_eq!(selections(a, layers), selections(b, layers), "TP {n}: indexer selections");
    }

    // Two sequences in one step: one in prefill, one decoding after its own prompt.
    let mixed = |m: &Model| -> Vec<Vec<f32>> {
        let (mut a, mut b) = (m.new_state(), m.new_state());
        m.forward(&prompt[..3], &mut b, LogitsFor::LastToken, None).expect("b's prompt");
        let mut batch = [
            SeqInput::new(prompt, &mut a, LogitsFor::AllTokens),
            SeqInput::new(&prompt[3..4], &mut b, LogitsFor::LastToken),
        ];
        m.forward_batch(&mut batch, None).expect("mixed step")
    };
    for (x, y) in mixed(&one).iter().zip(&mixed(&many)) {
        let d = max_abs_diff(x, y);
        assert!(d <= LOGITS_TOL, "TP {n}: a mixed batch differs by {d}");
    }

    check_shards(&one, &many);
    (dp, dd)
}

/// Every rank's resident weights are its shard, from the loader's accounting: a replicated
/// tensor whole on every rank, a split one cut so the ranks' parts add up to the stored tensor,
/// no rank holding it all; and each rank's
/// weights (counted from the weights themselves) are exactly what the loader handed it.
fn check_shards(one: &Model, many: &Model) {
    let n = many.ranks().len();
    let whole: BTreeMap<&str, usize> =
        one.ranks()[0].loaded.iter().map(|t| (t.name.as_str(), t.stored_bytes)).collect();
    let mut summed: BTreeMap<&str, usize> = BTreeMap::new();
    let mut split_names = 0;
    for rank in many.ranks() {
        for t in &rank.loaded {
            assert_eq!(whole.get(t.name.as_str()), Some(&t.stored_bytes), "{} is a tensor of the model", t.name);
            if t.split {
                *summed.entry(&t.name).or_default() += t.kept_bytes;
                // At most twice the even share: a dimension of 2 MXFP4 blocks over 4 ranks is
                // the worst case here (half on each of two ranks, nothing on the others).
                let (r, kept, stored) = (rank.shard.rank, t.kept_bytes, t.stored_bytes);
                assert!(kept < stored && kept * n <= 2 * stored, "{}: rank {r} keeps {kept} of {stored}", t.name);
            } else {
                assert_eq!(t.kept_bytes, t.stored_bytes, "{} is replicated whole", t.name);
            }
        }
        let matrices: usize = rank.loaded.iter().filter(|t| t.matrix).map(|t| t.kept_bytes).sum();
        assert_eq!(rank.matrix_bytes(), matrices, "rank {}: weights held = weights loaded", rank.shard.rank);
        let total: usize = rank.loaded.iter().filter(|t| t.matrix).map(|t| t.stored_bytes).sum();
        assert!(matrices < total, "rank {} holds less than the whole model", rank.shard.rank);
    }
    for (name, kept) in &summed {
        assert_eq!(*kept, whole[name], "{name}: the ranks' parts add up to the tensor");
        split_names += 1;
    }
    assert!(split_names > 0);
    for needle in ["o_proj", "experts.0.w2", "lm_head", "embed_tokens", "q_b_proj", "kv_b_proj", "q_proj"] {
        assert!(summed.keys().any(|k| k.contains(needle)), "{needle} is split");
    }
}

fn golden_prompt(g: &Golden) -> Vec<u32> {
    g.ids("decode.prompt_input_ids")
}

#[test]
fn tensor_parallel_2_and_4_equal_one_rank_on_the_goldens() {
    for name in ["k3-tiny", "k3-tiny-mxfp4", "k31-tiny-indexer"] {
        let g = Golden::open(name);
        let prompt = golden_prompt(&g);
        for n in [2, 4] {
            let (dp, dd) = check_against_one_rank(&g.dir, n, &prompt);
            eprintln!("{name} TP {n}: max |Δ logits| prefill {dp:.2e}, decode {dd:.2e}");
        }
        // The goldens themselves, through TP 2.
        let many = Model::load_with(&g.dir, Parallelism::tensor(2)).expect("loads");
        let mut st = many.new_state();
        let steps = g.ids("decode.input_ids");
        many.forward(&prompt, &mut st, LogitsFor::AllTokens, None).expect("prefill");
        let mut logits = Vec::new();
        for &id in &steps {
            logits.extend(many.forward(&[id], &mut st, LogitsFor::AllTokens, None).expect("decode"));
        }
        let d = common::assert_close("decode.logits", &logits, &g.f32("decode.logits"), g.tol_logits());
        eprintln!("{name} TP 2 against the golden: {d:.2e} (tolerance {:.1e})", g.tol_logits());
    }
}

#[test]
fn tensor_parallel_3_splits_uneven_dimensions() {
    // 3 KDA and 3 MLA heads; dense intermediate 112, expert intermediate 160 (5 MXFP4 blocks:
    // 2, 2, 1), shared experts 160, hidden 256 and vocabulary 512: none divides by 3.
    let mut cfg = tiny_config(&TinyOptions { seed: 7, k31: true, mxfp4: true, vision: false });
    let t = &mut cfg["text_config"];
    t["linear_attn_config"]["num_heads"] = 3.into();
    t["num_attention_heads"] = 3.into();
    t["num_key_value_heads"] = 3.into();
    t["intermediate_size"] = 112.into();
    t["moe_intermediate_size"] = 160.into();
    t["index_topk"] = 8.into();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(dir.path(), &cfg, 7, true).expect("random model");
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 % 250) as u32 + 3).collect();
    let (dp, dd) = check_against_one_rank(dir.path(), 3, &prompt);
    eprintln!("uneven TP 3: max |Δ logits| prefill {dp:.2e}, decode {dd:.2e}");

    match Model::load_with(dir.path(), Parallelism::tensor(2)) {
        Err(ModelError::Parallel { msg }) => assert!(msg.contains("heads"), "{msg}"),
        Err(e) => panic!("TP 2 of 3 heads: wrong error {e}"),
        Ok(_) => panic!("TP 2 of 3 heads must be refused"),
    }
}

/// Context parallelism over the tensor-parallel ranks against the same ranks without it: each
/// group of `c` consecutive ranks splits the latent pages (every rank holds every c-th page of
/// its group); the indexer's selections must be identical and the logits within 1e-4 (only the
/// attention's softmax is regrouped, by rank).
fn check_context_parallel(dir: &Path, n: usize, c: usize, prompt: &[u32]) -> f32 {
    let plain = Model::load_with(dir, Parallelism::tensor(n)).expect("TP");
    let cp = Model::load_with(dir, Parallelism { tensor: n, context: c, expert: false }).expect("TP with CP");
    assert_eq!(cp.cache_replicas(), n / c, "one copy of each page per group");
    let layers = plain.text_config().num_layers;
    let topk = plain.text_config().indexer.as_ref().map_or(0, |ix| ix.topk);
    assert!(prompt.len() > topk, "the sequence must outgrow the indexer's top-k ({topk})");
    let (p1, d1, t1, g1) = run(&plain, prompt, 6);
    let (p2, d2, t2, g2) = run(&cp, prompt, 6);
    assert_eq!(g1, g2, "CP {c} of TP {n}: greedy tokens");
    let mut pruned = 0;
    for (a, b) in t1.iter().zip(&t2) {
        let (sa, sb) = (selections(a, layers), selections(b, layers));
        assert_eq!(sa, sb, "CP {c} of TP {n}: indexer selections");
        pruned += sa.iter().filter(|s| s.len() == topk).count();
    }
    assert!(pruned > 0, "the indexer pruned positions");
    // Pages really are split: rank 0 holds about 1/c of them.
    let mut st = cp.new_state();
    cp.forward(prompt, &mut st, LogitsFor::LastToken, None).expect("prefill");
    let mla = (0..layers).find(|&i| st.mla(i).is_some()).expect("an MLA layer");
    let held = st.mla(mla).expect("cache").pages();
    assert_eq!(held, prompt.len().div_ceil(16).div_ceil(c), "rank 0 holds every {c}-th page");
    let d = max_abs_diff(&p1, &p2).max(max_abs_diff(&d1, &d2));
    assert!(d <= LOGITS_TOL, "CP {c} of TP {n}: logits differ by {d}");
    d
}

#[test]
fn context_parallel_2_and_3_equal_one_cache_per_rank() {
    let g = Golden::open("k31-tiny-indexer");
    let mut prompt = golden_prompt(&g);
    while prompt.len() < 100 {
        prompt.extend_from_within(..prompt.len().min(100 - prompt.len()));
    }
    let d = check_context_parallel(&g.dir, 2, 2, &prompt);
    eprintln!("k31-tiny-indexer CP 2: max |Δ logits| {d:.2e}");
    // Two groups of two: each group keeps one copy of the pages, split between its ranks.
    let d = check_context_parallel(&g.dir, 4, 2, &prompt);
    eprintln!("k31-tiny-indexer CP 2 of TP 4: max |Δ logits| {d:.2e}");

    let mut cfg = tiny_config(&TinyOptions { seed: 9, k31: true, mxfp4: false, vision: false });
    let t = &mut cfg["text_config"];
    t["linear_attn_config"]["num_heads"] = 3.into();
    t["num_attention_heads"] = 3.into();
    t["num_key_value_heads"] = 3.into();
    t["index_topk"] = 8.into();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(dir.path(), &cfg, 9, false).expect("random model");
    let prompt: Vec<u32> = (0..70).map(|i| (i * 53 % 250) as u32 + 3).collect();
    let d = check_context_parallel(dir.path(), 3, 3, &prompt);
    eprintln!("3-head model CP 3: max |Δ logits| {d:.2e}");

    match Model::load_with(dir.path(), Parallelism { tensor: 3, context: 2, expert: false }) {
        Err(ModelError::Parallel { msg }) => assert!(msg.contains("context-parallel"), "{msg}"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("CP 2 of TP 3 is refused (2 does not divide 3)"),
    }
}

#[test]
fn expert_parallel_places_whole_experts_and_equals_one_rank() {
    for (name, n) in [("k3-tiny", 2), ("k3-tiny-mxfp4", 4)] {
        let g = Golden::open(name);
        let prompt = golden_prompt(&g);
        let one = Model::load(&g.dir).expect("model");
        let ep = Model::load_with(&g.dir, Parallelism { tensor: n, context: 1, expert: true }).expect("EP");
        let (p1, d1, _, g1) = run(&one, &prompt, 4);
        let (p2, d2, _, g2) = run(&ep, &prompt, 4);
        let d = max_abs_diff(&p1, &p2).max(max_abs_diff(&d1, &d2));
        eprintln!("{name} EP {n}: max |Δ logits| {d:.2e}");
        assert!(d <= LOGITS_TOL, "{name} EP {n}: {d}");
        assert_eq!(g1, g2);
        // Each rank holds E / n whole experts: expert tensors are never cut, and each is on one rank.
        let experts = one.text_config().num_experts;
        let mut holders: BTreeMap<&str, usize> = BTreeMap::new();
        for rank in ep.ranks() {
            let mine: Vec<&str> =
                rank.loaded.iter().filter(|t| t.name.contains(".experts.")).map(|t| t.name.as_str()).collect();
            assert!(rank.loaded.iter().filter(|t| t.name.contains(".experts.")).all(|t| !t.split));
            let layer1 = mine
                .iter()
                .filter(|t| {
                    t.contains("layers.1.") && t.ends_with("w1.weight")
                        || t.contains("layers.1.") && t.ends_with("w1.weight_packed")
                })
                .count();
            assert_eq!(layer1, experts / n, "rank {}: its experts of layer 1", rank.shard.rank);
            for t in mine {
                *holders.entry(t).or_default() += 1;
            }
        }
        assert!(holders.values().all(|&h| h == 1), "every expert tensor on exactly one rank");
    }
}

/// TP = 2 with the GPU kernels (`kernels/ops/*.cu` built for the host, the GPU backend over it:
/// `host_backend`) on both CPU ranks equals TP = 1 on the CPU backend: prefill and decode logits within the bound above,
/// the same greedy tokens and (K3.1) the same indexer selections — at AMD's wave 64 and NVIDIA's
/// wave 32. The prompt is the golden's 7-token trace (each GPU thread is an OS thread here).
#[test]
fn tensor_parallel_2_through_the_host_built_gpu_kernels_equals_one_rank() {
    use kimi_kpl_host::host_backend;
    for (name, wave) in [("k3-tiny-mxfp4", 64), ("k31-tiny-indexer", 32)] {
        let g = Golden::open(name);
        let prompt = g.ids("trace.len7.input_ids");
        let one = Model::load(&g.dir).expect("model loads");
        let two = Model::load_with(&g.dir, Parallelism::tensor(2))
            .expect("model loads on 2 ranks")
            .with_backend(std::sync::Arc::new(host_backend(wave)));
        assert_eq!(two.ranks().len(), 2);
        let layers = one.text_config().num_layers;
        let (p1, d1, t1, g1) = run(&one, &prompt, 4);
        let (p2, d2, t2, g2) = run(&two, &prompt, 4);
        let (dp, dd) = (max_abs_diff(&p1, &p2), max_abs_diff(&d1, &d2));
        eprintln!("{name} TP 2 on {}: max |Δ logits| prefill {dp:.2e}, decode {dd:.2e}", two.backend().describe());
        assert!(dp <= GPU_KERNELS_TOL && dd <= GPU_KERNELS_TOL, "{name}: TP 2 on the kernels differs by {dp} / {dd}");
        assert_eq!(g1, g2, "{name}: greedy tokens");
        for (a, b) in t1.iter().zip(&t2) {
            assert_eq!(selections(a, layers), selections(b, layers), "{name}: indexer selections");
        }
    }
}
