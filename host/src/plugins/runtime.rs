//! One wasmtime engine per process: epoch interruption driven by a ticker thread, the pooling
//! allocator, per-kind memory caps and call deadlines, import validation (no ambient WASI), and
//! compiled artifacts cached on disk by sha256 + engine compatibility hash.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, StoreLimitsBuilder};

use super::bindings::host::kimi::host as imports;
use super::error::PluginError;
use super::host::{HostState, PluginEnv, TenantServices};

/// Epoch ticker period: deadlines are counted in these.
pub const TICK: Duration = Duration::from_millis(1);

/// The four plugin kinds (one WIT world each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginKind {
    Sampler,
    Grammar,
    Template,
    Policy,
}

/// Per-kind sandbox limits (spec plugin-anchors §3.5 as the starting point).
#[derive(Clone, Copy, Debug)]
pub struct KindLimits {
    pub memory_bytes: usize,
    /// Deadline of one call (a whole engine step for samplers).
    pub call: Duration,
    /// Deadline of instantiation and `describe` / constructors.
    pub init: Duration,
}

impl PluginKind {
    pub const ALL: [PluginKind; 4] =
        [PluginKind::Sampler, PluginKind::Grammar, PluginKind::Template, PluginKind::Policy];

    pub fn name(self) -> &'static str {
        match self {
            PluginKind::Sampler => "sampler",
            PluginKind::Grammar => "grammar",
            PluginKind::Template => "template",
            PluginKind::Policy => "policy",
        }
    }

    pub fn parse(s: &str) -> Option<PluginKind> {
        PluginKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The interface a component of this kind exports.
    pub fn export(self) -> String {
        format!("kimi:host/{}-plugin@{VERSION}", self.name())
    }

    /// Host interfaces this kind's world imports.
    pub fn imports(self) -> &'static [&'static str] {
        match self {
            PluginKind::Sampler => &["types", "log", "metrics", "tokenizer", "logits"],
            PluginKind::Grammar => &["types", "log", "tokenizer", "grammar-engine"],
            PluginKind::Template => &["types", "log", "tokenizer"],
            PluginKind::Policy => &["types", "log", "metrics", "kv", "rate-limit", "clock"],
        }
    }

    /// Memory caps leave room for Python guests (componentize-py) in the per-request kinds.
    pub fn default_limits(self) -> KindLimits {
        let ms = Duration::from_millis;
        match self {
            PluginKind::Sampler => KindLimits { memory_bytes: 64 << 20, call: ms(50), init: ms(1000) },
            PluginKind::Grammar => KindLimits { memory_bytes: 128 << 20, call: ms(100), init: ms(2000) },
            PluginKind::Template => KindLimits { memory_bytes: 128 << 20, call: ms(200), init: ms(2000) },
            PluginKind::Policy => KindLimits { memory_bytes: 128 << 20, call: ms(100), init: ms(2000) },
        }
    }
}

/// WIT package version this host implements.
pub const VERSION: &str = "0.1.0";

/// The optional export of a sampler that describes its distributions (world
/// `speculative-sampler`).
pub fn speculation_export() -> String {
    format!("kimi:host/speculation@{VERSION}")
}

/// Imports that Rust's std links into every wasm32-wasip2 component; defined as traps.
const TRAP_STUB_PREFIXES: [&str; 2] = ["wasi:cli/", "wasi:io/"];

/// `insecure-seed` seeds std's `HashMap` hasher (no data leaves the host, nothing is reachable
/// through it), so it is answered with a fixed seed rather than refused.
const INSECURE_SEED_PREFIX: &str = "wasi:random/insecure-seed@";

#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// Pooling allocator (fast instantiation, bounded memory) or on-demand allocation.
    pub pooling: bool,
    /// Where compiled artifacts are cached (None: no cache).
    pub cache_dir: Option<PathBuf>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions { pooling: true, cache_dir: default_cache_dir() }
    }
}

/// `$KIMI_HOST_CACHE` or `$XDG_CACHE_HOME/kimi-host` or `~/.cache/kimi-host`, plus `plugins/`.
pub fn default_cache_dir() -> Option<PathBuf> {
    crate::util::cache_base().map(|b| b.join("plugins"))
}

pub struct PluginRuntime {
    engine: Engine,
    options: RuntimeOptions,
    compat: String,
    stop: Arc<AtomicBool>,
}

impl Drop for PluginRuntime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A validated, compiled component.
pub struct CompiledPlugin {
    pub name: String,
    pub kind: PluginKind,
    pub component: Component,
    pub sha256: String,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
    /// One of our builtins (set by whoever loaded it from `builtin:`; see `PluginHealth`).
    pub trusted: bool,
}

/// What `plugin check` reports.
#[derive(Debug, serde::Serialize)]
pub struct CheckReport {
    pub sha256: String,
    pub kind: Option<PluginKind>,
    pub world: Option<String>,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
    pub verdict: Result<(), String>,
}

impl PluginRuntime {
    pub fn new(options: RuntimeOptions) -> Result<Arc<PluginRuntime>, PluginError> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        config.wasm_relaxed_simd(false);
        config.max_wasm_stack(1 << 20);
        if options.pooling {
            let mut pool = PoolingAllocationConfig::default();
            pool.total_component_instances(512)
                .total_core_instances(2048)
                .total_memories(512)
                .total_tables(1024)
                .max_memory_size(256 << 20)
                .max_core_instances_per_component(64)
                .max_memories_per_component(16)
                .max_tables_per_component(32)
                .table_elements(100_000)
                .max_component_instance_size(1 << 20)
                .max_core_instance_size(16 << 20);
            // A freed slot is reset by copying back only the pages its guest dirtied (found with
            // Linux's PAGEMAP_SCAN, kernel ≥ 6.7) rather than by `madvise`, which costs a TLB
            // shootdown on free and a page fault per touched page on the next instantiation:
            // sampler-standard's instantiate + describe + drop went from ~25 to ~9 µs. Pages past
            // the first MiB of dirty memory are still decommitted, so a slot never pins more.
            if PoolingAllocationConfig::is_pagemap_scan_available() {
                pool.pagemap_scan(wasmtime::Enabled::Yes)
                    .linear_memory_keep_resident(1 << 20)
                    .table_keep_resident(64 << 10);
            }
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        }
        let engine = Engine::new(&config).map_err(|e| PluginError::Runtime(format!("wasmtime engine: {e:#}")))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        let compat = format!("{:016x}", h.finish());
        let stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kimi-plugin-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| PluginError::Runtime(format!("epoch ticker: {e}")))?;
        }
        Ok(Arc::new(PluginRuntime { engine, options, compat, stop }))
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Imports and exports of a component, and whether this host accepts it.
    pub fn check(&self, bytes: &[u8]) -> CheckReport {
        let sha256 = crate::util::hex(&Sha256::digest(bytes));
        let component = match Component::new(&self.engine, bytes) {
            Ok(c) => c,
            Err(e) => {
                return CheckReport {
                    sha256,
                    kind: None,
                    world: None,
                    imports: vec![],
                    exports: vec![],
                    verdict: Err(format!("not a valid WebAssembly component: {e:#}")),
                };
            }
        };
        let (imports, exports) = self.interface_names(&component);
        let verdict = classify(&imports, &exports);
        CheckReport {
            sha256,
            kind: verdict.as_ref().ok().copied(),
            world: verdict.as_ref().ok().map(|k| {
                let speculative = exports.contains(&speculation_export());
                let world = if speculative { "speculative-sampler" } else { k.name() };
                format!("kimi:host/{world}@{VERSION}")
            }),
            imports,
            exports,
            verdict: verdict.map(|_| ()),
        }
    }

    fn interface_names(&self, component: &Component) -> (Vec<String>, Vec<String>) {
        let ty = component.component_type();
        let imports = ty.imports(&self.engine).map(|(n, _)| n.to_string()).collect();
        let exports = ty.exports(&self.engine).map(|(n, _)| n.to_string()).collect();
        (imports, exports)
    }

    /// Validates and compiles a component (from the on-disk cache when possible).
    pub fn load(&self, name: &str, bytes: &[u8]) -> Result<CompiledPlugin, PluginError> {
        let sha256 = crate::util::hex(&Sha256::digest(bytes));
        let component = self.compile_cached(name, bytes, &sha256)?;
        let (imports, exports) = self.interface_names(&component);
        let kind = classify(&imports, &exports)
            .map_err(|reason| PluginError::Rejected { plugin: name.to_string(), reason })?;
        Ok(CompiledPlugin { name: name.to_string(), kind, component, sha256, imports, exports, trusted: false })
    }

    fn compile_cached(&self, name: &str, bytes: &[u8], sha256: &str) -> Result<Component, PluginError> {
        let cached = self.options.cache_dir.as_ref().map(|d| d.join(format!("{sha256}-{}.cwasm", self.compat)));
        if let Some(path) = &cached
            && path.exists()
        {
            // SAFETY: the file is our own artifact (written below from bytes we compiled, named by
            // their sha256 and this engine's compatibility hash); tenant-supplied precompiled
            // artifacts are never deserialized.
            if let Ok(c) = unsafe { Component::deserialize_file(&self.engine, path) } {
                return Ok(c);
            }
        }
        let component = Component::new(&self.engine, bytes).map_err(|e| PluginError::Rejected {
            plugin: name.to_string(),
            reason: format!("not a valid WebAssembly component: {e:#}"),
        })?;
        if let Some(path) = &cached {
            let _ = write_atomic(path, &component);
        }
        Ok(component)
    }

    /// A linker with this kind's host imports; the std-only WASI imports trap if called.
    pub fn linker(&self, kind: PluginKind, component: &Component) -> Result<Linker<HostState>, PluginError> {
        let mut linker: Linker<HostState> = Linker::new(&self.engine);
        let err = |e: wasmtime::Error| PluginError::Runtime(format!("linking host imports: {e:#}"));
        type H = HasSelf<HostState>;
        for iface in kind.imports() {
            match *iface {
                "types" => imports::types::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "log" => imports::log::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "metrics" => imports::metrics::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "tokenizer" => imports::tokenizer::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "logits" => imports::logits::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "grammar-engine" => {
                    imports::grammar_engine::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?
                }
                "kv" => imports::kv::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "rate-limit" => imports::rate_limit::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                "clock" => imports::clock::add_to_linker::<HostState, H>(&mut linker, |s| s).map_err(err)?,
                _ => {}
            }
        }
        let seeds: Vec<String> = component
            .component_type()
            .imports(&self.engine)
            .map(|(n, _)| n.to_string())
            .filter(|n| n.starts_with(INSECURE_SEED_PREFIX))
            .collect();
        for name in seeds {
            linker
                .instance(&name)
                .and_then(|mut i| {
                    i.func_wrap("insecure-seed", |_store, (): ()| {
                        Ok(((0x243f_6a88_85a3_08d3u64, 0x1319_8a2e_0370_7344u64),))
                    })
                })
                .map_err(err)?;
        }
        linker.define_unknown_imports_as_traps(component).map_err(err)?;
        Ok(linker)
    }

    /// A fresh store with this kind's memory cap and a deadline of `deadline` from now.
    pub fn store(
        &self,
        kind: PluginKind,
        limits: KindLimits,
        env: Arc<PluginEnv>,
        tenant: Arc<TenantServices>,
        tenant_name: &str,
        plugin: &str,
    ) -> Store<HostState> {
        let store_limits = StoreLimitsBuilder::new()
            .memory_size(limits.memory_bytes)
            .trap_on_grow_failure(true)
            .instances(64)
            .memories(16)
            .tables(32)
            .build();
        let mut store = Store::new(&self.engine, HostState::new(env, tenant, tenant_name, plugin, store_limits));
        store.limiter(|s| s);
        store.epoch_deadline_trap();
        set_deadline(&mut store, limits.init);
        let _ = kind;
        store
    }
}

/// Arms the epoch deadline of the next call.
pub fn set_deadline(store: &mut Store<HostState>, d: Duration) {
    let ticks = (d.as_micros() / TICK.as_micros()).max(1) as u64;
    store.set_epoch_deadline(ticks);
}

/// Which kind a component is, from its exports; rejects imports outside our package (naming
/// them), except the std-only WASI stubs.
fn classify(imports: &[String], exports: &[String]) -> Result<PluginKind, String> {
    let iface = |imp: &str| -> Option<String> {
        imp.strip_prefix("kimi:host/").and_then(|r| r.strip_suffix(&format!("@{VERSION}"))).map(str::to_string)
    };
    // Imports first: anything outside our package (but the std-only stubs) is refused by name.
    for imp in imports {
        if TRAP_STUB_PREFIXES.iter().any(|p| imp.starts_with(p)) || imp.starts_with(INSECURE_SEED_PREFIX) {
            continue;
        }
        let known = iface(imp).is_some_and(|i| PluginKind::ALL.iter().any(|k| k.imports().contains(&i.as_str())));
        if !known {
            return Err(format!("import `{imp}` is not allowed (plugins may import only kimi:host/*@{VERSION})"));
        }
    }
    let kinds: Vec<PluginKind> = PluginKind::ALL.into_iter().filter(|k| exports.contains(&k.export())).collect();
    let kind = match kinds.as_slice() {
        [k] => *k,
        [] => {
            return Err(format!(
                "exports none of the plugin interfaces ({}); found exports: [{}]",
                PluginKind::ALL.iter().map(|k| k.export()).collect::<Vec<_>>().join(", "),
                exports.join(", ")
            ));
        }
        _ => return Err("exports more than one plugin interface".to_string()),
    };
    if kind != PluginKind::Sampler && exports.contains(&speculation_export()) {
        return Err("exports `speculation`, which only a sampler may export".to_string());
    }
    for imp in imports {
        if let Some(i) = iface(imp)
            && !kind.imports().contains(&i.as_str())
        {
            return Err(format!("import `{imp}` is not available to a {} plugin", kind.name()));
        }
    }
    Ok(kind)
}

fn write_atomic(path: &Path, component: &Component) -> std::io::Result<()> {
    let bytes = component.serialize().map_err(std::io::Error::other)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, path)
}
