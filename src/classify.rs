//! `eventRole` rules (docs/contract.md section 3): the origin's rule set, with the main-agent list from
//! configuration.
//!
//! Precedence, first match wins:
//! 1. an explicit `eventRole` (top level or `data.eventRole`) that is one of the four roles;
//!    any other non-null value is rejected (`invalid_role`) rather than silently re-routed;
//! 2. orchestration prefixes (`task.`, `continuation.`, `plan.`, `unblock.`, `zombie.`,
//!    `resume_reminder.`, `backlog.`) are `orchestration.task`;
//! 3. `a2a.*` is `delegation.subagent` for spawns, chains (`parentConversationId`, `depth`,
//!    `hop`) or when a side is a subagent; `conversation.main` only when both sides are main;
//!    `delegation.subagent` otherwise;
//! 4. side types come from `fromSessionType`/`toSessionType`, else the session keys, else the
//!    main-agent list;
//! 5. everything else is `system.observability`.

use crate::model::{DlqReason, Rejection, Role};
use serde_json::Value;
use std::collections::BTreeSet;

const ORCHESTRATION_PREFIXES: [&str; 7] = [
    "task.",
    "continuation.",
    "plan.",
    "unblock.",
    "zombie.",
    "resume_reminder.",
    "backlog.",
];

/// The main-agent list, trimmed and lower-cased once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MainAgents(BTreeSet<String>);

impl MainAgents {
    pub fn new<I: IntoIterator<Item = S>, S: AsRef<str>>(ids: I) -> Self {
        MainAgents(
            ids.into_iter()
                .map(|s| s.as_ref().trim().to_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
        )
    }
    pub fn contains(&self, id: &str) -> bool {
        self.0.contains(&id.trim().to_lowercase())
    }
}

/// What a side of an `a2a.*` exchange is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    Main,
    Subagent,
    Unknown,
}

impl SessionType {
    fn parse(v: &str) -> SessionType {
        match v.trim().to_ascii_lowercase().as_str() {
            "main" => SessionType::Main,
            "subagent" => SessionType::Subagent,
            _ => SessionType::Unknown,
        }
    }

    /// From a session key: `...:subagent:...` is a subagent, `agent:<id>:main` is main.
    pub fn from_session_key(key: &str) -> SessionType {
        let lower = key.to_ascii_lowercase();
        if lower.contains(":subagent:") {
            return SessionType::Subagent;
        }
        let parts: Vec<&str> = lower.split(':').collect();
        if parts.len() == 3 && parts[0] == "agent" && !parts[1].is_empty() && parts[2] == "main" {
            return SessionType::Main;
        }
        SessionType::Unknown
    }
}

/// Read access to an event's fields: top level first, then under `data`.
pub struct Fields<'a> {
    top: &'a serde_json::Map<String, Value>,
    data: Option<&'a serde_json::Map<String, Value>>,
}

/// Most members an object has for [`member`] to compare names one by one rather than hash.
const SCAN_MEMBERS: usize = 16;

/// `obj[name]`. An event's objects are small and every one is asked for dozens of names: up to
/// [`SCAN_MEMBERS`] members, comparing names (their lengths first) costs less than hashing the
/// name with the map's SipHash for each look-up.
pub fn member<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
    if obj.len() <= SCAN_MEMBERS {
        obj.iter().find(|(k, _)| k.as_str() == name).map(|(_, v)| v)
    } else {
        obj.get(name)
    }
}

impl<'a> Fields<'a> {
    pub fn new(top: &'a serde_json::Map<String, Value>) -> Self {
        let data = member(top, "data").and_then(Value::as_object);
        Fields { top, data }
    }

    /// The first non-null value of `name` at the top level or under `data`.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        member(self.top, name).filter(|v| !v.is_null()).or_else(|| {
            self.data
                .and_then(|d| member(d, name))
                .filter(|v| !v.is_null())
        })
    }

    pub fn str(&self, name: &str) -> Option<&'a str> {
        self.get(name).and_then(Value::as_str)
    }
}

fn side(
    fields: &Fields<'_>,
    type_field: &str,
    key_fields: &[&str],
    agent_field: &str,
    main: &MainAgents,
) -> SessionType {
    if let Some(t) = fields.str(type_field) {
        let parsed = SessionType::parse(t);
        if parsed != SessionType::Unknown {
            return parsed;
        }
    }
    for k in key_fields {
        if let Some(key) = fields.str(k) {
            let parsed = SessionType::from_session_key(key);
            if parsed != SessionType::Unknown {
                return parsed;
            }
        }
    }
    match fields.str(agent_field) {
        Some(agent) if main.contains(agent) => SessionType::Main,
        _ => SessionType::Unknown,
    }
}

/// The explicit role, if the event names one; an error if it names something else.
pub fn explicit_role(fields: &Fields<'_>) -> Result<Option<Role>, Rejection> {
    match fields.get("eventRole") {
        None => Ok(None),
        Some(Value::String(s)) => s.parse::<Role>().map(Some).map_err(|e| {
            Rejection::new(
                DlqReason::InvalidRole,
                format!(
                    "eventRole: {e}; fix the producer or drop the field to let the rules decide"
                ),
            )
        }),
        Some(other) => Err(Rejection::new(
            DlqReason::InvalidRole,
            format!("eventRole must be a string naming one of the four roles, got {other}"),
        )),
    }
}

/// Classify a collaboration or runtime event by the default rule set.
pub fn classify(
    event_type: &str,
    fields: &Fields<'_>,
    main: &MainAgents,
) -> Result<Role, Rejection> {
    if let Some(role) = explicit_role(fields)? {
        return Ok(role);
    }
    if ORCHESTRATION_PREFIXES
        .iter()
        .any(|p| event_type.starts_with(p))
    {
        return Ok(Role::OrchestrationTask);
    }
    if event_type.starts_with("a2a.") {
        if matches!(event_type, "a2a.spawn" | "a2a.spawn_result")
            || ["parentConversationId", "depth", "hop"]
                .iter()
                .any(|k| fields.get(k).is_some())
        {
            return Ok(Role::DelegationSubagent);
        }
        let from = side(
            fields,
            "fromSessionType",
            &["fromSessionKey", "requesterSessionKey", "sourceSessionKey"],
            "fromAgent",
            main,
        );
        let to = side(
            fields,
            "toSessionType",
            &["targetSessionKey", "toSessionKey"],
            "toAgent",
            main,
        );
        return Ok(if from == SessionType::Main && to == SessionType::Main {
            Role::ConversationMain
        } else {
            Role::DelegationSubagent
        });
    }
    Ok(Role::SystemObservability)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn role(v: Value, main: &[&str]) -> Result<Role, Rejection> {
        let obj = v.as_object().cloned().unwrap_or_default();
        let t = obj
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        classify(&t, &Fields::new(&obj), &MainAgents::new(main.iter()))
    }

    #[test]
    fn explicit_role_wins_over_every_rule() {
        let r = role(
            json!({"type":"task.created","eventRole":"system.observability"}),
            &[],
        );
        assert_eq!(r, Ok(Role::SystemObservability));
        let r = role(
            json!({"type":"a2a.send","data":{"eventRole":"conversation.main","fromSessionType":"subagent"}}),
            &[],
        );
        assert_eq!(r, Ok(Role::ConversationMain));
    }

    #[test]
    fn explicit_role_typo_is_rejected() {
        let r = role(
            json!({"type":"a2a.send","eventRole":"conversation.mian"}),
            &[],
        );
        assert_eq!(r.map_err(|e| e.reason), Err(DlqReason::InvalidRole));
        let r = role(json!({"type":"a2a.send","data":{"eventRole":7}}), &[]);
        assert_eq!(r.map_err(|e| e.reason), Err(DlqReason::InvalidRole));
    }

    #[test]
    fn null_explicit_role_is_ignored() {
        let r = role(json!({"type":"health.tick","eventRole":null}), &[]);
        assert_eq!(r, Ok(Role::SystemObservability));
    }

    #[test]
    fn orchestration_prefixes() {
        for t in [
            "task.created",
            "continuation.scheduled",
            "plan.updated",
            "unblock.requested",
            "zombie.detected",
            "resume_reminder.sent",
            "backlog.added",
        ] {
            assert_eq!(
                role(json!({ "type": t }), &[]),
                Ok(Role::OrchestrationTask),
                "{t}"
            );
        }
        // Prefix rule beats the a2a rule only for its prefixes; "tasks." is not "task.".
        assert_eq!(
            role(json!({"type":"tasks.x"}), &[]),
            Ok(Role::SystemObservability)
        );
    }

    #[test]
    fn a2a_main_main_by_session_type() {
        let r = role(
            json!({"type":"a2a.send","data":{"fromSessionType":"main","toSessionType":"main"}}),
            &[],
        );
        assert_eq!(r, Ok(Role::ConversationMain));
    }

    #[test]
    fn a2a_subagent_side_is_delegation() {
        let r = role(
            json!({"type":"a2a.send","data":{"fromSessionType":"main","toSessionType":"subagent"}}),
            &[],
        );
        assert_eq!(r, Ok(Role::DelegationSubagent));
    }

    #[test]
    fn a2a_spawns_and_chains_are_delegation_even_between_mains() {
        for extra in [
            json!({"parentConversationId":"c0"}),
            json!({"depth":1}),
            json!({"hop":2}),
        ] {
            let mut data = json!({"fromSessionType":"main","toSessionType":"main"});
            if let (Some(d), Some(e)) = (data.as_object_mut(), extra.as_object()) {
                d.extend(e.clone());
            }
            assert_eq!(
                role(json!({"type":"a2a.send","data":data}), &[]),
                Ok(Role::DelegationSubagent)
            );
        }
        assert_eq!(
            role(
                json!({"type":"a2a.spawn","data":{"fromSessionType":"main","toSessionType":"main"}}),
                &[]
            ),
            Ok(Role::DelegationSubagent)
        );
        assert_eq!(
            role(json!({"type":"a2a.spawn_result"}), &[]),
            Ok(Role::DelegationSubagent)
        );
    }

    #[test]
    fn a2a_null_chain_fields_do_not_count() {
        let r = role(
            json!({"type":"a2a.send","data":{"fromSessionType":"main","toSessionType":"main","parentConversationId":null,"depth":null,"hop":null}}),
            &[],
        );
        assert_eq!(r, Ok(Role::ConversationMain));
    }

    #[test]
    fn session_keys_decide_when_types_are_absent() {
        let r = role(
            json!({"type":"a2a.send","data":{"fromSessionKey":"agent:ruda:main","targetSessionKey":"agent:eden:main"}}),
            &[],
        );
        assert_eq!(r, Ok(Role::ConversationMain));
        let r = role(
            json!({"type":"a2a.send","data":{"fromAgent":"ruda","toAgent":"eden","targetSessionKey":"agent:eden:subagent:1"}}),
            &["ruda", "eden"],
        );
        assert_eq!(r, Ok(Role::DelegationSubagent));
    }

    #[test]
    fn main_agent_list_is_the_last_resort_and_case_insensitive() {
        let ev = json!({"type":"a2a.send","data":{"fromAgent":" Ruda ","toAgent":"EDEN"}});
        assert_eq!(
            role(ev.clone(), &["ruda", "eden"]),
            Ok(Role::ConversationMain)
        );
        assert_eq!(role(ev.clone(), &["ruda"]), Ok(Role::DelegationSubagent));
        assert_eq!(role(ev, &[]), Ok(Role::DelegationSubagent));
    }

    #[test]
    fn everything_else_is_observability() {
        assert_eq!(
            role(json!({"type":"health.ping"}), &[]),
            Ok(Role::SystemObservability)
        );
        assert_eq!(
            role(json!({"type":"run.started"}), &[]),
            Ok(Role::SystemObservability)
        );
    }

    #[test]
    fn origin_fixture_sequences_classify_as_their_emitter_said() {
        let text = include_str!("../fixtures/collab-events/a2a-emitted-events-examples.json");
        let doc: Value = serde_json::from_str(text).expect("fixture parses");
        let seq = doc["sequence_success"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(seq.len(), 4);
        for ev in seq {
            // With the explicit role removed, the session types must still give conversation.main.
            let mut ev = ev.clone();
            if let Some(d) = ev.get_mut("data").and_then(Value::as_object_mut) {
                d.remove("eventRole");
            }
            assert_eq!(role(ev, &["ruda", "eden"]), Ok(Role::ConversationMain));
        }
        let blocked = doc["sequence_blocked (concurrency limit)"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for ev in blocked {
            // No session types, no explicit role: the main-agent list decides.
            assert_eq!(
                role(ev.clone(), &["main", "ruda", "eden"]),
                Ok(Role::ConversationMain)
            );
            assert_eq!(role(ev, &["main", "ruda"]), Ok(Role::DelegationSubagent));
        }
    }
}
