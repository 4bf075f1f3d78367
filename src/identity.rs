//! Producer identity: which agent a raw message's subject says published it, and whether the
//! event speaks only as that agent.
//!
//! A NATS permission can check a subject, never a body. So a deployment that binds producers to
//! identities gives each agent's NATS user the right to publish only to subjects carrying its own
//! agent token (config/nats-server.roles.conf, `agent-<id>` users), and the worker checks that
//! the event inside claims no other speaker:
//!
//! ```text
//! <prefix>.raw.<key>.<type...>                  unidentified (a shared or trusted user)
//! <prefix>.raw.<key>._as.<agent>.<type...>      published by <agent>'s user
//! ```
//!
//! The key stays the fourth token, so the raw stream's partition transform
//! (`<prefix>.raw.*.>` -> `<prefix>.in.<p>.<key>.>`) and ordering by key are unchanged. `_as` is
//! reserved: no event type starts with `_` (types are checked to be dot-separated words).
//!
//! Pure: [`parse`] reads a producer subject, [`check`] compares the agent it names with the
//! speakers an event claims: the envelope's `agentId` and `payload.fromAgent`, and, for a turn
//! event, the `fromAgent` the turn rules read from the producer's object (top level, else under
//! `data`), which normalisation may have moved elsewhere in the envelope.

use crate::ingest::SubjectInfo;
use crate::model::{id_text, Envelope};

/// The marker token before the publishing agent's token.
pub const MARKER: &str = "_as";

/// A producer subject, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSubject {
    /// The ordering key token.
    pub key: String,
    /// The publishing agent's token, when the subject carries one.
    pub agent: Option<String>,
    /// The type tokens after the key (and after the agent, when present): what
    /// `ingest::SubjectInfo::type_suffix` should hold.
    pub type_suffix: String,
}

impl RawSubject {
    /// The subject facts normalisation reads: the key, and the type tokens without the agent.
    pub fn subject_info(&self) -> SubjectInfo {
        SubjectInfo {
            key: self.key.clone(),
            type_suffix: self.type_suffix.clone(),
        }
    }
}

/// Read `<prefix>.raw.<key>[._as.<agent>].<type...>`. `None` when the subject is not a raw
/// subject of `prefix`, or names the marker without an agent and a type.
pub fn parse(prefix: &str, subject: &str) -> Option<RawSubject> {
    let rest = subject.strip_prefix(prefix)?.strip_prefix(".raw.")?;
    let (key, after) = rest.split_once('.')?;
    if key.is_empty() || after.is_empty() {
        return None;
    }
    match after.split_once('.') {
        Some((MARKER, tail)) => {
            let (agent, type_suffix) = tail.split_once('.')?;
            if agent.is_empty() || type_suffix.is_empty() {
                return None;
            }
            Some(RawSubject {
                key: key.to_string(),
                agent: Some(agent.to_string()),
                type_suffix: type_suffix.to_string(),
            })
        }
        _ if after == MARKER => None,
        _ => Some(RawSubject {
            key: key.to_string(),
            agent: None,
            type_suffix: after.to_string(),
        }),
    }
}

/// The subject an agent's producer publishes an event of `event_type` on; `None` when the agent
/// id cannot be one subject token (it must be of `[A-Za-z0-9_-]`, at most 128, not starting with
/// `_`).
pub fn subject(prefix: &str, key: &str, agent: &str, event_type: &str) -> Option<String> {
    agent_token_ok(agent).then(|| format!("{prefix}.raw.{key}.{MARKER}.{agent}.{event_type}"))
}

/// The longest agent id, as for keys: a subject stays within the server's control-line limit.
pub const MAX_AGENT_LEN: usize = crate::model::MAX_TOKEN_LEN;

/// Whether an agent id can be the agent token of a subject (and of a permission): a key token
/// (`[A-Za-z0-9_-]{1,128}`) not starting with `_`, which marks the identity subjects' own tokens.
pub fn agent_token_ok(agent: &str) -> bool {
    crate::model::is_key_token(agent) && !agent.starts_with('_')
}

/// Why an event is refused for the identity it claims.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The event claims a speaker other than the agent whose user published it.
    #[error("published by agent `{publisher}` (subject token) but the event's {field} is `{claimed}`: an agent may publish only as itself; publish from {claimed}'s own NATS user, or fix the event")]
    Mismatch {
        publisher: String,
        field: &'static str,
        claimed: String,
    },
    /// Identities are required and the subject names none.
    #[error("the subject names no publishing agent (`<prefix>.raw.<key>._as.<agent>.<type>`), and producers must publish as themselves here")]
    Missing,
}

impl IdentityError {
    /// The dead-letter reason for it (`identity_mismatch`, `identity_missing`).
    pub fn reason(&self) -> &'static str {
        match self {
            IdentityError::Mismatch { .. } => "identity_mismatch",
            IdentityError::Missing => "identity_missing",
        }
    }
}

/// The speakers an event claims, with the field each came from: the envelope's `agentId` and
/// `payload.fromAgent` (the sending side of a message), and the producer's own `fromAgent` in
/// `source` (the object a turn event was normalised from, read as the turn rules read it: top
/// level, else under `data`). The recipient (`toAgent`) is not a claim.
pub fn claimed_speakers(
    env: &Envelope,
    source: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(f) = source.and_then(|s| {
        crate::classify::Fields::new(s)
            .get("fromAgent")
            .and_then(id_text)
    }) {
        out.push(("fromAgent", f));
    }
    if let Some(a) = env.agent_id.as_ref().and_then(id_text) {
        out.push(("agentId", a));
    }
    if let Some(f) = env
        .payload
        .as_ref()
        .and_then(|p| p.get("fromAgent"))
        .filter(|v| !v.is_null())
        .and_then(id_text)
    {
        out.push(("fromAgent", f));
    }
    out
}

/// Check an envelope normalised from a message on `subject` (and, for a turn event, the
/// producer's object it was normalised from). A subject without an agent passes unless
/// `require` is set; one with an agent passes when every speaker the event claims is that agent
/// (ids compared trimmed and case-insensitively, as main agents are).
pub fn check(
    subject: &RawSubject,
    env: &Envelope,
    source: Option<&serde_json::Map<String, serde_json::Value>>,
    require: bool,
) -> Result<(), IdentityError> {
    let Some(publisher) = subject.agent.as_deref() else {
        return if require {
            Err(IdentityError::Missing)
        } else {
            Ok(())
        };
    };
    for (field, claimed) in claimed_speakers(env, source) {
        if !claimed.trim().eq_ignore_ascii_case(publisher.trim()) {
            return Err(IdentityError::Mismatch {
                publisher: publisher.to_string(),
                field,
                claimed,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(agent: Option<&str>, from: Option<&str>) -> Envelope {
        let mut payload = json!({"toAgent": "ruda"});
        if let Some(f) = from {
            payload["fromAgent"] = json!(f);
        }
        Envelope {
            event_type: "a2a.response".into(),
            agent_id: agent.map(|a| json!(a)),
            payload: Some(payload),
            ..Envelope::default()
        }
    }

    #[test]
    fn agent_ids_are_one_bounded_subject_token() {
        assert!(agent_token_ok(&"a".repeat(MAX_AGENT_LEN)));
        assert!(!agent_token_ok(&"a".repeat(MAX_AGENT_LEN + 1)));
        assert!(!agent_token_ok("_as"));
        assert!(!agent_token_ok("eden.main"));
        assert!(agent_token_ok("eden-main_2"));
    }

    #[test]
    fn subjects_with_and_without_an_agent() {
        assert_eq!(
            parse("collab", "collab.raw.conv-1._as.eden.a2a.response"),
            Some(RawSubject {
                key: "conv-1".into(),
                agent: Some("eden".into()),
                type_suffix: "a2a.response".into(),
            })
        );
        assert_eq!(
            parse("collab", "collab.raw.conv-1.a2a.response"),
            Some(RawSubject {
                key: "conv-1".into(),
                agent: None,
                type_suffix: "a2a.response".into(),
            })
        );
        let identified = parse("collab", "collab.raw.conv-1._as.eden.a2a.response");
        assert_eq!(
            identified.map(|s| s.subject_info()),
            SubjectInfo::parse_raw("collab", "collab.raw.conv-1.a2a.response")
        );
        assert_eq!(parse("collab", "collab.raw.conv-1._as.eden"), None);
        assert_eq!(parse("collab", "collab.raw.conv-1._as"), None);
        assert_eq!(parse("collab", "collab.raw.conv-1"), None);
        assert_eq!(parse("collab", "other.raw.conv-1.a2a.send"), None);
        assert_eq!(
            subject("collab", "conv-1", "eden", "a2a.send").as_deref(),
            Some("collab.raw.conv-1._as.eden.a2a.send")
        );
        assert_eq!(subject("collab", "k", "a.b", "a2a.send"), None);
        assert_eq!(subject("collab", "k", "_as", "a2a.send"), None);
        assert_eq!(subject("collab", "k", "*", "a2a.send"), None);
    }

    #[test]
    fn an_agent_may_speak_only_as_itself() {
        let s = parse("collab", "collab.raw.conv-1._as.eden.a2a.response")
            .unwrap_or_else(|| panic!("parses"));
        assert_eq!(
            check(&s, &env(Some("eden"), Some("Eden ")), None, false),
            Ok(())
        );
        // eden deciding ruda's turn: publishing a response from ruda.
        let forged = check(&s, &env(Some("eden"), Some("ruda")), None, false);
        assert_eq!(
            forged,
            Err(IdentityError::Mismatch {
                publisher: "eden".into(),
                field: "fromAgent",
                claimed: "ruda".into(),
            })
        );
        assert_eq!(forged.err().map(|e| e.reason()), Some("identity_mismatch"));
        let forged = check(&s, &env(Some("ruda"), None), None, true);
        assert!(
            matches!(
                &forged,
                Err(IdentityError::Mismatch {
                    field: "agentId",
                    ..
                })
            ),
            "{forged:?}"
        );
        // An event that claims no speaker is the publisher's.
        assert_eq!(check(&s, &env(None, None), None, true), Ok(()));
    }

    #[test]
    fn unidentified_subjects_pass_unless_identity_is_required() {
        let s =
            parse("collab", "collab.raw.conv-1.a2a.response").unwrap_or_else(|| panic!("parses"));
        assert_eq!(
            check(&s, &env(Some("ruda"), Some("ruda")), None, false),
            Ok(())
        );
        let missing = check(&s, &env(Some("ruda"), Some("ruda")), None, true);
        assert_eq!(missing, Err(IdentityError::Missing));
        assert_eq!(missing.err().map(|e| e.reason()), Some("identity_missing"));
    }
}
