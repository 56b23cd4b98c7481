//! The standard sampling parameters of a request — names, defaults and ranges — defined once.
//!
//! The server deserializes a request's fields into [`SamplingParams`] and refuses it with a 400
//! naming the field when [`SamplingParams::check`] fails, before any work; it then forwards the
//! same struct as JSON to the tenant's sampler. `builtin:sampler-standard` deserializes that JSON
//! into this struct again, so both ends agree on every name, default and bound. Unknown keys are
//! ignored here (a tenant's own sampler may take more, e.g. `typical_p`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The standard fields, as given (`None`: not set, the default applies).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// In [0, 2]; 0 is greedy. Default 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// In (0, 1]. Default 1 (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// ≤ 0 is off (vLLM uses -1). Default off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// In [0, 1]. Default 0 (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// In [-2, 2], subtracted once from tokens that occur in the output. Default 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// In [-2, 2], subtracted per occurrence in the output. Default 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// In (0, 10]; > 1 discourages tokens of prompt and output. Default 1 (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Token id (decimal string, as OpenAI sends it) → bias in [-100, 100] added to its logit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f32>>,
}

/// A parameter out of its range; `param` is its name.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamError {
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for ParamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ParamError {}

impl SamplingParams {
    /// Checks every set field against its range; `vocab` bounds `logit_bias` ids.
    pub fn check(&self, vocab: u32) -> Result<(), ParamError> {
        range("temperature", self.temperature, 0.0, 2.0, Ends::Closed)?;
        range("top_p", self.top_p, 0.0, 1.0, Ends::OpenLow)?;
        range("min_p", self.min_p, 0.0, 1.0, Ends::Closed)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0, Ends::Closed)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, Ends::Closed)?;
        range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, Ends::OpenLow)?;
        self.logit_bias_ids(vocab).map(|_| ())
    }

    /// `logit_bias` by token id, checked (ids below `vocab`, biases in [-100, 100]).
    pub fn logit_bias_ids(&self, vocab: u32) -> Result<BTreeMap<u32, f32>, ParamError> {
        let err = |message: String| ParamError { param: "logit_bias", message };
        let mut out = BTreeMap::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| err(format!("logit_bias key `{k}` is not a token id")))?;
            if id >= vocab {
                return Err(err(format!("logit_bias token {id} is outside the vocabulary")));
            }
            if !(-100.0..=100.0).contains(&b) {
                return Err(err(format!("logit_bias values are numbers in [-100, 100], got {b}")));
            }
            out.insert(id, b);
        }
        Ok(out)
    }

    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }

    pub fn top_p(&self) -> f32 {
        self.top_p.unwrap_or(1.0)
    }

    /// 0 when off.
    pub fn top_k(&self) -> u32 {
        match self.top_k {
            Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            _ => 0,
        }
    }

    pub fn min_p(&self) -> f32 {
        self.min_p.unwrap_or(0.0)
    }

    pub fn presence_penalty(&self) -> f32 {
        self.presence_penalty.unwrap_or(0.0)
    }

    pub fn frequency_penalty(&self) -> f32 {
        self.frequency_penalty.unwrap_or(0.0)
    }

    pub fn repetition_penalty(&self) -> f32 {
        self.repetition_penalty.unwrap_or(1.0)
    }
}

#[derive(Clone, Copy)]
enum Ends {
    Closed,
    /// The low end excluded (`top_p = 0` and `repetition_penalty = 0` mean nothing).
    OpenLow,
}

fn range(param: &'static str, v: Option<f32>, lo: f32, hi: f32, ends: Ends) -> Result<(), ParamError> {
    let Some(v) = v else { return Ok(()) };
    let ok = v.is_finite()
        && v <= hi
        && match ends {
            Ends::Closed => v >= lo,
            Ends::OpenLow => v > lo,
        };
    if ok {
        return Ok(());
    }
    let open = if matches!(ends, Ends::OpenLow) { "(" } else { "[" };
    Err(ParamError { param, message: format!("{param} must be in {open}{lo}, {hi}], got {v}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_name_the_parameter() {
        let bad = [
            SamplingParams { temperature: Some(-0.1), ..Default::default() },
            SamplingParams { temperature: Some(f32::INFINITY), ..Default::default() },
            SamplingParams { top_p: Some(0.0), ..Default::default() },
            SamplingParams { repetition_penalty: Some(0.0), ..Default::default() },
            SamplingParams { min_p: Some(1.5), ..Default::default() },
            SamplingParams { frequency_penalty: Some(2.5), ..Default::default() },
        ];
        let names = ["temperature", "temperature", "top_p", "repetition_penalty", "min_p", "frequency_penalty"];
        for (p, name) in bad.iter().zip(names) {
            assert_eq!(p.check(10).expect_err(name).param, name);
        }
        let ok = SamplingParams {
            temperature: Some(0.0),
            top_p: Some(1.0),
            top_k: Some(-1),
            repetition_penalty: Some(1.2),
            logit_bias: Some(BTreeMap::from([("3".to_string(), -100.0)])),
            ..Default::default()
        };
        ok.check(10).expect("in range");
        assert_eq!((ok.top_k(), ok.min_p(), ok.logit_bias_ids(10).expect("ok")[&3]), (0, 0.0, -100.0));
        for (k, b) in [("x", 1.0), ("10", 1.0), ("2", 101.0)] {
            let p = SamplingParams { logit_bias: Some(BTreeMap::from([(k.to_string(), b)])), ..Default::default() };
            assert_eq!(p.check(10).expect_err(k).param, "logit_bias");
        }
    }
}
