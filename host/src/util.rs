//! Small helpers several layers share (kept here so no layer imports another just for them).

use std::path::PathBuf;

/// Lower-case hex of `bytes` (digests in ids, cache keys and key hashes).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `$KIMI_HOST_CACHE`, `$XDG_CACHE_HOME/kimi-host` or `~/.cache/kimi-host` (None without a home).
pub fn cache_base() -> Option<PathBuf> {
    std::env::var_os("KIMI_HOST_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kimi-host")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kimi-host")))
}
