//! Token usage and its cost (docs/contract.md, section 2c), read from a projected envelope.
//!
//! Producers report usage in several shapes; [`read`] finds a `usage` object wherever the
//! contract says one stands and reads any of them:
//!
//! - `inputTokens` / `outputTokens` (camelCase, seed 003 worker notifications and runtime events),
//! - `input_tokens` / `output_tokens` (Anthropic, OpenAI Responses),
//! - `prompt_tokens` / `completion_tokens` (OpenAI Chat Completions),
//!
//! with totals optional and cached and reasoning counts where the shape has them. Cost never
//! comes from the wire: [`Prices`] computes it from the operator's own price table, per model.

use crate::model::Envelope;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Tokens one event reports, and the model they were spent on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Input tokens read from a prompt cache (part of `input_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_input_tokens: Option<u64>,
    /// Output tokens spent on reasoning (part of `output_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    /// The model, when the producer named it beside the usage or on the event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl Usage {
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Add `other`'s counts; the model stays this one's, or becomes `other`'s when this has none.
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cached_input_tokens = add_opt(self.cached_input_tokens, other.cached_input_tokens);
        self.reasoning_tokens = add_opt(self.reasoning_tokens, other.reasoning_tokens);
        if self.model.is_none() {
            self.model.clone_from(&other.model);
        }
    }
}

fn add_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// The usage an envelope reports, if any: a `usage` object on the payload (a runtime event's
/// `payload`, a collaboration event's `data`, which the envelope keeps as its payload), in an
/// AG-UI `RUN_FINISHED`'s `result`, an AG-UI `CUSTOM` event named `usage` (its `value`), or an
/// A2A Message's or Task's `metadata` (as the wire normaliser keeps them: `message`, `task`,
/// `result`). A `usage` object with no token count it recognises is no usage.
pub fn read(env: &Envelope) -> Option<Usage> {
    let payload = env.payload.as_ref()?.as_object()?;
    let usage = candidates(payload).find_map(|(usage, holder)| {
        let mut u = parse(usage)?;
        if u.model.is_none() {
            u.model = model_of(holder).or_else(|| model_of(payload));
        }
        Some(u)
    })?;
    Some(usage)
}

/// The agent that spent an event's usage: its `agentId`, else the payload's `fromAgent` (the
/// speaker of a collaboration event), else the agent whose NATS user published it (`_as.<agent>`
/// in the raw subject).
pub fn spender(env: &Envelope) -> Option<String> {
    let text = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
    env.agent_id
        .as_ref()
        .and_then(text)
        .or_else(|| env.payload.as_ref()?.get("fromAgent").and_then(text))
        .or_else(|| env.publishing_agent())
}

/// `(usage object, the object holding it)` in the order the contract lists the places.
fn candidates<'a>(
    payload: &'a Map<String, Value>,
) -> impl Iterator<Item = (&'a Map<String, Value>, &'a Map<String, Value>)> + 'a {
    let custom_usage = (payload.get("agUiType").and_then(Value::as_str) == Some("CUSTOM")
        && payload.get("name").and_then(Value::as_str) == Some("usage"))
    .then(|| payload.get("value").and_then(Value::as_object))
    .flatten()
    .map(|v| (v, payload));
    // A relayed A2A answer keeps the agent's Message, Task or status update under `a2a` (see
    // `ingest::a2a_wire`); a Task's or an update's status carries the agent's Message.
    let a2a = obj(payload, "a2a");
    let status_message = |item: &'a Map<String, Value>| {
        obj(item, "status")
            .and_then(|s| obj(s, "message"))
            .and_then(|m| obj(m, "metadata"))
    };
    let holders = [
        Some(payload),
        obj(payload, "result"),
        obj(payload, "metadata"),
        obj(payload, "message").and_then(|m| obj(m, "metadata")),
        obj(payload, "task").and_then(|t| obj(t, "metadata")),
        obj(payload, "result").and_then(|r| obj(r, "metadata")),
        obj(payload, "data"),
        a2a.and_then(|a| obj(a, "message"))
            .and_then(|m| obj(m, "metadata")),
        a2a.and_then(|a| obj(a, "task"))
            .and_then(|t| obj(t, "metadata")),
        a2a.and_then(|a| obj(a, "task")).and_then(status_message),
        a2a.and_then(|a| obj(a, "statusUpdate"))
            .and_then(status_message),
    ];
    custom_usage.into_iter().chain(
        holders
            .into_iter()
            .flatten()
            .filter_map(|h| obj(h, "usage").map(|u| (u, h))),
    )
}

fn obj<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Map<String, Value>> {
    m.get(key).and_then(Value::as_object)
}

fn model_of(m: &Map<String, Value>) -> Option<String> {
    ["model", "modelId", "model_name"]
        .iter()
        .find_map(|k| m.get(*k).and_then(Value::as_str))
        .filter(|s| !s.trim().is_empty())
        .map(str::to_string)
}

fn count(m: &Map<String, Value>, keys: &[&str]) -> Option<u64> {
    keys.iter().find_map(|k| match m.get(*k)? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)),
        _ => None,
    })
}

/// One usage object in any of the three shapes.
fn parse(u: &Map<String, Value>) -> Option<Usage> {
    let input = count(u, &["inputTokens", "input_tokens", "prompt_tokens"]);
    let output = count(u, &["outputTokens", "output_tokens", "completion_tokens"]);
    let total = count(u, &["totalTokens", "total_tokens"]);
    if input.is_none() && output.is_none() && total.is_none() {
        return None;
    }
    let (input, output) = match (input, output, total) {
        (Some(i), Some(o), _) => (i, o),
        (Some(i), None, Some(t)) => (i, t.saturating_sub(i)),
        (None, Some(o), Some(t)) => (t.saturating_sub(o), o),
        (i, o, _) => (i.unwrap_or(0), o.unwrap_or(0)),
    };
    let details = |names: &[&str]| names.iter().find_map(|n| obj(u, n));
    // Anthropic: cache_read_input_tokens beside the counts; OpenAI: prompt_tokens_details /
    // input_tokens_details.cached_tokens; camelCase producers: cachedInputTokens.
    let cached = count(
        u,
        &[
            "cachedInputTokens",
            "cache_read_input_tokens",
            "cached_tokens",
        ],
    )
    .or_else(|| {
        details(&["prompt_tokens_details", "input_tokens_details"])
            .and_then(|d| count(d, &["cached_tokens"]))
    });
    let reasoning = count(u, &["reasoningTokens", "reasoning_tokens"]).or_else(|| {
        details(&["completion_tokens_details", "output_tokens_details"])
            .and_then(|d| count(d, &["reasoning_tokens"]))
    });
    Some(Usage {
        input_tokens: input,
        output_tokens: output,
        cached_input_tokens: cached,
        reasoning_tokens: reasoning,
        model: model_of(u),
    })
}

/// One model's prices, in the operator's currency per million tokens.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// The model name as producers report it (compared case-insensitively).
    pub model: String,
    /// Per million input tokens (those not read from a cache).
    pub input_per_mtok: f64,
    /// Per million output tokens (reasoning tokens included).
    pub output_per_mtok: f64,
    /// Per million input tokens read from a prompt cache; the input price when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_per_mtok: Option<f64>,
}

/// The operator's price table (`[[usage.prices]]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prices {
    by_model: Vec<Price>,
}

impl Prices {
    /// No prices: usage has tokens and no cost.
    pub const EMPTY: Prices = Prices {
        by_model: Vec::new(),
    };

    /// The table; an error names the first entry that cannot be used.
    pub fn new(prices: &[Price]) -> Result<Prices, String> {
        for (i, p) in prices.iter().enumerate() {
            let ok = |v: f64| v.is_finite() && v >= 0.0;
            if p.model.trim().is_empty() {
                return Err(format!("usage.prices[{i}].model is empty: name the model"));
            }
            if !ok(p.input_per_mtok)
                || !ok(p.output_per_mtok)
                || p.cached_input_per_mtok.is_some_and(|v| !ok(v))
            {
                return Err(format!(
                    "usage.prices[{i}] ({}): prices must be finite and not negative",
                    p.model
                ));
            }
            if prices[..i]
                .iter()
                .any(|q| q.model.eq_ignore_ascii_case(&p.model))
            {
                return Err(format!(
                    "usage.prices[{i}]: model {} is priced twice",
                    p.model
                ));
            }
        }
        Ok(Prices {
            by_model: prices.to_vec(),
        })
    }

    /// The cost of `usage`, or `None` when its model has no price (or it names no model).
    pub fn cost(&self, usage: &Usage) -> Option<f64> {
        let model = usage.model.as_deref()?;
        let p = self
            .by_model
            .iter()
            .find(|p| p.model.eq_ignore_ascii_case(model))?;
        let cached = usage
            .cached_input_tokens
            .unwrap_or(0)
            .min(usage.input_tokens);
        let fresh = usage.input_tokens - cached;
        let per = |tokens: u64, price: f64| tokens as f64 * price / 1_000_000.0;
        Some(
            per(fresh, p.input_per_mtok)
                + per(cached, p.cached_input_per_mtok.unwrap_or(p.input_per_mtok))
                + per(usage.output_tokens, p.output_per_mtok),
        )
    }
}

/// Tokens and cost, summed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct UsageRollup {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The cost of the tokens whose model has a price in the projector's price table.
    pub cost: f64,
    /// Tokens (input and output) whose model has no price: counted, not costed.
    pub unpriced_tokens: u64,
}

impl UsageRollup {
    /// One report's tokens, costed by `prices`.
    pub fn of(u: &Usage, prices: &Prices) -> UsageRollup {
        let cost = prices.cost(u);
        UsageRollup {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cost: cost.unwrap_or(0.0),
            unpriced_tokens: if cost.is_some() { 0 } else { u.total_tokens() },
        }
    }

    pub fn add(&mut self, o: &UsageRollup) {
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.cost += o.cost;
        self.unpriced_tokens = self.unpriced_tokens.saturating_add(o.unpriced_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(payload: Value) -> Envelope {
        Envelope {
            event_type: "run.finished".into(),
            payload: Some(payload),
            ..Envelope::default()
        }
    }

    #[test]
    fn every_documented_shape_is_read() {
        let camel = read(&env(json!({"usage": {"inputTokens": 10, "outputTokens": 4,
            "cachedInputTokens": 3, "reasoningTokens": 1}, "model": "m1"})));
        assert_eq!(
            camel,
            Some(Usage {
                input_tokens: 10,
                output_tokens: 4,
                cached_input_tokens: Some(3),
                reasoning_tokens: Some(1),
                model: Some("m1".into()),
            })
        );
        // Anthropic Messages.
        let anthropic = read(&env(
            json!({"usage": {"input_tokens": 25, "output_tokens": 7,
            "cache_read_input_tokens": 20}, "model": "claude-sonnet-4"}),
        ))
        .unwrap_or_default();
        assert_eq!(
            (anthropic.input_tokens, anthropic.cached_input_tokens),
            (25, Some(20))
        );
        // OpenAI Chat Completions, with details and a total.
        let chat = read(&env(json!({"result": {"model": "gpt-4o", "usage": {
            "prompt_tokens": 100, "completion_tokens": 30, "total_tokens": 130,
            "prompt_tokens_details": {"cached_tokens": 64},
            "completion_tokens_details": {"reasoning_tokens": 12}}}})))
        .unwrap_or_default();
        assert_eq!(
            chat,
            Usage {
                input_tokens: 100,
                output_tokens: 30,
                cached_input_tokens: Some(64),
                reasoning_tokens: Some(12),
                model: Some("gpt-4o".into()),
            }
        );
    }

    #[test]
    fn a_total_alone_fills_the_missing_side_and_nothing_is_guessed_past_it() {
        let u = read(&env(
            json!({"usage": {"input_tokens": 8, "total_tokens": 20}}),
        ))
        .unwrap_or_default();
        assert_eq!((u.input_tokens, u.output_tokens, u.model), (8, 12, None));
        assert_eq!(read(&env(json!({"usage": {"note": "n/a"}}))), None);
        assert_eq!(read(&env(json!({"usage": {"input_tokens": "8"}}))), None);
        assert_eq!(read(&env(json!({"tokens": 5}))), None);
    }

    #[test]
    fn usage_is_found_in_agui_results_custom_events_and_a2a_metadata() {
        let run_finished = read(&env(json!({"agUiType": "RUN_FINISHED",
            "result": {"usage": {"inputTokens": 1, "outputTokens": 2}}})));
        assert_eq!(run_finished.map(|u| u.total_tokens()), Some(3));
        let custom = read(&env(json!({"agUiType": "CUSTOM", "name": "usage",
            "value": {"input_tokens": 5, "output_tokens": 6, "model": "m"}})));
        assert_eq!(custom.and_then(|u| u.model), Some("m".into()));
        let a2a_task = read(&env(json!({"task": {"id": "t", "metadata": {
            "usage": {"prompt_tokens": 9, "completion_tokens": 1}, "model": "m2"}}})));
        assert_eq!(
            a2a_task.map(|u| (u.input_tokens, u.model)),
            Some((9, Some("m2".into())))
        );
        let a2a_message = read(&env(json!({"message": {"metadata": {
            "usage": {"input_tokens": 4, "output_tokens": 4}}}})));
        assert_eq!(a2a_message.map(|u| u.total_tokens()), Some(8));
    }

    #[test]
    fn usage_is_found_in_relayed_a2a_answers() {
        // As the wire normaliser keeps them: the agent's Task (its status message) or Message
        // under `a2a`, and a streamed status update's message.
        let meta = json!({"usage": {"inputTokens": 30, "outputTokens": 12}, "model": "gpt-4o"});
        for payload in [
            json!({"a2a": {"kind": "task", "task": {"id": "t", "status": {"state": "TASK_STATE_COMPLETED",
                "message": {"messageId": "m", "metadata": meta}}}}}),
            json!({"a2a": {"kind": "message", "message": {"messageId": "m", "metadata": meta}}}),
            json!({"a2a": {"kind": "statusUpdate", "statusUpdate": {"status": {"message": {"metadata": meta}}}}}),
            json!({"a2a": {"kind": "task", "task": {"id": "t", "metadata": meta}}}),
        ] {
            let u = read(&env(payload.clone()));
            assert_eq!(
                u.map(|u| (u.input_tokens, u.output_tokens, u.model)),
                Some((30, 12, Some("gpt-4o".into()))),
                "{payload}"
            );
        }
    }

    #[test]
    fn cost_comes_from_the_table_only_with_cached_input_at_its_own_price() {
        let prices = Prices::new(&[Price {
            model: "Claude-Sonnet-4".into(),
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cached_input_per_mtok: Some(0.3),
        }])
        .unwrap_or_default();
        let u = Usage {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
            cached_input_tokens: Some(500_000),
            reasoning_tokens: None,
            model: Some("claude-sonnet-4".into()),
        };
        let cost = prices.cost(&u).unwrap_or(-1.0);
        assert!((cost - (1.5 + 0.15 + 1.5)).abs() < 1e-9, "{cost}");
        let unpriced = Usage {
            model: Some("other".into()),
            ..u.clone()
        };
        assert_eq!(prices.cost(&unpriced), None);
        assert_eq!(prices.cost(&Usage { model: None, ..u }), None);
    }

    #[test]
    fn a_bad_price_table_is_refused_naming_the_entry() {
        let p = |model: &str, input: f64| Price {
            model: model.into(),
            input_per_mtok: input,
            output_per_mtok: 1.0,
            cached_input_per_mtok: None,
        };
        let dup = Prices::new(&[p("a", 1.0), p("A", 2.0)]);
        assert!(dup.is_err_and(|e| e.contains("usage.prices[1]") && e.contains("twice")));
        assert!(Prices::new(&[p("a", -1.0)]).is_err());
        assert!(Prices::new(&[p(" ", 1.0)]).is_err());
        assert!(Prices::new(&[p("a", f64::NAN)]).is_err());
    }

    #[test]
    fn sums_keep_optional_counts_optional() {
        let mut a = Usage {
            input_tokens: 1,
            output_tokens: 2,
            ..Usage::default()
        };
        a.add(&Usage {
            input_tokens: 3,
            output_tokens: 4,
            reasoning_tokens: Some(2),
            model: Some("m".into()),
            ..Usage::default()
        });
        assert_eq!(
            (a.total_tokens(), a.cached_input_tokens, a.reasoning_tokens),
            (10, None, Some(2))
        );
        assert_eq!(a.model.as_deref(), Some("m"));
    }
}
