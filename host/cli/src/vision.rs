//! `kimi-host vision`: runs a vision golden case's procedure (`case.json`: its images and clip,
//! the processor limits of the model's `preprocessor_config.json`, the end-to-end prompt) through
//! the public APIs — preprocessing, one packed tower call, merge and projector, `<|media_pad|>`
//! expansion and the text model over the merged embeddings — and names every tensor it computes
//! as the golden does. Inputs taken from the case: the raw images and the end-to-end prompt ids.

use std::path::Path;

use anyhow::{Context, Result, bail};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use kimi_host::model::batch::EmbedRows;
use kimi_host::model::vision::{Image, VisionInput, VisionModel, expand_media_pads};
use kimi_host::model::{LogitsFor, Model, SeqInput, Trace};

#[derive(Deserialize)]
struct CaseWire {
    items: Vec<ItemWire>,
    e2e: Option<E2eWire>,
}

#[derive(Deserialize)]
struct ItemWire {
    name: String,
    grid_thw: [usize; 3],
}

#[derive(Deserialize)]
struct E2eWire {
    images_in_prompt: Vec<String>,
}

/// The case's raw images: `input.{name}.rgb|rgba` `[H, W, C]` and `input.{clip}.frame{k}.rgb`.
fn input_image(st: &SafeTensors<'_>, name: &str) -> Result<Option<Image>> {
    for (suffix, channels) in [("rgb", 3), ("rgba", 4)] {
        if let Ok(t) = st.tensor(&format!("{name}.{suffix}")) {
            if t.dtype() != Dtype::U8 || t.shape().len() != 3 || t.shape()[2] != channels {
                bail!("input `{name}.{suffix}` is not a uint8 [H, W, {channels}] image");
            }
            let (h, w) = (t.shape()[0], t.shape()[1]);
            return Ok(Some(Image { width: w, height: h, channels, data: t.data().to_vec() }));
        }
    }
    Ok(None)
}

/// Runs the case in `case_dir` with the vision model `vm` and, for the end-to-end part, the
/// text model `text`.
pub fn run_case(vm: &VisionModel, text: Option<&Model>, case_dir: &Path) -> Result<Trace> {
    let case: CaseWire = {
        let p = case_dir.join("case.json");
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let mut de = serde_json::Deserializer::from_str(&s);
        serde_path_to_error::deserialize(&mut de).with_context(|| format!("{}", p.display()))?
    };
    let bytes = std::fs::read(case_dir.join("golden.safetensors")).context("golden.safetensors")?;
    let st = SafeTensors::deserialize(&bytes).context("golden.safetensors")?;
    let mut tr = Trace::default();
    let cfg = &vm.media;
    let p = cfg.patch_size;
    let be = kimi_kernels::CpuBackend;
    let backend: &dyn kimi_kernels::Backend = match text {
        Some(m) => m.backend(),
        None => &be,
    };
    let mut items = Vec::new();
    let mut batch_grids = Vec::new();
    for it in &case.items {
        let pre = format!("preproc.{}", it.name);
        if let Some(img) = input_image(&st, &format!("input.{}", it.name))? {
            let out = vm.preprocess(&img);
            let pl = out.plan;
            let (hp, wp) = (pl.new_height + pl.pad_height, pl.new_width + pl.pad_width);
            let g = out.input.grid_thw;
            tr.i64(
                format!("{pre}.resize_plan"),
                &[5],
                [pl.new_width, pl.new_height, pl.pad_width, pl.pad_height, pl.num_tokens].map(|v| v as i64).to_vec(),
            );
            tr.u8(format!("{pre}.resized_padded_u8"), &[hp, wp, 3], out.padded.clone());
            tr.f32(format!("{pre}.pixel_values"), &[out.input.patches(), 3, p, p], &out.input.pixel_values);
            tr.i64(format!("{pre}.grid_thw"), &[3], g.map(|v| v as i64).to_vec());
            batch_grids.extend(g.map(|v| v as i64));
            items.push(out.input);
        } else {
            // A clip: its frames processed one by one, concatenated frame-major.
            let frames = (0..)
                .map_while(|k| input_image(&st, &format!("input.{}.frame{k}", it.name)).transpose())
                .collect::<Result<Vec<_>>>()?;
            if frames.is_empty() {
                bail!("item `{}` has no input image or frames", it.name);
            }
            let processed: Vec<VisionInput> = frames.iter().map(|f| vm.preprocess(f).input).collect();
            let clip = VisionInput::clip(&processed).context("clip frames of different sizes")?;
            tr.f32(format!("{pre}.pixel_values"), &[clip.patches(), 3, p, p], &clip.pixel_values);
            tr.i64(format!("{pre}.grid_thw"), &[3], clip.grid_thw.map(|v| v as i64).to_vec());
            items.push(clip);
        }
        if items.last().map(|i| i.grid_thw) != Some(it.grid_thw) {
            eprintln!(
                "note: item `{}` has grid {:?}, the case lists {:?}",
                it.name,
                items.last().map(|i| i.grid_thw),
                it.grid_thw
            );
        }
    }
    tr.i64("preproc.batch.grid_thws", &[batch_grids.len() / 3, 3], batch_grids);
    let total: usize = items.iter().map(VisionInput::patches).sum();
    let all: Vec<f32> = items.iter().flat_map(|i| i.pixel_values.iter().copied()).collect();
    tr.f32("tower.pixel_values", &[total, 3, p, p], &all);
    let grids: Vec<i64> = items.iter().flat_map(|i| i.grid_thw.map(|v| v as i64)).collect();
    tr.i64("tower.grid_thws", &[items.len(), 3], grids);
    let rows = vm.encode(backend, &items, Some(&mut tr))?;
    let tokens: Vec<usize> = items.iter().map(VisionInput::tokens).collect();
    tr.i64("tokens_per_item", &[tokens.len()], tokens.iter().map(|&t| t as i64).collect());

    if let (Some(e2e), Some(model)) = (&case.e2e, text) {
        let t = st.tensor("e2e.input_ids").context("input `e2e.input_ids`")?;
        if t.dtype() != Dtype::I64 {
            bail!("e2e.input_ids is not int64");
        }
        let ids: Vec<u32> =
            t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as u32).collect();
        tr.i64("e2e.input_ids", &[ids.len()], ids.iter().map(|&t| i64::from(t)).collect());
        let pad =
            model.config.media_placeholder_token_id.context("the text model has no media_placeholder_token_id")?;
        // The prompt's images, in order: their rows of the projector output.
        let d = vm.config.text_hidden_size;
        let mut starts = Vec::new();
        let mut at = 0;
        for (it, n) in case.items.iter().zip(&tokens) {
            starts.push((it.name.as_str(), at, *n));
            at += n;
        }
        let mut merged_rows = Vec::new();
        let mut counts = Vec::new();
        for name in &e2e.images_in_prompt {
            let &(_, start, n) = starts.iter().find(|s| s.0 == name).with_context(|| format!("no item `{name}`"))?;
            merged_rows.extend_from_slice(&rows[start * d..(start + n) * d]);
            counts.push(n);
        }
        let (expanded, image_rows) = expand_media_pads(&ids, pad, &counts)?;
        tr.i64("e2e.expanded_input_ids", &[expanded.len()], expanded.iter().map(|&t| i64::from(t)).collect());
        let mut state = model.new_state();
        let mut inner = Trace::default();
        let mut seq = SeqInput::new(&expanded, &mut state, LogitsFor::AllTokens);
        seq.embeds = Some(EmbedRows { at: &image_rows, rows: &merged_rows });
        let logits = model.forward_batch(&mut [seq], Some(&mut inner))?.pop().unwrap_or_default();
        let embeds = inner.get_f32("embedding").context("the forward traced no embedding")?;
        tr.f32("e2e.inputs_embeds", &[expanded.len(), d], embeds);
        tr.f32("e2e.logits", &[expanded.len(), model.config.text.vocab_size], &logits);
    }
    Ok(tr)
}
