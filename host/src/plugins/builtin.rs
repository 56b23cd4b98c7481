//! Standard plugins compiled into the binary (built from `plugins/` by `build.rs`).

/// `builtin:<name>` → component bytes.
pub const BUILTINS: &[(&str, &[u8])] = &[
    ("sampler-standard", include_bytes!(concat!(env!("OUT_DIR"), "/sampler_standard.wasm"))),
    ("policy-limits", include_bytes!(concat!(env!("OUT_DIR"), "/policy_limits.wasm"))),
    ("policy-kimi-vendor", include_bytes!(concat!(env!("OUT_DIR"), "/policy_kimi_vendor.wasm"))),
    ("template-kimi-k3", include_bytes!(concat!(env!("OUT_DIR"), "/template_kimi_k3.wasm"))),
    ("grammar-kimi-k3", include_bytes!(concat!(env!("OUT_DIR"), "/grammar_kimi_k3.wasm"))),
];

/// Bytes of `builtin:<name>` (or of `<name>`).
pub fn builtin(name: &str) -> Option<&'static [u8]> {
    let name = name.strip_prefix("builtin:").unwrap_or(name);
    BUILTINS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}
