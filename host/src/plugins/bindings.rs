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

/// Samplers. Generated from world `speculative-sampler` (`sampler` plus the optional
/// `speculation` export); the host looks each interface up on its own, so a component of the
/// plain `sampler` world loads through these bindings too (`SamplerPlugin::new`).
pub mod sampler {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "speculative-sampler",
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

/// A template's segment as the tokenizer's (the two enums mirror each other).
impl From<host::kimi::host::types::Segment> for crate::tokenizer::Segment {
    fn from(s: host::kimi::host::types::Segment) -> Self {
        use host::kimi::host::types::Segment as Wit;
        match s {
            Wit::Text(t) => crate::tokenizer::Segment::Text(t),
            Wit::Special(n) => crate::tokenizer::Segment::Special(n),
        }
    }
}

/// A plugin's declarative constraint as the native grammar engine's.
impl From<host::kimi::host::grammar_engine::Constraint> for crate::grammar::Constraint {
    fn from(c: host::kimi::host::grammar_engine::Constraint) -> Self {
        use host::kimi::host::grammar_engine::Constraint as Wit;
        match c {
            Wit::JsonSchema(s) => crate::grammar::Constraint::JsonSchema(s),
            Wit::Lark(s) => crate::grammar::Constraint::Lark(s),
            Wit::Regex(s) => crate::grammar::Constraint::Regex(s),
            Wit::Choice(v) => crate::grammar::Constraint::Choice(v),
        }
    }
}
