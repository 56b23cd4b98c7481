//! Per (tenant, plugin) health: call counts and time, failures, and the circuit breaker that
//! disables a plugin for its tenant after repeated failures.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Failures within this window that disable a plugin for its tenant.
pub const STRIKES: usize = 3;
pub const STRIKE_WINDOW: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct PluginHealth {
    pub calls: AtomicU64,
    pub call_nanos: AtomicU64,
    pub failures: AtomicU64,
    pub traps: AtomicU64,
    pub timeouts: AtomicU64,
    recent: Mutex<VecDeque<Instant>>,
    disabled: AtomicBool,
}

impl PluginHealth {
    pub fn record_call(&self, d: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.call_nanos.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts a failure; returns true if the plugin is now disabled.
    pub fn record_failure(&self, trap: bool, timeout: bool) -> bool {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if trap {
            self.traps.fetch_add(1, Ordering::Relaxed);
        }
        if timeout {
            self.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let mut q = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        q.push_back(now);
        while q.front().is_some_and(|t| now.duration_since(*t) > STRIKE_WINDOW) {
            q.pop_front();
        }
        if q.len() >= STRIKES {
            self.disabled.store(true, Ordering::Relaxed);
        }
        self.is_disabled()
    }

    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// Re-enables (an operator action, or a new upload of the plugin).
    pub fn reset(&self) {
        self.disabled.store(false, Ordering::Relaxed);
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}
