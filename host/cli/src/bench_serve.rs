//! `kimi-host bench serve`: a loopback load generator. For each concurrency level, the same
//! workload (same prompts, seeds and lengths) runs through the HTTP server (streaming
//! `/v1/completions`) and through the in-process engine API, so server overhead shows as a ratio.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use kimi_host::engine::{GenRequest, SamplerRequest, SamplingSpec, SeqEvent};
use kimi_host::server::AppState;
use kimi_host::server::tenants::LoadedPlugin;

#[derive(Debug, Clone, Serialize)]
pub struct LoadFigures {
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServeBenchRow {
    pub concurrency: usize,
    pub requests: usize,
    pub http: LoadFigures,
    pub in_process: LoadFigures,
    /// HTTP output tokens/s ÷ in-process output tokens/s.
    pub throughput_ratio: f64,
}

/// What one request saw: time to first token, gaps between tokens, tokens.
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn figures(samples: &[Sample], wall: Duration) -> LoadFigures {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.gaps.iter().map(|g| g.as_secs_f64() * 1e3)).collect();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let secs = wall.as_secs_f64().max(1e-9);
    LoadFigures {
        requests_per_s: samples.len() as f64 / secs,
        output_tokens_per_s: tokens as f64 / secs,
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p99_ms: pct(&mut ttft, 0.99),
        itl_p50_ms: pct(&mut itl, 0.5),
        itl_p99_ms: pct(&mut itl, 0.99),
    }
}

fn prompt_text(i: usize) -> String {
    format!("Request {i}: tell me about the weather in city number {} and the week ahead.", i * 7 + 3)
}

/// One streaming completion over a fresh loopback connection (HTTP/1.1, chunked SSE).
async fn http_one(addr: SocketAddr, model: &str, i: usize, max_tokens: usize) -> anyhow::Result<Sample> {
    let body = json!({"model": model, "prompt": prompt_text(i), "max_tokens": max_tokens, "seed": i,
        "temperature": 1.0, "stream": true, "stream_options": {"include_usage": true}});
    http_stream(addr, body).await
}

/// Streams one `/v1/completions` request with `body`.
async fn http_stream(addr: SocketAddr, body: Value) -> anyhow::Result<Sample> {
    let body = body.to_string();
    let t0 = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    let (mut first, mut last, mut gaps, mut tokens, mut done) = (None, None, Vec::new(), 0usize, false);
    let mut scanned = 0;
    while !done {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = buf[scanned..].iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&buf[scanned..scanned + end]).trim().to_string();
            scanned += end + 1;
            let Some(data) = line.strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| anyhow::anyhow!("bad chunk {data}: {e}"))?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            } else if v.get("error").is_some() {
                anyhow::bail!("{data}");
            } else if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                let now = Instant::now();
                if first.is_none() {
                    first = Some(now - t0);
                }
                if let Some(l) = last {
                    gaps.push(now - l);
                }
                last = Some(now);
            }
        }
    }
    if !done {
        anyhow::bail!("stream ended early: {}", String::from_utf8_lossy(&buf).chars().take(300).collect::<String>());
    }
    Ok(Sample { ttft: first.unwrap_or_else(|| t0.elapsed()), gaps, tokens })
}

/// The same request through the engine directly.
async fn engine_one(state: &Arc<AppState>, i: usize, max_tokens: usize) -> anyhow::Result<Sample> {
    let tenant = state.tenants.first().ok_or_else(|| anyhow::anyhow!("no tenant"))?;
    let Some(LoadedPlugin::Sampler(sampler)) = tenant.plugin(&tenant.default_sampler).map(|p| p.plugin) else {
        anyhow::bail!("no sampler");
    };
    let t0 = Instant::now();
    let prompt = state.tok.encode_text(&prompt_text(i));
    let req = GenRequest {
        prompt,
        max_tokens,
        n: 1,
        stop_tokens: state.env.eos_tokens.clone(),
        constraint: None,
        sampling: SamplingSpec {
            sampler,
            params_json: r#"{"temperature": 1.0}"#.into(),
            seed: i as u64,
            info: SamplerRequest {
                tenant: tenant.name.clone(),
                request_id: format!("bench-{i}"),
                model: state.model_name.clone(),
                params_json: "{}".into(),
            },
        },
        logprobs: None,
        cache_salt: None,
        media: None,
    };
    let mut h = state.engine.submit(req)?;
    let (mut first, mut last, mut gaps, mut tokens) = (None, None, Vec::new(), 0);
    while let Some(ev) = h.events.recv().await {
        match ev {
            SeqEvent::Token { .. } => {
                let now = Instant::now();
                tokens += 1;
                if first.is_none() {
                    first = Some(now - t0);
                }
                if let Some(l) = last {
                    gaps.push(now - l);
                }
                last = Some(now);
            }
            SeqEvent::Cached { .. } => {}
            SeqEvent::Finished { .. } => break,
            SeqEvent::Failed { error, .. } => anyhow::bail!("{error}"),
        }
    }
    Ok(Sample { ttft: first.unwrap_or_else(|| t0.elapsed()), gaps, tokens })
}

async fn level<F, Fut>(concurrency: usize, requests: usize, one: F) -> anyhow::Result<(Vec<Sample>, Duration)>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Sample>> + Send,
{
    let t = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (one, next) = (one.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return anyhow::Ok(out);
                }
                out.push(one(i).await?);
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((all, t.elapsed()))
}

/// Runs every concurrency level against a server started on loopback from `state`.
pub async fn bench_serve(
    state: Arc<AppState>,
    levels: &[usize],
    requests_per_level: usize,
    max_tokens: usize,
) -> anyhow::Result<Vec<ServeBenchRow>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = kimi_host::server::router(state.clone());
    let http = state.http.clone();
    tokio::spawn(kimi_host::server::listener::serve(listener, app, http, std::future::pending(), Duration::ZERO));
    let model = state.model_name.clone();
    // Warm-up: compile caches, first-touch the weights.
    http_one(addr, &model, 0, 4).await?;
    let mut rows = Vec::new();
    for &c in levels {
        let requests = requests_per_level.max(c);
        let m = model.clone();
        let (http, http_wall) = level(c, requests, move |i| {
            let m = m.clone();
            async move { http_one(addr, &m, i, max_tokens).await }
        })
        .await?;
        let st = state.clone();
        let (inproc, in_wall) = level(c, requests, move |i| {
            let st = st.clone();
            async move { engine_one(&st, i, max_tokens).await }
        })
        .await?;
        let (h, p) = (figures(&http, http_wall), figures(&inproc, in_wall));
        let ratio = if p.output_tokens_per_s > 0.0 { h.output_tokens_per_s / p.output_tokens_per_s } else { 0.0 };
        rows.push(ServeBenchRow { concurrency: c, requests, http: h, in_process: p, throughput_ratio: ratio });
    }
    Ok(rows)
}

/// `bench serve --shared-prefix N`: TTFT of requests that share an N-token prefix, with the
/// prefix cache and without (each request in a partition of its own), alternating, in one run.
#[derive(Debug, Clone, Serialize)]
pub struct SharedPrefixRow {
    pub prefix_tokens: usize,
    pub requests: usize,
    pub ttft_p50_ms_cached: f64,
    pub ttft_p50_ms_uncached: f64,
    /// Uncached TTFT p50 ÷ cached TTFT p50.
    pub speedup: f64,
}

pub async fn bench_shared_prefix(
    state: Arc<AppState>,
    prefix_tokens: usize,
    requests: usize,
) -> anyhow::Result<SharedPrefixRow> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = kimi_host::server::router(state.clone());
    tokio::spawn(kimi_host::server::listener::serve(
        listener,
        app,
        state.http.clone(),
        std::future::pending(),
        Duration::ZERO,
    ));
    // A prefix of about `prefix_tokens` tokens of this model's tokenizer.
    let mut prefix = String::new();
    let mut k = 0;
    while state.tok.encode_text(&prefix).len() < prefix_tokens {
        prefix.push_str(&format!("Rule {k}: answer briefly and cite the section you used. "));
        k += 1;
    }
    let model = state.model_name.clone();
    let body = |i: usize, salt: String| {
        json!({"model": model, "prompt": format!("{prefix}\nQuestion {i}: what changed?"), "max_tokens": 1,
            "seed": i, "temperature": 0.0, "stream": true, "cache_salt": salt})
    };
    // Warm-up: first-touch the weights and fill the cached partition once.
    http_stream(addr, body(1_000_000, "bench-cached".into())).await?;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for i in 0..requests.max(1) {
        on.push(http_stream(addr, body(i, "bench-cached".into())).await?.ttft.as_secs_f64() * 1e3);
        off.push(http_stream(addr, body(i, format!("bench-uncached-{i}"))).await?.ttft.as_secs_f64() * 1e3);
    }
    let (a, b) = (pct(&mut on, 0.5), pct(&mut off, 0.5));
    Ok(SharedPrefixRow {
        prefix_tokens: state.tok.encode_text(&prefix).len(),
        requests: requests.max(1),
        ttft_p50_ms_cached: a,
        ttft_p50_ms_uncached: b,
        speedup: if a > 0.0 { b / a } else { 0.0 },
    })
}

pub fn print(rows: &[ServeBenchRow]) {
    println!(
        "{:>5} {:>6}  {:<10} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8}",
        "conc", "reqs", "path", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"
    );
    for r in rows {
        for (name, f) in [("http", &r.http), ("in-process", &r.in_process)] {
            println!(
                "{:>5} {:>6}  {:<10} {:>8.2} {:>10.1} {:>7.1}ms {:>7.1}ms {:>6.2}ms {:>6.2}ms",
                r.concurrency,
                r.requests,
                name,
                f.requests_per_s,
                f.output_tokens_per_s,
                f.ttft_p50_ms,
                f.ttft_p99_ms,
                f.itl_p50_ms,
                f.itl_p99_ms
            );
        }
        println!(
            "{:>5} {:>6}  http ÷ in-process output tokens/s = {:.2}",
            r.concurrency, r.requests, r.throughput_ratio
        );
    }
}
