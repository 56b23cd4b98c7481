//! `kimi-host.toml`: listen address, model, threads, engine pools and tenants (see
//! `examples/kimi-host.toml` for every field). Errors name the offending key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use std::sync::Arc;

use serde::Deserialize;

use crate::engine::EngineConfig;
use crate::plugins::{LocalQuotas, QuotaFailure, QuotaStore, RedisQuotas};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("config: {0}")]
    Invalid(String),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Checkpoint directory; absent: the embedded tiny default.
    pub model: Option<PathBuf>,
    /// Tokenizer directory; absent: the model directory.
    pub tokenizer: Option<PathBuf>,
    /// The id clients send as `model` (default: the model directory's name).
    pub model_name: Option<String>,
    /// Compute threads (default: all cores).
    pub threads: Option<usize>,
    /// Tensor-parallel ranks the model is spread over (default 1).
    pub tensor_parallel: Option<usize>,
    /// Ranks of the tensor-parallel group that split each sequence's latent cache by pages
    /// (1, or `tensor_parallel`; default 1).
    pub context_parallel: Option<usize>,
    /// Requantise attention, dense-MLP and shared-expert linears to FP8 at load.
    #[serde(default)]
    pub fp8_dense: bool,
    /// Place whole routed experts on the tensor-parallel ranks instead of splitting each.
    #[serde(default)]
    pub expert_parallel: bool,
    /// Lay the MXFP4 routed experts out for the CPU's AMX tiles (where it has them): on the
    /// medium model prefill +20 % and batch-64 decode +13 %, single-stream decode −5 %.
    #[serde(default)]
    pub mxfp4_tiles: bool,
    /// Where the model runs: cpu (default), hip, cuda or auto.
    pub backend: Option<String>,
    /// A DSpark draft directory: speculative decoding for every decoding sequence.
    pub draft: Option<PathBuf>,
    /// Draft tokens proposed and verified per step with `draft` (1–16; default 4).
    pub num_speculative_tokens: Option<usize>,
    /// How drafts are chosen with `draft`: `sampled` (default; drawn from each request's
    /// sampler distribution and verified by rejection sampling, where the sampler describes its
    /// distributions) or `greedy` (argmax drafts, verified by sample-and-match).
    pub speculative_drafts: Option<crate::engine::DraftMode>,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub http: HttpSection,
    #[serde(default)]
    pub operator: OperatorSection,
    /// Where compiled plugins are cached (default: the user cache directory).
    pub plugin_cache: Option<PathBuf>,
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
}

/// Most draft tokens verified per step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Draft tokens per step when a draft is given without `num_speculative_tokens`.
pub const DEFAULT_SPECULATIVE_TOKENS: usize = 4;

fn default_listen() -> String {
    "127.0.0.1:8000".into()
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    pub max_seqs: usize,
    pub max_batched_tokens: usize,
    /// Bytes for sequence state, e.g. "1GiB".
    pub state_memory: String,
    pub queue_timeout_ms: u64,
    pub max_waiting: usize,
    /// Seconds running streams get to finish on SIGTERM.
    pub shutdown_grace_s: u64,
    /// Cache prompt prefixes (KDA states at 64-token block boundaries, shared latent pages),
    /// partitioned per tenant (see each tenant's `prefix_cache`).
    pub prefix_cache: bool,
}

impl Default for EngineSection {
    fn default() -> Self {
        let d = EngineConfig::default();
        EngineSection {
            max_seqs: d.max_seqs,
            max_batched_tokens: d.max_batched_tokens,
            state_memory: "1GiB".into(),
            queue_timeout_ms: d.queue_timeout.as_millis() as u64,
            max_waiting: d.max_waiting,
            shutdown_grace_s: 30,
            prefix_cache: false,
        }
    }
}

impl EngineSection {
    pub fn engine_config(&self) -> Result<EngineConfig, ConfigError> {
        if self.max_seqs == 0 || self.max_batched_tokens == 0 {
            return Err(ConfigError::Invalid("engine.max_seqs and engine.max_batched_tokens must be ≥ 1".into()));
        }
        Ok(EngineConfig {
            vision: None,
            max_seqs: self.max_seqs,
            max_batched_tokens: self.max_batched_tokens,
            state_memory: parse_size(&self.state_memory).ok_or_else(|| {
                ConfigError::Invalid(format!("engine.state_memory: bad size {:?}", self.state_memory))
            })?,
            queue_timeout: Duration::from_millis(self.queue_timeout_ms),
            max_waiting: self.max_waiting,
            speculation: None,
            prefix_cache: self.prefix_cache,
            fault_probe: None,
        })
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    /// Largest request body in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// Largest `n`.
    pub max_n: usize,
    /// Context length served (default: the model's).
    pub max_context: Option<usize>,
    /// Most chat messages in one request.
    pub max_messages: usize,
    /// Most content parts plus tool calls over all messages.
    pub max_content_parts: usize,
    /// Most image parts.
    pub max_images: usize,
    /// Largest encoded image (after base64 decoding), bytes.
    pub max_image_bytes: usize,
    /// Most pixels (width × height) an image may declare; checked from its header, before
    /// decoding (a decompression bomb declares more).
    pub max_image_pixels: u64,
    /// Most vision-tower patches (after the release resize) over a request's images.
    pub max_image_patches: usize,
    /// Most tools.
    pub max_tools: usize,
    /// Most `properties` entries over all schemas (tools and response_format).
    pub max_schema_properties: usize,
    /// Most JSON values over all schemas.
    pub max_schema_nodes: usize,
    /// Deepest JSON nesting of a tool or response_format.
    pub max_schema_depth: usize,
    /// Longest stop sequence, in bytes.
    pub max_stop_bytes: usize,
    /// Most logit_bias entries.
    pub max_logit_bias: usize,
    /// Where rate-limit buckets live: `memory` (this process) or `redis://host:port[/db]`, so
    /// replicas behind one load balancer enforce one budget per tenant.
    pub store: String,
    /// Key prefix in the shared store (replicas of one deployment use the same one).
    pub store_prefix: String,
    /// Connect / read / write timeout for the shared store.
    pub store_timeout_ms: u64,
}

impl Default for LimitsSection {
    fn default() -> Self {
        LimitsSection {
            max_body_bytes: 8 << 20,
            default_max_tokens: 1024,
            max_n: 8,
            max_context: None,
            max_messages: 4096,
            max_content_parts: 8192,
            max_images: 32,
            max_image_bytes: 20 << 20,
            max_image_pixels: 1 << 26,
            max_image_patches: crate::model::vision::MAX_PATCHES_PER_CALL,
            max_tools: 128,
            max_schema_properties: 5000,
            max_schema_nodes: 100_000,
            max_schema_depth: 100,
            max_stop_bytes: 1024,
            max_logit_bias: 1024,
            store: "memory".into(),
            store_prefix: "kimi-host".into(),
            store_timeout_ms: 250,
        }
    }
}

/// Connection hygiene: a bounded number of slow or idle clients cannot starve the others.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Most open connections (more are answered 503 and closed at once).
    pub max_connections: usize,
    /// Most open connections from one client address.
    pub max_connections_per_ip: usize,
    /// Time a client has to send a request's headers, counted from when the server starts
    /// waiting for them; on a keep-alive connection that is also its idle limit.
    pub header_timeout_ms: u64,
    /// Time a client has to send a request's body.
    pub body_timeout_ms: u64,
    /// A response write that makes no progress this long (a client that stopped reading)
    /// closes the connection.
    pub write_timeout_ms: u64,
    /// A stream that has nothing to send for this long (queued, or in a long prefill) sends an
    /// SSE comment, so proxies with idle timeouts keep it open.
    pub sse_keepalive_ms: u64,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            max_connections: 4096,
            max_connections_per_ip: 256,
            header_timeout_ms: 10_000,
            body_timeout_ms: 30_000,
            write_timeout_ms: 60_000,
            sse_keepalive_ms: 15_000,
        }
    }
}

/// The operator's own access: admin endpoints, and what `/metrics` shows to whom.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OperatorSection {
    /// SHA-256 (hex) of each operator key (`/admin/*`; `/metrics` when `metrics_require_key`).
    pub api_key_sha256: Vec<String>,
    /// `/metrics` answers only requests with an operator key.
    pub metrics_require_key: bool,
    /// Label uploaded and operator-configured plugins by name on `/metrics` (otherwise they are
    /// summed per tenant and kind as `upload` / `configured`; builtins always keep their names).
    pub metrics_plugin_names: bool,
}

/// One tenant: who it is, which plugins it runs, what it may use.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    /// SHA-256 (hex) of each API key; keys themselves are never stored.
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
    /// Requests without an `Authorization` header map to this tenant (loopback setups only).
    #[serde(default)]
    pub anonymous: bool,
    #[serde(default)]
    pub plugins: TenantPlugins,
    /// Most requests in flight (more: 429).
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
    /// Default think-channel budgets by effort (`low`, `high`, `max`).
    #[serde(default)]
    pub thinking_budgets: BTreeMap<String, u32>,
    /// Whether this tenant may upload its own plugins.
    #[serde(default = "yes")]
    pub allow_uploads: bool,
    /// While a shared quota store (`limits.store`) cannot answer: `open` admits, `closed`
    /// refuses with 429.
    #[serde(default)]
    pub quota_store_failure: QuotaFailure,
    /// Which prefix-cache partition this tenant's requests use (with `engine.prefix_cache`):
    /// `tenant` (its own; default), `shared` (one partition for every tenant that says so) or
    /// `off`.
    #[serde(default)]
    pub prefix_cache: PrefixPartition,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PrefixPartition {
    #[default]
    Tenant,
    Shared,
    Off,
}

fn default_concurrency() -> usize {
    64
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantPlugins {
    pub template: String,
    pub grammar: Option<String>,
    /// The default sampler; a request may name another of the tenant's samplers.
    pub sampler: String,
    pub policies: Vec<PolicyConfig>,
}

impl Default for TenantPlugins {
    fn default() -> Self {
        TenantPlugins {
            template: "builtin:template-kimi-k3".into(),
            grammar: Some("builtin:grammar-kimi-k3".into()),
            sampler: "builtin:sampler-standard".into(),
            policies: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// `builtin:<name>` or a path to a component.
    pub plugin: String,
    /// The policy's own configuration, passed to it as JSON.
    #[serde(default)]
    pub config: Option<toml::Value>,
}

impl ServeConfig {
    pub fn load(path: &Path) -> Result<ServeConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let mut c: ServeConfig =
            toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.into(), msg: e.to_string() })?;
        // Relative paths are relative to the config file.
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut c.model, &mut c.tokenizer, &mut c.plugin_cache].into_iter().flatten() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(c)
    }

    /// The built-in configuration: loopback, the embedded model, one anonymous local tenant.
    pub fn embedded_default() -> ServeConfig {
        ServeConfig {
            listen: default_listen(),
            model: None,
            tokenizer: None,
            model_name: None,
            threads: None,
            tensor_parallel: None,
            context_parallel: None,
            fp8_dense: false,
            expert_parallel: false,
            mxfp4_tiles: false,
            backend: None,
            draft: None,
            num_speculative_tokens: None,
            speculative_drafts: None,
            engine: EngineSection { state_memory: "256MiB".into(), ..Default::default() },
            limits: LimitsSection { max_context: Some(16_384), default_max_tokens: 256, ..Default::default() },
            http: HttpSection::default(),
            operator: OperatorSection::default(),
            plugin_cache: None,
            tenants: vec![TenantConfig {
                name: "local".into(),
                api_key_sha256: Vec::new(),
                anonymous: true,
                plugins: TenantPlugins::default(),
                max_concurrency: 128,
                thinking_budgets: BTreeMap::new(),
                allow_uploads: true,
                quota_store_failure: QuotaFailure::Open,
                prefix_cache: PrefixPartition::Tenant,
            }],
        }
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen
            .parse()
            .map_err(|e| ConfigError::Invalid(format!("listen: {:?} is not an address: {e}", self.listen)))
    }

    /// `backend`, parsed (default: the CPU).
    pub fn backend_kind(&self) -> Result<kimi_kernels::gpu::runtime::BackendKind, ConfigError> {
        let name = self.backend.as_deref().unwrap_or("cpu");
        kimi_kernels::gpu::runtime::BackendKind::parse(name)
            .ok_or_else(|| ConfigError::Invalid(format!("backend: {name:?} is not one of cpu, hip, cuda, auto")))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.backend_kind()?;
        if let Some(n) = self.tensor_parallel
            && !(1..=64).contains(&n)
        {
            return Err(ConfigError::Invalid(format!("tensor_parallel: {n} ranks (1 to 64)")));
        }
        if self.tenants.is_empty() {
            return Err(ConfigError::Invalid("at least one [[tenants]] entry is needed".into()));
        }
        let mut names = std::collections::HashSet::new();
        let mut anonymous = 0;
        let key_hashes_ok = |keys: &[String], at: &str| match keys
            .iter()
            .all(|k| k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            true => Ok(()),
            false => {
                Err(ConfigError::Invalid(format!("{at}: api_key_sha256 entries are 64 hex digits (sha256 of the key)")))
            }
        };
        key_hashes_ok(&self.operator.api_key_sha256, "operator")?;
        if self.operator.metrics_require_key && self.operator.api_key_sha256.is_empty() {
            return Err(ConfigError::Invalid(
                "operator.metrics_require_key needs at least one operator.api_key_sha256".into(),
            ));
        }
        let h = &self.http;
        if h.max_connections == 0 || h.max_connections_per_ip == 0 {
            return Err(ConfigError::Invalid(
                "http.max_connections and http.max_connections_per_ip must be ≥ 1".into(),
            ));
        }
        if h.header_timeout_ms == 0 || h.body_timeout_ms == 0 || h.write_timeout_ms == 0 || h.sse_keepalive_ms == 0 {
            return Err(ConfigError::Invalid("http timeouts must be ≥ 1 ms".into()));
        }
        for t in &self.tenants {
            if !names.insert(&t.name) {
                return Err(ConfigError::Invalid(format!("tenant `{}` is defined twice", t.name)));
            }
            key_hashes_ok(&t.api_key_sha256, &format!("tenants.{}", t.name))?;
            anonymous += usize::from(t.anonymous);
            for e in t.thinking_budgets.keys() {
                if !matches!(e.as_str(), "low" | "high" | "max") {
                    return Err(ConfigError::Invalid(format!(
                        "tenants.{}.thinking_budgets: unknown effort `{e}` (low, high, max)",
                        t.name
                    )));
                }
            }
        }
        if anonymous > 1 {
            return Err(ConfigError::Invalid("only one tenant may be anonymous".into()));
        }
        self.listen_addr()?;
        self.engine.engine_config()?;
        if let Some(t) = self.num_speculative_tokens
            && !(1..=MAX_SPECULATIVE_TOKENS).contains(&t)
        {
            return Err(ConfigError::Invalid(format!(
                "num_speculative_tokens must be 1..={MAX_SPECULATIVE_TOKENS}, not {t}"
            )));
        }
        if self.speculative_drafts.is_some() && self.draft.is_none() {
            return Err(ConfigError::Invalid("speculative_drafts needs a draft (draft = \"<dir>\")".into()));
        }
        if self.num_speculative_tokens.is_some() && self.draft.is_none() {
            return Err(ConfigError::Invalid("num_speculative_tokens needs a draft (draft = \"<dir>\")".into()));
        }
        self.quota_store()?;
        Ok(())
    }

    /// The rate-limit store `limits.store` names (no connection is made yet).
    pub fn quota_store(&self) -> Result<Arc<dyn QuotaStore>, ConfigError> {
        let l = &self.limits;
        match l.store.as_str() {
            "memory" => Ok(Arc::new(LocalQuotas::default())),
            url if url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://") => {
                if l.store_timeout_ms == 0 {
                    return Err(ConfigError::Invalid("limits.store_timeout_ms must be ≥ 1".into()));
                }
                let store = RedisQuotas::new(url, &l.store_prefix, Duration::from_millis(l.store_timeout_ms))
                    .map_err(|e| ConfigError::Invalid(format!("limits.store: {e}")))?;
                Ok(Arc::new(store))
            }
            other => {
                Err(ConfigError::Invalid(format!("limits.store: {other:?} is neither `memory` nor a redis:// URL")))
            }
        }
    }
}

/// "512MiB", "1GiB", "64MB", "1000" (bytes).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Hex SHA-256 of an API key, as stored in the config.
pub fn key_hash(key: &str) -> String {
    use sha2::{Digest, Sha256};
    crate::util::hex(&Sha256::digest(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_keys() {
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("2 GiB"), Some(2 << 30));
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(key_hash("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn config_errors_name_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "listen = \"127.0.0.1:1\"\nbogus = 1\n").expect("write");
        let e = ServeConfig::load(&p).expect_err("unknown key").to_string();
        assert!(e.contains("bogus"), "{e}");
        std::fs::write(&p, "[[tenants]]\nname = \"a\"\napi_key_sha256 = [\"xyz\"]\n").expect("write");
        let e = ServeConfig::load(&p).expect("parses").validate().expect_err("bad hash").to_string();
        assert!(e.contains("api_key_sha256"), "{e}");
    }
}
