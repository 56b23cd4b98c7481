//! `kimi-host inspect`: what a checkpoint is and what serving it costs, from `config.json` alone
//! or with its shard index / weights — and whether the loader's name map matches the checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use serde::Serialize;

use kimi_host::model::ModelError;
use kimi_host::model::checkpoint::{Checkpoint, parse_weight_map};
use kimi_host::model::config::{MixerKind, load_config};
use kimi_host::model::forward::{Model, PREFIX};
use kimi_host::model::plan::weight_kind;
use kimi_host::model::weights::NameRecorder;

#[derive(Debug, Serialize)]
pub struct InspectReport {
    pub num_layers: usize,
    pub kda_layers: usize,
    pub mla_layers: usize,
    /// One letter per layer: K = KDA, M = MLA.
    pub mixer_plan: String,
    /// One letter per layer: D = dense MLP, E = latent MoE.
    pub ffn_plan: String,
    /// Layers where AttnRes banks a block snapshot.
    pub snapshot_layers: Vec<usize>,
    pub indexer: Option<String>,
    pub params_by_kind: BTreeMap<String, u64>,
    pub total_params: u64,
    /// Non-routed parameters except the embedding table, plus top-k/E of the routed experts.
    pub activated_params_per_token: u64,
    pub bytes_by_dtype: BTreeMap<String, u64>,
    pub bytes_source: String,
    pub weight_bytes: u64,
    /// This engine's layout: f32 recurrent `[H,K,V]` + f32 conv window (W−1 frames × 3 branches).
    pub kda_state_bytes_per_sequence: u64,
    pub latent_values_per_token_per_mla_layer: usize,
    /// f32 latent rows over all MLA layers (bf16 would be half).
    pub latent_cache_bytes_per_token: u64,
    pub indexer_key_bytes_per_token: u64,
    pub context_tokens: usize,
    /// KDA state + latent cache + indexer keys for one sequence of `context_tokens`.
    pub sequence_bytes_for_context: u64,
    pub name_check: Option<NameCheck>,
    /// Parameters of the vision tower and projector (0 without `vision_config`).
    pub vision_params: u64,
}

#[derive(Debug, Serialize)]
pub struct NameCheck {
    pub source: String,
    pub listed: usize,
    pub needed: usize,
    /// Needed by the text model but not in the checkpoint.
    pub missing: Vec<String>,
    /// `language_model.*` tensors the text model does not use.
    pub unused: Vec<String>,
    /// Tensors of the vision tower and projector (not part of the text model).
    pub vision: usize,
    /// Needed by the vision tower (`vision_config`) but not in the checkpoint.
    pub vision_missing: Vec<String>,
    /// `vision_tower.*` / `mm_projector.*` tensors the tower does not read.
    pub vision_unused: Vec<String>,
    /// Anything else.
    pub other: Vec<String>,
}

impl NameCheck {
    pub fn ok(&self) -> bool {
        self.missing.is_empty()
            && self.unused.is_empty()
            && self.other.is_empty()
            && self.vision_missing.is_empty()
            && self.vision_unused.is_empty()
    }
}

/// Tensor names of the checkpoint in `dir`, from its index (`.json` or `.json.gz`) or its single
/// safetensors file; None when there is neither.
pub fn listed_names(dir: &Path) -> Result<Option<(String, BTreeSet<String>)>, ModelError> {
    let io = |p: &Path, e: std::io::Error| ModelError::Io { path: p.display().to_string(), source: e };
    for file in ["model.safetensors.index.json", "model.safetensors.index.json.gz"] {
        let p = dir.join(file);
        if !p.exists() {
            continue;
        }
        let mut text = String::new();
        let f = std::fs::File::open(&p).map_err(|e| io(&p, e))?;
        if file.ends_with(".gz") {
            flate2::read::GzDecoder::new(f).read_to_string(&mut text).map_err(|e| io(&p, e))?;
        } else {
            std::io::BufReader::new(f).read_to_string(&mut text).map_err(|e| io(&p, e))?;
        }
        let map = parse_weight_map(&text, &p)?;
        return Ok(Some((file.to_string(), map.into_keys().collect())));
    }
    if dir.join("model.safetensors").exists() {
        let ck = Checkpoint::open(dir)?;
        return Ok(Some(("model.safetensors".to_string(), ck.names().cloned().collect())));
    }
    Ok(None)
}

pub fn inspect(dir: &Path, context: Option<usize>) -> Result<InspectReport, ModelError> {
    let config = load_config(dir)?;
    let c = config.text.clone();
    let listed = listed_names(dir)?;
    let mut rec = NameRecorder::new(|base: &str| match &listed {
        Some((_, names)) => names.contains(&format!("{base}.weight_packed")),
        None => c.mxfp4_declared,
    });
    let vision_config = config.vision_config.clone();
    Model::build(config, &mut rec)?;
    // The vision tower and projector, when the checkpoint has one.
    let mut vision_rec = NameRecorder::new(|_: &str| false);
    if let Some(vc) = &vision_config {
        kimi_host::model::vision::record(&kimi_host::model::vision::VisionConfig::parse(vc)?, &mut vision_rec)?;
    }
    let vision_params: u64 = vision_rec.tensors.iter().map(|t| t.params).sum();

    let mut params_by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for t in &rec.tensors {
        *params_by_kind.entry(weight_kind(t, &c).to_string()).or_default() += t.params;
    }
    let total: u64 = params_by_kind.values().sum();
    let routed = params_by_kind.get("routed_experts").copied().unwrap_or(0);
    let embedding = params_by_kind.get("embedding").copied().unwrap_or(0);
    let routed_active = if c.num_experts > 0 { routed * c.experts_per_token as u64 / c.num_experts as u64 } else { 0 };
    let activated = total - routed - embedding + routed_active;

    // Bytes: the real headers when the weights are here, else the release dtypes.
    let (bytes_by_dtype, bytes_source) = match Checkpoint::open(dir) {
        Ok(ck) => (
            ck.bytes_by_dtype().into_iter().map(|(d, b)| (d.name().to_string(), b)).collect::<BTreeMap<_, _>>(),
            "checkpoint headers".to_string(),
        ),
        Err(_) => {
            let mut m = BTreeMap::new();
            for t in rec.tensors.iter().chain(&vision_rec.tensors) {
                *m.entry(t.dtype.name().to_string()).or_default() += t.bytes;
            }
            (m, "estimated from the release storage dtypes (no weights here)".to_string())
        }
    };
    let weight_bytes = bytes_by_dtype.values().sum();

    let kda_state = (c.kda.num_heads * c.kda.head_dim * c.kda.head_dim
        + 3 * (c.kda.conv_kernel - 1) * c.kda_projection_dim()) as u64
        * 4;
    let kda_total = kda_state * c.num_kda_layers() as u64;
    let latent_per_token = (c.latent_width() * c.num_mla_layers() * 4) as u64;
    let index_per_token = c.indexer.as_ref().map_or(0, |ix| (ix.head_dim * c.num_mla_layers() * 4) as u64);
    let context_tokens = context.unwrap_or(c.max_position_embeddings.min(1 << 20));

    let name_check = listed.as_ref().map(|(source, names)| {
        let needed: BTreeSet<&str> = rec.tensors.iter().map(|t| t.name.as_str()).collect();
        let missing = needed.iter().filter(|n| !names.contains(**n)).map(|n| n.to_string()).collect();
        let mut unused = Vec::new();
        let mut other = Vec::new();
        let mut vision = 0;
        let vision_needed: BTreeSet<&str> = vision_rec.tensors.iter().map(|t| t.name.as_str()).collect();
        let vision_missing = vision_needed.iter().filter(|n| !names.contains(**n)).map(|n| n.to_string()).collect();
        let mut vision_unused = Vec::new();
        for n in names {
            if n.starts_with("vision_tower.") || n.starts_with("mm_projector.") {
                vision += 1;
                if !vision_needed.contains(n.as_str()) {
                    vision_unused.push(n.clone());
                }
            } else if n.starts_with(PREFIX) {
                if !needed.contains(n.as_str()) {
                    unused.push(n.clone());
                }
            } else {
                other.push(n.clone());
            }
        }
        NameCheck {
            source: source.clone(),
            listed: names.len(),
            needed: needed.len(),
            missing,
            unused,
            vision,
            vision_missing,
            vision_unused,
            other,
        }
    });

    Ok(InspectReport {
        num_layers: c.num_layers,
        kda_layers: c.num_kda_layers(),
        mla_layers: c.num_mla_layers(),
        mixer_plan: c.layer_kinds.iter().map(|k| if *k == MixerKind::Kda { 'K' } else { 'M' }).collect(),
        ffn_plan: (0..c.num_layers).map(|i| if c.is_moe_layer(i) { 'E' } else { 'D' }).collect(),
        snapshot_layers: (0..c.num_layers).filter(|i| i % c.attn_res_block_size == 0).collect(),
        indexer: c.indexer.as_ref().map(|ix| format!("{} heads × {}, top-{}", ix.n_heads, ix.head_dim, ix.topk)),
        params_by_kind,
        total_params: total,
        activated_params_per_token: activated,
        bytes_by_dtype,
        bytes_source,
        weight_bytes,
        kda_state_bytes_per_sequence: kda_total,
        latent_values_per_token_per_mla_layer: c.latent_width(),
        latent_cache_bytes_per_token: latent_per_token,
        indexer_key_bytes_per_token: index_per_token,
        context_tokens,
        sequence_bytes_for_context: kda_total + (latent_per_token + index_per_token) * context_tokens as u64,
        name_check,
        vision_params,
    })
}

fn human(n: u64) -> String {
    let f = n as f64;
    if f >= 1e12 {
        format!("{:.3} T", f / 1e12)
    } else if f >= 1e9 {
        format!("{:.2} B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.2} M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1} K", f / 1e3)
    } else {
        n.to_string()
    }
}

fn bytes(n: u64) -> String {
    let f = n as f64;
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut i = 0;
    let mut v = f;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2} {} ({n} B)", units[i])
}

/// Compact run-length form of a plan string: "KKKM×23 M".
fn runs(plan: &str, period: usize) -> String {
    let chunks: Vec<&str> = plan.as_bytes().chunks(period).map(|c| std::str::from_utf8(c).unwrap_or("")).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chunks.len() {
        let mut j = i;
        while j < chunks.len() && chunks[j] == chunks[i] {
            j += 1;
        }
        out.push(if j - i > 1 { format!("{}×{}", chunks[i], j - i) } else { chunks[i].to_string() });
        i = j;
    }
    out.join(" ")
}

impl std::fmt::Display for InspectReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "layers: {} ({} KDA, {} MLA)", self.num_layers, self.kda_layers, self.mla_layers)?;
        let period = self.mixer_plan.find('M').map_or(self.num_layers, |p| p + 1).max(1);
        writeln!(f, "mixers: {}   (K = KDA, M = MLA, layer 0 first)", runs(&self.mixer_plan, period))?;
        writeln!(f, "ffn:    {}   (D = dense SiTU MLP, E = latent MoE)", runs(&self.ffn_plan, 1))?;
        writeln!(f, "AttnRes snapshots at layers {:?}", self.snapshot_layers)?;
        if let Some(ix) = &self.indexer {
            writeln!(f, "K3.1 indexer in every MLA layer: {ix}")?;
        }
        writeln!(f, "parameters by module kind:")?;
        for (k, v) in &self.params_by_kind {
            writeln!(f, "  {k:<24} {:>12}  ({v})", human(*v))?;
        }
        writeln!(f, "  {:<24} {:>12}  ({})", "total", human(self.total_params), self.total_params)?;
        writeln!(
            f,
            "  {:<24} {:>12}  ({})",
            "activated per token",
            human(self.activated_params_per_token),
            self.activated_params_per_token
        )?;
        writeln!(f, "weight bytes by dtype ({}):", self.bytes_source)?;
        for (k, v) in &self.bytes_by_dtype {
            writeln!(f, "  {k:<6} {}", bytes(*v))?;
        }
        writeln!(f, "  total  {}", bytes(self.weight_bytes))?;
        writeln!(f, "KDA state per sequence (f32): {}", bytes(self.kda_state_bytes_per_sequence))?;
        writeln!(
            f,
            "latent cache: {} values per token per MLA layer; {} per token over all MLA layers (f32)",
            self.latent_values_per_token_per_mla_layer,
            bytes(self.latent_cache_bytes_per_token)
        )?;
        if self.indexer_key_bytes_per_token > 0 {
            writeln!(f, "indexer keys per token (f32): {}", bytes(self.indexer_key_bytes_per_token))?;
        }
        writeln!(f, "one sequence of {} tokens: {}", self.context_tokens, bytes(self.sequence_bytes_for_context))?;
        writeln!(f, "weights + that sequence: {}", bytes(self.weight_bytes + self.sequence_bytes_for_context))?;
        if self.vision_params > 0 {
            writeln!(
                f,
                "vision tower + projector: {} parameters (BF16, replicated on every rank)",
                self.vision_params
            )?;
        }
        if let Some(nc) = &self.name_check {
            writeln!(
                f,
                "name map vs {}: {} tensors listed, {} needed by the text model, {} missing, {} unused language_model.*, {} vision tower/projector, {} other",
                nc.source,
                nc.listed,
                nc.needed,
                nc.missing.len(),
                nc.unused.len(),
                nc.vision,
                nc.other.len()
            )?;
            for n in nc.missing.iter().take(20) {
                writeln!(f, "  missing: {n}")?;
            }
            for n in nc.unused.iter().take(20) {
                writeln!(f, "  unused:  {n}")?;
            }
            for n in nc.vision_missing.iter().take(20) {
                writeln!(f, "  vision missing: {n}")?;
            }
            for n in nc.vision_unused.iter().take(20) {
                writeln!(f, "  vision unused:  {n}")?;
            }
            for n in nc.other.iter().take(20) {
                writeln!(f, "  other:   {n}")?;
            }
            writeln!(f, "name map: {}", if nc.ok() { "OK" } else { "MISMATCH" })?;
        }
        Ok(())
    }
}
