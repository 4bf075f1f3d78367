//! From one raw message to the messages to publish: projections or a dead letter.
//!
//! Pure: the bus hands in the message's bytes and its stream facts, and publishes what comes out,
//! in order, with the given Msg-Ids.

use crate::config::Names;
use crate::ingest::{self, Normalized, RawInput, RelayHeaders, SubjectInfo};
use crate::model::{DlqReason, RawEventRef, Rejection};
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};

pub const H_ROLE: &str = "Collab-Event-Role";
pub const H_TYPE: &str = "Collab-Event-Type";
pub const H_SOURCE_SEQ: &str = "Collab-Source-Seq";
pub const H_SOURCE_SUBJECT: &str = "Collab-Source-Subject";
pub const H_DLQ_REASON: &str = "Collab-Dlq-Reason";
pub const H_DLQ_DETAIL: &str = "Collab-Dlq-Detail";
/// Marks a partition barrier in the raw stream: written by a worker, never an input (see
/// `bus::worker`). Its value is the prefix of the workers that sent it (`collab`, or
/// `collab_v2` for a projection version; `1` from earlier releases). Every set of workers over
/// the raw stream reads every barrier, and none deletes one (see `bus::acker`).
pub const H_BARRIER: &str = "Collab-Barrier";
/// On a barrier, marks it as a reshard marker (see `bus::reader`): its value is the first raw
/// sequence of the set of raw streams that `collab-projector reshard` made.
pub const H_RESHARD: &str = "Collab-Reshard";

/// A message to publish on JetStream.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    pub subject: String,
    pub payload: Bytes,
    /// Deterministic, so a republish after a crash collapses in the duplicate window.
    pub msg_id: String,
    pub headers: Vec<(&'static str, String)>,
    pub kind: OutKind,
}

/// The Msg-Id of an output an input's own processing makes: `<stream>:<seq>:<which>` (its
/// projections by index, `dlq`, `suppressed`), the same on every reprocessing of the input. A
/// turn's decision published for another input (`turn:...`) has an id of its own.
pub fn input_msg_id(stream: &str, seq: u64, which: impl std::fmt::Display) -> String {
    format!("{stream}:{seq}:{which}")
}

/// The raw sequence an output's Msg-Id names, if [`input_msg_id`] made it for `stream`.
pub fn input_of_msg_id(msg_id: &str, stream: &str) -> Option<u64> {
    crate::config::input_of_msg_id(msg_id, stream)
}

/// What an outgoing message is, for metrics and the turn book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutKind {
    Projection(crate::model::Role),
    DeadLetter(DlqReason),
}

/// A raw message as stored: its bytes and where the stream keeps it.
#[derive(Debug, Clone)]
pub struct RawMessage<'a> {
    pub bytes: &'a [u8],
    pub stream: &'a str,
    pub seq: u64,
    /// The subject the stream stored it under (`<prefix>.in.<p>.<key>.<type>`).
    pub stored_subject: &'a str,
    pub stored_at: DateTime<Utc>,
    /// Delivery attempt, from 1.
    pub delivered: i64,
    /// Its NATS headers (a relay's `Collab-*` headers are read from them).
    pub headers: Option<&'a async_nats::HeaderMap>,
    /// Its producer's subject ([`producer_subject`]), worked out once when first asked for
    /// (`Default::default()` when building one).
    pub producer: std::cell::OnceCell<String>,
}

impl<'a> RawMessage<'a> {
    /// A delivered JetStream message, as its delivery's metadata `info` describes it.
    pub fn from_delivery(
        msg: &'a async_nats::jetstream::Message,
        info: &async_nats::jetstream::message::Info<'a>,
    ) -> RawMessage<'a> {
        RawMessage {
            bytes: &msg.payload,
            stream: info.stream,
            seq: info.stream_sequence,
            stored_subject: msg.subject.as_str(),
            stored_at: info.published,
            delivered: info.delivered,
            headers: msg.headers.as_ref(),
            producer: Default::default(),
        }
    }

    /// The subject its producer published it on (see [`producer_subject`]).
    pub fn producer_subject(&self, names: &Names) -> &str {
        self.producer
            .get_or_init(|| producer_subject(names, self.stored_subject))
    }

    /// The agent whose user published it: the `_as.<agent>` of its producer's subject, if any.
    pub fn publishing_agent(&self, names: &Names) -> Option<String> {
        crate::identity::parse(&names.raw_prefix, self.producer_subject(names))
            .and_then(|s| s.agent)
    }
}

/// The producer's subject, recovered from the partitioned one: `<prefix>.in.<tokens>.<rest>`
/// -> `<prefix>.raw.<rest>`, past the raw stream's `names.raw_depth` partition tokens. Subjects
/// that are not partitioned that way are returned as they are.
pub fn producer_subject(names: &Names, stored: &str) -> String {
    let prefix = names.raw_prefix.as_str();
    let Some(mut rest) = stored
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix(".in."))
    else {
        return stored.to_string();
    };
    for _ in 0..names.raw_depth {
        match rest.split_once('.') {
            Some((p, tail)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                rest = tail;
            }
            _ => return stored.to_string(),
        }
    }
    format!("{prefix}.raw.{rest}")
}

/// The turn facts of a normalised event, when the turn contract applies to it (an `a2a.*` event
/// with a conversation, of a role in `enforce_roles`): read from the object the normaliser
/// parsed, never from the raw bytes again. `None`: the event is projected as it is. An event's
/// speaker is its `fromAgent`, else the subject's publishing agent, else (a response) its
/// `agentId`: only the turn's target may decide it (`turns::spoken_by_target`), only a side
/// may end it (`turns::spoken_by_a_side`).
pub fn turn_facts(
    n: &Normalized,
    raw: &RawMessage<'_>,
    names: &Names,
    enforce_roles: &[crate::model::Role],
) -> Option<crate::turns::TurnFacts> {
    let conversation_id = n.conversation_id.as_deref()?;
    if !enforce_roles.contains(&n.role()) {
        return None;
    }
    let subject = raw.producer_subject(names);
    let mut facts = crate::turns::facts(
        n.source.as_deref()?,
        &n.envelope.event_type,
        conversation_id,
        &n.key,
        raw.seq,
        raw.stored_at.timestamp_millis(),
        subject,
    )?;
    if facts.from_agent.is_none() {
        // An event that names no `fromAgent` is spoken by the agent whose user published it
        // (`_as.<agent>` in the subject), whatever its kind: a complete or an error published
        // by an agent is that agent's, and may end only a turn it is a side of. A response on
        // a subject that names no agent is spoken by its `agentId`. `identity::check` has held
        // every speaker the event claims to the subject's agent already.
        let response = facts.kind == crate::turns::TurnEventKind::Response;
        facts.from_agent = raw.publishing_agent(names).or_else(|| {
            let agent_id = n.envelope.agent_id.as_ref().and_then(crate::model::id_text);
            agent_id.filter(|_| response)
        });
    }
    Some(facts)
}

/// The run facts of a normalised AG-UI `RUN_STARTED`, `RUN_FINISHED` or `RUN_ERROR` (docs/contract.md
/// 2b), its run not yet resolved (the partition knows the key's open run), with the agent whose
/// user published it (`_as.<agent>`), who owns a run it starts. `None`: not a run event,
/// projected as it is.
pub fn run_event(
    n: &Normalized,
    raw: &RawMessage<'_>,
    names: &Names,
) -> Option<crate::turns::runs::RunEvent> {
    let header = raw.headers.and_then(|h| RelayHeaders::from_nats(h).run_id);
    crate::turns::runs::RunEvent::of(
        &n.envelope,
        &n.key,
        header.as_deref(),
        raw.seq,
        raw.stored_at.timestamp_millis(),
        raw.producer_subject(names),
        raw.publishing_agent(names).as_deref(),
    )
}

/// Move the fields of `events` larger than `limits.max_inline_bytes` out of their payloads
/// (see [`crate::blobs`]); the blobs to store before the events are published. A field can only
/// be that large if the raw message is, or if redaction rewrote it: anything else is skipped
/// without looking at it.
///
/// An envelope still larger than `max_envelope` bytes once its large fields are out (a payload of
/// many small fields) has its whole payload offloaded as one blob, so its projection fits.
pub fn offload(
    events: &mut [Normalized],
    raw_len: usize,
    limits: &crate::config::LimitSettings,
    max_envelope: usize,
) -> Vec<crate::blobs::Blob> {
    let mut blobs = Vec::new();
    for n in events.iter_mut() {
        if raw_len <= limits.max_inline_bytes.min(max_envelope) && n.envelope.redactions.is_none() {
            continue;
        }
        let role = n.role();
        if let Some(payload) = n.envelope.payload.as_mut() {
            blobs.extend(crate::blobs::offload(
                payload,
                limits.max_inline_bytes,
                role,
            ));
        }
        let size = serde_json::to_vec(&n.envelope).map_or(0, |v| v.len());
        if size > max_envelope {
            if let Some(payload) = n.envelope.payload.as_mut() {
                blobs.push(crate::blobs::offload_all(payload, role));
            }
        }
    }
    blobs
}

/// The dead letter `too_large` that replaces an output too large to publish even once its
/// payload is offloaded (an envelope whose ids or references alone are that large): it names the
/// input's raw sequence; the publisher bounds its body to fit.
pub fn too_large(names: &Names, out: &Outgoing, max_bytes: usize) -> Outgoing {
    let header = |name: &str| {
        out.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
    };
    let seq = header(H_SOURCE_SEQ).unwrap_or_default();
    let reason = DlqReason::TooLarge;
    Outgoing {
        subject: names.dlq_subject(reason),
        payload: out.payload.clone(),
        msg_id: format!("{}:too_large", out.msg_id),
        headers: vec![
            (H_DLQ_REASON, reason.as_str().to_string()),
            (
                H_DLQ_DETAIL,
                format!(
                    "its {} projection on {} would be {} bytes, over the {max_bytes} bytes NATS accepts, even with its payload offloaded; the body is an excerpt of that projection",
                    header(H_TYPE).unwrap_or_default(),
                    out.subject,
                    out.payload.len()
                ),
            ),
            (H_SOURCE_SEQ, seq),
        ],
        kind: OutKind::DeadLetter(reason),
    }
}

/// Normalise a raw message into envelopes, or say why it cannot be projected.
pub fn normalize_raw(
    raw: &RawMessage<'_>,
    names: &Names,
    settings: &ingest::Settings,
    max_deliver: i64,
) -> Result<Vec<Normalized>, Rejection> {
    normalize_raw_with(raw, names, settings, max_deliver, None)
}

/// As [`normalize_raw`], for the partition's own pass over its messages in order: streamed text
/// (AG-UI deltas) is redacted over whole messages through the partition's `streams`, so a secret
/// split over deltas is caught (see [`ingest::normalize_streamed`]). Re-reads of the stream for
/// other purposes (a reload, artifacts) use [`normalize_raw`], never feeding `streams`.
pub fn normalize_raw_streamed(
    raw: &RawMessage<'_>,
    names: &Names,
    settings: &ingest::Settings,
    max_deliver: i64,
    streams: &mut crate::redact::StreamRedactor,
) -> Result<Vec<Normalized>, Rejection> {
    normalize_raw_with(raw, names, settings, max_deliver, Some(streams))
}

fn normalize_raw_with(
    raw: &RawMessage<'_>,
    names: &Names,
    settings: &ingest::Settings,
    max_deliver: i64,
    streams: Option<&mut crate::redact::StreamRedactor>,
) -> Result<Vec<Normalized>, Rejection> {
    let source = raw.producer_subject(names).to_string();
    if max_deliver > 0 && raw.delivered >= max_deliver {
        return Err(Rejection::new(
            DlqReason::MaxDeliver,
            format!(
                "delivery {} of {max_deliver}: earlier attempts did not finish (worker crash or persistent publish failure); inspect the worker logs, then replay",
                raw.delivered
            ),
        ));
    }
    // `<prefix>.raw.<key>._as.<agent>.<type>` names the agent whose user published it.
    let identified = crate::identity::parse(&names.raw_prefix, &source);
    let subject = match &identified {
        Some(r) => Some(r.subject_info()),
        None => SubjectInfo::parse_raw(&names.raw_prefix, &source),
    };
    let raw_ref = RawEventRef {
        stream: raw.stream.to_string(),
        seq: raw.seq,
        subject: source,
        stored_at: raw.stored_at.to_rfc3339_opts(SecondsFormat::Millis, true),
    };
    let input = RawInput {
        bytes: raw.bytes,
        subject,
        raw_ref: Some(raw_ref),
        relay: raw.headers.map(RelayHeaders::from_nats).unwrap_or_default(),
    };
    let events = match streams {
        Some(streams) => ingest::normalize_streamed(&input, settings, streams)?,
        None => ingest::normalize(&input, settings)?,
    };
    if let Some(identified) = &identified {
        for n in &events {
            crate::identity::check(
                identified,
                &n.envelope,
                n.source.as_deref(),
                settings.require_identity,
            )
            .map_err(|e| {
                let reason = match e {
                    crate::identity::IdentityError::Mismatch { .. } => DlqReason::IdentityMismatch,
                    crate::identity::IdentityError::Missing => DlqReason::IdentityMissing,
                };
                Rejection::new(reason, e.to_string())
            })?;
        }
    }
    Ok(events)
}

/// The buffer a projection's envelope is serialised into starts this large.
const ENVELOPE_CAPACITY: usize = 1024;

/// Serialise an envelope as a projection on its role subject.
pub fn projection(names: &Names, n: &Normalized, source_seq: u64, msg_id: String) -> Outgoing {
    let role = n.role();
    let subject = names.proj_subject(role, &n.key, &n.envelope.event_type);
    // Sized up front rather than doubled from a few bytes as the envelope is written.
    let mut payload = Vec::with_capacity(ENVELOPE_CAPACITY);
    if serde_json::to_writer(&mut payload, &n.envelope).is_err() {
        payload.clear();
    }
    Outgoing {
        subject,
        payload: Bytes::from(payload),
        msg_id,
        headers: vec![
            (H_ROLE, role.as_str().to_string()),
            (H_TYPE, n.envelope.event_type.clone()),
            (H_SOURCE_SEQ, source_seq.to_string()),
        ],
        kind: OutKind::Projection(role),
    }
}

/// The dead letter for a raw message: its original bytes with the reason in headers.
pub fn dead_letter(names: &Names, raw: &RawMessage<'_>, rejection: &Rejection) -> Outgoing {
    let source = raw.producer_subject(names).to_string();
    // Header values must be one line.
    let detail: String = rejection
        .detail
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    Outgoing {
        subject: names.dlq_subject(rejection.reason),
        payload: Bytes::copy_from_slice(raw.bytes),
        msg_id: input_msg_id(raw.stream, raw.seq, "dlq"),
        headers: vec![
            (H_DLQ_REASON, rejection.reason.as_str().to_string()),
            (H_DLQ_DETAIL, detail),
            (H_SOURCE_SUBJECT, source),
            (H_SOURCE_SEQ, raw.seq.to_string()),
        ],
        kind: OutKind::DeadLetter(rejection.reason),
    }
}

/// The default projection of a raw message, without the turn contract: each envelope on its
/// role subject, or one dead letter.
pub fn project(
    raw: &RawMessage<'_>,
    names: &Names,
    settings: &ingest::Settings,
    max_deliver: i64,
) -> Vec<Outgoing> {
    match normalize_raw(raw, names, settings, max_deliver) {
        Ok(events) => events
            .iter()
            .enumerate()
            .map(|(i, n)| projection(names, n, raw.seq, input_msg_id(raw.stream, raw.seq, i)))
            .collect(),
        Err(rejection) => vec![dead_letter(names, raw, &rejection)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::MainAgents;
    use crate::model::Role;

    #[test]
    fn an_input_msg_id_names_its_input_and_nothing_else_does() {
        let id = input_msg_id("COLLAB_RAW", 42, "dlq");
        assert_eq!(id, "COLLAB_RAW:42:dlq");
        assert_eq!(input_of_msg_id(&id, "COLLAB_RAW"), Some(42));
        assert_eq!(
            input_of_msg_id(&input_msg_id("COLLAB_RAW", 7, 0), "COLLAB_RAW"),
            Some(7)
        );
        assert_eq!(input_of_msg_id("turn:conv-1:4", "COLLAB_RAW"), None);
        assert_eq!(input_of_msg_id("COLLAB_RAW:42:dlq", "OTHER_RAW"), None);
        assert_eq!(input_of_msg_id("COLLAB_RAW_X:42:0", "COLLAB_RAW"), None);
    }

    fn settings() -> ingest::Settings {
        let mut s = crate::config::Settings::default()
            .ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"));
        s.main_agents = MainAgents::new(["ruda", "eden"]);
        s.max_payload_bytes = 1024;
        s
    }

    /// Names over a raw stream with one partition token (`collab.in.<p>.<key>...`, the layout
    /// of a stream made with a single partition count), so stored subjects stay short here.
    fn one_token_names() -> Names {
        let mut n = Names::new("collab");
        n.raw_depth = 1;
        n
    }

    fn raw<'a>(bytes: &'a [u8], subject: &'a str) -> RawMessage<'a> {
        RawMessage {
            bytes,
            stream: "COLLAB_RAW",
            seq: 7,
            stored_subject: subject,
            stored_at: DateTime::from_timestamp_millis(1_771_329_600_000).unwrap_or_default(),
            delivered: 1,
            headers: None,
            producer: Default::default(),
        }
    }

    /// The phase facet and the turn contract read one failure table: every row that blocks a
    /// turn also marks the response `failed`, and a plain reply is `completed`.
    #[test]
    fn the_phase_facet_follows_the_turn_failure_table() {
        let names = one_token_names();
        let rows = [
            (r#"{"waitStatus":"timeout"}"#, "failed"),
            (r#"{"notFound":true}"#, "failed"),
            (r#"{"errorCode":"not_found"}"#, "failed"),
            (r#"{"status":"NOT_FOUND"}"#, "failed"),
            (r#"{"error":{"code":"not_found"}}"#, "failed"),
            (r#"{"outcome":"no_reply"}"#, "failed"),
            (r#"{"message":"done"}"#, "completed"),
        ];
        for (extra, phase) in rows {
            let mut data =
                serde_json::json!({"fromAgent": "eden", "toAgent": "ruda", "conversationId": "c1"});
            if let (Some(d), Ok(serde_json::Value::Object(e))) =
                (data.as_object_mut(), serde_json::from_str(extra))
            {
                d.extend(e);
            }
            let body = serde_json::json!({"type": "a2a.response", "agentId": "eden", "data": data})
                .to_string();
            let events = normalize_raw(
                &raw(body.as_bytes(), "collab.in.1.c1.a2a.response"),
                &names,
                &settings(),
                0,
            );
            let env = events
                .ok()
                .and_then(|e| e.into_iter().next())
                .map(|n| n.envelope);
            assert_eq!(env.and_then(|e| e.phase).as_deref(), Some(phase), "{body}");
        }
    }

    #[test]
    fn an_agent_publishes_only_as_itself() {
        let names = one_token_names();
        let subject = "collab.in.3.c1._as.eden.a2a.response";
        let as_ruda = br#"{"type":"a2a.response","agentId":"ruda","data":{"fromAgent":"ruda","toAgent":"eden","conversationId":"c1","message":"done"}}"#;
        let out = project(&raw(as_ruda, subject), &names, &settings(), 10);
        assert_eq!(
            out[0].kind,
            OutKind::DeadLetter(DlqReason::IdentityMismatch)
        );
        assert_eq!(out[0].subject, "collab.dlq.identity_mismatch");
        let as_eden = br#"{"type":"a2a.response","agentId":"eden","data":{"fromAgent":"eden","toAgent":"ruda","conversationId":"c1","message":"done"}}"#;
        let out = project(&raw(as_eden, subject), &names, &settings(), 10);
        assert_eq!(out[0].kind, OutKind::Projection(Role::ConversationMain));
        // The agent token is not part of the type or the key.
        assert_eq!(
            out[0].subject,
            "collab.proj.conversation.main.c1.a2a.response"
        );
        // Required identities: a subject naming no agent is refused.
        let mut strict = settings();
        strict.require_identity = true;
        let plain = project(
            &raw(as_eden, "collab.in.3.c1.a2a.response"),
            &names,
            &strict,
            10,
        );
        assert_eq!(
            plain[0].kind,
            OutKind::DeadLetter(DlqReason::IdentityMissing)
        );
        let named = project(&raw(as_eden, subject), &names, &strict, 10);
        assert_eq!(named[0].kind, OutKind::Projection(Role::ConversationMain));
    }

    /// The speaker the turn rules read (the producer's `fromAgent`, top level, else under
    /// `data`) is held to the subject's agent, whatever shape normalisation gives the envelope:
    /// `data` nested under a `payload`, or a top-level `fromAgent` moved aside by a colliding
    /// one under `data`.
    #[test]
    fn an_agent_cannot_speak_as_another_through_the_fields_the_turn_rules_read() {
        let names = one_token_names();
        let subject = "collab.in.3.c1._as.eden.a2a.response";
        for forged in [
            &br#"{"type":"a2a.response","conversationId":"c1","data":{"fromAgent":"ruda","toAgent":"main","message":"approved"},"payload":{}}"#[..],
            br#"{"type":"a2a.response","conversationId":"c1","fromAgent":"ruda","data":{"fromAgent":"eden","toAgent":"ruda","message":"approved"}}"#,
        ] {
            let out = project(&raw(forged, subject), &names, &settings(), 10);
            assert_eq!(
                out[0].kind,
                OutKind::DeadLetter(DlqReason::IdentityMismatch),
                "{}",
                String::from_utf8_lossy(forged)
            );
        }
    }

    /// A complete or an error that names no speaker, published by an agent's user, is that
    /// agent's: the turn rules then let it end only a turn the agent is a side of.
    #[test]
    fn a_speakerless_error_on_an_agents_subject_is_spoken_by_that_agent() {
        let names = one_token_names();
        let body = br#"{"type":"a2a.error","data":{"conversationId":"c1","toAgent":"ruda"}}"#;
        for (subject, speaker) in [
            ("collab.in.3.c1._as.eden.a2a.error", Some("eden")),
            ("collab.in.3.c1.a2a.error", None),
        ] {
            let r = raw(body, subject);
            let events = normalize_raw(&r, &names, &settings(), 10)
                .unwrap_or_else(|e| panic!("normalises: {e:?}"));
            let every_role = [
                Role::ConversationMain,
                Role::DelegationSubagent,
                Role::OrchestrationTask,
                Role::SystemObservability,
            ];
            let facts = turn_facts(&events[0], &r, &names, &every_role)
                .unwrap_or_else(|| panic!("{subject}: turn facts"));
            assert_eq!(facts.from_agent.as_deref(), speaker, "{subject}");
        }
    }

    #[test]
    fn producer_subject_is_recovered() {
        let one = one_token_names();
        assert_eq!(
            producer_subject(&one, "collab.in.61.conv-1.a2a.send"),
            "collab.raw.conv-1.a2a.send"
        );
        assert_eq!(producer_subject(&one, "other.x"), "other.x");
        let ladder = Names::new("collab");
        assert_eq!(
            producer_subject(&ladder, "collab.in.1.3.3.11.27.27.91.219.42.a2a.send"),
            "collab.raw.42.a2a.send"
        );
        assert_eq!(
            producer_subject(&ladder, &ladder.stored_subject("collab.raw.c.x")),
            "collab.raw.c.x"
        );
        // Fewer partition tokens than the layout has: not a subject of this stream.
        assert_eq!(
            producer_subject(&ladder, "collab.in.61.conv-1.a2a.send"),
            "collab.in.61.conv-1.a2a.send"
        );
    }

    #[test]
    fn main_main_send_projects_on_the_conversation_subject() {
        let body = br#"{"type":"a2a.send","agentId":"ruda","ts":1771329600000,"data":{"fromAgent":"ruda","toAgent":"eden","conversationId":"c1","message":"hi"}}"#;
        let out = project(
            &raw(body, "collab.in.3.c1.a2a.send"),
            &one_token_names(),
            &settings(),
            10,
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].subject, "collab.proj.conversation.main.c1.a2a.send");
        assert_eq!(out[0].msg_id, "COLLAB_RAW:7:0");
        assert_eq!(out[0].kind, OutKind::Projection(Role::ConversationMain));
        let env: serde_json::Value = serde_json::from_slice(&out[0].payload).unwrap_or_default();
        assert_eq!(env["eventRole"], "conversation.main");
        assert_eq!(env["timestamp"], "2026-02-17T12:00:00.000Z");
        assert_eq!(env["rawEventRef"]["seq"], 7);
        assert_eq!(env["rawEventRef"]["subject"], "collab.raw.c1.a2a.send");
        assert_eq!(env["owner"], "agent");
        assert_eq!(env["payload"]["message"], "hi");
    }

    #[test]
    fn wrong_key_is_dead_lettered_with_the_expected_key() {
        let body = br#"{"type":"a2a.send","data":{"conversationId":"agent:x","fromAgent":"ruda","toAgent":"eden"}}"#;
        let out = project(
            &raw(body, "collab.in.3.wrong.a2a.send"),
            &one_token_names(),
            &settings(),
            10,
        );
        assert_eq!(out[0].subject, "collab.dlq.bad_key");
        assert_eq!(out[0].payload.as_ref(), body);
        let detail = &out[0]
            .headers
            .iter()
            .find(|(k, _)| *k == H_DLQ_DETAIL)
            .map(|h| h.1.clone());
        assert!(
            detail.as_deref().unwrap_or("").contains("_bYWdlbnQ6eA"),
            "{detail:?}"
        );
        assert!(out[0]
            .headers
            .contains(&(H_SOURCE_SUBJECT, "collab.raw.wrong.a2a.send".to_string())));
    }

    #[test]
    fn each_reason_has_its_dead_letter() {
        let names = one_token_names();
        let cases: [(&[u8], DlqReason); 6] = [
            (b"{not json", DlqReason::BadJson),
            (b"[1,2]", DlqReason::Unrecognized),
            (br#"{"hello":"world"}"#, DlqReason::Unrecognized),
            (br#"{"type":"bad type"}"#, DlqReason::BadType),
            (br#"{"type":"a..b"}"#, DlqReason::BadType),
            (
                br#"{"type":"a2a.send","eventRole":"nope","data":{"conversationId":"k"}}"#,
                DlqReason::InvalidRole,
            ),
        ];
        for (body, reason) in cases {
            let out = project(&raw(body, "collab.in.1.k.x"), &names, &settings(), 10);
            assert_eq!(
                out[0].kind,
                OutKind::DeadLetter(reason),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let big = vec![b' '; 2000];
        let out = project(&raw(&big, "collab.in.1.k.x"), &names, &settings(), 10);
        assert_eq!(out[0].kind, OutKind::DeadLetter(DlqReason::TooLarge));
        let mut last = raw(br#"{"type":"health.ping"}"#, "collab.in.1.k.x");
        last.delivered = 10;
        let out = project(&last, &names, &settings(), 10);
        assert_eq!(out[0].kind, OutKind::DeadLetter(DlqReason::MaxDeliver));
    }
}
