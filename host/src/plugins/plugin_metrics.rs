//! Plugin-defined metrics (`metrics.counter-add` / `metrics.observe` in `wit/host.wit`), kept per
//! tenant with a cap on distinct series so no plugin can explode the exporter's cardinality.
//! `/metrics` exports them as `kimi_plugin_counter_total` and `kimi_plugin_histogram`, labelled
//! with tenant, plugin and the metric's name (see `server::metrics`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Most (plugin, name) series one tenant's plugins may define; later ones are dropped (counted).
pub const MAX_SERIES_PER_TENANT: usize = 256;
/// Longest metric name a plugin may use.
pub const MAX_NAME_BYTES: usize = 128;
/// Histogram upper bounds: 1e-3 · 4^k, so one layout serves seconds, tokens and bytes alike.
pub const BUCKETS: [f64; 16] = {
    let mut b = [0.0; 16];
    let mut i = 0;
    let mut v = 0.001;
    while i < 16 {
        b[i] = v;
        v *= 4.0;
        i += 1;
    }
    b
};

#[derive(Clone, Debug, PartialEq)]
pub enum Series {
    Counter(u64),
    /// Per-bucket counts (the last one is +Inf), sum and count.
    Histogram {
        buckets: [u64; BUCKETS.len() + 1],
        sum: f64,
        count: u64,
    },
}

#[derive(Debug, Default)]
pub struct PluginMetricStore {
    series: Mutex<BTreeMap<(String, String), Series>>,
    /// Updates refused: over the series cap, a name too long, or a name used as the other kind.
    pub dropped: AtomicU64,
}

impl PluginMetricStore {
    fn update(
        &self,
        plugin: &str,
        name: &str,
        fresh: impl FnOnce() -> Series,
        apply: impl FnOnce(&mut Series) -> bool,
    ) {
        if name.len() > MAX_NAME_BYTES {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut m = self.series.lock();
        let key = (plugin.to_string(), name.to_string());
        let full = m.len() >= MAX_SERIES_PER_TENANT;
        let ok = match m.get_mut(&key) {
            Some(s) => apply(s),
            None if !full => {
                let mut s = fresh();
                let ok = apply(&mut s);
                m.insert(key, s);
                ok
            }
            None => false,
        };
        if !ok {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn counter_add(&self, plugin: &str, name: &str, value: u64) {
        self.update(
            plugin,
            name,
            || Series::Counter(0),
            |s| match s {
                Series::Counter(c) => {
                    *c = c.saturating_add(value);
                    true
                }
                Series::Histogram { .. } => false,
            },
        );
    }

    pub fn observe(&self, plugin: &str, name: &str, value: f64) {
        if !value.is_finite() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.update(
            plugin,
            name,
            || Series::Histogram { buckets: [0; BUCKETS.len() + 1], sum: 0.0, count: 0 },
            |s| match s {
                Series::Histogram { buckets, sum, count } => {
                    let i = BUCKETS.iter().position(|b| value <= *b).unwrap_or(BUCKETS.len());
                    buckets[i] += 1;
                    *sum += value;
                    *count += 1;
                    true
                }
                Series::Counter(_) => false,
            },
        );
    }

    /// ((plugin, name), series) now.
    pub fn snapshot(&self) -> Vec<((String, String), Series)> {
        self.series.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histograms_accumulate_and_the_series_cap_holds() {
        let m = PluginMetricStore::default();
        m.counter_add("p", "hits", 2);
        m.counter_add("p", "hits", 3);
        m.observe("p", "size", 0.002);
        m.observe("p", "size", 1e9);
        m.observe("p", "hits", 1.0); // a counter's name used as a histogram: refused
        m.observe("p", "size", f64::NAN);
        let snap = m.snapshot();
        assert_eq!(snap[0], (("p".into(), "hits".into()), Series::Counter(5)));
        let Series::Histogram { buckets, sum, count } = &snap[1].1 else { panic!("histogram") };
        assert_eq!((*count, buckets[1], buckets[BUCKETS.len()]), (2, 1, 1));
        assert!((sum - (1e9 + 0.002)).abs() < 1.0);
        assert_eq!(m.dropped.load(Ordering::Relaxed), 2);
        for i in 0..MAX_SERIES_PER_TENANT + 10 {
            m.counter_add("flood", &format!("c{i}"), 1);
        }
        assert_eq!(m.snapshot().len(), MAX_SERIES_PER_TENANT);
        assert_eq!(m.dropped.load(Ordering::Relaxed), 2 + 12);
        m.counter_add("p", &"x".repeat(MAX_NAME_BYTES + 1), 1);
        assert_eq!(m.dropped.load(Ordering::Relaxed), 15);
    }
}
