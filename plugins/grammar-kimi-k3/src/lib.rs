//! `builtin:grammar-kimi-k3`: the request's tools, `tool_choice` and `response_format` become a
//! Lark constraint over the Kimi-K3 output channels (see `kimi-xtml::grammar`), which the host
//! compiles and enforces natively. `auto` with no JSON response format needs no constraint.

use kimi_plugin::grammar::exports::kimi::host::grammar_plugin::{Capabilities, GrammarRequest, Guest};
use kimi_plugin::grammar::kimi::host::grammar_engine::Constraint;
use kimi_plugin::grammar::kimi::host::types::{PluginError, RequestInfo};
use kimi_xtml::grammar::{ToolChoice, output_grammar};
use serde_json::Value;

fn parse(what: &str, s: &Option<String>) -> Result<Option<Value>, PluginError> {
    match s {
        None => Ok(None),
        Some(s) => {
            serde_json::from_str(s).map(Some).map_err(|e| PluginError::BadConfig(format!("{what} is not JSON: {e}")))
        }
    }
}

/// Thinking is on unless Kimi's `thinking` object or `reasoning_effort: none` turns it off.
fn thinking_on(t: Option<&Value>) -> bool {
    let Some(t) = t else { return true };
    if t.get("reasoning_effort").and_then(Value::as_str) == Some("none") {
        return false;
    }
    t.get("thinking").and_then(|x| x.get("type")).and_then(Value::as_str) != Some("disabled")
}

struct KimiK3Grammar;

impl Guest for KimiK3Grammar {
    fn describe() -> Capabilities {
        Capabilities { name: "grammar-kimi-k3".into() }
    }

    fn plan(_req: RequestInfo, g: GrammarRequest) -> Result<Option<Constraint>, PluginError> {
        let tools = parse("tools", &g.tools_json)?;
        let choice = parse("tool_choice", &g.tool_choice_json)?;
        let rf = parse("response_format", &g.response_format_json)?;
        let thinking = parse("thinking", &g.thinking_json)?;
        let choice = ToolChoice::from_request(choice.as_ref()).map_err(|e| PluginError::BadConfig(e.0))?;
        let grammar = output_grammar(tools.as_ref(), &choice, rf.as_ref(), thinking_on(thinking.as_ref()))
            .map_err(|e| PluginError::BadConfig(e.0))?;
        Ok(grammar.map(Constraint::Lark))
    }
}

kimi_plugin::grammar::export_grammar!(KimiK3Grammar);
