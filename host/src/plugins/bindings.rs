//! Host-side bindings generated from `wit/`. The imports are generated once (world
//! `host-imports`) and shared by every plugin world through `with`.

pub mod host {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "host-imports",
        with: {
            "kimi:host/logits.step-logits": crate::plugins::host::StepLogits,
        },
        imports: { default: trappable },
    });
}

pub mod sampler {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "sampler",
        with: {
            "kimi:host/types": crate::plugins::bindings::host::kimi::host::types,
            "kimi:host/log": crate::plugins::bindings::host::kimi::host::log,
            "kimi:host/metrics": crate::plugins::bindings::host::kimi::host::metrics,
            "kimi:host/tokenizer": crate::plugins::bindings::host::kimi::host::tokenizer,
            "kimi:host/logits": crate::plugins::bindings::host::kimi::host::logits,
        },
    });
}

pub mod policy {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "policy",
        with: {
            "kimi:host/types": crate::plugins::bindings::host::kimi::host::types,
            "kimi:host/log": crate::plugins::bindings::host::kimi::host::log,
            "kimi:host/metrics": crate::plugins::bindings::host::kimi::host::metrics,
            "kimi:host/kv": crate::plugins::bindings::host::kimi::host::kv,
            "kimi:host/rate-limit": crate::plugins::bindings::host::kimi::host::rate_limit,
            "kimi:host/clock": crate::plugins::bindings::host::kimi::host::clock,
        },
    });
}

pub mod grammar {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "grammar",
        with: {
            "kimi:host/types": crate::plugins::bindings::host::kimi::host::types,
            "kimi:host/log": crate::plugins::bindings::host::kimi::host::log,
            "kimi:host/tokenizer": crate::plugins::bindings::host::kimi::host::tokenizer,
            "kimi:host/grammar-engine": crate::plugins::bindings::host::kimi::host::grammar_engine,
        },
    });
}

pub mod template {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "template",
        with: {
            "kimi:host/types": crate::plugins::bindings::host::kimi::host::types,
            "kimi:host/log": crate::plugins::bindings::host::kimi::host::log,
            "kimi:host/tokenizer": crate::plugins::bindings::host::kimi::host::tokenizer,
        },
    });
}
