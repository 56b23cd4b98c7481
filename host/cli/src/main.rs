//! `kimi-host` command line.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use safetensors::{Dtype, tensor::TensorView};

use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::model::{LogitsFor, Model, Parallelism, WeightFormat};
use kimi_host::server::tenants::PluginRef;
use kimi_host::tokenizer::Tokenizer;
use kimi_host_cli::bench::{argmax, bench_forward};
use kimi_host_cli::bench_tokenizer::bench_tokenizer;
use kimi_host_cli::inspect::inspect;

#[derive(Parser)]
#[command(name = "kimi-host", version, about = "Inference host for the Kimi-K3 model family")]
struct Cli {
    /// Log lines on stderr as text or JSON (one object per line). Filter with `RUST_LOG`
    /// (e.g. `info`, `kimi_host=debug`); the default is `info` for `serve`, `warn` otherwise.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Installs the log subscriber (stderr; stdout stays for command output).
fn init_logging(format: LogFormat, default_level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // A second init (never happens in the binary) would only be refused; nothing to handle.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).try_init(),
    };
}

#[derive(Subcommand)]
enum Command {
    /// Describe a checkpoint: layer plan, parameters, bytes, state and cache sizes, name-map check.
    /// Works on a directory holding only config.json (plus, optionally, the shard index).
    Inspect {
        /// Checkpoint directory (config.json, and optionally the index or weights).
        model_dir: PathBuf,
        /// Context length for the memory estimate (default: min(max_position_embeddings, 1M)).
        #[arg(long)]
        context: Option<usize>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Per-GPU memory plan of a deployment: weights by kind, KDA state per sequence, latent and
    /// indexer bytes per token, activations, and how many sequences of a context fit. Refuses
    /// (non-zero exit) a plan that does not fit, naming the term.
    Plan {
        /// Checkpoint or config directory (config.json, optionally the shard index).
        model_dir: PathBuf,
        #[arg(long, default_value_t = 8)]
        gpus: usize,
        /// Memory per GPU, e.g. 288GB or 192GiB.
        #[arg(long, default_value = "288GB")]
        gpu_memory: String,
        /// Context tokens per sequence.
        #[arg(long, default_value_t = 1_000_000)]
        context: usize,
        /// Default: every GPU.
        #[arg(long)]
        tensor_parallel: Option<usize>,
        /// Ranks of the tensor-parallel group that split a sequence's latent cache by tokens.
        #[arg(long, default_value_t = 1)]
        context_parallel: usize,
        /// Requantise attention, dense and shared-expert linears to FP8.
        #[arg(long)]
        fp8_dense: bool,
        /// Whole routed experts per GPU (a contiguous range) instead of a slice of each.
        #[arg(long)]
        expert_parallel: bool,
        /// Latent cache storage: bf16, fp8 or f32.
        #[arg(long, default_value = "bf16")]
        kv_cache_dtype: String,
        /// Tokens of the largest step (prefill chunk), for the activation estimate.
        #[arg(long, default_value_t = 8192)]
        step_tokens: usize,
        #[arg(long)]
        json: bool,
    },
    /// Run a DSpark golden case's procedure (its case.json: target prefill with aux taps, draft
    /// context rows, block pass, Markov walks, verify with KDA snapshots, acceptance, rollback)
    /// and write every tensor it computes, named as the golden names them.
    Speculate {
        /// Target checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// DSpark draft directory (config.json and safetensors).
        #[arg(long)]
        draft: PathBuf,
        /// Case directory (case.json; golden.safetensors for the prompt and stored uniforms).
        #[arg(long)]
        case: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run a vision golden case's procedure (its case.json: preprocessing of its images and clip,
    /// one packed tower call, merge and projector, `<|media_pad|>` expansion and the text model
    /// over the merged embeddings) and write every tensor it computes, named as the golden does.
    Vision {
        /// Checkpoint with the vision tower (config.json with `vision_config`, its safetensors,
        /// preprocessor_config.json).
        #[arg(long)]
        model: PathBuf,
        /// Text model for the end-to-end part (default: `--model` itself).
        #[arg(long)]
        text_model: Option<PathBuf>,
        /// Case directory (case.json; golden.safetensors for the images and prompt ids).
        #[arg(long)]
        case: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Write prefill (and cached decode) logits to a safetensors file.
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids as a JSON array, e.g. "[1,2,3]" (or @file holding one).
        #[arg(long)]
        prompt_ids: String,
        /// Ids fed one per cached decode step after the prompt, as a JSON array.
        #[arg(long)]
        decode_ids: Option<String>,
        /// Output file: `prefill_logits` [T, V] and, with --decode-ids, `decode_logits` [N, V].
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        spread: ModelArgs,
    },
    /// Greedy generation; prints one id per line.
    Generate {
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids as a JSON array (or @file).
        #[arg(long)]
        prompt_ids: String,
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        /// Keep going after the end-of-message token.
        #[arg(long)]
        ignore_eos: bool,
        #[command(flatten)]
        spread: ModelArgs,
    },
    /// Write a small random checkpoint in the real Kimi-K3 layout.
    MakeTiny {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// K3.1: add the lightning indexer to every MLA layer.
        #[arg(long)]
        k31: bool,
        /// Store routed experts as MXFP4.
        #[arg(long)]
        mxfp4: bool,
        /// Add a tiny MoonViT3d tower and projector so the model sees images.
        #[arg(long)]
        vision: bool,
    },
    /// Write a random DSpark draft (Inferact layout) for the checkpoint in --target: every
    /// speculative code path runs on it, though it proposes little the target accepts.
    MakeDraft {
        #[arg(long)]
        target: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Draft decoder layers.
        #[arg(long, default_value_t = 2)]
        layers: usize,
    },
    /// Encode text to ids (or decode ids to text).
    Tokenize {
        /// Directory with tiktoken.model (and optionally tokenizer_config.json).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Text to encode (plain text: special-token spellings stay ordinary text).
        #[arg(long, conflicts_with_all = ["file", "decode"])]
        text: Option<String>,
        /// File whose contents to encode.
        #[arg(long, conflicts_with = "decode")]
        file: Option<PathBuf>,
        /// Ids to decode, as a JSON array.
        #[arg(long)]
        decode: Option<String>,
        /// Recognise special-token spellings in the text (raw prompts only).
        #[arg(long)]
        allow_special: bool,
        /// Print ids as a JSON array (default: space-separated).
        #[arg(long)]
        json: bool,
    },
    /// Render an OpenAI chat-completions request to prompt ids with a template plugin.
    Render {
        /// Directory with tiktoken.model (and optionally tokenizer_config.json).
        #[arg(long)]
        tokenizer: PathBuf,
        /// The request body (JSON file).
        #[arg(long)]
        request: PathBuf,
        /// Template plugin: builtin:<name> or a component file.
        #[arg(long, default_value = "builtin:template-kimi-k3")]
        template: String,
    },
    /// Serve the OpenAI-compatible API. With no arguments: the embedded tiny model, the builtin
    /// plugins and one local tenant on 127.0.0.1:8000.
    Serve {
        /// Configuration file (see examples/kimi-host.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Checkpoint directory (overrides the file's `model`).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Listen address (overrides the file's `listen`).
        #[arg(long)]
        listen: Option<String>,
        #[command(flatten)]
        overrides: ServeOverrides,
    },
    /// Plugin tools.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// GPU kernel tools.
    #[command(subcommand)]
    Kernels(KernelsCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// How a command spreads and stores the model (`logits`, `generate`, `bench forward`).
#[derive(clap::Args, Clone, Copy, Debug)]
struct ModelArgs {
    /// Tensor-parallel ranks (threads here; GPUs later): heads, intermediate sizes and the
    /// vocabulary split across them.
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Context-parallel ranks (a divisor of the tensor-parallel size): each group of this many
    /// consecutive ranks splits a sequence's latent cache by pages and merges its attention
    /// exactly.
    #[arg(long, default_value_t = 1)]
    context_parallel: usize,
    /// Requantise attention, dense-MLP and shared-expert linears to FP8 E4M3 at load.
    #[arg(long)]
    fp8_dense: bool,
    /// Place whole routed experts on the tensor-parallel ranks (a contiguous range each)
    /// instead of splitting every expert's intermediate dimension.
    #[arg(long)]
    expert_parallel: bool,
    /// Lay the MXFP4 routed experts out for the CPU's AMX tiles (where it has them): faster
    /// prefill and batched decode, slower single-stream decode (medium model: +20 %, +13 %, −5 %).
    #[arg(long)]
    mxfp4_tiles: bool,
}

impl ModelArgs {
    fn parallelism(&self) -> Parallelism {
        Parallelism { tensor: self.tensor_parallel, context: self.context_parallel, expert: self.expert_parallel }
    }

    fn format(&self) -> WeightFormat {
        WeightFormat { fp8_dense: self.fp8_dense, mxfp4_tiles: self.mxfp4_tiles }
    }

    fn load(&self, dir: &Path) -> Result<Model> {
        Model::load_as(dir, self.parallelism(), self.format())
            .with_context(|| format!("loading model from {}", dir.display()))
    }
}

/// `serve`'s flags that override its config file's model settings.
#[derive(clap::Args, Clone, Debug, Default)]
struct ServeOverrides {
    /// Tensor-parallel ranks (overrides the file's `tensor_parallel`).
    #[arg(long)]
    tensor_parallel: Option<usize>,
    /// Context-parallel ranks (overrides the file's `context_parallel`).
    #[arg(long)]
    context_parallel: Option<usize>,
    /// Requantise attention, dense-MLP and shared-expert linears to FP8 (sets `fp8_dense`).
    #[arg(long)]
    fp8_dense: bool,
    /// Whole routed experts per rank (sets `expert_parallel`).
    #[arg(long)]
    expert_parallel: bool,
    /// MXFP4 routed experts on the CPU's AMX tiles (sets `mxfp4_tiles`).
    #[arg(long)]
    mxfp4_tiles: bool,
    /// Where the model runs: cpu, hip, cuda or auto (sets `backend`).
    #[arg(long)]
    backend: Option<String>,
    /// A DSpark draft directory: speculative decoding (sets `draft`).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Draft tokens verified per step (sets `num_speculative_tokens`; default 4).
    #[arg(long)]
    num_speculative_tokens: Option<usize>,
    /// How drafts are chosen: sampled or greedy (sets `speculative_drafts`; default sampled).
    #[arg(long, value_parser = ["sampled", "greedy"])]
    speculative_drafts: Option<String>,
    /// Cache prompt prefixes (sets `engine.prefix_cache`).
    #[arg(long)]
    prefix_cache: bool,
}

#[derive(Subcommand)]
enum KernelsCommand {
    /// Print the manifest `scripts/build-gpu-kernels.sh` wrote: every kernel per architecture
    /// with its parameter size, registers, LDS and spills, and the compiler.
    Report {
        /// The manifest (default: target/gpu-kernels/manifest.json).
        #[arg(long, default_value = "target/gpu-kernels/manifest.json")]
        manifest: PathBuf,
    },
    /// Run the built kernels on a GPU against the CPU backend and print memory bandwidth as a
    /// fraction of HBM (what `scripts/device-check.sh` runs). Non-zero exit on any mismatch.
    Check {
        /// Where `scripts/build-gpu-kernels.sh` wrote the kernels and their manifest.
        #[arg(long, default_value = "target/gpu-kernels")]
        kernels: PathBuf,
        /// cuda or hip.
        #[arg(long, default_value = "cuda")]
        backend: String,
        /// A directory holding the text goldens (k3-tiny, k3-tiny-mxfp4, k31-tiny-indexer, as
        /// in ../shared/golden): also run them through the GPU backend.
        #[arg(long)]
        golden: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Show a component's world, imports and exports, and whether this host accepts it.
    Check {
        /// A component file (.wasm), or builtin:<name>.
        file: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Builtin plugins' per-call costs beside their native equivalents.
    Plugins {
        #[arg(long, default_value_t = 200)]
        steps: usize,
        /// Sequences per sampler step.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Tokenizer for the grammar-mask timings (the Kimi vocabulary is the real test).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// The vision tower + projector on synthetic images: images/s, patches/s and GFLOP/s beside
    /// the BF16 product peak measured in the same run (a random release-width tower without
    /// `--model`).
    Vision {
        /// A checkpoint with `vision_config` (default: a random tower of the release width).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Blocks of the random tower.
        #[arg(long, default_value_t = 2)]
        layers: usize,
        /// Image size, WxH.
        #[arg(long, default_value = "512x512")]
        size: String,
        /// Images per tower call.
        #[arg(long, default_value_t = 2)]
        images: usize,
        #[arg(long)]
        json: bool,
    },
    /// Encode MB/s on a mixed-language corpus, beside Python tiktoken when it is importable.
    Tokenizer {
        #[arg(long)]
        tokenizer: PathBuf,
        /// Corpus size in MB.
        #[arg(long, default_value_t = 8.0)]
        mb: f64,
        #[arg(long)]
        json: bool,
    },
    /// Loopback load test of `serve`: requests/s, output tokens/s, TTFT and inter-token latency,
    /// over HTTP and through the in-process engine API in the same run.
    Serve {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        model: Option<PathBuf>,
        /// Concurrency levels, e.g. 1,8,64.
        #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
        concurrency: Vec<usize>,
        /// Requests per level (at least the concurrency).
        #[arg(long, default_value_t = 64)]
        requests: usize,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Instead: TTFT of requests sharing an N-token prefix, prefix cache on and off (turns
        /// `engine.prefix_cache` on; `--requests` of each, alternating).
        #[arg(long)]
        shared_prefix: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// A bounded soak of `serve` under faults on loopback (mixed traffic, clients that vanish,
    /// a tenant with a misbehaving plugin, a SIGTERM drain); fails on any unanswered request,
    /// leaked state, counter mismatch or RSS growth past the stated bound.
    Soak {
        /// Seconds of traffic.
        #[arg(long, default_value_t = 60)]
        duration: u64,
        /// Concurrent clients.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// A misbehaving sampler component for the second tenant (default: the test plugin the
        /// build leaves in `plugins/target/wasm32-wasip2/release/test_hostile.wasm`, if present).
        #[arg(long)]
        hostile: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Prefill and decode tokens/s, with measured memory bandwidth as the baseline.
    Forward {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 128)]
        prompt_len: usize,
        #[arg(long, default_value_t = 32)]
        decode: usize,
        /// Sequences decoded together, one run per size (e.g. `1,8,64`); ratios are against the first.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        batch: Vec<usize>,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// A DSpark draft for the model: also decode one sequence greedily with and without it.
        #[arg(long)]
        draft: Option<PathBuf>,
        /// Draft tokens a step with --draft.
        #[arg(long, default_value_t = 4)]
        num_speculative_tokens: usize,
        #[command(flatten)]
        spread: ModelArgs,
        /// Then decode the first batch size once more with every backend op timed: time, calls
        /// and weight GB/s per op and weight shape.
        #[arg(long)]
        op_profile: bool,
        #[arg(long)]
        json: bool,
    },
}

/// "288GB" (10^9), "192GiB" (2^30), "512MiB", or bytes.
fn parse_memory(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().with_context(|| format!("--gpu-memory {s}: a number and a unit, e.g. 288GB"))?;
    let scale = match unit.trim() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0f64.powi(4),
        u => bail!("--gpu-memory {s}: unknown unit {u:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"),
    };
    let bytes = n * scale;
    if !(1.0..=1e15).contains(&bytes) {
        bail!("--gpu-memory {s}: out of range");
    }
    Ok(bytes as u64)
}

fn parse_ids(arg: &str, what: &str) -> Result<Vec<u32>> {
    let text = match arg.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {what} from {path}"))?,
        None => arg.to_string(),
    };
    let raw: Vec<i64> =
        serde_json::from_str(&text).with_context(|| format!("{what} must be a JSON array of token ids"))?;
    raw.iter().map(|&x| u32::try_from(x).map_err(|_| anyhow::anyhow!("{what}: {x} is not a valid token id"))).collect()
}

/// The server configuration (file or embedded default, flags on top) and its loaded state.
fn server_state(
    config: Option<PathBuf>,
    model: Option<PathBuf>,
    listen: Option<String>,
    over: ServeOverrides,
) -> Result<(kimi_host::server::config::ServeConfig, std::sync::Arc<kimi_host::server::AppState>)> {
    use kimi_host::server::{AppState, config::ServeConfig, embedded};
    let mut cfg = match &config {
        Some(p) => ServeConfig::load(p)?,
        None => ServeConfig::embedded_default(),
    };
    if let Some(m) = model {
        cfg.model = Some(m);
    }
    if let Some(l) = listen {
        cfg.listen = l;
    }
    if let Some(n) = over.tensor_parallel {
        cfg.tensor_parallel = Some(n);
    }
    if let Some(n) = over.context_parallel {
        cfg.context_parallel = Some(n);
    }
    cfg.fp8_dense |= over.fp8_dense;
    cfg.expert_parallel |= over.expert_parallel;
    cfg.mxfp4_tiles |= over.mxfp4_tiles;
    if over.backend.is_some() {
        cfg.backend = over.backend;
    }
    if over.draft.is_some() {
        cfg.draft = over.draft;
    }
    if over.num_speculative_tokens.is_some() {
        cfg.num_speculative_tokens = over.num_speculative_tokens;
    }
    if let Some(d) = &over.speculative_drafts {
        cfg.speculative_drafts = Some(if d == "greedy" {
            kimi_host::engine::DraftMode::Greedy
        } else {
            kimi_host::engine::DraftMode::Sampled
        });
    }
    cfg.engine.prefix_cache |= over.prefix_cache;
    cfg.validate()?;
    if let Some(t) = cfg.threads {
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().context("setting threads")?;
    }
    let model_dir = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            if cfg.model_name.is_none() {
                cfg.model_name = Some(embedded::MODEL_NAME.to_string());
            }
            embedded::ensure_model()?
        }
    };
    let state = std::sync::Arc::new(AppState::build(&cfg, &model_dir)?);
    Ok((cfg, state))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

fn serve(config: Option<PathBuf>, model: Option<PathBuf>, listen: Option<String>, over: ServeOverrides) -> Result<()> {
    use kimi_host::server::{embedded, serve};
    let (cfg, state) = server_state(config, model, listen, over)?;
    let addr = cfg.listen_addr()?;
    let grace = std::time::Duration::from_secs(cfg.engine.shutdown_grace_s);
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        // Printed once the socket is bound, so the example works when it appears.
        println!("{}", embedded::usage_examples(&addr.to_string(), &state.model_name));
        serve(state, listener, grace).await.map_err(anyhow::Error::from)
    })?;
    Ok(())
}

/// Counts allocations for `bench forward`'s per-step figure; otherwise the system allocator.
#[global_allocator]
static ALLOC: kimi_host_cli::alloc_count::CountingAlloc = kimi_host_cli::alloc_count::CountingAlloc;

fn main() -> Result<()> {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve { .. });
    init_logging(cli.log_format, if serving { "info" } else { "warn" });
    match cli.command {
        Command::Serve { config, model, listen, overrides } => serve(config, model, listen, overrides)?,
        Command::Inspect { model_dir, context, json } => {
            let report = inspect(&model_dir, context).with_context(|| format!("inspecting {}", model_dir.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Kernels(KernelsCommand::Report { manifest }) => {
            let text = std::fs::read_to_string(&manifest).with_context(|| {
                format!("reading {} (build the kernels first: scripts/build-gpu-kernels.sh)", manifest.display())
            })?;
            let m = kimi_kernels::gpu::manifest::Manifest::parse(&text).map_err(anyhow::Error::msg)?;
            print!("{m}");
        }
        Command::Kernels(KernelsCommand::Check { kernels, backend, golden }) => {
            use kimi_kernels::gpu::device::GpuDevice;
            let loading = || format!("loading the kernels of {}", kernels.display());
            // The probes' messages name what was looked for when there is no runtime or device.
            let dev: std::sync::Arc<dyn GpuDevice> = match backend.as_str() {
                "cuda" => {
                    kimi_kernels::gpu::runtime::probe_cuda()?;
                    std::sync::Arc::new(kimi_kernels::gpu::cuda::CudaKernels::open(&kernels, 0).with_context(loading)?)
                }
                "hip" => {
                    kimi_kernels::gpu::runtime::probe_hip()?;
                    std::sync::Arc::new(kimi_kernels::gpu::hip::HipKernels::open(&kernels, 0).with_context(loading)?)
                }
                other => bail!("kernels check: unknown backend `{other}` (cuda, hip)"),
            };
            kimi_host_cli::device_check::run(dev, golden.as_deref())?;
        }
        Command::Plan {
            model_dir,
            gpus,
            gpu_memory,
            context,
            tensor_parallel,
            context_parallel,
            fp8_dense,
            expert_parallel,
            kv_cache_dtype,
            step_tokens,
            json,
        } => {
            use kimi_host::model::plan::{CacheDtype, PlanRequest};
            let gpu_memory = parse_memory(&gpu_memory)?;
            let cache = CacheDtype::parse(&kv_cache_dtype)
                .with_context(|| format!("--kv-cache-dtype {kv_cache_dtype}: one of bf16, fp8, f32"))?;
            let req = PlanRequest {
                gpus,
                gpu_memory,
                context,
                tensor_parallel,
                context_parallel,
                fp8_dense,
                expert_parallel,
                cache,
                step_tokens,
            };
            let p = kimi_host_cli::plan::plan_dir(&model_dir, &req)
                .with_context(|| format!("planning {}", model_dir.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&p)?);
            } else {
                print!("{}", kimi_host_cli::plan::PlanText(&p));
            }
        }
        Command::Speculate { model, draft, case, out } => {
            let m = Model::load(&model).with_context(|| format!("loading {}", model.display()))?;
            let d = kimi_host::model::dspark::DsparkDraft::load(&draft, &m)
                .with_context(|| format!("loading the draft {}", draft.display()))?;
            let tr = kimi_host_cli::speculate::run_case(&m, &d, &case)?;
            kimi_host_cli::speculate::write_trace(&tr, &out)?;
            eprintln!("wrote {} tensors to {}", tr.tensors.len(), out.display());
        }
        Command::Vision { model, text_model, case, out } => {
            let text_dir = text_model.unwrap_or_else(|| model.clone());
            let m = Model::load(&text_dir).with_context(|| format!("loading {}", text_dir.display()))?;
            let cfg = kimi_host::model::config::load_config(&model)?;
            let vc = cfg.vision_config.with_context(|| format!("{} has no vision_config", model.display()))?;
            let vm = kimi_host::model::vision::VisionModel::load(&model, &vc, m.backend())
                .with_context(|| format!("loading the vision tower of {}", model.display()))?;
            let tr = kimi_host_cli::vision::run_case(&vm, Some(&m), &case)?;
            kimi_host_cli::speculate::write_trace(&tr, &out)?;
            eprintln!("wrote {} tensors to {}", tr.tensors.len(), out.display());
        }
        Command::Logits { model, prompt_ids, decode_ids, out, spread } => {
            logits_cmd(&model, &prompt_ids, decode_ids.as_deref(), &out, spread)?
        }
        Command::Generate { model, prompt_ids, max_tokens, ignore_eos, spread } => {
            let prompt = parse_ids(&prompt_ids, "--prompt-ids")?;
            if prompt.is_empty() {
                bail!("--prompt-ids must hold at least one id");
            }
            let m = spread.load(&model)?;
            let eos = m.text_config().eos_token_id;
            let mut state = m.new_state();
            let mut logits = m.forward(&prompt, &mut state, LogitsFor::LastToken, None)?;
            for _ in 0..max_tokens {
                let next = argmax(&logits) as u32;
                println!("{next}");
                if !ignore_eos && Some(next) == eos {
                    break;
                }
                logits = m.forward(&[next], &mut state, LogitsFor::LastToken, None)?;
            }
        }
        Command::MakeTiny { out, seed, k31, mxfp4, vision } => {
            make_tiny(&out, &TinyOptions { seed, k31, mxfp4, vision })
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("wrote a tiny Kimi-K3{} checkpoint to {}", if k31 { ".1" } else { "" }, out.display());
        }
        Command::MakeDraft { target, out, seed, layers } => {
            kimi_host::model::tiny::make_draft(&target, &out, seed, layers)
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("wrote a random DSpark draft for {} to {}", target.display(), out.display());
        }
        Command::Tokenize { tokenizer, text, file, decode, allow_special, json } => {
            tokenize_cmd(&tokenizer, text, file, decode, allow_special, json)?
        }
        Command::Render { tokenizer, request, template } => render_cmd(&tokenizer, &request, &template)?,
        Command::Plugin(PluginCommand::Check { file, json }) => plugin_check_cmd(&file, json)?,
        Command::Bench(BenchCommand::Plugins { steps, batch, tokenizer, json }) => {
            let t = kimi_host_cli::bench_plugins::bench_plugins(steps, batch, tokenizer.as_deref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                kimi_host_cli::bench_plugins::print(&t);
            }
        }
        Command::Bench(BenchCommand::Vision { model, layers, size, images, json }) => {
            let (w, h) = size
                .split_once('x')
                .and_then(|(w, h)| Some((w.parse::<usize>().ok()?, h.parse::<usize>().ok()?)))
                .filter(|&(w, h)| (1..=16384).contains(&w) && (1..=16384).contains(&h))
                .with_context(|| format!("--size {size}: expected WxH with sides 1..=16384"))?;
            if !(1..=64).contains(&layers) || !(1..=64).contains(&images) {
                anyhow::bail!("--layers and --images take 1..=64");
            }
            let r = kimi_host_cli::bench_vision::bench_vision(model.as_deref(), layers, [w, h], images)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{r}");
            }
        }
        Command::Bench(BenchCommand::Tokenizer { tokenizer, mb, json }) => {
            let r = bench_tokenizer(&tokenizer, mb)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{r}");
            }
        }
        Command::Bench(BenchCommand::Serve {
            config,
            model,
            concurrency,
            requests,
            max_tokens,
            shared_prefix,
            json,
        }) => {
            if let Some(n) = shared_prefix {
                if !(1..=1_000_000).contains(&n) {
                    bail!("--shared-prefix takes 1..=1000000 tokens");
                }
                let over = ServeOverrides { prefix_cache: true, ..ServeOverrides::default() };
                let (_, state) = server_state(config, model, None, over)?;
                let engine = state.engine.clone();
                let row = runtime()?.block_on(kimi_host_cli::bench_serve::bench_shared_prefix(
                    state,
                    n,
                    requests.min(256),
                ))?;
                engine.shutdown(std::time::Duration::from_secs(1));
                if json {
                    println!("{}", serde_json::to_string_pretty(&row)?);
                } else {
                    println!(
                        "shared prefix of {} tokens, {} requests each: TTFT p50 {:.1} ms with the prefix cache, {:.1} ms without (×{:.2})",
                        row.prefix_tokens, row.requests, row.ttft_p50_ms_cached, row.ttft_p50_ms_uncached, row.speedup
                    );
                }
                return Ok(());
            }
            let (_, state) = server_state(config, model, None, ServeOverrides::default())?;
            let engine = state.engine.clone();
            let rows = runtime()?.block_on(kimi_host_cli::bench_serve::bench_serve(
                state,
                &concurrency,
                requests,
                max_tokens,
            ))?;
            engine.shutdown(std::time::Duration::from_secs(1));
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                kimi_host_cli::bench_serve::print(&rows);
            }
        }
        Command::Bench(BenchCommand::Soak { duration, concurrency, seed, hostile, json }) => {
            soak_cmd(duration, concurrency, seed, hostile, json)?
        }
        Command::Bench(BenchCommand::Forward {
            model,
            prompt_len,
            decode,
            batch,
            threads,
            draft,
            num_speculative_tokens,
            spread,
            op_profile,
            json,
        }) => {
            if let Some(n) = threads {
                rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("setting up the thread pool")?;
            }
            // Each size holds that many sequence states: capped before anything is loaded.
            const MAX_BATCH: usize = 1024;
            if batch.len() > 16 || batch.iter().any(|&b| b == 0 || b > MAX_BATCH) {
                bail!("--batch takes at most 16 sizes, each from 1 to {MAX_BATCH}");
            }
            if !(1..=16).contains(&num_speculative_tokens) {
                bail!("--num-speculative-tokens must be 1..=16");
            }
            let r =
                bench_forward(&model, prompt_len, decode, &batch, spread.parallelism(), spread.format(), op_profile)?;
            let spec = match &draft {
                Some(dir) => {
                    let m = spread.load(&model)?;
                    let d = kimi_host::model::dspark::DsparkDraft::load(dir, &m)
                        .with_context(|| format!("loading the draft {}", dir.display()))?;
                    Some(kimi_host_cli::bench::bench_speculative(
                        &m,
                        &d,
                        prompt_len,
                        decode.max(2),
                        num_speculative_tokens,
                    )?)
                }
                None => None,
            };
            if json {
                let mut v = serde_json::to_value(&r)?;
                if let Some(s) = &spec {
                    v["speculative"] = serde_json::to_value(s)?;
                }
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{r}");
                if let Some(s) = &spec {
                    print!("{s}");
                }
            }
        }
    }
    Ok(())
}

/// `logits`: prefill (and optional decode) logits of a prompt, written as safetensors.
fn logits_cmd(model: &Path, prompt_ids: &str, decode_ids: Option<&str>, out: &Path, spread: ModelArgs) -> Result<()> {
    let prompt = parse_ids(prompt_ids, "--prompt-ids")?;
    if prompt.is_empty() {
        bail!("--prompt-ids must hold at least one id");
    }
    let decode = decode_ids.map(|d| parse_ids(d, "--decode-ids")).transpose()?;
    let m = spread.load(model)?;
    let v = m.text_config().vocab_size;
    let mut state = m.new_state();
    let prefill = m.forward(&prompt, &mut state, LogitsFor::AllTokens, None)?;
    let mut tensors = vec![("prefill_logits".to_string(), vec![prompt.len(), v], f32_bytes(&prefill))];
    if let Some(ids) = decode {
        let mut rows = Vec::with_capacity(ids.len() * v);
        for id in &ids {
            rows.extend(m.forward(&[*id], &mut state, LogitsFor::AllTokens, None)?);
        }
        tensors.push(("decode_logits".to_string(), vec![ids.len(), v], f32_bytes(&rows)));
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// `tokenize`: ids of a text (or the text of ids).
fn tokenize_cmd(
    tokenizer: &Path,
    text: Option<String>,
    file: Option<PathBuf>,
    decode: Option<String>,
    allow_special: bool,
    json: bool,
) -> Result<()> {
    let tok = Tokenizer::load(tokenizer).with_context(|| format!("loading tokenizer from {}", tokenizer.display()))?;
    if let Some(ids) = decode {
        let ids = parse_ids(&ids, "--decode")?;
        print!("{}", tok.decode(&ids)?);
        return Ok(());
    }
    let text = match (text, file) {
        (Some(t), _) => t,
        (None, Some(f)) => std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?,
        (None, None) => bail!("give --text, --file or --decode"),
    };
    let ids = if allow_special { tok.encode_with_specials(&text) } else { tok.encode_text(&text) };
    if json {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        println!("{}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "));
    }
    Ok(())
}

/// `render`: a chat request through a template plugin, as ids and text.
fn render_cmd(tokenizer: &Path, request: &Path, template: &str) -> Result<()> {
    use kimi_host::plugins::bindings::host::kimi::host::types::RequestInfo;
    use kimi_host::tokenizer::Segment;
    let tok = std::sync::Arc::new(
        Tokenizer::load(tokenizer).with_context(|| format!("loading tokenizer from {}", tokenizer.display()))?,
    );
    let body = std::fs::read_to_string(request).with_context(|| format!("reading {}", request.display()))?;
    let bytes = PluginRef::parse(template).bytes()?;
    let rt = kimi_host::plugins::PluginRuntime::new(kimi_host::plugins::RuntimeOptions::default())?;
    let compiled = rt.load(template, &bytes)?;
    let plugin = kimi_host::plugins::TemplatePlugin::new(rt, &compiled)?;
    let env = std::sync::Arc::new(kimi_host::plugins::PluginEnv::from_tokenizer(tok.clone(), tok.vocab_size() as u32));
    let svc = std::sync::Arc::new(kimi_host::plugins::TenantServices::default());
    let req = RequestInfo {
        tenant: "local".into(),
        request_id: "render".into(),
        model: "kimi".into(),
        params_json: body.clone(),
    };
    let rendered = plugin.render(&env, &svc, &req, &body)?;
    let segs: Vec<Segment> = rendered.segments.into_iter().map(Segment::from).collect();
    let text: String = segs
        .iter()
        .map(|s| match s {
            Segment::Text(t) | Segment::Special(t) => t.as_str(),
        })
        .collect();
    let ids = tok.encode_segments(&segs)?;
    println!("{}", serde_json::json!({"ids": ids, "text": text}));
    Ok(())
}

fn plugin_check_cmd(file: &str, json: bool) -> Result<()> {
    let bytes = PluginRef::parse(file).bytes()?;
    let rt =
        kimi_host::plugins::PluginRuntime::new(kimi_host::plugins::RuntimeOptions { pooling: false, cache_dir: None })?;
    let report = rt.check(&bytes);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("sha256:  {}", report.sha256);
        println!("world:   {}", report.world.as_deref().unwrap_or("(none)"));
        println!("imports:");
        for i in &report.imports {
            println!("  {i}");
        }
        println!("exports:");
        for e in &report.exports {
            println!("  {e}");
        }
        match &report.verdict {
            Ok(()) => println!("verdict: accepted"),
            Err(why) => println!("verdict: rejected — {why}"),
        }
    }
    if report.verdict.is_err() {
        std::process::exit(2);
    }
    Ok(())
}

/// `bench soak` (see `kimi_host_cli::bench_soak`); an error when it found a violation.
fn soak_cmd(duration: u64, concurrency: usize, seed: u64, hostile: Option<PathBuf>, json: bool) -> Result<()> {
    let built =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plugins/target/wasm32-wasip2/release/test_hostile.wasm");
    let hostile = match hostile {
        Some(p) => Some(std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?),
        None => std::fs::read(&built).ok(),
    };
    let report = runtime()?.block_on(kimi_host_cli::bench_soak::soak(
        std::time::Duration::from_secs(duration),
        concurrency.max(1),
        seed,
        hostile,
    ))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        kimi_host_cli::bench_soak::print(&report);
    }
    if !report.violations.is_empty() {
        anyhow::bail!("the soak found {} violations", report.violations.len());
    }
    Ok(())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
