"""A kimi-host policy plugin written in Python (built with componentize-py).

It refuses requests whose messages mention a blocked word (HTTP 403), caps `max_tokens`
(HTTP 400), and counts admitted requests per API key in the host's tenant-scoped key-value store.

Config (JSON): {"blocked_words": ["secret"], "max_tokens": 4096}
"""

import json

from wit_world import exports
from wit_world.exports import policy_plugin
from wit_world.imports import kv, log, metrics, types
from componentize_py_types import Err


def _config(text: str) -> dict:
    if not text.strip():
        return {}
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise Err(types.PluginError_BadConfig(f"python-policy config is not JSON: {e}"))
    if not isinstance(cfg, dict):
        raise Err(types.PluginError_BadConfig("python-policy config must be an object"))
    return cfg


def _reject(status: int, message: str) -> policy_plugin.Admission:
    metrics.counter_add("rejected", 1)
    return policy_plugin.Admission_Reject(policy_plugin.Rejection(status, message, None))


class PolicyPlugin(exports.PolicyPlugin):
    def describe(self) -> policy_plugin.Capabilities:
        return policy_plugin.Capabilities("python-policy")

    def admit(self, config: str, meta: policy_plugin.RequestMeta, body_json: str) -> policy_plugin.Admission:
        cfg = _config(config)
        limit = cfg.get("max_tokens")
        if isinstance(limit, int) and meta.max_tokens > limit:
            return _reject(400, f"max_tokens {meta.max_tokens} is over this tenant's limit of {limit}")
        body = json.loads(body_json) if body_json else {}
        text = " ".join(
            m.get("content", "") for m in body.get("messages", []) if isinstance(m.get("content"), str)
        ).lower()
        for word in cfg.get("blocked_words", []):
            if word.lower() in text:
                log.emit(log.Level.INFO, f"blocked a request mentioning {word!r}")
                return _reject(403, f"requests mentioning '{word}' are not allowed")
        key = f"admitted:{meta.key_id}"
        for _ in range(8):  # compare-and-set retry loop
            current = kv.get(key)
            count = int(current[0].decode()) if current else 0
            if kv.compare_and_set(key, str(count + 1).encode(), current[1] if current else None, 0):
                break
        return policy_plugin.Admission_Allow()

    def on_complete(self, config: str, meta: policy_plugin.RequestMeta, prompt_tokens: int, completion_tokens: int) -> None:
        metrics.counter_add("completion_tokens", completion_tokens)
