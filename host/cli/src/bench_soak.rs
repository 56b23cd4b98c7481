//! `kimi-host bench soak`: a bounded soak of `kimi-host serve` under faults, on loopback only.
//!
//! It starts the server as a child process (the embedded model, a generated config with two
//! tenants) and, for `--duration` seconds, runs a seeded mix from `--concurrency` clients:
//! streaming and non-streaming chat, completions with logprobs, tools, JSON-schema output, `n = 2`
//! with stop strings, bad requests, clients that vanish mid-stream or before the answer, and a
//! second tenant that uploads a misbehaving sampler (loops, hoards memory, panics, bad ids) and
//! uses it. Then it checks what a hosting vendor needs to hold:
//! - every request got a complete answer (a status and a well-formed body; a stream ends with
//!   `[DONE]` after a finish reason or an error) unless the client itself went away;
//! - the well-behaved tenant was never failed (its answers are 200, 400 for its bad requests, or
//!   429 when busy), whatever the other tenant's plugin did;
//! - once idle, the state pool and the queue are empty, and the good tenant is served again
//!   (its policy's concurrency slots all came back);
//! - the server's request counters agree with what the clients saw;
//! - resident memory after the run is within `RSS_GROWTH` of what it was after warm-up;
//! - SIGTERM during running streams ends each of them with a reason and the process exits 0
//!   within its grace period.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use kimi_host::server::config::key_hash;

/// Allowed growth of resident memory from warm-up to the end of the run: a quarter, and at least
/// 96 MiB. The hostile tenant's sampler hoards memory up to its 64 MiB cap, and the instance doing
/// so may be alive at the end of a short run though none was at warm-up; the other 32 MiB are
/// allocator and plugin-pool slack. (A 60 s run measured 64.6 MiB of growth against the former
/// 64 MiB slack: the cap alone.) A leak still shows: the documented 600 s run is held to it too.
pub const RSS_GROWTH: f64 = 0.25;
pub const RSS_SLACK_BYTES: u64 = 96 << 20;

const ACME_KEY: &str = "soak-acme";
const MALLORY_KEY: &str = "soak-mallory";
const OPERATOR_KEY: &str = "soak-operator";
/// How long one request may take before it counts as unanswered.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const GRACE_S: u64 = 5;

/// What the client saw of one request.
#[derive(Debug)]
enum Outcome {
    /// A complete answer: status, and whether its body was well-formed for that status.
    Answered { status: u16, well_formed: Result<(), String>, completion_tokens: u64 },
    /// The client went away on purpose (status known once headers arrived).
    Left { status: Option<u16> },
    /// No complete answer: the connection failed, closed early or timed out.
    Unanswered(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Scenario {
    Chat,
    ChatStream,
    Tools,
    JsonSchema,
    CompletionLogprobs,
    ChoicesWithStop,
    BadRequest,
    LeaveMidStream,
    LeaveBeforeAnswer,
    HostileUpload,
    HostileSampler,
}

impl Scenario {
    fn tenant(self) -> &'static str {
        match self {
            Scenario::HostileUpload | Scenario::HostileSampler => "mallory",
            _ => "acme",
        }
    }

    fn endpoint(self) -> &'static str {
        match self {
            Scenario::CompletionLogprobs => "/v1/completions",
            Scenario::HostileUpload => "/v1/plugins",
            _ => "/v1/chat/completions",
        }
    }

    /// Statuses the well-behaved tenant may see (it must never be failed by the other one).
    fn acceptable(self, status: u16) -> bool {
        match self {
            Scenario::BadRequest => matches!(status, 400 | 404 | 413 | 422),
            Scenario::HostileUpload => matches!(status, 200 | 201 | 400 | 403 | 404 | 409),
            // A misbehaving plugin fails its own requests, in any of the documented ways.
            Scenario::HostileSampler => matches!(status, 200 | 400 | 429 | 500 | 503),
            _ => matches!(status, 200 | 429),
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct ScenarioCounts {
    pub sent: u64,
    /// Status → answers.
    pub statuses: BTreeMap<u16, u64>,
    pub left: u64,
    pub unanswered: u64,
    pub unacceptable: u64,
    pub malformed: u64,
}

#[derive(Debug, Serialize)]
pub struct SoakReport {
    pub duration_s: f64,
    pub concurrency: usize,
    pub scenarios: BTreeMap<String, ScenarioCounts>,
    pub rss_after_warmup_bytes: u64,
    pub rss_end_bytes: u64,
    pub rss_bound_bytes: u64,
    pub pool_after: BTreeMap<String, f64>,
    pub drain_streams_ended_with_reason: usize,
    pub drain_streams: usize,
    pub exit_after_sigterm_s: f64,
    /// Whether the misbehaving-plugin tenant took part (`--hostile`).
    pub hostile_tenant: bool,
    /// Every check that failed; empty when the soak passed.
    pub violations: Vec<String>,
    /// Examples of what went wrong (the first few), for debugging.
    pub examples: Vec<String>,
}

struct Tally {
    counts: BTreeMap<Scenario, ScenarioCounts>,
    /// (tenant, endpoint, status) → answers, to compare with the server's counters.
    answered: BTreeMap<(String, String, u16), u64>,
    /// (tenant, endpoint) → requests whose status the client never learned.
    unknown: BTreeMap<(String, String), u64>,
    completion_tokens: BTreeMap<String, u64>,
    examples: Vec<String>,
}

impl Tally {
    fn record(&mut self, sc: Scenario, out: Outcome) {
        let c = self.counts.entry(sc).or_default();
        c.sent += 1;
        let key = |s: u16| (sc.tenant().to_string(), sc.endpoint().to_string(), s);
        let mut example = None;
        match out {
            Outcome::Answered { status, well_formed, completion_tokens } => {
                *c.statuses.entry(status).or_default() += 1;
                *self.answered.entry(key(status)).or_default() += 1;
                *self.completion_tokens.entry(sc.tenant().to_string()).or_default() += completion_tokens;
                if !sc.acceptable(status) {
                    c.unacceptable += 1;
                    example = Some(format!("{sc:?}: status {status} ({well_formed:?})"));
                }
                if let Err(e) = well_formed {
                    c.malformed += 1;
                    example = Some(format!("{sc:?}: malformed {status} answer: {e}"));
                }
            }
            Outcome::Left { status } => {
                c.left += 1;
                match status {
                    Some(s) => *self.answered.entry(key(s)).or_default() += 1,
                    None => *self.unknown.entry((sc.tenant().to_string(), sc.endpoint().to_string())).or_default() += 1,
                }
            }
            Outcome::Unanswered(why) => {
                c.unanswered += 1;
                example = Some(format!("{sc:?}: unanswered: {why}"));
            }
        }
        if let Some(e) = example
            && self.examples.len() < 20
        {
            self.examples.push(e);
        }
    }
}

/// A response read to the end (`Connection: close`), with a chunked body decoded.
struct Response {
    status: u16,
    content_type: String,
    body: Vec<u8>,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_response(raw: &[u8]) -> Result<Response, String> {
    let end = find(raw, b"\r\n\r\n").ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let status = head.get(9..12).and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad status line {head:?}"))?;
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_ascii_lowercase())
    };
    let mut rest = &raw[end + 4..];
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut out = Vec::new();
        loop {
            let line_end = find(rest, b"\r\n").ok_or("chunked body cut short")?;
            let size_text = String::from_utf8_lossy(&rest[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| format!("bad chunk size {size_text:?}"))?;
            rest = &rest[line_end + 2..];
            if size == 0 {
                break;
            }
            if rest.len() < size + 2 {
                return Err("chunk cut short".into());
            }
            out.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        out
    } else {
        if let Some(n) = header("content-length").and_then(|v| v.parse::<usize>().ok())
            && rest.len() < n
        {
            return Err(format!("body has {} of {n} bytes", rest.len()));
        }
        rest.to_vec()
    };
    Ok(Response { status, content_type: header("content-type").unwrap_or_default(), body })
}

/// Checks an answer's shape: OpenAI errors have `error.message`; a 200 has finish reasons; an
/// event stream ends with `[DONE]` after a finish reason or an error event. Returns the
/// completion tokens reported in `usage`.
fn check_answer(r: &Response) -> (Result<(), String>, u64) {
    if r.content_type.starts_with("text/event-stream") {
        let text = String::from_utf8_lossy(&r.body);
        let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        if events.last() != Some(&"[DONE]") {
            return (Err("stream did not end with [DONE]".into()), 0);
        }
        let mut reason = false;
        let mut tokens = 0;
        for e in &events[..events.len() - 1] {
            let Ok(v) = serde_json::from_str::<Value>(e) else { return (Err(format!("bad event {e}")), 0) };
            if v.get("error").is_some_and(|e| e["message"].is_string()) {
                reason = true;
            }
            if v["choices"].as_array().is_some_and(|cs| cs.iter().any(|c| c["finish_reason"].is_string())) {
                reason = true;
            }
            if let Some(t) = v["usage"]["completion_tokens"].as_u64() {
                tokens = t;
            }
        }
        return (if reason { Ok(()) } else { Err("stream ended without a finish reason or error".into()) }, tokens);
    }
    let Ok(v) = serde_json::from_slice::<Value>(&r.body) else {
        return (Err(format!("status {} with a non-JSON body", r.status)), 0);
    };
    if r.status >= 400 {
        let ok = v["error"]["message"].is_string();
        return (if ok { Ok(()) } else { Err(format!("error without error.message: {v}")) }, 0);
    }
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    if let Some(choices) = v["choices"].as_array()
        && !choices.iter().all(|c| c["finish_reason"].is_string())
    {
        return (Err(format!("a choice without finish_reason: {v}")), tokens);
    }
    (Ok(()), tokens)
}

/// How the client behaves after sending.
#[derive(Clone, Copy)]
enum Leave {
    Never,
    /// After the first body bytes of a stream.
    MidStream,
    /// Right after sending, before any answer.
    BeforeAnswer,
}

async fn send(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: &[u8], leave: Leave) -> Outcome {
    let go = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: soak\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        s.write_all(body).await.map_err(|e| format!("write: {e}"))?;
        if let Leave::BeforeAnswer = leave {
            return Ok(Outcome::Left { status: None });
        }
        let mut raw = Vec::new();
        let mut buf = [0u8; 16 << 10];
        loop {
            let n = s.read(&mut buf).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
            if let Leave::MidStream = leave
                && let Some(end) = find(&raw, b"\r\n\r\n")
                && raw.len() > end + 4
            {
                let status = String::from_utf8_lossy(&raw[..end]).get(9..12).and_then(|s| s.parse().ok());
                return Ok(Outcome::Left { status });
            }
        }
        let r = parse_response(&raw)
            .map_err(|e| format!("{e}: {:?}", String::from_utf8_lossy(&raw[..raw.len().min(200)])))?;
        let (well_formed, completion_tokens) = check_answer(&r);
        Ok(Outcome::Answered { status: r.status, well_formed, completion_tokens })
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, go).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => Outcome::Unanswered(e),
        Err(_) => Outcome::Unanswered(format!("no answer within {REQUEST_TIMEOUT:?}")),
    }
}

/// A small seeded generator (xorshift64*), so a run's mix repeats.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn chat_body(model: &str, content: &str, max_tokens: u64, extra: Value) -> Value {
    let mut b = json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens});
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    b
}

/// One request of scenario `sc`.
async fn run_one(addr: SocketAddr, model: &str, sc: Scenario, rng: &mut Rng, hostile: &str) -> Outcome {
    let text = format!("soak question {}: what is the weather like in city {}?", rng.next() % 1000, rng.next() % 97);
    let max_tokens = 1 + rng.below(16);
    let post = |path: &str, key: &str, body: Value, leave: Leave| {
        let (path, key, body) = (path.to_string(), key.to_string(), body.to_string());
        async move { send(addr, "POST", &path, Some(&key), body.as_bytes(), leave).await }
    };
    let chat = "/v1/chat/completions";
    match sc {
        Scenario::Chat => post(chat, ACME_KEY, chat_body(model, &text, max_tokens, json!({})), Leave::Never).await,
        Scenario::ChatStream => {
            let extra = json!({"stream": true, "stream_options": {"include_usage": true}, "temperature": 0.8});
            post(chat, ACME_KEY, chat_body(model, &text, max_tokens, extra), Leave::Never).await
        }
        Scenario::Tools => {
            let extra = json!({"tools": [{"type": "function", "function": {"name": "get_weather",
                "description": "Weather for a city", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}],
                "tool_choice": if rng.below(2) == 0 { json!("auto") } else { json!("required") }});
            post(chat, ACME_KEY, chat_body(model, &text, max_tokens + 16, extra), Leave::Never).await
        }
        Scenario::JsonSchema => {
            let extra = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema":
                {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}});
            post(chat, ACME_KEY, chat_body(model, &text, 24, extra), Leave::Never).await
        }
        Scenario::CompletionLogprobs => {
            let body = json!({"model": model, "prompt": text, "max_tokens": max_tokens, "logprobs": 2,
                "stream": rng.below(2) == 0});
            post("/v1/completions", ACME_KEY, body, Leave::Never).await
        }
        Scenario::ChoicesWithStop => {
            let extra = json!({"n": 2, "stop": ["e", "\n"], "seed": rng.next() % 1000, "temperature": 1.0});
            post(chat, ACME_KEY, chat_body(model, &text, max_tokens, extra), Leave::Never).await
        }
        Scenario::BadRequest => {
            let bodies: [&[u8]; 5] = [
                b"{\"model\": \"soak\", \"messages\": [",
                br#"{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "n": 1000}"#,
                br#"{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}"#,
                br#"{"model": "soak", "messages": "not a list"}"#,
                br#"{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}"#,
            ];
            let b = bodies[rng.below(bodies.len() as u64) as usize];
            send(addr, "POST", chat, Some(ACME_KEY), b, Leave::Never).await
        }
        Scenario::LeaveMidStream => {
            post(chat, ACME_KEY, chat_body(model, &text, 400, json!({"stream": true})), Leave::MidStream).await
        }
        Scenario::LeaveBeforeAnswer => {
            post(chat, ACME_KEY, chat_body(model, &text, 400, json!({})), Leave::BeforeAnswer).await
        }
        Scenario::HostileUpload => {
            // Replace the tenant's misbehaving sampler (delete, then upload again).
            let _ = send(addr, "DELETE", "/v1/plugins/hostile", Some(MALLORY_KEY), b"", Leave::Never).await;
            let body = json!({"kind": "sampler", "name": "hostile", "component": hostile});
            post("/v1/plugins", MALLORY_KEY, body, Leave::Never).await
        }
        Scenario::HostileSampler => {
            let modes = ["loop", "grow", "panic", "bad-token", "argmax"];
            let mode = modes[rng.below(modes.len() as u64) as usize];
            let extra = json!({"plugins": {"sampler": "hostile"}, "sampler_params": {"hostile": mode},
                "stream": rng.below(2) == 0});
            post(chat, MALLORY_KEY, chat_body(model, &text, max_tokens, extra), Leave::Never).await
        }
    }
}

/// The mix: mostly the well-behaved tenant; a fifth of the requests from the hostile one.
fn pick(rng: &mut Rng) -> Scenario {
    const MIX: [(Scenario, u64); 11] = [
        (Scenario::Chat, 14),
        (Scenario::ChatStream, 14),
        (Scenario::Tools, 8),
        (Scenario::JsonSchema, 6),
        (Scenario::CompletionLogprobs, 8),
        (Scenario::ChoicesWithStop, 6),
        (Scenario::BadRequest, 6),
        (Scenario::LeaveMidStream, 10),
        (Scenario::LeaveBeforeAnswer, 8),
        (Scenario::HostileUpload, 1),
        (Scenario::HostileSampler, 19),
    ];
    let total: u64 = MIX.iter().map(|m| m.1).sum();
    let mut x = rng.below(total);
    for (s, w) in MIX {
        if x < w {
            return s;
        }
        x -= w;
    }
    Scenario::Chat
}

/// A fresh directory under the system temp dir, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> anyhow::Result<ScratchDir> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let p = std::env::temp_dir().join(format!("kimi-soak-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| anyhow::anyhow!("creating {}: {e}", p.display()))?;
        Ok(ScratchDir(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct ServerProcess {
    child: Child,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_config(dir: &Path, addr: SocketAddr, model: &Path) -> anyhow::Result<PathBuf> {
    let config = dir.join("soak.toml");
    let text = format!(
        "listen = \"{addr}\"\nmodel = \"{}\"\nmodel_name = \"soak\"\nplugin_cache = \"{}\"\n\
         [engine]\nqueue_timeout_ms = 20000\nshutdown_grace_s = {GRACE_S}\n\
         [operator]\napi_key_sha256 = [\"{}\"]\nmetrics_require_key = true\n\
         [[tenants]]\nname = \"acme\"\napi_key_sha256 = [\"{}\"]\nallow_uploads = false\n\
         [[tenants.plugins.policies]]\nplugin = \"builtin:policy-limits\"\n\
         config = {{ requests_per_minute = 1000000, max_concurrent = 200 }}\n\
         [[tenants]]\nname = \"mallory\"\napi_key_sha256 = [\"{}\"]\n",
        model.display(),
        dir.join("plugin-cache").display(),
        key_hash(OPERATOR_KEY),
        key_hash(ACME_KEY),
        key_hash(MALLORY_KEY),
    );
    std::fs::write(&config, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", config.display()))?;
    Ok(config)
}

fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| anyhow::anyhow!("RSS: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| anyhow::anyhow!("RSS: no VmRSS line"))
}

/// `name{labels} value` lines of the exposition text.
fn metric_lines(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_string(), v)))
        .collect()
}

async fn get_json(addr: SocketAddr, path: &str, key: Option<&str>) -> anyhow::Result<(u16, Vec<u8>)> {
    let go = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: soak\r\n{auth}Connection: close\r\n\r\n").as_bytes()).await?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        let r = parse_response(&raw).map_err(anyhow::Error::msg)?;
        anyhow::Ok((r.status, r.body))
    };
    tokio::time::timeout(Duration::from_secs(30), go).await.map_err(|_| anyhow::anyhow!("GET {path} timed out"))?
}

/// Runs the soak; `Err` only when it could not run at all (violations are in the report).
/// `hostile`: a misbehaving sampler component for the second tenant (`test_hostile.wasm`); without
/// one, that tenant's scenarios are left out (and the report says so).
pub async fn soak(
    duration: Duration,
    concurrency: usize,
    seed: u64,
    hostile: Option<Vec<u8>>,
) -> anyhow::Result<SoakReport> {
    let model = kimi_host::server::embedded::ensure_model()?;
    let dir = ScratchDir::new()?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| anyhow::anyhow!("finding a free port: {e}"))?;
    let config = write_config(dir.path(), addr, &model)?;
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.path().join("serve.log"))?;
    let child = Command::new(exe)
        .args(["serve", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting kimi-host serve: {e}"))?;
    let mut server = ServerProcess { child };
    let t = Instant::now();
    while !matches!(get_json(addr, "/health", None).await, Ok((200, _))) {
        if t.elapsed() > Duration::from_secs(120) || server.child.try_wait().ok().flatten().is_some() {
            let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
            anyhow::bail!("the server did not come up:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = server.child.id();
    let hostile = match hostile {
        Some(bytes) => {
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            let upload = json!({"kind": "sampler", "name": "hostile", "component": b64}).to_string();
            let first = send(addr, "POST", "/v1/plugins", Some(MALLORY_KEY), upload.as_bytes(), Leave::Never).await;
            if !matches!(first, Outcome::Answered { status: 201, .. }) {
                anyhow::bail!("uploading the misbehaving sampler failed: {first:?}");
            }
            Some(b64)
        }
        None => None,
    };

    let hostile_used = hostile.is_some();
    let tally = Arc::new(Mutex::new(Tally {
        counts: BTreeMap::new(),
        answered: BTreeMap::new(),
        unknown: BTreeMap::new(),
        completion_tokens: BTreeMap::new(),
        examples: Vec::new(),
    }));
    let t0 = Instant::now();
    let deadline = t0 + duration;
    let warm_at = t0 + (duration / 5).clamp(Duration::from_secs(2), Duration::from_secs(30));
    let rss_warm = Arc::new(Mutex::new(None::<u64>));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let (tally, stop, hostile) = (tally.clone(), stop.clone(), hostile.clone());
        workers.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(w as u64 + 1) | 1);
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                let sc = pick(&mut rng);
                let Some(hostile) = hostile.as_deref().or(sc.tenant().eq("acme").then_some("")) else { continue };
                let out = run_one(addr, "soak", sc, &mut rng, hostile).await;
                tally.lock().record(sc, out);
            }
        }));
    }
    {
        let rss_warm = rss_warm.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(warm_at.into()).await;
            *rss_warm.lock() = rss_bytes(pid).ok();
        });
    }
    for w in workers {
        w.await.map_err(|e| anyhow::anyhow!("a soak worker failed: {e}"))?;
    }
    let ran = t0.elapsed();
    let mut violations = Vec::new();

    // Idle: nothing may stay queued, running or reserved.
    let t = Instant::now();
    let (pool_after, metrics_text) = loop {
        let (status, body) = get_json(addr, "/metrics", Some(OPERATOR_KEY)).await?;
        if status != 200 {
            anyhow::bail!("/metrics answered {status}");
        }
        let metrics_text = String::from_utf8_lossy(&body).into_owned();
        let pool_after: BTreeMap<String, f64> = metric_lines(&metrics_text)
            .into_iter()
            .filter(|(k, _)| {
                [
                    "kimi_pool_slots_used",
                    "kimi_pool_pages_used",
                    "kimi_pool_bytes_used",
                    "kimi_running_requests",
                    "kimi_running_sequences",
                    "kimi_queue_depth",
                ]
                .contains(&k.as_str())
            })
            .collect();
        if pool_after.values().all(|v| *v == 0.0) || t.elapsed() > Duration::from_secs(30) {
            break (pool_after, metrics_text);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for (k, v) in &pool_after {
        if *v != 0.0 {
            violations.push(format!("{k} is {v} once idle (expected 0)"));
        }
    }
    // Admission state comes back too: the good tenant's policy caps concurrency at 200, so
    // slots leaked by requests that ended early would refuse it now.
    let probe = chat_body("soak", "after the soak", 2, json!({})).to_string();
    let probe = send(addr, "POST", "/v1/chat/completions", Some(ACME_KEY), probe.as_bytes(), Leave::Never).await;
    if !matches!(probe, Outcome::Answered { status: 200, .. }) {
        violations.push(format!("once idle, the good tenant is not served: {probe:?}"));
    }

    // The server's counters against what the clients saw.
    let tally = std::mem::replace(
        &mut *tally.lock(),
        Tally {
            counts: BTreeMap::new(),
            answered: BTreeMap::new(),
            unknown: BTreeMap::new(),
            completion_tokens: BTreeMap::new(),
            examples: Vec::new(),
        },
    );
    let lines = metric_lines(&metrics_text);
    let server_count = |tenant: &str, endpoint: &str, status: Option<u16>| -> u64 {
        lines
            .iter()
            .filter(|(k, _)| {
                k.starts_with("kimi_requests_total{")
                    && k.contains(&format!("tenant=\"{tenant}\""))
                    && k.contains(&format!("endpoint=\"{endpoint}\""))
                    && status.is_none_or(|s| k.contains(&format!("status=\"{s}\"")))
            })
            .map(|(_, v)| *v as u64)
            .sum()
    };
    let mut pairs: Vec<(String, String)> = tally.answered.keys().map(|(t, e, _)| (t.clone(), e.clone())).collect();
    pairs.extend(tally.unknown.keys().cloned());
    pairs.sort();
    pairs.dedup();
    for (tenant, endpoint) in pairs.iter().filter(|(_, e)| e != "/v1/plugins") {
        let mut seen = 0;
        for ((t, e, s), n) in &tally.answered {
            if t == tenant && e == endpoint {
                seen += n;
                let counted = server_count(tenant, endpoint, Some(*s));
                if counted < *n {
                    violations.push(format!("{tenant} {endpoint} {s}: clients saw {n}, the server counted {counted}"));
                }
            }
        }
        let unknown = tally.unknown.get(&(tenant.clone(), endpoint.clone())).copied().unwrap_or(0);
        let counted = server_count(tenant, endpoint, None);
        if counted < seen || counted > seen + unknown {
            violations.push(format!(
                "{tenant} {endpoint}: the server counted {counted} requests; clients saw {seen} answers and left {unknown} unread"
            ));
        }
    }
    for (tenant, tokens) in &tally.completion_tokens {
        let counted = lines
            .iter()
            .filter(|(k, _)| {
                k.starts_with("kimi_completion_tokens_total{") && k.contains(&format!("tenant=\"{tenant}\""))
            })
            .map(|(_, v)| *v as u64)
            .sum::<u64>();
        if counted < *tokens {
            violations
                .push(format!("{tenant}: answers reported {tokens} completion tokens, the server counted {counted}"));
        }
    }
    for (sc, c) in &tally.counts {
        if c.unanswered > 0 {
            violations.push(format!("{sc:?}: {} requests got no complete answer", c.unanswered));
        }
        if c.unacceptable > 0 {
            violations.push(format!("{sc:?}: {} answers had a status this tenant must not see", c.unacceptable));
        }
        if c.malformed > 0 {
            violations.push(format!("{sc:?}: {} answers were malformed", c.malformed));
        }
    }

    // Memory: after the run (idle) against after warm-up.
    let rss_end = rss_bytes(pid)?;
    let rss_warm = rss_warm.lock().unwrap_or(rss_end);
    let rss_bound = rss_warm + ((rss_warm as f64 * RSS_GROWTH) as u64).max(RSS_SLACK_BYTES);
    if rss_end > rss_bound {
        violations.push(format!("RSS grew from {rss_warm} B after warm-up to {rss_end} B (bound {rss_bound} B)"));
    }

    // SIGTERM while streams run: each ends with a reason, the process exits 0 within the grace.
    let drain_n = concurrency.clamp(2, 8);
    let mut streams = Vec::new();
    for i in 0..drain_n {
        let body = chat_body("soak", &format!("drain {i}"), 4000, json!({"stream": true})).to_string();
        streams.push(tokio::spawn(async move {
            send(addr, "POST", "/v1/chat/completions", Some(ACME_KEY), body.as_bytes(), Leave::Never).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t_term = Instant::now();
    let pid_t = libc::pid_t::try_from(pid).map_err(|_| anyhow::anyhow!("pid {pid} out of range"))?;
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped) and a valid signal.
    if unsafe { libc::kill(pid_t, libc::SIGTERM) } != 0 {
        anyhow::bail!("could not send SIGTERM to the server");
    }
    let mut ended = 0;
    for s in streams {
        match s.await? {
            Outcome::Answered { well_formed: Ok(()), .. } => ended += 1,
            other => {
                if violations.len() < 40 {
                    violations.push(format!("a stream running at SIGTERM did not end with a reason: {other:?}"));
                }
            }
        }
    }
    let exit = loop {
        if let Some(st) = server.child.try_wait()? {
            break Some(st);
        }
        if t_term.elapsed() > Duration::from_secs(GRACE_S + 10) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let exit_after = t_term.elapsed().as_secs_f64();
    match exit {
        Some(st) if st.success() => {}
        Some(st) => violations.push(format!("the server exited with {st} after SIGTERM")),
        None => violations.push(format!("the server was still running {exit_after:.1} s after SIGTERM")),
    }
    drop(server);

    Ok(SoakReport {
        duration_s: ran.as_secs_f64(),
        concurrency,
        scenarios: tally.counts.into_iter().map(|(k, v)| (format!("{k:?}"), v)).collect(),
        rss_after_warmup_bytes: rss_warm,
        rss_end_bytes: rss_end,
        rss_bound_bytes: rss_bound,
        pool_after,
        drain_streams_ended_with_reason: ended,
        drain_streams: drain_n,
        exit_after_sigterm_s: exit_after,
        hostile_tenant: hostile_used,
        violations,
        examples: tally.examples,
    })
}

pub fn print(r: &SoakReport) {
    println!("soak: {:.1} s, {} clients", r.duration_s, r.concurrency);
    if !r.hostile_tenant {
        println!("(no misbehaving plugin given: the second tenant's scenarios were left out; pass --hostile FILE)");
    }
    println!("{:<20} {:>6} {:>6} {:>6} {:>6}  statuses", "scenario", "sent", "left", "unansw", "bad");
    for (name, c) in &r.scenarios {
        let statuses: Vec<String> = c.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
        println!(
            "{:<20} {:>6} {:>6} {:>6} {:>6}  {}",
            name,
            c.sent,
            c.left,
            c.unanswered,
            c.unacceptable + c.malformed,
            statuses.join(" ")
        );
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "RSS: {:.1} MiB after warm-up, {:.1} MiB at the end (bound {:.1} MiB)",
        mib(r.rss_after_warmup_bytes),
        mib(r.rss_end_bytes),
        mib(r.rss_bound_bytes)
    );
    let pool: Vec<String> = r.pool_after.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("once idle: {}", pool.join(" "));
    println!(
        "SIGTERM: {}/{} running streams ended with a reason; exit after {:.1} s",
        r.drain_streams_ended_with_reason, r.drain_streams, r.exit_after_sigterm_s
    );
    if r.violations.is_empty() {
        println!("PASS");
    } else {
        println!("FAIL:");
        for v in &r.violations {
            println!("  - {v}");
        }
        for e in &r.examples {
            println!("  e.g. {e}");
        }
    }
}
