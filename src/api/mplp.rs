//! A work session as an MPLP Collab object (seed 002), valid against the real schema
//! (`fixtures/mplp/schemas/v2/mplp-collab.schema.json`, Coregentis/MPLP-Protocol at 214939ab).
//!
//! - `collab_id` and `context_id` are UUID v4 in shape, derived from a SHA-256 of the session id
//!   (version nibble 4, RFC 4122 variant), so the same session always exports the same ids;
//! - `meta` carries `protocol_version` and `schema_version` (both `1.0.0`), as the schema requires;
//! - `mode`: two participants are a `pair`; a coordinator that delegated to workers
//!   (`delegation.subagent` sends or spawns) is `orchestrated`, with `role_id` `orchestrator` and
//!   `worker`; anything else is `broadcast`;
//! - `status`: ACTIVE is `active`, QUIET `suspended`, ARCHIVED `completed`;
//! - `title`: the conversation name, else the first message; `purpose`: the first send's goal,
//!   else the first message, else a sentence naming the session. Like every text of a view, these
//!   come only from events of the caller's roles.

use crate::model::Role;
use crate::sessions::{SessionView, Status, WorkSession};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

pub const PROTOCOL_VERSION: &str = "1.0.0";
pub const SCHEMA_VERSION: &str = "1.0.0";

/// A stable id shaped as a UUID v4 (the MPLP identifier pattern), from a SHA-256 of `name`.
pub fn uuid_v4_from(name: &str) -> String {
    let d = Sha256::digest(name.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The MPLP mode of a view's participants.
pub fn mode(v: &SessionView) -> &'static str {
    let coordinator = v.participants.iter().any(|p| p.coordinator);
    let worker = v.participants.iter().any(|p| p.worker);
    if v.participants.len() == 2 {
        "pair"
    } else if coordinator && worker {
        "orchestrated"
    } else {
        "broadcast"
    }
}

fn status(s: Status) -> &'static str {
    match s {
        Status::Active => "active",
        Status::Quiet => "suspended",
        Status::Archived => "completed",
    }
}

/// The Collab object of a session, as seen through `v`, the view for `roles` (the caller's).
/// `now` stands in for a creation time the session does not know.
pub fn collab(s: &WorkSession, v: &SessionView, roles: &[Role], now: &str) -> Value {
    let mode = mode(v);
    let created = v.created_at.clone().unwrap_or_else(|| now.to_string());
    let updated = v.updated_at.clone().unwrap_or_else(|| created.clone());
    let participants: Vec<Value> = v
        .participants
        .iter()
        .map(|p| {
            let mut m = Map::new();
            m.insert("participant_id".into(), json!(p.id));
            m.insert("kind".into(), json!(p.kind.as_str()));
            let role_id = match mode {
                "orchestrated" if p.coordinator => Some("orchestrator".to_string()),
                "orchestrated" if p.worker => Some("worker".to_string()),
                _ => p.role.map(|r| r.as_str().to_string()),
            };
            if let Some(r) = role_id {
                m.insert("role_id".into(), json!(r));
            }
            if let Some(n) = &p.display_name {
                m.insert("display_name".into(), json!(n));
            }
            Value::Object(m)
        })
        .collect();
    let participants = if participants.is_empty() {
        // The schema needs one; a session with events but no named party was run by the system.
        vec![json!({"participant_id": "collab-projector", "kind": "system"})]
    } else {
        participants
    };
    let purpose = s
        .goal(roles)
        .or_else(|| s.first_message(roles))
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| format!("Collaboration in work session {}", v.work_session_id));
    let title = if v.title.trim().is_empty() {
        format!("Work session {}", v.id)
    } else {
        v.title.clone()
    };
    json!({
        "meta": {
            "protocol_version": PROTOCOL_VERSION,
            "schema_version": SCHEMA_VERSION,
            "created_at": created,
            "updated_at": updated,
            "created_by": "collab-projector",
        },
        "collab_id": uuid_v4_from(&format!("collab:{}", v.id)),
        "context_id": uuid_v4_from(&format!("context:{}", v.id)),
        "title": title,
        "purpose": purpose,
        "mode": mode,
        "status": status(v.status),
        "participants": participants,
        "created_at": created,
        "updated_at": updated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_v4_shaped_and_stable() {
        let a = uuid_v4_from("collab:ws_1");
        assert_eq!(a, uuid_v4_from("collab:ws_1"));
        assert_ne!(a, uuid_v4_from("collab:ws_2"));
        let bytes = a.as_bytes();
        assert_eq!(a.len(), 36);
        assert_eq!(bytes[14], b'4');
        assert!(matches!(bytes[19], b'8' | b'9' | b'a' | b'b'));
        assert!(a
            .chars()
            .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)));
    }
}
