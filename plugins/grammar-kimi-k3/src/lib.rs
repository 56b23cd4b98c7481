//! `builtin:grammar-kimi-k3`: the request's tools, `tool_choice` and `response_format` become a
//! Lark constraint over the Kimi-K3 output channels (see `kimi-xtml::grammar`), which the host
//! compiles and enforces natively. `auto` with no JSON response format and no thinking budget
//! needs no constraint.

use kimi_plugin::grammar::exports::kimi::host::grammar_plugin::{Capabilities, EffortBudget, GrammarRequest, Guest};
use kimi_plugin::grammar::kimi::host::grammar_engine::Constraint;
use kimi_plugin::grammar::kimi::host::types::{PluginError, RequestInfo};
use kimi_xtml::grammar::{ThinkChannel, ToolChoice, output_grammar};
use kimi_xtml::thinking::thinking_of;
use serde_json::Value;

fn parse(what: &str, s: &Option<String>) -> Result<Option<Value>, PluginError> {
    match s {
        None => Ok(None),
        Some(s) => {
            serde_json::from_str(s).map(Some).map_err(|e| PluginError::BadConfig(format!("{what} is not JSON: {e}")))
        }
    }
}

/// The think channel this request opens: off, free, or bounded by the request's
/// `thinking.budget_tokens` or else the tenant's default for the request's effort.
fn think_channel(t: Option<&Value>, defaults: &[EffortBudget]) -> Result<ThinkChannel, PluginError> {
    let t = thinking_of(t.unwrap_or(&Value::Null)).map_err(|e| PluginError::BadConfig(e.0))?;
    if !t.on {
        return Ok(ThinkChannel::Off);
    }
    let budget = t.budget_tokens.or_else(|| defaults.iter().find(|d| d.effort == t.effort).map(|d| d.tokens));
    Ok(budget.map_or(ThinkChannel::Open, ThinkChannel::Budget))
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
        let grammar = output_grammar(
            tools.as_ref(),
            &choice,
            rf.as_ref(),
            think_channel(thinking.as_ref(), &g.thinking_budgets)?,
        )
        .map_err(|e| PluginError::BadConfig(e.0))?;
        Ok(grammar.map(Constraint::Lark))
    }
}

kimi_plugin::grammar::export_grammar!(KimiK3Grammar);
