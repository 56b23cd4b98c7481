//! The embedded default model: a tiny K3.1-architecture checkpoint (MXFP4 experts, lightning
//! indexer, byte-level tokenizer) generated once, deterministically, into the user cache. Random
//! weights — it speaks nonsense — but every serving path is real.

use std::path::PathBuf;
use std::time::Duration;

use crate::model::tiny::{TinyOptions, make_tiny};

/// Bumped when the generated checkpoint changes.
const NAME: &str = "tiny-k31-mxfp4-vision-v2";
pub const MODEL_NAME: &str = "kimi-k3-tiny";

/// `$KIMI_HOST_CACHE`, `$XDG_CACHE_HOME/kimi-host` or `~/.cache/kimi-host`.
pub fn cache_base() -> PathBuf {
    crate::util::cache_base().unwrap_or_else(|| std::env::temp_dir().join("kimi-host"))
}

/// Why the embedded model could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedModelError {
    #[error("cannot create the model cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
    #[error("generating the embedded model: {0}")]
    Generate(#[from] crate::model::ModelError),
    #[error("cannot place the embedded model at {0}")]
    Place(PathBuf),
}

/// The embedded model's directory, generated on first use.
pub fn ensure_model() -> Result<PathBuf, EmbeddedModelError> {
    let dir = cache_base().join("models").join(NAME);
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let parent = dir.parent().unwrap_or(&dir);
    std::fs::create_dir_all(parent).map_err(|source| EmbeddedModelError::Cache { path: parent.into(), source })?;
    let tmp = parent.join(format!(".{NAME}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_message(format!("generating the embedded tiny K3.1 model into {}", dir.display()));
    bar.enable_steady_tick(Duration::from_millis(100));
    let made = make_tiny(&tmp, &TinyOptions { seed: 0x4b33, k31: true, mxfp4: true, vision: true });
    bar.finish_and_clear();
    made?;
    // Another process may have finished first; either copy is the same model.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("config.json").exists() {
            return Err(EmbeddedModelError::Place(dir));
        }
    }
    eprintln!("embedded model ready: {}", dir.display());
    Ok(dir)
}

/// What `serve` prints so a user can try the server at once.
pub fn usage_examples(addr: &str, model: &str) -> String {
    format!(
        r#"kimi-host is serving `{model}` on http://{addr}

Try it:
  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python3 -c 'from openai import OpenAI
c = OpenAI(base_url="http://{addr}/v1", api_key="local")
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32)
print(r.choices[0].message)'
"#
    )
}
