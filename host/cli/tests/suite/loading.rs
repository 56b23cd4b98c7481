//! Config parsing and checkpoint loading: every failure names the key or the tensor, with the
//! expected and the found value; sharded checkpoints load like single files.

use crate::common;

use std::path::Path;

use kimi_host::model::config::{MixerKind, parse_config};
use kimi_host::model::{LogitsFor, Model, ModelError};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use serde_json::Value;

fn release_config() -> Value {
    let text = std::fs::read_to_string(common::golden_dir().join("k3-release-config/config.json")).expect("config");
    serde_json::from_str(&text).expect("json")
}

fn parse(v: &Value) -> Result<kimi_host::model::ModelConfig, ModelError> {
    parse_config(&v.to_string())
}

#[test]
fn release_config_layer_lists_are_one_indexed() {
    let c = parse(&release_config()).expect("release config parses").text;
    assert_eq!(c.num_layers, 93);
    let mla: Vec<usize> = (0..93).filter(|&i| c.layer_kinds[i] == MixerKind::Mla).collect();
    let mut want: Vec<usize> = (0..23).map(|j| 4 * j + 3).collect();
    want.push(92);
    assert_eq!(mla, want, "MLA at 0-indexed 3, 7, …, 91 and 92");
    assert_eq!(c.num_kda_layers(), 69);
    assert!(!c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(92));
    assert_eq!(c.latent_width(), 576);
    assert!(c.indexer.is_none(), "K3 has no indexer keys");
    assert!(c.mxfp4_declared);
    assert_eq!(c.situ_beta, 4.0);
    assert_eq!(c.situ_linear_beta, Some(25.0));
}

fn expect_config_error(v: &Value, key: &str) {
    match parse(v) {
        Err(ModelError::Config { key: k, .. }) => assert_eq!(k, key),
        other => panic!("expected a config error naming {key}, got {other:?}"),
    }
}

#[test]
fn missing_and_inconsistent_keys_are_named() {
    let mut v = release_config();
    v["text_config"].as_object_mut().expect("object").remove("hidden_size");
    expect_config_error(&v, "text_config.hidden_size");

    let mut v = release_config();
    v["text_config"]["linear_attn_config"]["kda_layers"][0] = Value::from(4); // 4 is also MLA
    expect_config_error(&v, "text_config.linear_attn_config.full_attn_layers");

    let mut v = release_config();
    v["text_config"]["linear_attn_config"]["kda_layers"].as_array_mut().expect("list").pop(); // 91 in neither
    expect_config_error(&v, "text_config.linear_attn_config.kda_layers");

    let mut v = release_config();
    v["text_config"]["linear_attn_config"]["full_attn_layers"][23] = Value::from(94); // past the end
    expect_config_error(&v, "text_config.linear_attn_config.full_attn_layers");

    let mut v = release_config();
    v["text_config"]["num_experts_per_token"] = Value::from(1000);
    expect_config_error(&v, "text_config.num_experts_per_token");

    let mut v = release_config();
    v["text_config"]["index_n_heads"] = Value::from(64);
    v["text_config"]["index_topk"] = Value::from(2048);
    expect_config_error(&v, "text_config.index_head_dim");

    let mut v = release_config();
    v["text_config"]["rms_norm_eps"] = Value::from("small");
    expect_config_error(&v, "text_config.rms_norm_eps");
}

#[test]
fn unimplemented_architectures_are_refused_by_name() {
    for (path, value) in [
        (vec!["model_type"], "deepseek_v3"),
        (vec!["text_config", "model_type"], "kimi_vl"),
        (vec!["text_config", "hidden_act"], "silu"),
        (vec!["text_config", "topk_method"], "greedy"),
    ] {
        let mut v = release_config();
        let mut slot = &mut v;
        for p in &path {
            slot = &mut slot[*p];
        }
        *slot = Value::from(value);
        match parse(&v) {
            Err(ModelError::Unsupported(msg)) => assert!(msg.contains(value), "{msg}"),
            other => panic!("{path:?} = {value}: expected Unsupported, got {other:?}"),
        }
    }
}

/// Copies a golden model into a temp dir, letting `edit` rewrite the tensor list.
fn edited_copy(
    case: &str,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let src = common::golden_dir().join(case);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).expect("copy config");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("golden model parses");
    let mut tensors: Vec<_> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    write_tensors(&dir.path().join("model.safetensors"), &tensors);
    dir
}

fn write_tensors(path: &Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view"))).collect();
    safetensors::serialize_to_file(views, None, path).expect("write");
}

const Q_PROJ: &str = "language_model.model.layers.1.self_attn.q_proj.weight";

fn load_err(dir: &Path) -> ModelError {
    match Model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let dir = edited_copy("k3-tiny", |ts| {
        let t = ts.iter_mut().find(|t| t.0 == Q_PROJ).expect("q_proj");
        t.2 = vec![t.2[1], t.2[0]];
    });
    let e = load_err(dir.path());
    match &e {
        ModelError::Shape { name, expected, found } => {
            assert_eq!(name, Q_PROJ);
            assert_eq!(expected, &vec![64, 128]);
            assert_eq!(found, &vec![128, 64]);
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(Q_PROJ) && msg.contains("[64, 128]") && msg.contains("[128, 64]"), "{msg}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited_copy("k3-tiny", |ts| ts.retain(|t| t.0 != Q_PROJ));
    match load_err(dir.path()) {
        ModelError::MissingTensor { name } => assert_eq!(name, Q_PROJ),
        other => panic!("expected a missing-tensor error, got {other:?}"),
    }
}

#[test]
fn wrong_dtype_names_tensor_expected_and_found() {
    let dir = edited_copy("k3-tiny", |ts| {
        let t = ts.iter_mut().find(|t| t.0 == Q_PROJ).expect("q_proj");
        t.1 = safetensors::Dtype::F16;
    });
    match load_err(dir.path()) {
        ModelError::Dtype { name, expected, found } => {
            assert_eq!(name, Q_PROJ);
            assert_eq!(expected, "BF16 or F32");
            assert_eq!(found, "F16");
        }
        other => panic!("expected a dtype error, got {other:?}"),
    }
}

#[test]
fn truncated_file_names_the_tensor_cut_off() {
    let dir = edited_copy("k3-tiny", |_| {});
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).expect("meta").len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    f.set_len(len - 1000).expect("truncate");
    match load_err(dir.path()) {
        ModelError::Truncated { name, need, have, .. } => {
            assert!(name.starts_with("language_model."), "{name}");
            assert_eq!(have, len - 1000);
            assert!(need > have);
        }
        other => panic!("expected a truncation error, got {other:?}"),
    }
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    let single = common::golden_dir().join("k3-tiny-mxfp4");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(single.join("config.json"), dir.path().join("config.json")).expect("copy");
    let bytes = std::fs::read(single.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<_> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half = tensors.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        write_tensors(&dir.path().join(&file), part);
        for t in part.iter() {
            map.insert(t.0.clone(), Value::from(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).expect("index");

    let ids = [5u32, 17, 200, 3, 99];
    let a = Model::load(&single).expect("single");
    let b = Model::load(dir.path()).expect("sharded");
    let la = a.forward(&ids, &mut a.new_state(), LogitsFor::AllTokens, None).expect("forward");
    let lb = b.forward(&ids, &mut b.new_state(), LogitsFor::AllTokens, None).expect("forward");
    assert_eq!(la, lb);

    // An index naming a tensor its shard lacks is an error naming that tensor.
    let moved = tensors[half].0.clone();
    let mut bad = serde_json::json!({"weight_map": map});
    bad["weight_map"][&moved] = Value::from("model-00001-of-00002.safetensors");
    std::fs::write(dir.path().join("model.safetensors.index.json"), bad.to_string()).expect("index");
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains(&moved), "{msg}");
}

#[test]
fn out_of_range_ids_are_an_error_not_a_panic() {
    let m = Model::load(&common::golden_dir().join("k3-tiny")).expect("load");
    match m.forward(&[1, 256], &mut m.new_state(), LogitsFor::AllTokens, None) {
        Err(ModelError::TokenOutOfRange { id: 256, vocab: 256 }) => {}
        other => panic!("expected TokenOutOfRange, got {:?}", other.map(|v| v.len())),
    }
}
