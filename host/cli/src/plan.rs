//! `kimi-host plan`: the per-GPU memory plan of a deployment, from `config.json` (and the shard
//! index, to know which experts are MXFP4) — no weights needed.

use std::fmt;
use std::path::Path;

use kimi_host::model::config::load_config;
use kimi_host::model::plan::{Plan, PlanError, PlanRequest, plan};

use crate::inspect::listed_names;

/// The seed deployment's figure for one 1 M-token request on eight MI355X (TP 8, MXFP4
/// experts, FP8 dense), printed beside a plan for comparison.
pub const SEED_PER_GPU_GB: f64 = 199.0;

/// Plans `req` for the checkpoint or config directory `dir`.
pub fn plan_dir(dir: &Path, req: &PlanRequest) -> Result<Plan, PlanError> {
    let config = load_config(dir)?;
    let c = config.text;
    let listed = listed_names(dir)?;
    let packed = |base: &str| match &listed {
        Some((_, names)) => names.contains(&format!("{base}.weight_packed")),
        None => c.mxfp4_declared,
    };
    plan(&c, packed, req)
}

/// A plan as text.
pub struct PlanText<'a>(pub &'a Plan);

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

impl fmt::Display for PlanText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.0;
        writeln!(
            f,
            "{} GPUs of {:.1} GB: tensor parallel {} × context parallel {} ({} replica{}), {} tokens, dense {}, cache {:?}",
            p.gpus,
            gb(p.gpu_memory),
            p.tensor_parallel,
            p.context_parallel,
            p.replicas,
            if p.replicas == 1 { "" } else { "s" },
            p.context,
            if p.fp8_dense { "FP8" } else { "BF16" },
            p.cache
        )?;
        writeln!(f, "per GPU:")?;
        writeln!(f, "  weights                 {:>10.2} GB", gb(p.weight_bytes))?;
        let mut kinds: Vec<(&String, &u64)> = p.weight_bytes_by_kind.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        for (k, b) in kinds {
            writeln!(f, "    {k:<22}{:>10.3} GB", gb(*b))?;
        }
        writeln!(f, "  KDA state / sequence    {:>10.3} GB", gb(p.kda_state_bytes_per_sequence))?;
        writeln!(f, "  latent rows / token     {:>10} B", p.latent_bytes_per_token)?;
        writeln!(f, "  indexer keys / token    {:>10} B", p.indexer_bytes_per_token)?;
        writeln!(
            f,
            "  one sequence            {:>10.2} GB ({} tokens on this GPU)",
            gb(p.bytes_per_sequence),
            p.tokens_per_gpu
        )?;
        writeln!(f, "  activations (estimate)  {:>10.2} GB ({}-token step)", gb(p.activation_bytes), p.step_tokens)?;
        writeln!(
            f,
            "  total with one sequence {:>10.2} GB   (the seed's deployment: ~{SEED_PER_GPU_GB:.0} GB)",
            gb(p.total_for_one_sequence)
        )?;
        writeln!(f, "fits {} sequence{} of {} tokens", p.sequences, if p.sequences == 1 { "" } else { "s" }, p.context)
    }
}
