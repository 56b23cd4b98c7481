//! Write kimi-host plugins in Rust.
//!
//! One module per world of the `kimi:host` WIT package. Implement the world's export trait and
//! register it with the matching macro:
//!
//! ```ignore
//! use kimi_plugin::sampler::exports::kimi::host::sampler_plugin::{Guest, GuestSequence /* … */};
//! struct MySampler;
//! impl Guest for MySampler { /* describe, sample */ }
//! kimi_plugin::sampler::export_sampler!(MySampler);
//! ```
//!
//! A sampler that also describes its distributions for speculative decoding exports the
//! `speculation` interface too (world `speculative-sampler`). Generate that world's bindings in
//! the plugin crate itself with `wit_bindgen::generate!({ path: ".../wit", world:
//! "speculative-sampler" })` and `export!`, as `sampler-standard` does: one crate cannot hold the
//! export macros of `sampler-plugin` twice, so this crate offers only the plain `sampler` world.
//!
//! Build with `cargo build --release --target wasm32-wasip2`; the result is a component the
//! host loads (`kimi-host plugin check <file.wasm>` shows what it imports and exports).

pub mod sampler {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "sampler",
        pub_export_macro: true,
        export_macro_name: "export_sampler",
        default_bindings_module: "kimi_plugin::sampler",
    });
}

pub mod grammar {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "grammar",
        pub_export_macro: true,
        export_macro_name: "export_grammar",
        default_bindings_module: "kimi_plugin::grammar",
    });
}

pub mod template {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "template",
        pub_export_macro: true,
        export_macro_name: "export_template",
        default_bindings_module: "kimi_plugin::template",
    });
}

pub mod policy {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "policy",
        pub_export_macro: true,
        export_macro_name: "export_policy",
        default_bindings_module: "kimi_plugin::policy",
    });
}
