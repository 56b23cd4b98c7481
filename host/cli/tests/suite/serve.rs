//! `kimi-host serve` end to end: two servers on a tiny K3.1 checkpoint (one with two keyed tenants,
//! one with a state pool that holds two sequences), driven by `tests/python/openai_suite.py`
//! through the official `openai` package, installed into a virtualenv by this test.

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{build_custom_sampler, repo, run};
use kimi_host::engine::pool::StateShape;
use kimi_host::model::tiny::{TinyOptions, make_tiny};
use kimi_host::server::config::key_hash;

/// A virtualenv with the pinned client packages (created once per target directory).
/// None: PyPI is unreachable and the calling test is skipped (with a message).
fn python() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let py = venv.join("bin/python");
    let marker = venv.join(".installed-v1");
    if !marker.exists() {
        run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv));
        let mut pip = Command::new(&py);
        pip.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-cache-dir",
            "openai==1.109.1",
            "httpx==0.28.1",
            "jsonschema==4.23.0",
        ]);
        if !common::pip_install_or_skip("the openai client suite", &mut pip) {
            return None;
        }
        std::fs::write(&marker, "").expect("marker");
    }
    Some(py)
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr")
}

/// Signal masks and per-thread states of a process (Linux `/proc`), for a failure message: a
/// server that ignores SIGTERM shows whether the signal is pending, blocked or caught, and where
/// each thread waits.
fn process_state(pid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mut out: Vec<String> = status
        .lines()
        .filter(|l| {
            ["State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Threads"].iter().any(|k| l.starts_with(k))
        })
        .map(str::to_string)
        .collect();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let path = t.path();
            let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
            let wchan = std::fs::read_to_string(path.join("wchan")).unwrap_or_default();
            out.push(format!("task {}: {} wchan={wchan}", t.file_name().to_string_lossy(), stat.trim()));
        }
    }
    out.join("\n")
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn start(config: &Path, addr: SocketAddr, log: &Path) -> Server {
    let log = std::fs::File::create(log).expect("log");
    let child = Command::new(env!("CARGO_BIN_EXE_kimi-host"))
        .args(["serve", "--config"])
        .arg(config)
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn kimi-host serve");
    let server = Server(child);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(120) {
        if get(addr, "/health").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            return server;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("kimi-host serve did not come up on {addr}");
}

#[test]
fn openai_client_against_kimi_host_serve() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    make_tiny(&model, &TinyOptions { seed: 3, k31: true, mxfp4: true, vision: true }).expect("make-tiny");
    let cache = dir.path().join("plugin-cache");
    let (main, small) = (free_port(), free_port());
    let config = |addr: SocketAddr, top: &str, extra: &str, tenants: &str| {
        format!(
            "listen = \"{addr}\"\nmodel = \"{}\"\nmodel_name = \"kimi-tiny\"\nplugin_cache = \"{}\"\n{top}\n\
             [limits]\nmax_context = 8192\n{extra}\n{tenants}",
            model.display(),
            cache.display()
        )
    };
    let main_cfg = dir.path().join("main.toml");
    std::fs::write(
        &main_cfg,
        // The main server spreads the model over two tensor-parallel ranks: the suite must not
        // see a difference.
        config(
            main,
            "tensor_parallel = 2",
            "[engine]\nmax_seqs = 64\nstate_memory = \"512MiB\"\nqueue_timeout_ms = 60000",
            &format!(
                "[[tenants]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n\
                 [[tenants]]\nname = \"b\"\napi_key_sha256 = [\"{}\"]\n\
                 [[tenants.plugins.policies]]\nplugin = \"builtin:policy-kimi-vendor\"\n\
                 [[tenants.plugins.policies]]\nplugin = \"builtin:policy-limits\"\n\
                 config = {{ max_completion_tokens = 64, requests_per_minute = 1000 }}\n\
                 [[tenants]]\nname = \"c\"\napi_key_sha256 = [\"{}\"]\n\
                 [[tenants.plugins.policies]]\nplugin = \"builtin:policy-limits\"\n\
                 config = {{ requests_per_minute = 2 }}\n\
                 [[tenants]]\nname = \"d\"\napi_key_sha256 = [\"{}\"]\nmax_concurrency = 2\n",
                key_hash("key-a"),
                key_hash("key-b"),
                key_hash("key-c"),
                key_hash("key-d")
            ),
        ),
    )
    .expect("config");
    // The small server's pool holds two sequences of (prompt + 600) tokens, no more.
    let c = kimi_host::model::Model::load(&model).expect("model");
    let shape = StateShape::of(c.rank_config(), c.ranks().len(), c.cache_replicas());
    let per_seq = shape.slot_bytes + StateShape::pages_for(1200) * shape.page_bytes;
    let small_cfg = dir.path().join("small.toml");
    std::fs::write(
        &small_cfg,
        config(
            small,
            "",
            &format!("[engine]\nmax_seqs = 8\nstate_memory = \"{}\"\nqueue_timeout_ms = 300", 2 * per_seq + 1),
            "[[tenants]]\nname = \"local\"\nanonymous = true\n",
        ),
    )
    .expect("config");
    // The template's stop tokens, for tests that must keep a stream going.
    let tok = kimi_host::tokenizer::Tokenizer::load(&model).expect("tokenizer");
    let stops: Vec<String> =
        ["<|end_of_msg|>", "[EOS]"].iter().filter_map(|n| tok.special_id(n)).map(|i| i.to_string()).collect();
    let Some(py) = python() else { return };
    let wasm = build_custom_sampler();
    let _a = start(&main_cfg, main, &dir.path().join("main.log"));
    let _b = start(&small_cfg, small, &dir.path().join("small.log"));
    let out = Command::new(&py)
        .arg(repo().join("host/cli/tests/python/openai_suite.py"))
        .env("KIMI_URL", format!("http://{main}"))
        .env("KIMI_SMALL_URL", format!("http://{small}"))
        .env("KIMI_MODEL", "kimi-tiny")
        .env("KIMI_KEY_A", "key-a")
        .env("KIMI_KEY_B", "key-b")
        .env("KIMI_KEY_C", "key-c")
        .env("KIMI_KEY_D", "key-d")
        .env("KIMI_STOP_IDS", stops.join(","))
        .env("KIMI_SAMPLER_WASM", &wasm)
        .env("KIMI_BIN", env!("CARGO_BIN_EXE_kimi-host"))
        .env("KIMI_TOKENIZER", &model)
        .output()
        .expect("python");
    let logs = std::fs::read_to_string(dir.path().join("main.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "openai suite failed:\n{}\n{}\n--- server log (tail) ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        logs.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
}

/// Reads an HTTP/1.1 response to a request until the server closes the connection.
fn post_stream(addr: SocketAddr, path: &str, body: &str, mut on_first: impl FnMut()) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let mut fired = false;
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if !fired && String::from_utf8_lossy(&out).matches("data: {").count() >= 3 {
            fired = true;
            on_first();
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn embedded_default_answers_its_printed_curl_and_drains_on_sigterm() {
    let cache = tempfile::tempdir().expect("tempdir");
    let addr = free_port();
    let log = cache.path().join("serve.log");
    let child = Command::new(env!("CARGO_BIN_EXE_kimi-host"))
        .args(["serve", "--listen", &addr.to_string()])
        .env("KIMI_HOST_CACHE", cache.path())
        .env("RUST_BACKTRACE", "1")
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(cache.path().join("serve.err")).expect("log"))
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut server = Server(child);
    let t = Instant::now();
    while !get(addr, "/health").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
        assert!(t.elapsed() < Duration::from_secs(300), "the embedded default did not come up");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The printed example, run as printed.
    let printed = std::fs::read_to_string(&log).expect("log");
    let curl: String = printed
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("curl "))
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(curl.contains(&addr.to_string()), "no curl example printed:\n{printed}");
    let has_curl = Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success());
    let answer = if has_curl {
        let out =
            Command::new("sh").arg("-c").arg(format!("{curl} --silent --show-error --fail")).output().expect("curl");
        assert!(out.status.success(), "{curl}\n{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        // No curl on this machine: send the printed request (its path and `-d` body) ourselves.
        let path = curl.split_whitespace().nth(1).and_then(|u| u.split_once(&addr.to_string())).map(|x| x.1);
        let body = curl.split_once("-d '").and_then(|x| x.1.rsplit_once('\'')).map(|x| x.0);
        let (Some(path), Some(body)) = (path, body) else { panic!("cannot read the printed example:\n{curl}") };
        let text = post_stream(addr, path, body, || {});
        text.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default()
    };
    let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON answer");
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert!(v["choices"][0]["finish_reason"].is_string(), "{v}");

    // SIGTERM during a stream: the stream still ends properly, then the process exits cleanly.
    let pid = server.0.id().to_string();
    let body = r#"{"model": "kimi-k3-tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "stream": true}"#;
    let text = post_stream(addr, "/v1/chat/completions", body, || {
        run(Command::new("kill").args(["-TERM", &pid]));
    });
    assert!(text.contains("data: [DONE]"), "stream not ended cleanly: {}", &text[text.len().saturating_sub(500)..]);
    assert!(text.contains("\"finish_reason\":\"") || text.contains("shutting down"), "{text}");
    let t = Instant::now();
    loop {
        if let Some(status) = server.0.try_wait().expect("wait") {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "server did not exit after SIGTERM; stderr:\n{}\nprocess:\n{}",
            std::fs::read_to_string(cache.path().join("serve.err")).unwrap_or_default(),
            process_state(&pid)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(get(addr, "/health").is_none(), "still listening");
}

#[test]
fn example_config_is_valid() {
    let c = kimi_host::server::config::ServeConfig::load(&repo().join("examples/kimi-host.toml")).expect("parses");
    c.validate().expect("valid");
    assert_eq!(c.tenants.len(), 2);
    assert!(c.tenants[0].api_key_sha256.contains(&key_hash("secret")));
}
