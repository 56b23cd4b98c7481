//! Token buckets behind the `rate-limit` host interface (rate limits, token quotas and
//! concurrency caps of `policy-limits` and tenants' own policies). In process by default; in
//! Redis when `[limits] store = "redis://…"`, so replicas behind one load balancer share one
//! budget per tenant. A bucket refills at `per_second` up to `burst`; `release` gives tokens back
//! (a finished request's concurrency slot, unused reserved tokens), never above `burst`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The store could not answer (Redis unreachable, timed out, or replied nonsense).
#[derive(Debug, Clone, thiserror::Error)]
#[error("quota store: {0}")]
pub struct QuotaError(pub String);

/// Ok, or milliseconds until `amount` is available (`u64::MAX`: never, it exceeds `burst`).
pub type Acquired = Result<(), u64>;

/// Where buckets live. `scope` keeps tenants apart (one tenant's plugin names only its own).
pub trait QuotaStore: Send + Sync {
    fn try_acquire(
        &self,
        scope: &str,
        name: &str,
        amount: u32,
        per_second: f64,
        burst: u32,
    ) -> Result<Acquired, QuotaError>;
    fn release(&self, scope: &str, name: &str, amount: u32) -> Result<(), QuotaError>;
    /// `memory` or `redis`, for `/health` and logs.
    fn kind(&self) -> &'static str;
    /// Whether the store answers now (start-up check; the memory store always does).
    fn check(&self) -> Result<(), QuotaError> {
        Ok(())
    }
}

/// Most buckets kept in memory per store; a full map forgets the stalest full buckets first.
const LOCAL_MAX_BUCKETS: usize = 100_000;

struct Bucket {
    tokens: f64,
    burst: f64,
    last: Instant,
}

/// This process's buckets (the default: one replica, one budget).
#[derive(Default)]
pub struct LocalQuotas {
    buckets: Mutex<HashMap<(String, String), Bucket>>,
}

impl QuotaStore for LocalQuotas {
    fn try_acquire(
        &self,
        scope: &str,
        name: &str,
        amount: u32,
        per_second: f64,
        burst: u32,
    ) -> Result<Acquired, QuotaError> {
        let mut m = self.buckets.lock();
        let now = Instant::now();
        let rate = if per_second.is_finite() { per_second.max(0.0) } else { 0.0 };
        if m.len() >= LOCAL_MAX_BUCKETS {
            // A bucket that has refilled is indistinguishable from a new one: forget those.
            m.retain(|_, b| b.tokens < b.burst);
        }
        let b = m.entry((scope.to_string(), name.to_string())).or_insert(Bucket {
            tokens: burst as f64,
            burst: burst as f64,
            last: now,
        });
        b.burst = burst as f64;
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(b.burst);
        b.last = now;
        Ok(take(&mut b.tokens, amount as f64, rate, burst as f64))
    }

    fn release(&self, scope: &str, name: &str, amount: u32) -> Result<(), QuotaError> {
        if let Some(b) = self.buckets.lock().get_mut(&(scope.to_string(), name.to_string())) {
            b.tokens = (b.tokens + amount as f64).min(b.burst);
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

/// The bucket arithmetic, shared by the local store and (in Lua) the Redis one.
fn take(tokens: &mut f64, want: f64, rate: f64, burst: f64) -> Acquired {
    if want > burst {
        Err(u64::MAX)
    } else if *tokens >= want {
        *tokens -= want;
        Ok(())
    } else if rate > 0.0 {
        Err(((want - *tokens) / rate * 1000.0).ceil() as u64)
    } else {
        Err(u64::MAX)
    }
}

/// Atomic refill-and-take on one hash (`tokens`, `burst`, `last` in ms of Redis' own clock, so
/// replicas' clocks never matter). Returns the wait in ms, 0 when granted, -1 for never. The key
/// expires once the bucket would be full again (then a missing key means exactly that); a bucket
/// that never refills (a concurrency cap) expires after `ARGV[4]` ms without use, so slots held by
/// a replica that died come back.
const ACQUIRE_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local want = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local idle_ttl = tonumber(ARGV[4])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'last')
local tokens = tonumber(b[1])
local last = tonumber(b[2])
if tokens == nil or last == nil then
  tokens = burst
  last = now
end
if now > last then
  tokens = math.min(burst, tokens + (now - last) / 1000 * rate)
  last = now
end
local wait
if want > burst then
  wait = -1
elseif tokens >= want then
  tokens = tokens - want
  wait = 0
elseif rate > 0 then
  wait = math.ceil((want - tokens) / rate * 1000)
else
  wait = -1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'burst', tostring(burst), 'last', tostring(last))
local ttl = idle_ttl
if rate > 0 then
  ttl = math.ceil((burst - tokens) / rate * 1000) + 1000
end
redis.call('PEXPIRE', KEYS[1], ttl)
return wait
";

const RELEASE_LUA: &str = r"
local b = redis.call('HMGET', KEYS[1], 'tokens', 'burst')
local tokens = tonumber(b[1])
local burst = tonumber(b[2])
if tokens == nil or burst == nil then
  return 0
end
redis.call('HSET', KEYS[1], 'tokens', tostring(math.min(burst, tokens + tonumber(ARGV[1]))))
return 1
";

/// How long a never-refilling bucket (a concurrency cap) lives without use.
const IDLE_TTL_MS: u64 = 3_600_000;

/// After a failed connect, calls fail at once for this long instead of each waiting for the
/// connect timeout (an unreachable Redis must not add its timeout to every request).
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Buckets in Redis, shared by every replica configured with the same URL and prefix.
pub struct RedisQuotas {
    client: redis::Client,
    prefix: String,
    timeout: Duration,
    idle: Mutex<Vec<redis::Connection>>,
    down_until: Mutex<Option<Instant>>,
    acquire: redis::Script,
    release: redis::Script,
}

impl RedisQuotas {
    /// Parses the URL (no connection yet: the server starts even while Redis is down, and each
    /// tenant's failure policy decides what its requests get meanwhile).
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<RedisQuotas, QuotaError> {
        let client = redis::Client::open(url).map_err(|e| QuotaError(format!("bad Redis URL {url:?}: {e}")))?;
        Ok(RedisQuotas {
            client,
            prefix: prefix.to_string(),
            timeout,
            idle: Mutex::new(Vec::new()),
            down_until: Mutex::new(None),
            acquire: redis::Script::new(ACQUIRE_LUA),
            release: redis::Script::new(RELEASE_LUA),
        })
    }

    /// `prefix:<len>:<scope>:<name>`: the length keeps `a:b` + `c` apart from `a` + `b:c`.
    fn key(&self, scope: &str, name: &str) -> String {
        format!("{}:{}:{scope}:{name}", self.prefix, scope.len())
    }

    fn with_connection<T>(
        &self,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, QuotaError> {
        if self.down_until.lock().is_some_and(|t| Instant::now() < t) {
            return Err(QuotaError("Redis was unreachable a moment ago".into()));
        }
        let pooled = self.idle.lock().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => match self.connect() {
                Ok(c) => c,
                Err(e) => {
                    *self.down_until.lock() = Some(Instant::now() + RETRY_AFTER_FAILURE);
                    return Err(e);
                }
            },
        };
        match f(&mut conn) {
            Ok(v) => {
                let mut idle = self.idle.lock();
                if idle.len() < 32 {
                    idle.push(conn);
                }
                Ok(v)
            }
            // The connection may be half-read: drop it, the next call opens a fresh one.
            Err(e) => Err(QuotaError(format!("Redis: {e}"))),
        }
    }

    fn connect(&self) -> Result<redis::Connection, QuotaError> {
        let c = self
            .client
            .get_connection_with_timeout(self.timeout)
            .map_err(|e| QuotaError(format!("cannot reach Redis: {e}")))?;
        c.set_read_timeout(Some(self.timeout)).map_err(|e| QuotaError(format!("Redis: {e}")))?;
        c.set_write_timeout(Some(self.timeout)).map_err(|e| QuotaError(format!("Redis: {e}")))?;
        Ok(c)
    }
}

impl QuotaStore for RedisQuotas {
    fn try_acquire(
        &self,
        scope: &str,
        name: &str,
        amount: u32,
        per_second: f64,
        burst: u32,
    ) -> Result<Acquired, QuotaError> {
        let key = self.key(scope, name);
        let rate = if per_second.is_finite() { per_second.max(0.0) } else { 0.0 };
        let wait: i64 = self
            .with_connection(|c| self.acquire.key(&key).arg(amount).arg(rate).arg(burst).arg(IDLE_TTL_MS).invoke(c))?;
        Ok(match wait {
            0 => Ok(()),
            w if w < 0 => Err(u64::MAX),
            w => Err(w as u64),
        })
    }

    fn release(&self, scope: &str, name: &str, amount: u32) -> Result<(), QuotaError> {
        let key = self.key(scope, name);
        self.with_connection(|c| self.release.key(&key).arg(amount).invoke::<i64>(c)).map(|_| ())
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn check(&self) -> Result<(), QuotaError> {
        self.with_connection(|c| redis::cmd("PING").query::<String>(c).map(|_| ()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_buckets_refill_cap_and_release_within_burst() {
        let q = LocalQuotas::default();
        for _ in 0..3 {
            assert_eq!(q.try_acquire("t", "r", 1, 0.0, 3).expect("local"), Ok(()));
        }
        assert_eq!(q.try_acquire("t", "r", 1, 0.0, 3).expect("local"), Err(u64::MAX));
        // Another scope has its own bucket.
        assert_eq!(q.try_acquire("u", "r", 1, 0.0, 3).expect("local"), Ok(()));
        q.release("t", "r", 10).expect("local");
        for _ in 0..3 {
            assert_eq!(q.try_acquire("t", "r", 1, 0.0, 3).expect("local"), Ok(()));
        }
        assert_eq!(q.try_acquire("t", "r", 1, 0.0, 3).expect("local"), Err(u64::MAX), "release stops at burst");
        // A refilling bucket says how long to wait.
        assert_eq!(q.try_acquire("t", "rate", 2, 1.0, 2).expect("local"), Ok(()));
        assert!(matches!(q.try_acquire("t", "rate", 2, 1.0, 2).expect("local"), Err(ms) if ms > 1000 && ms <= 2000));
        assert_eq!(q.try_acquire("t", "big", 5, 1.0, 2).expect("local"), Err(u64::MAX));
    }

    #[test]
    fn an_unreachable_redis_fails_fast_after_the_first_timeout() {
        // Port 1 on loopback: nothing listens, the connect is refused.
        let q = RedisQuotas::new("redis://127.0.0.1:1/", "t", Duration::from_millis(200)).expect("url");
        let first = q.try_acquire("s", "n", 1, 1.0, 1).expect_err("unreachable");
        assert!(first.0.contains("cannot reach Redis"), "{first}");
        let second = q.try_acquire("s", "n", 1, 1.0, 1).expect_err("unreachable");
        assert!(second.0.contains("a moment ago"), "the second call tried to connect again: {second}");
        assert!(RedisQuotas::new("not a url", "t", Duration::from_millis(200)).is_err());
    }
}
