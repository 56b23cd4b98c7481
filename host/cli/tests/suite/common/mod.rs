//! Shared helpers for tests: the goldens in `../shared/golden` (never copied into the project),
//! running commands, and building the custom-sampler example.

#![allow(dead_code)]

use std::path::PathBuf;

use kimi_host::model::checkpoint::{Checkpoint, Dtype};

/// A sampler that misbehaves on request (loops, hoards memory, panics, bad ids, floods the log);
/// built by `host/build.rs` (the `kimi-host` library's build, which runs before this crate
/// compiles) into the plugins' target directory, embedded only here, never in the release binary.
pub const TEST_HOSTILE: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../plugins/target/wasm32-wasip2/release/test_hostile.wasm"
));
use serde_json::Value;

/// `../shared/golden` from the repository root (override with `KIMI_GOLDEN_DIR`).
pub fn golden_dir() -> PathBuf {
    let dir = std::env::var_os("KIMI_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden"));
    assert!(dir.is_dir(), "golden directory {} not found: the tests need ../shared/golden", dir.display());
    dir
}

pub struct Golden {
    pub dir: PathBuf,
    pub case: Value,
    pub ck: Checkpoint,
}

impl Golden {
    pub fn open(name: &str) -> Golden {
        let dir = golden_dir().join(name);
        let case: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json"))
            .expect("case.json is JSON");
        let ck = Checkpoint::open_file(&dir.join("golden.safetensors")).expect("golden.safetensors");
        Golden { dir, case, ck }
    }

    pub fn names(&self) -> Vec<String> {
        self.case["golden_tensors"].as_object().expect("golden_tensors").keys().cloned().collect()
    }

    pub fn has(&self, name: &str) -> bool {
        self.ck.contains(name)
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let info = self.ck.info(name).unwrap_or_else(|| panic!("golden tensor {name} missing"));
        assert_eq!(info.dtype, Dtype::F32, "{name}");
        self.ck.read_f32(info)
    }

    pub fn i64(&self, name: &str) -> Vec<i64> {
        let info = self.ck.info(name).unwrap_or_else(|| panic!("golden tensor {name} missing"));
        assert_eq!(info.dtype, Dtype::I64, "{name}");
        self.ck.read_i64(info)
    }

    pub fn u8(&self, name: &str) -> Vec<u8> {
        let info = self.ck.info(name).unwrap_or_else(|| panic!("golden tensor {name} missing"));
        assert_eq!(info.dtype, Dtype::U8, "{name}");
        self.ck.bytes(info).bytes().to_vec()
    }

    /// The raw image `{base}.rgb` or `{base}.rgba` (`[H, W, C]` u8) of a vision case, if held.
    pub fn image(&self, base: &str) -> Option<kimi_host::model::vision::Image> {
        [("rgb", 3), ("rgba", 4)].into_iter().find_map(|(suffix, channels)| {
            let key = format!("{base}.{suffix}");
            self.has(&key).then(|| {
                let s = self.shape(&key);
                kimi_host::model::vision::Image { width: s[1], height: s[0], channels, data: self.u8(&key) }
            })
        })
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.i64(name).into_iter().map(|x| x as u32).collect()
    }

    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.ck.info(name).expect("tensor").shape.clone()
    }

    pub fn tol_logits(&self) -> f32 {
        self.case["suggested_tolerance"]["logits_max_abs"].as_f64().expect("tolerance") as f32
    }

    pub fn tol_state(&self) -> f32 {
        self.case["suggested_tolerance"]["hidden_and_state_max_abs"].as_f64().expect("tolerance") as f32
    }
}

/// Max |a − b|; NaN in exactly one of the two counts as infinite, NaN in both as equal.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (x - y).abs(),
            _ => f32::INFINITY,
        })
        .fold(0.0, f32::max)
}

pub fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    let d = max_abs_diff(got, want);
    assert!(d <= tol, "{name}: max |Δ| = {d} exceeds tolerance {tol}");
    d
}

/// The standard sampler's definition by brute force over a whole row: temperature, then top-k,
/// then top-p (smallest prefix reaching p after top-k renormalisation), then min-p.
pub fn exact_distribution(row: &[f32], t: f64, top_k: usize, top_p: f64, min_p: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let z: f64 = row.iter().map(|&l| (l as f64 / t).exp()).sum();
    let probs: Vec<f64> = order.iter().map(|&i| (row[i] as f64 / t).exp() / z).collect();
    let mut keep = if top_k > 0 { top_k.min(row.len()) } else { row.len() };
    let s: f64 = probs[..keep].iter().sum();
    let mut cum = 0.0;
    if let Some(i) = probs[..keep].iter().position(|p| {
        cum += p / s;
        cum >= top_p
    }) {
        keep = i + 1;
    }
    let floor = min_p * probs[0];
    keep = probs[..keep].iter().take_while(|&&p| p >= floor).count().max(1);
    let s: f64 = probs[..keep].iter().sum();
    let mut out = vec![0.0; row.len()];
    for (j, &i) in order.iter().enumerate().take(keep) {
        out[i] = probs[j] / s;
    }
    out
}

/// Chi-square check of sampled `counts` (from `n` draws) against the exact distribution `want`:
/// no draw may land on a zero-probability token, and the statistic must stay within 6 standard
/// deviations of its mean (dof). `what` names the case in failure messages.
pub fn assert_chi_square(counts: &[u32], want: &[f64], n: usize, what: &str) {
    let (mut chi2, mut dof) = (0.0, 0);
    for (c, w) in counts.iter().zip(want) {
        if *w > 0.0 {
            let e = w * n as f64;
            chi2 += (*c as f64 - e).powi(2) / e;
            dof += 1;
        } else {
            assert_eq!(*c, 0, "{what}: sampled a token the filters exclude");
        }
    }
    let bound = dof as f64 + 6.0 * (2.0 * dof as f64).sqrt();
    assert!(chi2 < bound, "{what}: chi2 {chi2:.1} over {dof} dof");
}

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command; on failure, panics with its output.
pub fn run(cmd: &mut std::process::Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds `examples/custom-sampler` (typical-p) for wasm32-wasip2; returns the component's path.
pub fn build_custom_sampler() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = repo().join("plugins/target");
    run(std::process::Command::new(cargo)
        .args(["build", "--release", "--locked", "--target", "wasm32-wasip2", "--manifest-path"])
        .arg(repo().join("examples/custom-sampler/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .env_remove("CARGO_TARGET_DIR"));
    target.join("wasm32-wasip2/release/typical_sampler.wasm")
}

/// A `redis-server` to start: the one on PATH, else Debian's unpacked into `target/redis` by
/// `scripts/fetch-redis.sh` (no system install). Returns (binary, library directory to add).
pub fn redis_server() -> (PathBuf, Option<PathBuf>) {
    if let Ok(out) = std::process::Command::new("redis-server").arg("--version").output()
        && out.status.success()
    {
        return (PathBuf::from("redis-server"), None);
    }
    let root = repo();
    let dir = root.join("target/redis");
    let bin = dir.join("usr/bin/redis-server");
    if !bin.exists() {
        let status = std::process::Command::new(root.join("scripts/fetch-redis.sh"))
            .arg(&dir)
            .status()
            .expect("run scripts/fetch-redis.sh");
        assert!(status.success(), "scripts/fetch-redis.sh could not unpack Debian's redis-server");
    }
    (bin, Some(dir.join("usr/lib/x86_64-linux-gnu")))
}

/// Runs a package installer; on failure, decides between skipping (PyPI cannot be reached from
/// here, or the disk is full: the machine's fault; the test prints why and returns) and failing
/// (otherwise the failure is real). `KIMI_REQUIRE_PYPI=1` makes both failures too.
pub fn pip_install_or_skip(test: &str, cmd: &mut std::process::Command) -> bool {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    if out.status.success() {
        return true;
    }
    let why = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if std::env::var_os("KIMI_REQUIRE_PYPI").is_none() {
        if why.contains("No space left on device") || why.contains("Errno 28") {
            eprintln!("SKIPPED {test}: the disk is full, so its packages cannot be installed:\n{why}");
            return false;
        }
        if !pypi_reachable() {
            eprintln!(
                "SKIPPED {test}: PyPI (pypi.org:443) is unreachable, so its packages cannot be installed:\n{why}"
            );
            return false;
        }
    }
    panic!("{cmd:?} failed although PyPI is reachable and the disk has room:\n{why}");
}

/// Whether a TCP connection to pypi.org:443 opens within 5 s.
pub fn pypi_reachable() -> bool {
    use std::net::ToSocketAddrs;
    let Ok(addrs) = ("pypi.org", 443).to_socket_addrs() else { return false };
    addrs.into_iter().any(|a| std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(5)).is_ok())
}

/// Feeds a matcher its lowest allowed token up to `steps` times, stopping early when masking or
/// consuming fails, nothing is allowed, or the matcher has stopped.
pub fn walk_lowest_allowed(m: &mut kimi_host::grammar::ConstraintMatcher, steps: usize) {
    for _ in 0..steps {
        let Ok(mask) = m.mask() else { return };
        let mut first = None;
        mask.iter_set_entries(|i| {
            if first.is_none() {
                first = Some(i as u32);
            }
        });
        let Some(t) = first else { return };
        if m.consume(t).is_err() || m.is_stopped() {
            return;
        }
    }
}

/// The GPU tools' Python (`scripts/gpu-tools.sh`: pinned triton and numpy), installed once for
/// the whole suite; `None`, after saying why, when the machine cannot install them (the script
/// exits 75: no PyPI, a full disk). Any other failure fails the test.
pub fn gpu_tools_python() -> Option<String> {
    static PYTHON: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let out = std::process::Command::new("bash")
                .arg(root.join("scripts/gpu-tools.sh"))
                .output()
                .expect("run scripts/gpu-tools.sh");
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.code() == Some(75) {
                eprintln!("SKIPPED: the GPU tools (triton, numpy) could not be installed:\n{err}");
                return None;
            }
            assert!(out.status.success(), "scripts/gpu-tools.sh failed:\n{err}");
            Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
        })
        .clone()
}
