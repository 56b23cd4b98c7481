//! Tenants: API keys (as SHA-256), plugin sets, uploaded components, limits. A tenant's plugins,
//! sampler instances, kv store and rate buckets are its own: nothing here is reachable from
//! another tenant's requests.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::plugins::{
    CompiledPlugin, EffortBudget, GrammarPlugin, PluginEnv, PluginError, PluginHealth, PluginKind, PluginRuntime,
    PolicyPlugin, QuotaStore, SamplerPlugin, TemplatePlugin, TenantSampler, TenantServices,
};

use super::config::TenantConfig;

/// A loaded plugin of any kind, as a request uses it.
#[derive(Clone)]
pub enum LoadedPlugin {
    Sampler(Arc<Mutex<TenantSampler>>),
    Template(Arc<TemplatePlugin>),
    Grammar(Arc<GrammarPlugin>),
    Policy(Arc<PolicyPlugin>),
}

impl LoadedPlugin {
    pub fn health(&self) -> Arc<PluginHealth> {
        match self {
            LoadedPlugin::Sampler(s) => s.lock().unwrap_or_else(|e| e.into_inner()).health.clone(),
            LoadedPlugin::Template(x) => x.0.health.clone(),
            LoadedPlugin::Grammar(x) => x.0.health.clone(),
            LoadedPlugin::Policy(x) => x.0.health.clone(),
        }
    }

    pub fn kind(&self) -> PluginKind {
        match self {
            LoadedPlugin::Sampler(_) => PluginKind::Sampler,
            LoadedPlugin::Template(_) => PluginKind::Template,
            LoadedPlugin::Grammar(_) => PluginKind::Grammar,
            LoadedPlugin::Policy(_) => PluginKind::Policy,
        }
    }
}

/// Where a tenant's plugin came from: only uploads are the tenant's to replace or delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginOrigin {
    /// Compiled into this binary (`builtin:<name>`).
    Builtin,
    /// Named by the operator's config file (a component path).
    Configured,
    /// Uploaded by the tenant through `/v1/plugins`.
    Upload,
}

impl PluginOrigin {
    pub fn name(self) -> &'static str {
        match self {
            PluginOrigin::Builtin => "builtin",
            PluginOrigin::Configured => "configured",
            PluginOrigin::Upload => "upload",
        }
    }
}

/// One entry of a tenant's plugin list.
#[derive(Clone)]
pub struct PluginEntry {
    pub name: String,
    pub sha256: String,
    pub origin: PluginOrigin,
    pub plugin: LoadedPlugin,
    /// Call counts, time and failures (read by `/metrics` without taking the plugin's lock).
    pub health: Arc<PluginHealth>,
}

pub struct Tenant {
    pub name: String,
    key_hashes: Vec<String>,
    pub anonymous: bool,
    pub services: Arc<TenantServices>,
    /// Plugins by name (builtins as `builtin:<name>`, uploads by their own name).
    plugins: RwLock<BTreeMap<String, PluginEntry>>,
    pub default_template: String,
    pub default_grammar: Option<String>,
    pub default_sampler: String,
    /// (policy name, its JSON config), run in order.
    pub policies: Vec<(String, String)>,
    pub max_concurrency: usize,
    pub in_flight: AtomicUsize,
    pub thinking_budgets: Vec<EffortBudget>,
    pub allow_uploads: bool,
    pub prefix_cache: crate::server::config::PrefixPartition,
}

/// Why a change to a tenant's plugin list was refused.
#[derive(Debug, thiserror::Error)]
pub enum PluginListError {
    #[error("{0}")]
    NotFound(String),
    /// The name belongs to a builtin or configured plugin.
    #[error("{0}")]
    Reserved(String),
    #[error("{0}")]
    Full(String),
}

/// Most plugins one tenant may upload.
pub const MAX_UPLOADS: usize = 32;
/// Largest uploaded component.
pub const MAX_COMPONENT_BYTES: usize = 16 << 20;

/// Loads a plugin for one tenant (each tenant gets its own sampler instance and state).
pub fn instantiate(
    runtime: &Arc<PluginRuntime>,
    compiled: &CompiledPlugin,
    env: &Arc<PluginEnv>,
    services: &Arc<TenantServices>,
    tenant: &str,
) -> Result<LoadedPlugin, PluginError> {
    Ok(match compiled.kind {
        PluginKind::Sampler => {
            let p = Arc::new(SamplerPlugin::new(runtime.clone(), compiled)?);
            let mut ts = TenantSampler::new(p, env.clone(), services.clone(), tenant);
            // Instantiate now so a broken sampler fails at load, not on the first request.
            ts.instance()?;
            LoadedPlugin::Sampler(Arc::new(Mutex::new(ts)))
        }
        PluginKind::Template => LoadedPlugin::Template(Arc::new(TemplatePlugin::new(runtime.clone(), compiled)?)),
        PluginKind::Grammar => LoadedPlugin::Grammar(Arc::new(GrammarPlugin::new(runtime.clone(), compiled)?)),
        PluginKind::Policy => LoadedPlugin::Policy(Arc::new(PolicyPlugin::new(runtime.clone(), compiled)?)),
    })
}

/// A plugin named in the config: `builtin:<name>` or a path to a component file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginRef {
    Builtin(String),
    File(std::path::PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum PluginRefError {
    #[error("unknown builtin plugin `builtin:{0}`")]
    UnknownBuiltin(String),
    #[error("plugin {path}: {source}")]
    Read { path: String, source: std::io::Error },
}

impl PluginRef {
    pub fn parse(reference: &str) -> PluginRef {
        match reference.strip_prefix(BUILTIN_PREFIX) {
            Some(name) => PluginRef::Builtin(name.to_string()),
            None => PluginRef::File(reference.into()),
        }
    }

    /// The name the tenant knows it by: `builtin:<name>`, or the file's stem.
    pub fn name(&self) -> String {
        match self {
            PluginRef::Builtin(n) => format!("{BUILTIN_PREFIX}{n}"),
            PluginRef::File(p) => {
                p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned())
            }
        }
    }

    pub fn bytes(&self) -> Result<Vec<u8>, PluginRefError> {
        match self {
            PluginRef::Builtin(n) => crate::plugins::builtin::builtin(n)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| PluginRefError::UnknownBuiltin(n.clone())),
            PluginRef::File(p) => {
                std::fs::read(p).map_err(|source| PluginRefError::Read { path: p.display().to_string(), source })
            }
        }
    }
}

/// Why a configured tenant could not be set up (named at start-up).
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenant `{tenant}`: {source}")]
    Reference { tenant: String, source: PluginRefError },
    #[error("tenant `{tenant}`: `{reference}`: {source}")]
    Plugin { tenant: String, reference: String, source: PluginError },
    #[error("tenant `{tenant}`: `{reference}` is a {found} plugin, not a {want}")]
    WrongKind { tenant: String, reference: String, found: &'static str, want: &'static str },
    #[error("tenant `{tenant}`: policy config: {source}")]
    PolicyConfig { tenant: String, source: serde_json::Error },
}

/// Names starting with this are the builtins'.
pub const BUILTIN_PREFIX: &str = "builtin:";

impl Tenant {
    pub fn from_config(
        c: &TenantConfig,
        runtime: &Arc<PluginRuntime>,
        env: &Arc<PluginEnv>,
        quotas: &Arc<dyn QuotaStore>,
    ) -> Result<Tenant, TenantError> {
        let services = Arc::new(TenantServices::new(&c.name, quotas.clone(), c.quota_store_failure));
        let mut plugins = BTreeMap::new();
        let tenant = || c.name.clone();
        let mut load = |reference: &str, want: PluginKind| -> Result<String, TenantError> {
            let r = PluginRef::parse(reference);
            let name = r.name();
            if plugins.contains_key(&name) {
                return Ok(name);
            }
            let bytes = r.bytes().map_err(|source| TenantError::Reference { tenant: tenant(), source })?;
            let plugin_err = |source: PluginError| TenantError::Plugin {
                tenant: tenant(),
                reference: reference.to_string(),
                source,
            };
            let builtin = matches!(r, PluginRef::Builtin(_));
            let mut compiled = runtime.load(&name, &bytes).map_err(plugin_err)?;
            compiled.trusted = builtin;
            if compiled.kind != want {
                return Err(TenantError::WrongKind {
                    tenant: tenant(),
                    reference: reference.to_string(),
                    found: compiled.kind.name(),
                    want: want.name(),
                });
            }
            let plugin = instantiate(runtime, &compiled, env, &services, &c.name).map_err(plugin_err)?;
            let origin = if builtin { PluginOrigin::Builtin } else { PluginOrigin::Configured };
            let health = plugin.health();
            plugins.insert(
                name.clone(),
                PluginEntry { name: name.clone(), sha256: compiled.sha256.clone(), origin, plugin, health },
            );
            Ok(name)
        };
        let default_template = load(&c.plugins.template, PluginKind::Template)?;
        let default_grammar = c.plugins.grammar.as_deref().map(|g| load(g, PluginKind::Grammar)).transpose()?;
        let default_sampler = load(&c.plugins.sampler, PluginKind::Sampler)?;
        let mut policies = Vec::new();
        for p in &c.plugins.policies {
            let name = load(&p.plugin, PluginKind::Policy)?;
            let config = match &p.config {
                Some(v) => serde_json::to_string(v)
                    .map_err(|source| TenantError::PolicyConfig { tenant: c.name.clone(), source })?,
                None => "{}".into(),
            };
            policies.push((name, config));
        }
        // Builtin samplers are always selectable by name.
        let _ = load("builtin:sampler-standard", PluginKind::Sampler)?;
        Ok(Tenant {
            name: c.name.clone(),
            key_hashes: c.api_key_sha256.iter().map(|k| k.to_ascii_lowercase()).collect(),
            anonymous: c.anonymous,
            services,
            plugins: RwLock::new(plugins),
            default_template,
            default_grammar,
            default_sampler,
            policies,
            max_concurrency: c.max_concurrency,
            in_flight: AtomicUsize::new(0),
            thinking_budgets: c
                .thinking_budgets
                .iter()
                .map(|(e, t)| EffortBudget { effort: e.clone(), tokens: *t })
                .collect(),
            allow_uploads: c.allow_uploads,
            prefix_cache: c.prefix_cache,
        })
    }

    pub fn has_any_key(&self) -> bool {
        !self.key_hashes.is_empty()
    }

    pub fn has_key_hash(&self, hash: &str) -> bool {
        self.key_hashes.iter().any(|h| h == hash)
    }

    /// The tenant's plugin called `name` (an upload, or `builtin:<name>` / `<name>` for builtins).
    pub fn plugin(&self, name: &str) -> Option<PluginEntry> {
        let plugins = self.plugins.read().unwrap_or_else(|e| e.into_inner());
        plugins.get(name).or_else(|| plugins.get(&format!("builtin:{name}"))).cloned()
    }

    pub fn list(&self) -> Vec<PluginEntry> {
        self.plugins.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Adds an uploaded plugin (replacing an earlier upload of the same name). Builtin and
    /// operator-configured plugins can be neither replaced nor shadowed.
    pub fn add_upload(&self, entry: PluginEntry) -> Result<(), PluginListError> {
        let mut plugins = self.plugins.write().unwrap_or_else(|e| e.into_inner());
        if matches!(PluginRef::parse(&entry.name), PluginRef::Builtin(_)) {
            return Err(PluginListError::Reserved(format!("names starting with `{BUILTIN_PREFIX}` are reserved")));
        }
        let shadowed = plugins.get(&entry.name).or_else(|| plugins.get(&format!("{BUILTIN_PREFIX}{}", entry.name)));
        if let Some(p) = shadowed.filter(|p| p.origin != PluginOrigin::Upload) {
            return Err(PluginListError::Reserved(format!(
                "`{}` is a {} plugin of this tenant; choose another name",
                entry.name,
                p.origin.name()
            )));
        }
        let uploads = plugins.values().filter(|p| p.origin == PluginOrigin::Upload).count();
        if !plugins.contains_key(&entry.name) && uploads >= MAX_UPLOADS {
            return Err(PluginListError::Full(format!("a tenant may upload at most {MAX_UPLOADS} plugins")));
        }
        plugins.insert(entry.name.clone(), entry);
        Ok(())
    }

    /// Removes an upload; builtins and configured plugins stay.
    pub fn remove_upload(&self, name: &str) -> Result<(), PluginListError> {
        let mut plugins = self.plugins.write().unwrap_or_else(|e| e.into_inner());
        match plugins.get(name) {
            Some(p) if p.origin == PluginOrigin::Upload => {
                plugins.remove(name);
                Ok(())
            }
            Some(p) => Err(PluginListError::Reserved(format!(
                "`{name}` is a {} plugin: only the operator's configuration can remove it",
                p.origin.name()
            ))),
            None => Err(PluginListError::NotFound(format!("no plugin named `{name}`"))),
        }
    }

    /// Counts a request in; None when the tenant is at its concurrency cap.
    pub fn enter(self: &Arc<Self>) -> Option<InFlight> {
        let prev = self.in_flight.fetch_add(1, Ordering::AcqRel);
        if prev >= self.max_concurrency {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(InFlight(self.clone()))
    }
}

/// A request in flight for its tenant (counted until dropped).
pub struct InFlight(Arc<Tenant>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
