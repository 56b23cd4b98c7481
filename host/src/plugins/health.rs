//! Per (tenant, plugin) health: call counts and time, failures, and the circuit breaker that
//! disables a plugin for its tenant after repeated failures.
//!
//! The breaker is closed (calls run), open (calls refused with `Disabled`) or half-open: a
//! cool-down after it opened, calls run again; the first success closes it, the first failure
//! opens it for twice as long (up to `MAX_COOL_DOWN`). An operator or a new upload resets it.
//!
//! Builtin plugins are ours and trusted: when a request makes one trap, run out of memory or
//! time, the request was too large for it, so that is the request's error (HTTP 400) and never
//! a strike. Only failures no request can cause (bad results, failed instantiation) count.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::PluginError;

/// Failures within this window that disable a plugin for its tenant.
pub const STRIKES: usize = 3;
pub const STRIKE_WINDOW: Duration = Duration::from_secs(60);
/// How long an opened breaker stays open before a trial call (doubles on each failed trial).
pub const COOL_DOWN: Duration = Duration::from_secs(30);
pub const MAX_COOL_DOWN: Duration = Duration::from_secs(600);

#[derive(Default)]
struct Breaker {
    recent: VecDeque<Instant>,
    /// When it opened, and for how long; None: closed.
    open: Option<(Instant, Duration)>,
    /// Trial calls are running after a cool-down.
    half_open: bool,
    /// The cool-down of the next opening.
    next_cool_down: Option<Duration>,
}

#[derive(Default)]
pub struct PluginHealth {
    /// A builtin: request-caused traps are the request's fault (see the module comment).
    pub trusted: bool,
    pub calls: AtomicU64,
    pub call_nanos: AtomicU64,
    pub failures: AtomicU64,
    pub traps: AtomicU64,
    pub timeouts: AtomicU64,
    /// Failures charged to the request instead of the plugin (trusted plugins only).
    pub request_faults: AtomicU64,
    breaker: Mutex<Breaker>,
}

impl PluginHealth {
    pub fn new(trusted: bool) -> PluginHealth {
        PluginHealth { trusted, ..Default::default() }
    }

    pub fn record_call(&self, d: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.call_nanos.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts a failure as a strike; returns true if the plugin is now disabled.
    pub fn record_failure(&self, trap: bool, timeout: bool) -> bool {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if trap {
            self.traps.fetch_add(1, Ordering::Relaxed);
        }
        if timeout {
            self.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let mut b = self.breaker.lock();
        let now = Instant::now();
        if b.half_open {
            // A failed trial: open again, for longer.
            let d = b.next_cool_down.unwrap_or(COOL_DOWN);
            b.open = Some((now, d));
            b.next_cool_down = Some((d * 2).min(MAX_COOL_DOWN));
            b.half_open = false;
            b.recent.clear();
            return true;
        }
        b.recent.push_back(now);
        while b.recent.front().is_some_and(|t| now.duration_since(*t) > STRIKE_WINDOW) {
            b.recent.pop_front();
        }
        if b.recent.len() >= STRIKES && b.open.is_none() {
            let d = b.next_cool_down.unwrap_or(COOL_DOWN);
            b.open = Some((now, d));
            b.next_cool_down = Some((d * 2).min(MAX_COOL_DOWN));
            b.recent.clear();
        }
        b.open.is_some()
    }

    /// A call succeeded: a half-open breaker closes.
    pub fn record_success(&self) {
        let mut b = self.breaker.lock();
        if b.half_open {
            *b = Breaker::default();
        }
    }

    /// Classifies a failed call: for a trusted plugin, a trap, memory or deadline failure is the
    /// request's (`PluginError::RequestTooLarge`, no strike); anything else is a strike.
    pub fn failed(&self, e: PluginError) -> PluginError {
        let timeout = matches!(e, PluginError::Timeout { .. });
        let trap = matches!(e, PluginError::Trap { .. } | PluginError::OutOfMemory { .. });
        if self.trusted && (timeout || trap) {
            self.request_faults.fetch_add(1, Ordering::Relaxed);
            if trap {
                self.traps.fetch_add(1, Ordering::Relaxed);
            }
            if timeout {
                self.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            return e.charged_to_request();
        }
        if timeout || trap || matches!(e, PluginError::BadReturn { .. }) {
            self.record_failure(trap || matches!(e, PluginError::BadReturn { .. }), timeout);
        }
        e
    }

    /// Whether calls are refused now (an open breaker past its cool-down turns half-open).
    pub fn is_disabled(&self) -> bool {
        let mut b = self.breaker.lock();
        match b.open {
            Some((at, d)) if at.elapsed() >= d => {
                b.open = None;
                b.half_open = true;
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Whether the breaker is open, without moving it to half-open (for `/health`, `/metrics`).
    pub fn is_open(&self) -> bool {
        self.breaker.lock().open.is_some_and(|(at, d)| at.elapsed() < d)
    }

    /// Re-enables (an operator action, or a new upload of the plugin).
    pub fn reset(&self) {
        *self.breaker.lock() = Breaker::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trap() -> PluginError {
        PluginError::Trap { plugin: "p".into(), msg: "boom".into() }
    }

    #[test]
    fn trusted_plugins_charge_traps_to_the_request() {
        let h = PluginHealth::new(true);
        for _ in 0..10 {
            let e = h.failed(trap());
            assert!(matches!(e, PluginError::RequestTooLarge { .. }), "{e}");
        }
        assert!(!h.is_disabled());
        assert_eq!(h.request_faults.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn breaker_opens_after_strikes_and_a_reset_closes_it() {
        let h = PluginHealth::new(false);
        for _ in 0..STRIKES {
            let _ = h.failed(trap());
        }
        assert!(h.is_disabled() && h.is_open());
        h.reset();
        assert!(!h.is_disabled());
    }

    #[test]
    fn breaker_half_opens_after_its_cool_down() {
        let h = PluginHealth::new(false);
        for _ in 0..STRIKES {
            let _ = h.failed(trap());
        }
        // Pretend the cool-down has passed.
        h.breaker.lock().open = Some((Instant::now() - COOL_DOWN, COOL_DOWN));
        assert!(!h.is_disabled(), "half-open after the cool-down");
        // A failed trial opens it again at once, for longer.
        let _ = h.failed(trap());
        assert!(h.is_disabled());
        let d = h.breaker.lock().open.map(|o| o.1);
        assert_eq!(d, Some(COOL_DOWN * 2));
        h.breaker.lock().open = Some((Instant::now() - COOL_DOWN * 2, COOL_DOWN * 2));
        assert!(!h.is_disabled());
        h.record_success();
        assert!(!h.is_disabled());
        // Closed again: one failure is one strike, not an opening.
        let _ = h.failed(trap());
        assert!(!h.is_disabled());
    }
}
