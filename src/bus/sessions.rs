//! The work-session writer: folds stored projections into the work-session KV bucket.
//!
//! The worker calls [`SessionWriter::observe`] once a group of inputs' publishes are stored and
//! before their progress mark. Per session it does one read, applies every event of the group
//! with [`crate::sessions::apply_as`], and writes with compare-and-set (create when absent),
//! re-reading on a revision conflict: workers of other partitions write the same session
//! concurrently. Applying is idempotent, so a redelivered group, or a retried `observe`, changes
//! nothing twice.
//!
//! Keys: a session is stored under `encode_id(session id)`. Events that name a conversation but no
//! work session (a synthesised blocked response, for example) are resolved through an alias entry
//! `conv.<encode_id(conversation id)>`, written when an event names both. A conversation's events
//! are processed in order in one partition, so the alias exists before such an event comes.

use crate::config::Names;
use crate::model::{encode_id, Envelope};
use crate::pipeline::{OutKind, Outgoing};
use crate::sessions::{self, Identity, Position, WorkSession};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;
use tracing::{debug, warn};

/// Largest session value written; a session that would grow beyond it stops being updated (it
/// would exceed the server's message size) and a warning is logged.
pub const MAX_SESSION_BYTES: usize = 900 * 1024;
/// Attempts per session (conflicts and transient errors) before `observe` gives up.
const MAX_ATTEMPTS: u32 = 50;
/// Aliases remembered in memory, to skip rewriting them.
const ALIAS_CACHE: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("work-session bucket {bucket}: {detail}")]
    Open { bucket: String, detail: String },
    #[error("work session {key}: {detail}")]
    Kv { key: String, detail: String },
}

/// The KV key of a session.
pub fn session_key(id: &str) -> String {
    encode_id(id)
}

/// The KV key of a conversation's alias to its work session.
pub fn alias_key(conversation_id: &str) -> String {
    format!("conv.{}", encode_id(conversation_id))
}

/// How an outgoing projection is identified, from its Msg-Id: a turn's response
/// (`turn:<key>:<turn>`) by its turn, anything else by its raw position and the output index
/// (`<stream>:<seq>:<n>`; `suppressed` sorts after the numbered outputs).
pub fn identity(
    partition: u16,
    raw_seq: u64,
    msg_id: &str,
    ordinal: u32,
    in_order: bool,
) -> Identity {
    if msg_id.starts_with("turn:") {
        return Identity::TurnResponse;
    }
    let index = match msg_id.rsplit(':').next() {
        Some("suppressed") => 1_000_000,
        Some(n) => n.parse::<u32>().unwrap_or(ordinal),
        None => ordinal,
    };
    Identity::Raw {
        partition,
        position: Position(raw_seq, index),
        in_order,
    }
}

pub struct SessionWriter {
    kv: kv::Store,
    aliases: Mutex<HashMap<String, String>>,
    /// Striped locks by session: this worker's partitions update a hot session one at a time
    /// instead of racing each other into revision conflicts (other workers still may; the
    /// compare-and-swap settles those).
    stripes: Vec<tokio::sync::Mutex<()>>,
}

const STRIPES: usize = 64;

impl SessionWriter {
    pub async fn new(js: &jetstream::Context, names: &Names) -> Result<Self, SessionError> {
        let kv = js
            .get_key_value(&names.sessions_bucket)
            .await
            .map_err(|e| SessionError::Open {
                bucket: names.sessions_bucket.clone(),
                detail: e.to_string(),
            })?;
        Ok(SessionWriter {
            kv,
            aliases: Mutex::new(HashMap::new()),
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
        })
    }

    /// Fold a group of stored outputs of `partition` (in processing order, each with the raw
    /// sequence of the input it came from) into their sessions. Dead letters and outputs that
    /// belong to no session are skipped. Safe to call again with the same items.
    ///
    /// `in_order`: every message of the partition before these was processed and observed (the
    /// worker is not recovering a previous owner's in-flight messages). Out-of-order groups are
    /// remembered position by position until an in-order group passes them.
    pub async fn observe(
        &self,
        partition: u16,
        items: &[(u64, &Outgoing)],
        in_order: bool,
    ) -> Result<(), SessionError> {
        let mut groups: BTreeMap<String, Vec<(Envelope, Identity)>> = BTreeMap::new();
        let mut last_seq = None;
        let mut ordinal = 0u32;
        for (seq, out) in items {
            if last_seq != Some(*seq) {
                last_seq = Some(*seq);
                ordinal = 0;
            } else {
                ordinal += 1;
            }
            if !matches!(out.kind, OutKind::Projection(_)) {
                continue;
            }
            let Ok(env) = serde_json::from_slice::<Envelope>(&out.payload) else {
                debug!(subject = %out.subject, "projection is not an envelope; not a session event");
                continue;
            };
            let keys = sessions::keys(&env);
            let id = match (&keys.work_session_id, &keys.conversation_id) {
                (Some(ws), Some(conv)) => {
                    self.remember_alias(conv, ws).await?;
                    ws.clone()
                }
                (Some(ws), None) => ws.clone(),
                (None, Some(conv)) => self.resolve(conv).await?,
                (None, None) => continue,
            };
            let ident = identity(partition, *seq, &out.msg_id, ordinal, in_order);
            groups.entry(id).or_default().push((env, ident));
        }
        for (id, events) in groups {
            self.update(&id, &events).await?;
        }
        Ok(())
    }

    /// Read, apply, compare-and-set; again on conflict.
    async fn update(&self, id: &str, events: &[(Envelope, Identity)]) -> Result<(), SessionError> {
        let stripe = id.bytes().fold(0usize, |h, b| {
            h.wrapping_mul(31).wrapping_add(usize::from(b))
        }) % STRIPES;
        let _serialised = self.stripes[stripe].lock().await;
        let key = session_key(id);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let result = self.try_update(id, &key, events).await;
            match result {
                Ok(()) => return Ok(()),
                Err(e) if attempt >= MAX_ATTEMPTS => {
                    return Err(SessionError::Kv {
                        key,
                        detail: e.to_string(),
                    })
                }
                Err(Attempt::Conflict) => {
                    debug!(key = %key, "work session changed meanwhile; re-reading");
                }
                Err(Attempt::Failed(detail)) => {
                    warn!(key = %key, error = %detail, "work session write failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt.min(25))))
                        .await;
                }
            }
        }
    }

    async fn try_update(
        &self,
        id: &str,
        key: &str,
        events: &[(Envelope, Identity)],
    ) -> Result<(), Attempt> {
        let entry = self
            .kv
            .entry(key.to_string())
            .await
            .map_err(|e| Attempt::Failed(e.to_string()))?;
        let (mut current, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                match serde_json::from_slice::<WorkSession>(&e.value) {
                    Ok(s) => (Some(s), e.revision),
                    Err(err) => {
                        // Never silently reset a session: an unreadable value is reported and
                        // left alone.
                        warn!(key = %key, error = %err, "stored work session is unreadable; not updated");
                        return Ok(());
                    }
                }
            }
            Some(e) => (None, e.revision),
            None => (None, 0),
        };
        let mut changed = false;
        for (env, ident) in events {
            let keys = sessions::keys(env);
            let s = current.get_or_insert_with(|| WorkSession {
                id: id.to_string(),
                ..WorkSession::default()
            });
            changed |= sessions::apply_mut(s, env, &keys, *ident);
        }
        let Some(session) = current.filter(|_| changed) else {
            return Ok(());
        };
        let bytes = serde_json::to_vec(&session).map_err(|e| Attempt::Failed(e.to_string()))?;
        if bytes.len() > MAX_SESSION_BYTES {
            warn!(key = %key, bytes = bytes.len(), "work session too large to store; further events are not aggregated");
            return Ok(());
        }
        match self.kv.update(key, Bytes::from(bytes), revision).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Err(Attempt::Conflict),
            Err(e) => Err(Attempt::Failed(e.to_string())),
        }
    }

    async fn remember_alias(&self, conv: &str, ws: &str) -> Result<(), SessionError> {
        if self.cached(conv).as_deref() == Some(ws) {
            return Ok(());
        }
        let key = alias_key(conv);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.kv.put(&key, Bytes::from(ws.to_string())).await {
                Ok(_) => break,
                Err(e) if attempt >= MAX_ATTEMPTS => {
                    return Err(SessionError::Kv {
                        key,
                        detail: e.to_string(),
                    })
                }
                Err(e) => {
                    warn!(key = %key, error = %e, "conversation alias write failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt.min(25))))
                        .await;
                }
            }
        }
        self.cache(conv, ws);
        Ok(())
    }

    /// The session of a conversation that names no work session: its alias, else itself.
    async fn resolve(&self, conv: &str) -> Result<String, SessionError> {
        if let Some(ws) = self.cached(conv) {
            return Ok(ws);
        }
        let key = alias_key(conv);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.kv.get(key.clone()).await {
                Ok(Some(v)) => {
                    let ws = String::from_utf8_lossy(&v).into_owned();
                    self.cache(conv, &ws);
                    return Ok(ws);
                }
                Ok(None) => return Ok(conv.to_string()),
                Err(e) if attempt >= MAX_ATTEMPTS => {
                    return Err(SessionError::Kv {
                        key,
                        detail: e.to_string(),
                    })
                }
                Err(e) => {
                    warn!(key = %key, error = %e, "conversation alias read failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt.min(25))))
                        .await;
                }
            }
        }
    }

    fn cached(&self, conv: &str) -> Option<String> {
        self.aliases.lock().ok().and_then(|m| m.get(conv).cloned())
    }

    fn cache(&self, conv: &str, ws: &str) {
        if let Ok(mut m) = self.aliases.lock() {
            if m.len() >= ALIAS_CACHE {
                m.clear();
            }
            m.insert(conv.to_string(), ws.to_string());
        }
    }
}

enum Attempt {
    Conflict,
    Failed(String),
}

impl std::fmt::Display for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attempt::Conflict => f.write_str("revision conflicts persisted"),
            Attempt::Failed(d) => f.write_str(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_from_msg_ids() {
        assert_eq!(
            identity(3, 17, "turn:c1:0", 0, true),
            Identity::TurnResponse
        );
        assert_eq!(
            identity(3, 17, "COLLAB_RAW:17:2", 0, true),
            Identity::Raw {
                partition: 3,
                position: Position(17, 2),
                in_order: true,
            }
        );
        let sup = identity(3, 17, "COLLAB_RAW:17:suppressed", 1, false);
        assert!(
            matches!(sup, Identity::Raw { position: Position(17, n), in_order: false, .. } if n > 2)
        );
        assert_eq!(
            identity(3, 17, "odd", 4, true),
            Identity::Raw {
                partition: 3,
                position: Position(17, 4),
                in_order: true,
            }
        );
    }

    #[test]
    fn keys_are_kv_safe_and_aliases_never_collide_with_sessions() {
        assert_eq!(session_key("ws_1"), "ws_1");
        assert_eq!(session_key("agent:x"), "_bYWdlbnQ6eA");
        assert_eq!(alias_key("c1"), "conv.c1");
        // Session keys never hold a dot; alias keys always do.
        assert!(!session_key("a.b").contains('.'));
    }
}
