"""kimi-host serve, driven by the official `openai` package (and httpx for raw HTTP).

Run by host/cli/tests/suite/serve.rs, which starts the servers and sets:
  KIMI_URL, KIMI_MODEL, KIMI_KEY_A, KIMI_KEY_B   the main server and two tenants' keys
  KIMI_SMALL_URL                                 a server whose state pool holds two sequences
  KIMI_SAMPLER_WASM                              a sampler component to upload (typical-p)
  KIMI_BIN, KIMI_TOKENIZER                       `kimi-host render` for expected prompt counts
The model has random weights: checks are about the server's behaviour, never the text's sense.
"""

import base64
import zlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import httpx
import jsonschema
import openai
from openai import OpenAI

URL = os.environ["KIMI_URL"]
MODEL = os.environ["KIMI_MODEL"]
KEY_A = os.environ["KIMI_KEY_A"]
KEY_B = os.environ["KIMI_KEY_B"]
SMALL_URL = os.environ["KIMI_SMALL_URL"]

client = OpenAI(base_url=URL + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
client_b = OpenAI(base_url=URL + "/v1", api_key=KEY_B, max_retries=0, timeout=120)
USER = [{"role": "user", "content": "Say something."}]
NO_THINK = {"thinking": {"type": "disabled"}}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}}},
]


def chat(**kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", USER)
    return client.chat.completions.create(**kw)


def test_models():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids


def test_non_streaming_chat():
    r = chat(max_tokens=24, seed=1)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert c.message.role == "assistant"
    assert r.usage.completion_tokens <= 24 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.model == MODEL


def test_streaming_equals_non_streaming():
    kw = dict(max_tokens=20, seed=7, temperature=1.0, extra_body=NO_THINK)
    whole = chat(**kw)
    chunks = list(chat(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == (whole.choices[0].message.content or ""), (text, whole.choices[0].message.content)
    assert finish == [whole.choices[0].finish_reason], finish
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage
    assert chunks[0].choices[0].delta.role == "assistant"


def test_seed_reproducibility():
    a = chat(max_tokens=16, seed=123, temperature=1.0)
    b = chat(max_tokens=16, seed=123, temperature=1.0)
    assert a.choices[0].message == b.choices[0].message
    c = chat(max_tokens=16, seed=124, temperature=1.0)
    # Different seeds almost surely differ on a random model (reasoning or content).
    assert (c.choices[0].message.content, getattr(c.choices[0].message, "reasoning_content", None)) != (
        a.choices[0].message.content, getattr(a.choices[0].message, "reasoning_content", None))


def test_n_two():
    r = chat(max_tokens=12, n=2, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def check_calls(r, names):
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.function.name in names, call.function.name
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_and_named():
    for seed in range(3):
        r = chat(max_tokens=1500, seed=seed, tools=TOOLS, tool_choice="required", extra_body=NO_THINK)
        check_calls(r, {"get_weather", "lookup"})
        named = {"type": "function", "function": {"name": "lookup"}}
        r = chat(max_tokens=1500, seed=seed, tools=TOOLS, tool_choice=named, extra_body=NO_THINK)
        check_calls(r, {"lookup"})
        assert len(r.choices[0].message.tool_calls) == 1


def test_tool_calls_stream_like_non_stream():
    kw = dict(max_tokens=1500, seed=3, tools=TOOLS, tool_choice="required", extra_body=NO_THINK)
    whole = chat(**kw)
    calls = {}
    for ch in chat(stream=True, **kw):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            calls.setdefault(d.index, [d.function.name, ""])
            calls[d.index][1] += d.function.arguments or ""
    got = [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert got == want, (got, want)


def test_json_schema_response_format():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
              "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    for seed in range(3):
        r = chat(max_tokens=800, seed=seed, response_format=rf, extra_body=NO_THINK)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"


def test_logprobs():
    r = chat(max_tokens=10, seed=2, logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    content = r.choices[0].logprobs.content
    assert content, r.choices[0]
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-5
    stop = 1 if r.choices[0].finish_reason == "stop" else 0
    assert len(content) + stop == r.usage.completion_tokens


def test_stop_strings_and_usage_counts():
    # Raw completions: find a substring of an unconstrained run, then stop on it.
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, seed=11, temperature=1.0, logprobs=0)
    base = client.completions.create(**kw)
    text = base.choices[0].text
    assert base.usage.completion_tokens == len(base.choices[0].logprobs.tokens) + (base.choices[0].finish_reason == "stop")
    probe = next((text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip()), None)
    assert probe, text
    kw.pop("logprobs")
    r = client.completions.create(stop=[probe], **kw)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert r.choices[0].text == text[:text.index(probe)], (r.choices[0].text, text, probe)
    # Prompt tokens equal the tokenizer's count for the rendered prompt.
    body = {"model": MODEL, "messages": USER}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(body, f)
    out = subprocess.run([os.environ["KIMI_BIN"], "render", "--tokenizer", os.environ["KIMI_TOKENIZER"], "--request", f.name],
                         check=True, capture_output=True, text=True).stdout
    ids = json.loads(out)["ids"]
    r = chat(max_tokens=4)
    assert r.usage.prompt_tokens == len(ids), (r.usage.prompt_tokens, len(ids))
    prompt_ids = client.completions.create(model=MODEL, prompt="Hello, world", max_tokens=1).usage.prompt_tokens
    assert prompt_ids == len("Hello, world".encode()), prompt_ids  # byte-level tokenizer: one id per byte


def test_uploaded_sampler_is_per_tenant():
    wasm = open(os.environ["KIMI_SAMPLER_WASM"], "rb").read()
    up = httpx.post(URL + "/v1/plugins", headers={"Authorization": "Bearer " + KEY_A}, timeout=120,
                    json={"kind": "sampler", "name": "typical", "component": base64.b64encode(wasm).decode()})
    assert up.status_code == 201, up.text
    assert up.json()["kind"] == "sampler"
    names = lambda key: [p["name"] for p in httpx.get(URL + "/v1/plugins", headers={"Authorization": "Bearer " + key}).json()["data"]]
    assert "typical" in names(KEY_A) and "typical" not in names(KEY_B)
    extra = {"plugins": {"sampler": "typical"}, "sampler_params": {"typical_p": 0.5}, **NO_THINK}
    a = chat(max_tokens=8, seed=9, extra_body=extra)
    b = chat(max_tokens=8, seed=9, extra_body=extra)
    assert a.choices[0].message.content == b.choices[0].message.content
    try:
        client_b.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body=extra)
        raise AssertionError("tenant B used tenant A's sampler")
    except openai.BadRequestError as e:
        assert "typical" in str(e)
    bad = httpx.post(URL + "/v1/plugins", headers={"Authorization": "Bearer " + KEY_A},
                     json={"kind": "sampler", "name": "junk", "component": base64.b64encode(b"\0asm junk").decode()})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "component", bad.text
    gone = httpx.delete(URL + "/v1/plugins/typical", headers={"Authorization": "Bearer " + KEY_A})
    assert gone.status_code == 200, gone.text
    try:
        chat(max_tokens=4, extra_body=extra)
        raise AssertionError("deleted sampler still usable")
    except openai.BadRequestError:
        pass


# A 2×2 PNG header with no pixel data: the template reads its size, the decoder refuses it.
PNG_URI = "data:image/png;base64," + base64.b64encode(
    b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR" + (2).to_bytes(4, "big") + (2).to_bytes(4, "big") + b"\x08\x06\0\0\0").decode()


def png_uri(w, h, seed):
    """A real w×h RGB PNG (zlib + CRC by hand: the suite's virtualenv has no imaging package)."""
    def chunk(kind, data):
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    rows = b"".join(b"\0" + bytes((x * 7 + y * 3 + seed) % 256 for x in range(w * 3)) for y in range(h))
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + b"\x08\x02\0\0\0"
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_images_reach_the_model():
    def ask(uri, **kw):
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": uri}}]
        return chat(messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0, **kw)
    # 100×60 pads to 112×84 (12 tokens), 200×60 to 224×84 (24): the usage difference is the tower's.
    a = ask(png_uri(100, 60, 1), logprobs=True, top_logprobs=5)
    b = ask(png_uri(200, 60, 1))
    assert b.usage.prompt_tokens - a.usage.prompt_tokens == 12, (a.usage, b.usage)
    c = ask(png_uri(100, 60, 90), logprobs=True, top_logprobs=5)
    top = lambda r: [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content[0].top_logprobs]
    assert top(a) != top(c), "different pixels, same log-probabilities"
    assert metric(URL, "kimi_engine_vision_images_total") >= 3


def test_tenant_policies():
    # Tenant B runs policy-kimi-vendor (n = 1, temperature ≤ 1) and policy-limits (≤ 64 tokens).
    for kw, word in [(dict(n=2), "n"), (dict(temperature=1.5), "temperature"), (dict(max_tokens=100), "64")]:
        try:
            client_b.chat.completions.create(model=MODEL, messages=USER, **{"max_tokens": 4, **kw})
            raise AssertionError(f"policy let {kw} through")
        except openai.BadRequestError as e:
            assert word in e.message, e.message
    r = client_b.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0.5)
    assert r.choices[0].finish_reason in ("stop", "length")
    # Tenant A has no such policies.
    assert len(chat(max_tokens=4, n=2, temperature=1.5).choices) == 2


def test_rate_and_concurrency_limits_answer_429_with_retry_after():
    # Tenant C: policy-limits at 2 requests per minute; the third request is refused.
    c = OpenAI(base_url=URL + "/v1", api_key=os.environ["KIMI_KEY_C"], max_retries=0, timeout=120)
    for _ in range(2):
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    try:
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        raise AssertionError("rate limit not enforced")
    except openai.RateLimitError as e:
        assert int(e.response.headers["retry-after"]) >= 1, e.response.headers
        assert "rate limit" in e.message, e.message
    # Tenant A is not affected by C's limits.
    assert chat(max_tokens=2).choices


def test_concurrency_cap_answers_429():
    # Tenant D allows 2 requests in flight: hold two long streams open, the third is refused.
    headers = {"Authorization": "Bearer " + os.environ["KIMI_KEY_D"]}
    # The stop tokens are biased away so the held streams cannot end on their own.
    body = {"model": MODEL, "messages": USER, "max_tokens": 4000, "stream": True,
            "logit_bias": {i: -100 for i in os.environ["KIMI_STOP_IDS"].split(",")}}
    http = httpx.Client(timeout=120)
    held = [http.stream("POST", URL + "/v1/chat/completions", headers=headers, json=body) for _ in range(2)]
    readers = []  # a dropped line iterator closes its connection (a client that left)
    try:
        for h in held:
            r = h.__enter__()
            assert r.status_code == 200
            readers.append(r.iter_lines())
            next(readers[-1])
        r = httpx.post(URL + "/v1/chat/completions", headers=headers, json={**body, "stream": False})
        assert r.status_code == 429 and r.headers.get("retry-after"), (r.status_code, r.text)
        assert "concurrent" in r.json()["error"]["message"], r.text
    finally:
        for h in held:
            h.__exit__(None, None, None)
        http.close()


def test_thinking_budget_bounds_reasoning():
    r = chat(max_tokens=300, seed=4, logprobs=True, extra_body={"thinking": {"type": "enabled", "budget_tokens": 6}})
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert "<|close|>" in tokens, tokens[:40]
    assert tokens.index("<|close|>") <= 6, tokens[:10]


def post_raw(body, key=KEY_A, raw=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(URL + "/v1/chat/completions", headers=headers, content=data, timeout=120)


def test_bad_input_is_4xx_and_the_server_keeps_serving():
    ok = {"model": MODEL, "messages": USER, "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases = [
        (None, b"{not json", 400),
        ({**ok, "messages": "hi"}, None, 400),
        ({**ok, "temperature": "hot"}, None, 400),
        ({**ok, "model": "gpt-4"}, None, 404),
        ({**ok, "messages": []}, None, 400),
        (None, b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
        (None, b'{"x": "' + b"a" * (20 << 20) + b'"}', 413),
        ({**ok, "max_tokens": 10_000_000}, None, 400),
        ({**ok, "temperature": -0.5}, None, 400),
        ({**ok, "n": 0}, None, 400),
        ({**ok, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, 400),
        ({**ok, "messages": [{"role": "wizard", "content": "x"}]}, None, 400),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URI}}]}]},
         None, 400),
    ]
    for body, raw, status in cases:
        r = post_raw(body, raw=raw)
        assert r.status_code == status, (body if raw is None else raw[:60], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"], err
    r = post_raw(cases[-1][0])
    assert "image 1" in r.json()["error"]["message"], r.text
    for key, status in [(None, 401), ("wrong-key", 401)]:
        r = post_raw(ok, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    try:
        OpenAI(base_url=URL + "/v1", api_key="nope", max_retries=0).models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError:
        pass
    assert post_raw(ok).status_code == 200


def metric(url, name):
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_64_concurrent_streams():
    results = [None] * 64

    def one(i):
        try:
            finish, n = None, 0
            for ch in chat(stream=True, max_tokens=8 + i % 5, seed=i, extra_body=NO_THINK):
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                n += 1
            results[i] = finish
        except Exception as e:  # noqa: BLE001
            results[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(r in ("stop", "length") for r in results), results


def test_disconnects_free_the_pool():
    def one(i):
        with httpx.stream("POST", URL + "/v1/chat/completions", headers={"Authorization": "Bearer " + KEY_A},
                          json={"model": MODEL, "messages": USER, "max_tokens": 5000, "stream": True, "seed": i},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and "delta" in line and "role" not in line:
                    return  # leave mid-stream

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    deadline = time.time() + 60
    while time.time() < deadline:
        if metric(URL, "kimi_pool_slots_used") == 0 and metric(URL, "kimi_running_sequences") == 0:
            break
        time.sleep(0.2)
    assert metric(URL, "kimi_pool_slots_used") == 0
    assert metric(URL, "kimi_pool_bytes_used") == 0
    assert metric(URL, "kimi_engine_cancelled_requests_total") >= 32
    assert chat(max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_full_pool_answers_429():
    small = OpenAI(base_url=SMALL_URL + "/v1", api_key="x", max_retries=0, timeout=120)
    statuses = []

    def one(i):
        try:
            small.chat.completions.create(model=MODEL, messages=USER, max_tokens=600, seed=i, extra_body=NO_THINK)
            statuses.append(200)
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after"), e.response.headers
            statuses.append(429)
        except Exception as e:  # noqa: BLE001
            statuses.append(repr(e))

    # Enough at once that some must wait past the 300 ms queue timeout even when replies end
    # early (at EOS long before 600 tokens): with 8, fast replies freed the pool in time.
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    assert all(s in (200, 429) for s in statuses), statuses
    assert httpx.get(SMALL_URL + "/health").status_code == 200


def test_metrics_exposition():
    text = httpx.get(URL + "/metrics").text
    for name in ["kimi_requests_total", "kimi_time_to_first_token_seconds_bucket", "kimi_inter_token_seconds_bucket",
                 "kimi_queue_depth", "kimi_pool_slots_total", "kimi_plugin_calls_total", "kimi_plugin_traps_total",
                 "kimi_plugin_call_seconds_total"]:
        assert name in text, name
    assert 'plugin="builtin:sampler-standard"' in text


TESTS = [v for k, v in list(globals().items()) if k.startswith("test_")]

if __name__ == "__main__":
    only = sys.argv[1:]
    failed = []
    for t in TESTS:
        if only and t.__name__ not in only:
            continue
        t0 = time.time()
        try:
            t()
            print(f"ok    {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
        except Exception:  # noqa: BLE001
            failed.append(t.__name__)
            print(f"FAIL  {t.__name__}\n{traceback.format_exc()}", flush=True)
    print(f"{len(failed)} failed: {failed}" if failed else "all passed")
    sys.exit(1 if failed else 0)
