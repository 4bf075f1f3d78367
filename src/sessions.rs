//! Work sessions: projected events grouped by work session, with threads, participants, counts,
//! turns and the last message (the ConversationSummary fields of seed 004).
//!
//! Pure: [`apply`] folds one projected envelope into a session and says whether anything changed;
//! the KV writer (`bus::sessions`) does the reading and compare-and-set writing, and the API turns
//! a stored session into a [`SessionView`] for the roles a caller may see, with the status computed
//! from the clock it is given.
//!
//! # Idempotency
//!
//! Counts must not grow when an event is applied twice (a fold round repeated after a crash, a
//! brief overlap of two folding workers). Each event is identified by its position in the stream
//! it is folded from, read in order: the session keeps, per stream, a floor (every position at or
//! below it was applied), and an event at or below it is a repeat. A turn has one `a2a.response`:
//! once a turn has an outcome, another response for it (a previous owner's decision stored past
//! the duplicate window) changes nothing either.

use crate::model::shorten;
use crate::model::{id_text, Envelope, Role};
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// Longest last-message preview, in characters (the origin's `replyPreview`).
pub const PREVIEW_CHARS: usize = 200;
/// Longest title taken from a first message, in characters.
const TITLE_CHARS: usize = 80;

/// Where an event sits in its partition: raw sequence, then its index among that raw message's
/// outputs. Serialised as `[seq, index]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position(pub u64, pub u32);

/// How an applied event is identified, for idempotency: where it sits in the stream it is folded
/// from, read in order (`partition` says which; the projection-stream fold is
/// `bus::sessions::FOLD_PARTITION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub partition: u16,
    pub position: Position,
}

/// What a session applied from one partition: every position at or below `floor` (events are
/// applied in their stream's order, so nothing below it is left out).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub floor: Position,
}

impl Applied {
    pub fn seen(&self, p: Position) -> bool {
        p <= self.floor
    }

    pub fn record(&mut self, p: Position) {
        if p > self.floor {
            self.floor = p;
        }
    }
}

/// A participant's kind (seed 002's `kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Agent,
    Human,
    System,
    External,
}

impl Kind {
    /// A kind named by the facts (`user` is a human); anything else is not a kind.
    pub fn parse(s: &str) -> Option<Kind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "agent" | "subagent" | "main" => Some(Kind::Agent),
            "human" | "user" | "person" => Some(Kind::Human),
            "system" => Some(Kind::System),
            "external" => Some(Kind::External),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Agent => "agent",
            Kind::Human => "human",
            Kind::System => "system",
            Kind::External => "external",
        }
    }
}

/// State of one `conversation.main` turn as far as the session knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnMark {
    /// A send opened it; no response yet.
    Open,
    /// Its response was a real reply.
    Answered,
    /// Its response was a blocked outcome.
    Blocked,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Participant {
    pub id: String,
    /// Its kind as the events of each role gave it (the first one wins within a role). A caller
    /// sees the kind of its roles only; `agent` when they gave none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kinds: BTreeMap<Role, Kind>,
    /// Its display name as the events of each role gave it (the first one wins within a role).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub display_names: BTreeMap<Role, String>,
    /// The event roles it took part in.
    #[serde(default)]
    pub roles: BTreeSet<Role>,
    /// It delegated work (a `delegation.subagent` send or spawn from it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub coordinator: bool,
    /// It received delegated work.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub worker: bool,
}

/// One conversation of the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Thread {
    pub conversation_id: String,
    /// The sender and recipient of the thread's first event of each role that named either.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sides: BTreeMap<Role, Sides>,
    /// First and last event time per role (`first_time` and `last_time` are of every role).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub spans: BTreeMap<Role, Span>,
    #[serde(default)]
    pub counts: BTreeMap<Role, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_time: Option<String>,
    /// `conversation.main` turns by turn id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub turns: BTreeMap<String, TurnMark>,
}

/// The first and last event time of one role's events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Span {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<String>,
}

impl Span {
    fn note(&mut self, t: &str) {
        keep_min(&mut self.first, t);
        keep_max(&mut self.last, t);
    }
}

/// The earliest first and latest last time of the spans of `roles`. A session or thread stored
/// before times were kept per role has no span at all: it shows `shared`, the times of every
/// role.
fn visible_span(spans: &BTreeMap<Role, Span>, roles: &[Role], shared: Span) -> Span {
    if spans.is_empty() {
        return shared;
    }
    let mut out = Span::default();
    for (_, sp) in spans.iter().filter(|(r, _)| roles.contains(r)) {
        if let Some(f) = &sp.first {
            keep_min(&mut out.first, f);
        }
        if let Some(l) = &sp.last {
            keep_max(&mut out.last, l);
        }
    }
    out
}

/// Who opened a thread, and to whom, as one role's events said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Sides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
}

/// The text a session took from the events of one role. Kept per role so that a caller sees
/// only the text of the roles its grant covers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct RoleText {
    /// A conversation name given by the producers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The first message's text (earliest in event time), shortened: the title when there is
    /// no name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_message_at: Option<String>,
    /// The goal of the earliest send that named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goal_at: Option<String>,
}

/// The last message seen in one role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastMessage {
    pub preview: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
}

/// A work session as stored (one KV entry). Read it through [`WorkSession::view`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkSession {
    /// The work session id, else the conversation id the session was keyed by.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_session_id: Option<String>,
    /// Name, first message and goal, per role of the events they came from. (Sessions stored
    /// before text was kept per role held them in `name`, `firstMessage` and `goal`; those are
    /// not read, since their role is unknown.)
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub text: BTreeMap<Role, RoleText>,
    /// Event time of the earliest and latest event of each role: a view's times and status
    /// come from its roles' events only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub spans: BTreeMap<Role, Span>,
    /// Event time of the earliest and latest event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// Events by role, then by type.
    #[serde(default)]
    pub counts: BTreeMap<Role, BTreeMap<String, u64>>,
    /// Threads by conversation id.
    #[serde(default)]
    pub threads: BTreeMap<String, Thread>,
    /// Participants by id.
    #[serde(default)]
    pub participants: BTreeMap<String, Participant>,
    /// The last message per role.
    #[serde(default)]
    pub last_message: BTreeMap<Role, LastMessage>,
    /// What was applied, per partition.
    #[serde(default)]
    pub applied: BTreeMap<u16, Applied>,
    /// Threads no longer kept one by one (see [`MAX_THREADS`]), summed by the set of roles they
    /// held (bit `i` is `Role::ALL[i]`), so a view restricted to some roles still counts them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub retired: BTreeMap<u8, RetiredThreads>,
    /// Retired threads that still had open turns, by conversation id: what their responses need
    /// to be counted (at most [`MAX_DORMANT`]; see [`MAX_THREADS`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dormant: BTreeMap<String, Dormant>,
    /// Tokens the session's events reported (docs/contract.md 2c), by the role of the event, the
    /// agent that spent them and the model. Cost is not stored: a view computes it from the
    /// price table it is given, so a changed price applies to the past too.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub usage: BTreeMap<Role, BTreeMap<String, BTreeMap<String, Tokens>>>,
}

/// Tokens reported for one agent and model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    #[serde(default)]
    pub cached_input: u64,
    #[serde(default)]
    pub reasoning: u64,
    /// Events that reported usage.
    #[serde(default)]
    pub events: u64,
}

/// Agents a session keeps usage for one by one per role, and models per agent; further ones are
/// summed under `other`, so a session's value stays bounded.
pub const MAX_USAGE_AGENTS: usize = 64;
pub const MAX_USAGE_MODELS: usize = 16;

/// Threads a session keeps one by one. Past `MAX_THREADS + RETIRE_SLACK`, the threads with the
/// oldest activity are summed into [`WorkSession::retired`] until `MAX_THREADS` remain: those
/// with no open turn first, then, when open turns alone hold the session above the bound, the
/// oldest of those too. A thread retired with open turns keeps a [`Dormant`] entry (its open
/// turn ids), so the responses that come later are still counted; any other event of its
/// conversation takes it back as a thread. So a session's stored value stays bounded however
/// long it runs and however many turns stay open.
pub const MAX_THREADS: usize = 256;
const RETIRE_SLACK: usize = 32;
/// Conversations retired with open turns that a session remembers; past it the ones with the
/// oldest activity are forgotten, and a response to one of their turns counts as a thread of its
/// own.
pub const MAX_DORMANT: usize = 1024;

/// What retired threads add to a session's totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct RetiredThreads {
    pub threads: u64,
    #[serde(default)]
    pub answered_turns: u64,
    #[serde(default)]
    pub blocked_turns: u64,
}

impl RetiredThreads {
    /// Count a turn's outcome; an open turn adds nothing.
    fn add(&mut self, mark: TurnMark) {
        match mark {
            TurnMark::Answered => self.answered_turns += 1,
            TurnMark::Blocked => self.blocked_turns += 1,
            TurnMark::Open => {}
        }
    }
}

/// The ids of the `n` entries with the smallest keys. Keys tied on their first part are told
/// apart by the id, so the order is total and the set the same whatever the selection's order;
/// it is a partial selection over references, not a sort, and copies only the ids it returns.
fn smallest_ids<K: Ord>(mut keyed: Vec<(K, &String)>, n: usize) -> Vec<String> {
    if keyed.len() > n {
        keyed.select_nth_unstable(n);
        keyed.truncate(n);
    }
    keyed.into_iter().map(|(_, id)| id.clone()).collect()
}

/// A conversation whose thread was retired while some of its turns were open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Dormant {
    /// The role-set mask the thread was retired under (its [`WorkSession::retired`] entry).
    pub roles: u8,
    /// Its turns still open.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub open: BTreeSet<String>,
    /// Its last activity (event time), which decides what is forgotten first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_time: Option<String>,
}

/// The role-set bit mask of [`WorkSession::retired`].
fn role_mask<'a>(roles: impl IntoIterator<Item = &'a Role>) -> u8 {
    roles.into_iter().fold(0u8, |m, r| {
        m | Role::ALL
            .iter()
            .position(|x| x == r)
            .map_or(0, |i| 1u8 << i)
    })
}

/// The roles of a [`role_mask`] bit mask.
fn mask_roles(mask: u8) -> impl Iterator<Item = Role> {
    Role::ALL
        .iter()
        .enumerate()
        .filter(move |(bit, _)| mask & (1 << bit) != 0)
        .map(|(_, r)| *r)
}

/// Retire threads past [`MAX_THREADS`]: oldest activity first, those with an open turn only
/// once no other is left (they stay [`Dormant`]).
///
/// Runs before every new thread while the session holds more than `MAX_THREADS + RETIRE_SLACK`,
/// so it selects the threads to retire by reference (a partial selection, not a sort of every
/// thread) and copies only their ids.
fn retire_threads(s: &mut WorkSession) {
    if s.threads.len() <= MAX_THREADS + RETIRE_SLACK {
        return;
    }
    let excess = s.threads.len() - MAX_THREADS;
    // Threads with no open turn first, then by last activity.
    let candidates = s
        .threads
        .iter()
        .map(|(id, t)| {
            let open = t.turns.values().any(|m| *m == TurnMark::Open);
            ((open, &t.last_time), id)
        })
        .collect();
    for id in smallest_ids(candidates, excess) {
        let Some(t) = s.threads.remove(&id) else {
            continue;
        };
        let roles = role_mask(t.counts.keys());
        let r = s.retired.entry(roles).or_default();
        r.threads += 1;
        let mut open = BTreeSet::new();
        for (turn, m) in t.turns {
            r.add(m);
            if m == TurnMark::Open {
                open.insert(turn);
            }
        }
        if !open.is_empty() {
            let last_time = t.last_time;
            s.dormant.insert(
                id,
                Dormant {
                    roles,
                    open,
                    last_time,
                },
            );
        }
    }
    forget_dormant(s);
}

/// Forget the dormant conversations past [`MAX_DORMANT`], oldest activity first.
fn forget_dormant(s: &mut WorkSession) {
    let Some(excess) = s.dormant.len().checked_sub(MAX_DORMANT).filter(|e| *e > 0) else {
        return;
    };
    let oldest = s.dormant.iter().map(|(id, d)| (&d.last_time, id)).collect();
    for id in smallest_ids(oldest, excess) {
        s.dormant.remove(&id);
    }
}

/// What an event of a conversation the session holds no thread for does with its dormant entry.
enum Dormancy {
    /// Not dormant: the conversation starts a thread of its own.
    No,
    /// A response to one of its open turns, counted in the retired totals: nothing more to do.
    Counted,
    /// Anything else: the conversation comes back as this thread (no longer counted among the
    /// retired ones), with its open turns.
    Woken(Thread),
}

/// An event of a conversation the session holds no thread for, as far as its dormant entry goes.
fn note_dormant(s: &mut WorkSession, conversation: &str, ev: &Folded<'_>) -> Dormancy {
    let Some(d) = s.dormant.get_mut(conversation) else {
        return Dormancy::No;
    };
    if ev.is_turn_response && d.open.remove(&ev.turn) {
        if let Some(t) = &ev.at {
            keep_max(&mut d.last_time, t);
        }
        s.retired.entry(d.roles).or_default().add(outcome(ev.env));
        if d.open.is_empty() {
            s.dormant.remove(conversation);
        }
        return Dormancy::Counted;
    }
    let Some(d) = s.dormant.remove(conversation) else {
        return Dormancy::No;
    };
    if let Some(r) = s.retired.get_mut(&d.roles) {
        r.threads = r.threads.saturating_sub(1);
    }
    // It keeps the roles it was retired under (with no events counted yet), so a caller who
    // could see it then still sees it, whatever the role of the event that woke it.
    let counts = mask_roles(d.roles).map(|r| (r, 0)).collect();
    Dormancy::Woken(Thread {
        conversation_id: conversation.to_string(),
        last_time: d.last_time,
        counts,
        turns: d.open.into_iter().map(|t| (t, TurnMark::Open)).collect(),
        ..Thread::default()
    })
}

/// The session and conversation an envelope belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKeys {
    pub work_session_id: Option<String>,
    pub conversation_id: Option<String>,
}

impl SessionKeys {
    /// The session id: the work session id, else the conversation id.
    #[cfg(test)]
    pub fn session_id(&self) -> Option<&str> {
        self.work_session_id
            .as_deref()
            .or(self.conversation_id.as_deref())
    }
}

/// Per conversation, where a run of events moved its alias: the index of each event that moved
/// it and the session it moved to, in order.
pub type AliasMoves = HashMap<String, Vec<(usize, String)>>;

/// Where events go, in order: each to its work session; one naming only a conversation to the
/// session that conversation's alias names, as the events before it left the aliases (an event
/// naming both sets it), else to the conversation itself. `aliases` holds the aliases known
/// before the first event (a conversation missing from it has none). Returns each event's
/// session (`None`: it names neither) and, per conversation whose alias the events moved, where
/// it moved: the index of each event that moved it and the session it moved to, in order (the
/// last one is the alias the events leave).
pub fn route(
    events: &[SessionKeys],
    mut aliases: HashMap<String, String>,
) -> (Vec<Option<String>>, AliasMoves) {
    let mut moved = AliasMoves::new();
    let sessions = events
        .iter()
        .enumerate()
        .map(|(i, k)| match (&k.work_session_id, &k.conversation_id) {
            (Some(ws), Some(conv)) => {
                if aliases.get(conv) != Some(ws) {
                    aliases.insert(conv.clone(), ws.clone());
                    moved.entry(conv.clone()).or_default().push((i, ws.clone()));
                }
                Some(ws.clone())
            }
            (Some(ws), None) => Some(ws.clone()),
            (None, Some(conv)) => Some(aliases.get(conv).unwrap_or(conv).clone()),
            (None, None) => None,
        })
        .collect();
    (sessions, moved)
}

/// The payload fields the fold reads; [`envelope_for_fold`] keeps these and skips the rest.
/// Every payload read of this module names one of them (checked in debug builds).
const FOLD_FIELDS: &[&str] = &[
    "workSessionId",
    "conversationId",
    "sessionId",
    "contextId",
    "turnId",
    "turn",
    "message",
    "replyPreview",
    "text",
    "outcome",
    "fromAgent",
    "toAgent",
    "conversationName",
    "conversationTitle",
    "goal",
    "agentKind",
    "kind",
    "agentName",
    "agentDisplayName",
    "displayName",
    "participants",
    "fromKind",
    "fromType",
    "fromParticipantKind",
    "toKind",
    "toType",
    "toParticipantKind",
    "fromName",
    "fromDisplayName",
    "toName",
    "toDisplayName",
    // Usage (crate::usage::read): where it stands and the model beside it.
    "usage",
    "model",
    "modelId",
    "model_name",
    "result",
    "metadata",
    "task",
    "agUiType",
    "name",
    "value",
    "a2a",
];

/// A stored projection as the fold reads it: the envelope fields the fold uses and, of the
/// payload, only [`FOLD_FIELDS`]. The rest (tool arguments and results, message sections,
/// whatever a producer sent) is skipped over rather than built into order-preserving JSON
/// values, which was most of the fold's cost. Folding it gives the same session as folding the
/// whole envelope.
pub fn envelope_for_fold(bytes: &[u8]) -> serde_json::Result<Envelope> {
    let e: FoldEnvelope = serde_json::from_slice(bytes)?;
    Ok(Envelope {
        event_type: e.event_type,
        event_role: e.event_role,
        timestamp: e.timestamp,
        session_id: e.session_id,
        turn_id: e.turn_id,
        agent_id: e.agent_id,
        conversation_id: e.conversation_id,
        work_session_id: e.work_session_id,
        raw_event_ref: e.raw_event_ref,
        payload: e.payload.0,
        ..Envelope::default()
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FoldEnvelope {
    #[serde(rename = "type")]
    event_type: String,
    event_role: Option<Role>,
    timestamp: Option<String>,
    session_id: Option<Value>,
    turn_id: Option<Value>,
    agent_id: Option<Value>,
    conversation_id: Option<Value>,
    work_session_id: Option<Value>,
    raw_event_ref: Option<crate::model::RawEventRef>,
    #[serde(default)]
    payload: FoldPayload,
}

/// A payload object cut down to [`FOLD_FIELDS`]; any other payload reads as none (the fold
/// reads fields of objects only).
#[derive(Default)]
struct FoldPayload(Option<Value>);

impl<'de> Deserialize<'de> for FoldPayload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FoldPayloadVisitor)
    }
}

struct FoldPayloadVisitor;

impl<'de> serde::de::Visitor<'de> for FoldPayloadVisitor {
    type Value = FoldPayload;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a payload")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<FoldPayload, A::Error> {
        let mut kept = serde_json::Map::new();
        while let Some(FoldKey(name)) = m.next_key()? {
            match name {
                Some(name) => {
                    kept.insert(name.to_string(), m.next_value::<Value>()?);
                }
                None => {
                    m.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(FoldPayload(Some(Value::Object(kept))))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> Result<FoldPayload, A::Error> {
        while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(FoldPayload(None))
    }

    fn visit_unit<E>(self) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }

    fn visit_bool<E>(self, _: bool) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }

    fn visit_str<E>(self, _: &str) -> Result<FoldPayload, E> {
        Ok(FoldPayload(None))
    }
}

/// A payload key: the [`FOLD_FIELDS`] name it is, if any (compared without allocating).
struct FoldKey(Option<&'static str>);

impl<'de> Deserialize<'de> for FoldKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl serde::de::Visitor<'_> for Key {
            type Value = FoldKey;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a field name")
            }

            fn visit_str<E>(self, k: &str) -> Result<FoldKey, E> {
                Ok(FoldKey(FOLD_FIELDS.iter().copied().find(|f| *f == k)))
            }
        }
        d.deserialize_str(Key)
    }
}

fn field<'a>(env: &'a Envelope, name: &str) -> Option<&'a Value> {
    debug_assert!(
        FOLD_FIELDS.contains(&name),
        "{name} is read by the fold but not kept by envelope_for_fold"
    );
    env.payload
        .as_ref()
        .and_then(|p| p.get(name))
        .filter(|v| !v.is_null())
}

fn field_str<'a>(env: &'a Envelope, name: &str) -> Option<&'a str> {
    field(env, name)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

fn field_id(env: &Envelope, name: &str) -> Option<String> {
    field(env, name).and_then(id_text)
}

/// The work session and conversation of an envelope, from its envelope ids, else its payload.
/// The conversation is the conversation key of docs/contract.md section 4 without the work session.
pub fn keys(env: &Envelope) -> SessionKeys {
    let ws = env
        .work_session_id
        .as_ref()
        .and_then(id_text)
        .or_else(|| field_id(env, "workSessionId"));
    let conv = env
        .conversation_id
        .as_ref()
        .and_then(id_text)
        .or_else(|| field_id(env, "conversationId"))
        .or_else(|| {
            env.event_type
                .starts_with("a2a.")
                .then(|| {
                    env.session_id
                        .as_ref()
                        .and_then(id_text)
                        .or_else(|| field_id(env, "sessionId"))
                        .or_else(|| field_id(env, "contextId"))
                })
                .flatten()
        });
    SessionKeys {
        work_session_id: ws,
        conversation_id: conv,
    }
}

/// The turn id of docs/contract.md section 4: `turnId`, else `turn`, else `0`.
pub fn turn_id(env: &Envelope) -> String {
    crate::model::turn_id([
        env.turn_id.as_ref(),
        field(env, "turnId"),
        field(env, "turn"),
    ])
}

/// Event time: the producer's timestamp, else the raw stream's store time.
fn event_time(env: &Envelope) -> Option<String> {
    env.timestamp.clone().or_else(|| {
        env.raw_event_ref
            .as_ref()
            .map(|r| r.stored_at.clone())
            .filter(|s| !s.is_empty())
    })
}

fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|d| d.with_timezone(&Utc))
}

/// `a` is later than `b` (unparseable times compare as text).
fn later(a: &str, b: &str) -> bool {
    // The fold compares an event's time several times per event; times written alike (UTC,
    // `Z`, the same number of fraction digits) order as their text does, without parsing.
    if same_utc_layout(a, b) {
        return a > b;
    }
    match (parse_time(a), parse_time(b)) {
        (Some(x), Some(y)) => x > y,
        _ => a > b,
    }
}

/// Whether `a` and `b` are both `YYYY-MM-DDTHH:MM:SS[.f...]Z` with as many fraction digits, so
/// that their text order is their time order. Where either does not parse, [`later`] compares
/// the text anyway, so this shortcut never changes its answer.
fn same_utc_layout(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() || a.len() < 20 {
        return false;
    }
    let last = a.len() - 1;
    a.iter().zip(b).enumerate().all(|(i, (&x, &y))| {
        let want = match i {
            4 | 7 => Some(b'-'),
            10 => Some(b'T'),
            13 | 16 => Some(b':'),
            19 if last > 19 => Some(b'.'),
            i if i == last => Some(b'Z'),
            _ => None,
        };
        match want {
            Some(c) => x == c && y == c,
            None => x.is_ascii_digit() && y.is_ascii_digit(),
        }
    })
}

/// Whether a value at `at` replaces `value` set at `value_at`: when there is none yet, or it is
/// earlier.
fn earliest(value: &Option<String>, value_at: &Option<String>, at: Option<&str>) -> bool {
    match (value, value_at, at) {
        (None, _, _) => true,
        (Some(_), Some(prev), Some(at)) => later(prev, at),
        _ => false,
    }
}

/// The value set earliest of several (by its time; a value without a time only when none has
/// one).
fn earliest_of<'a>(
    values: impl Iterator<Item = (&'a Option<String>, &'a Option<String>)>,
) -> Option<String> {
    let mut best: Option<(&String, &Option<String>)> = None;
    for (v, at) in values {
        let Some(v) = v else { continue };
        best = match best {
            None => Some((v, at)),
            Some((_, Some(b))) if at.as_deref().is_some_and(|a| later(b, a)) => Some((v, at)),
            Some((_, None)) if at.is_some() => Some((v, at)),
            keep => keep,
        };
    }
    best.map(|(v, _)| v.clone())
}

fn keep_min(slot: &mut Option<String>, t: &str) {
    if slot.as_deref().is_none_or(|cur| later(cur, t)) {
        *slot = Some(t.to_string());
    }
}

fn keep_max(slot: &mut Option<String>, t: &str) {
    if slot.as_deref().is_none_or(|cur| later(t, cur)) {
        *slot = Some(t.to_string());
    }
}

fn message_text(env: &Envelope) -> Option<&str> {
    field_str(env, "message")
        .or_else(|| field_str(env, "replyPreview"))
        .or_else(|| field_str(env, "text"))
}

/// The outcome a turn's response gives it.
fn outcome(env: &Envelope) -> TurnMark {
    if field_str(env, "outcome") == Some("blocked") {
        TurnMark::Blocked
    } else {
        TurnMark::Answered
    }
}

/// Apply one projected event at a raw position (index 0 of its raw message), processed in
/// partition order. `None` when nothing changed: the event was seen before, or it belongs to no
/// session.
#[cfg(test)]
pub fn apply(
    current: Option<WorkSession>,
    env: &Envelope,
    partition: u16,
    raw_seq: u64,
) -> Option<WorkSession> {
    apply_as(
        current,
        env,
        Identity {
            partition,
            position: Position(raw_seq, 0),
        },
    )
}

/// Apply one projected event with an explicit identity. `None` when nothing changed.
#[cfg(test)]
pub fn apply_as(
    current: Option<WorkSession>,
    env: &Envelope,
    identity: Identity,
) -> Option<WorkSession> {
    let keys = keys(env);
    let id = keys.session_id()?.to_string();
    let mut s = current.unwrap_or_else(|| WorkSession {
        id,
        ..WorkSession::default()
    });
    if fold_into(&mut s, env, &keys, identity) {
        Some(s)
    } else {
        None
    }
}

/// Fold one projected event into the session `s`, in place; `false` when nothing changed (a
/// repeat).
pub fn fold_into(
    s: &mut WorkSession,
    env: &Envelope,
    keys: &SessionKeys,
    identity: Identity,
) -> bool {
    let ev = Folded::of(env);
    // A turn has one response: a second one for a decided turn (a previous owner's decision
    // stored past the duplicate window) changes nothing.
    if ev.is_turn_response && turn_decided(s, keys, &ev.turn) {
        return false;
    }
    let applied = s.applied.entry(identity.partition).or_default();
    if applied.seen(identity.position) {
        return false;
    }
    applied.record(identity.position);

    if s.work_session_id.is_none() {
        s.work_session_id = keys.work_session_id.clone();
    }
    count(s, &ev);
    note_text(s, &ev);
    note_last_message(s, &ev);
    note_participants(s, &ev);
    note_usage(s, &ev);
    if let Some(c) = &keys.conversation_id {
        note_thread(s, c, &ev);
    }
    true
}

/// Add the tokens the event reports to its role, agent and model (past the bounds, `other`).
fn note_usage(s: &mut WorkSession, ev: &Folded<'_>) {
    let Some(u) = crate::usage::read(ev.env) else {
        return;
    };
    let agent = crate::usage::spender(ev.env).unwrap_or_else(|| "unknown".into());
    let model = u.model.clone().unwrap_or_else(|| "unknown".into());
    let by_agent = s.usage.entry(ev.role).or_default();
    let agent = bounded_key(by_agent, agent, MAX_USAGE_AGENTS);
    let by_model = by_agent.entry(agent).or_default();
    let model = bounded_key(by_model, model, MAX_USAGE_MODELS);
    let t = by_model.entry(model).or_default();
    t.input = t.input.saturating_add(u.input_tokens);
    t.output = t.output.saturating_add(u.output_tokens);
    t.cached_input = t
        .cached_input
        .saturating_add(u.cached_input_tokens.unwrap_or(0));
    t.reasoning = t.reasoning.saturating_add(u.reasoning_tokens.unwrap_or(0));
    t.events += 1;
}

/// `key` while the map holds it or has room for it, else `other`.
fn bounded_key<V>(map: &BTreeMap<String, V>, key: String, max: usize) -> String {
    if map.contains_key(&key) || map.len() < max {
        key
    } else {
        "other".into()
    }
}

/// What the fold reads from one envelope.
struct Folded<'a> {
    env: &'a Envelope,
    role: Role,
    turn: String,
    is_turn_response: bool,
    at: Option<String>,
    from: Option<String>,
    to: Option<String>,
    text: Option<&'a str>,
}

impl<'a> Folded<'a> {
    fn of(env: &'a Envelope) -> Folded<'a> {
        let role = env.event_role.unwrap_or(Role::SystemObservability);
        Folded {
            env,
            role,
            turn: turn_id(env),
            is_turn_response: role == Role::ConversationMain && env.event_type == "a2a.response",
            at: event_time(env),
            from: field_id(env, "fromAgent"),
            to: field_id(env, "toAgent"),
            text: message_text(env),
        }
    }
}

/// Whether the event's turn already has an outcome in its thread.
fn turn_decided(s: &WorkSession, keys: &SessionKeys, turn: &str) -> bool {
    keys.conversation_id
        .as_ref()
        .and_then(|c| s.threads.get(c))
        .and_then(|t| t.turns.get(turn))
        .is_some_and(|m| *m != TurnMark::Open)
}

/// Counts by role and type, and the session's times.
fn count(s: &mut WorkSession, ev: &Folded<'_>) {
    let by_type = s.counts.entry(ev.role).or_default();
    if let Some(n) = keyed(by_type, &ev.env.event_type, || 0) {
        *n += 1;
    }
    if let Some(t) = &ev.at {
        keep_min(&mut s.created_at, t);
        keep_max(&mut s.updated_at, t);
        s.spans.entry(ev.role).or_default().note(t);
    }
}

/// The name, first message and goal, kept under the role of the event they came from (a caller
/// sees its roles' only).
fn note_text(s: &mut WorkSession, ev: &Folded<'_>) {
    let env = ev.env;
    let name = ["conversationName", "conversationTitle"]
        .iter()
        .find_map(|k| field_str(env, k));
    let goal = (env.event_type == "a2a.send")
        .then(|| field_str(env, "goal"))
        .flatten();
    let is_a2a = env.event_type.starts_with("a2a.");
    if name.is_none() && goal.is_none() && !(is_a2a && ev.text.is_some()) {
        return;
    }
    let rt = s.text.entry(ev.role).or_default();
    if rt.name.is_none() {
        rt.name = name.map(|n| shorten(n, PREVIEW_CHARS));
    }
    if !is_a2a {
        return;
    }
    // Events of a session arrive from several partitions in any order: keep the earliest.
    let at = ev.at.as_deref();
    if let Some(t) = ev.text {
        if earliest(&rt.first_message, &rt.first_message_at, at) {
            rt.first_message = Some(shorten(t, TITLE_CHARS));
            rt.first_message_at = ev.at.clone();
        }
    }
    if let Some(g) = goal {
        if earliest(&rt.goal, &rt.goal_at, at) {
            rt.goal = Some(shorten(g, PREVIEW_CHARS));
            rt.goal_at = ev.at.clone();
        }
    }
}

/// The role's last message: the latest in event time.
fn note_last_message(s: &mut WorkSession, ev: &Folded<'_>) {
    let Some(t) = ev.text else { return };
    let newer = match (s.last_message.get(&ev.role), &ev.at) {
        (None, _) => true,
        (Some(prev), Some(at)) => prev.timestamp.as_deref().is_none_or(|p| !later(p, at)),
        (Some(_), None) => true,
    };
    if newer {
        let from = ev
            .from
            .clone()
            .or_else(|| ev.env.agent_id.as_ref().and_then(id_text));
        s.last_message.insert(
            ev.role,
            LastMessage {
                preview: shorten(t, PREVIEW_CHARS),
                timestamp: ev.at.clone(),
                from,
            },
        );
    }
}

/// Participants: both sides of a message, the acting agent, and any listed participants; who
/// delegated work and who received it.
fn note_participants(s: &mut WorkSession, ev: &Folded<'_>) {
    let (env, role) = (ev.env, ev.role);
    if let Some(f) = &ev.from {
        note_participant(
            s,
            f,
            role,
            side_kind(env, &FROM_SIDE),
            side_name(env, &FROM_SIDE),
        );
    }
    if let Some(t) = &ev.to {
        note_participant(
            s,
            t,
            role,
            side_kind(env, &TO_SIDE),
            side_name(env, &TO_SIDE),
        );
    }
    if let Some(agent) = env.agent_id.as_ref().and_then(id_text) {
        let kind = ["agentKind", "kind"]
            .iter()
            .find_map(|k| field_str(env, k).and_then(Kind::parse));
        let name = ["agentName", "agentDisplayName", "displayName"]
            .iter()
            .find_map(|k| field_str(env, k));
        note_participant(s, &agent, role, kind, name);
    }
    if let Some(Value::Array(list)) = field(env, "participants") {
        for p in list {
            let Some(pid) = p.get("id").and_then(id_text) else {
                continue;
            };
            let kind = ["kind", "type"]
                .iter()
                .find_map(|k| p.get(*k).and_then(Value::as_str).and_then(Kind::parse));
            let name = ["displayName", "display_name", "name"]
                .iter()
                .find_map(|k| p.get(*k).and_then(Value::as_str))
                .map(str::trim)
                .filter(|n| !n.is_empty());
            note_participant(s, &pid, role, kind, name);
        }
    }
    let delegates = role == Role::DelegationSubagent
        && matches!(env.event_type.as_str(), "a2a.send" | "a2a.spawn");
    if let (true, Some(f), Some(t)) = (delegates, &ev.from, &ev.to) {
        if let Some(p) = s.participants.get_mut(f) {
            p.coordinator = true;
        }
        if let Some(p) = s.participants.get_mut(t) {
            p.worker = true;
        }
    }
}

/// The entry of `key` in `map`, made by `make` when there is none. Looked up before a key is
/// allocated: most events name types, threads and participants their session knows already. (`None`
/// never happens: the entry is there once made.)
fn keyed<'m, V>(
    map: &'m mut BTreeMap<String, V>,
    key: &str,
    make: impl FnOnce() -> V,
) -> Option<&'m mut V> {
    if !map.contains_key(key) {
        map.insert(key.to_string(), make());
    }
    map.get_mut(key)
}

/// The conversation's thread: its sides, counts, times and turns.
fn note_thread(s: &mut WorkSession, conversation: &str, ev: &Folded<'_>) {
    if !s.threads.contains_key(conversation) {
        let thread = match note_dormant(s, conversation, ev) {
            Dormancy::Counted => return,
            Dormancy::Woken(thread) => thread,
            Dormancy::No => Thread {
                conversation_id: conversation.to_string(),
                ..Thread::default()
            },
        };
        retire_threads(s);
        s.threads.insert(conversation.to_string(), thread);
    }
    let Some(th) = s.threads.get_mut(conversation) else {
        return;
    };
    if ev.from.is_some() || ev.to.is_some() {
        th.sides.entry(ev.role).or_insert_with(|| Sides {
            from_agent: ev.from.clone(),
            to_agent: ev.to.clone(),
        });
    }
    *th.counts.entry(ev.role).or_insert(0) += 1;
    if let Some(t) = &ev.at {
        keep_min(&mut th.first_time, t);
        keep_max(&mut th.last_time, t);
        th.spans.entry(ev.role).or_default().note(t);
    }
    if ev.role != Role::ConversationMain {
        return;
    }
    if ev.env.event_type == "a2a.send" {
        th.turns.entry(ev.turn.clone()).or_insert(TurnMark::Open);
    } else if ev.is_turn_response {
        let slot = th.turns.entry(ev.turn.clone()).or_insert(TurnMark::Open);
        if *slot == TurnMark::Open {
            *slot = outcome(ev.env);
        }
    }
}

/// The payload fields that describe one side of a message: its kind, then its name.
struct SideFields {
    kind: [&'static str; 3],
    name: [&'static str; 2],
}

const FROM_SIDE: SideFields = SideFields {
    kind: ["fromKind", "fromType", "fromParticipantKind"],
    name: ["fromName", "fromDisplayName"],
};

const TO_SIDE: SideFields = SideFields {
    kind: ["toKind", "toType", "toParticipantKind"],
    name: ["toName", "toDisplayName"],
};

fn side_kind(env: &Envelope, side: &SideFields) -> Option<Kind> {
    side.kind
        .iter()
        .find_map(|k| field_str(env, k).and_then(Kind::parse))
}

fn side_name<'a>(env: &'a Envelope, side: &SideFields) -> Option<&'a str> {
    side.name.iter().find_map(|k| field_str(env, k))
}

fn note_participant(
    s: &mut WorkSession,
    id: &str,
    role: Role,
    kind: Option<Kind>,
    name: Option<&str>,
) {
    let Some(p) = keyed(&mut s.participants, id, || Participant {
        id: id.to_string(),
        ..Participant::default()
    }) else {
        return;
    };
    p.roles.insert(role);
    if let Some(k) = kind {
        p.kinds.entry(role).or_insert(k);
    }
    if let Some(n) = name {
        p.display_names
            .entry(role)
            .or_insert_with(|| shorten(n, PREVIEW_CHARS));
    }
}

/// A session's status, from its last event time and the clock: `ACTIVE`, `QUIET` after
/// `http.quiet_after` without events, `ARCHIVED` after `http.archive_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Active,
    Quiet,
    Archived,
}

impl Status {
    pub const ALL: [Status; 3] = [Status::Active, Status::Quiet, Status::Archived];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Active => "ACTIVE",
            Status::Quiet => "QUIET",
            Status::Archived => "ARCHIVED",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL
            .into_iter()
            .find(|x| x.as_str().eq_ignore_ascii_case(s))
    }

    /// `ARCHIVED` after `archive_after` without events, `QUIET` after `quiet_after`, else
    /// `ACTIVE` (also when the last event time is unknown or in the future).
    pub fn at(
        updated_at: Option<&str>,
        now: DateTime<Utc>,
        quiet_after: Duration,
        archive_after: Duration,
    ) -> Status {
        let Some(last) = updated_at.and_then(parse_time) else {
            return Status::Active;
        };
        let idle = (now - last).to_std().unwrap_or(Duration::ZERO);
        if idle >= archive_after {
            Status::Archived
        } else if idle >= quiet_after {
            Status::Quiet
        } else {
            Status::Active
        }
    }
}

/// A participant as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "Participant", deny_unknown_fields)]
pub struct ParticipantView {
    /// The agent (or person, or system) id.
    pub id: String,
    /// What it is.
    pub kind: Kind,
    /// Its first visible event role (in the order of [`Role::ALL`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// The visible event roles it took part in.
    pub roles: Vec<Role>,
    /// Its display name, when the events gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// It delegated work (a `delegation.subagent` send or spawn from it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub coordinator: bool,
    /// It received delegated work.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub worker: bool,
}

/// One conversation of a session as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "Thread", deny_unknown_fields)]
pub struct ThreadView {
    /// `conv:<conversationId>`, as the origin.
    pub id: String,
    /// The conversation id.
    pub conversation_id: String,
    /// The agent that opened the conversation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    /// The agent it was addressed to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
    /// The visible event roles of its events.
    pub roles: Vec<Role>,
    /// Its visible events.
    pub event_count: u64,
    /// Its first event time (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// Its last event time (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_time: Option<String>,
    /// Turns sent and not yet answered.
    pub open_turns: u64,
    /// Turns whose response was a blocked outcome.
    pub blocked_turns: u64,
    /// Turns answered by a real reply.
    pub answered_turns: u64,
}

/// A work session as the API shows it to a caller who may see `roles`: counts, turns and
/// participants of the visible roles only.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "WorkSession", deny_unknown_fields)]
pub struct SessionView {
    /// The id to read it with (`/api/work-sessions/{id}`).
    pub id: String,
    /// The work session id (or the conversation id of a session without one).
    pub work_session_id: String,
    /// Its name, when the events gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A title: the conversation name, else the first message, else the session id.
    pub title: String,
    /// Its status now.
    pub status: Status,
    /// Its first event time (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    /// Its last event time (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// Its visible events.
    pub event_count: u64,
    /// Every conversation of the session, including those no longer listed in `threads`.
    pub thread_count: usize,
    /// Visible events by role.
    pub counts_by_role: BTreeMap<Role, u64>,
    /// Visible events by type.
    pub counts_by_type: BTreeMap<String, u64>,
    /// Turns sent and not yet answered.
    pub open_turns: u64,
    /// Turns whose response was a blocked outcome.
    pub blocked_turns: u64,
    /// Turns answered by a real reply.
    pub answered_turns: u64,
    /// The last message's text, shortened.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 200))]
    pub last_message_preview: Option<String>,
    /// The last message's time (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_message_timestamp: Option<String>,
    /// Who took part, in the visible roles.
    pub participants: Vec<ParticipantView>,
    /// The most recently active conversations (256 or so), those with an open turn kept first;
    /// older ones count only in the totals.
    pub threads: Vec<ThreadView>,
    /// Tokens the visible roles' events reported, per agent and model, with their cost.
    pub usage: Vec<UsageView>,
    /// Their sum.
    pub usage_total: UsageTotal,
}

/// Tokens one agent spent on one model in a session, and their cost.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct UsageView {
    /// The agent that spent them (`unknown` when the events named none; `other` past 64 agents).
    pub agent: String,
    /// The model (`unknown` when the events named none; `other` past 16 models per agent).
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Input tokens read from a prompt cache (part of `inputTokens`).
    pub cached_input_tokens: u64,
    /// Output tokens spent on reasoning (part of `outputTokens`).
    pub reasoning_tokens: u64,
    /// Events that reported usage.
    pub events: u64,
    /// The cost from the configured price table (`[usage] prices`); absent when the model has
    /// no price.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

/// A session's usage summed over agents and models.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct UsageTotal {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_input_tokens: u64,
    pub reasoning_tokens: u64,
    /// The cost of the tokens of priced models.
    pub cost: f64,
    /// Tokens (input and output) of models the price table has no price for, not in `cost`.
    pub unpriced_tokens: u64,
}

/// What a view needs besides the session.
#[derive(Debug, Clone, Copy)]
pub struct ViewOptions<'a> {
    /// Roles the caller may see (and asked for).
    pub roles: &'a [Role],
    pub now: DateTime<Utc>,
    pub quiet_after: Duration,
    pub archive_after: Duration,
    /// The price table usage is costed with.
    pub prices: &'a crate::usage::Prices,
}

impl WorkSession {
    /// Whether it holds an event of one of `roles` (and, when `types` is not empty, of one of
    /// those types in those roles).
    pub fn matches(&self, roles: &[Role], types: &[String]) -> bool {
        roles.iter().any(|r| {
            self.counts.get(r).is_some_and(|by_type| {
                if types.is_empty() {
                    by_type.values().any(|n| *n > 0)
                } else {
                    types.iter().any(|t| by_type.get(t).is_some_and(|n| *n > 0))
                }
            })
        })
    }

    /// The text of the visible roles, in the order of [`Role::ALL`].
    fn visible_text<'a>(&'a self, roles: &'a [Role]) -> impl Iterator<Item = &'a RoleText> + 'a {
        Role::ALL
            .into_iter()
            .filter(|r| roles.contains(r))
            .filter_map(|r| self.text.get(&r))
    }

    /// The conversation name given by an event of one of `roles` (the first role of
    /// [`Role::ALL`] that gave one).
    pub fn name(&self, roles: &[Role]) -> Option<String> {
        self.visible_text(roles).find_map(|t| t.name.clone())
    }

    /// The earliest first message among `roles`.
    pub fn first_message(&self, roles: &[Role]) -> Option<String> {
        earliest_of(
            self.visible_text(roles)
                .map(|t| (&t.first_message, &t.first_message_at)),
        )
    }

    /// The earliest goal among `roles`.
    pub fn goal(&self, roles: &[Role]) -> Option<String> {
        earliest_of(self.visible_text(roles).map(|t| (&t.goal, &t.goal_at)))
    }

    /// A title from the text of `roles`: the conversation name, else the first message, else
    /// the session id.
    pub fn title(&self, roles: &[Role]) -> String {
        self.name(roles)
            .or_else(|| self.first_message(roles))
            .unwrap_or_else(|| format!("Work session {}", self.id))
    }

    /// The view of the session restricted to `opts.roles`; `None` when it holds nothing in them.
    pub fn view(&self, opts: &ViewOptions<'_>) -> Option<SessionView> {
        let visible = |r: &Role| opts.roles.contains(r);
        if !self.matches(opts.roles, &[]) {
            return None;
        }
        let mut counts_by_role = BTreeMap::new();
        let mut counts_by_type: BTreeMap<String, u64> = BTreeMap::new();
        for (role, by_type) in self.counts.iter().filter(|(r, _)| visible(r)) {
            counts_by_role.insert(*role, by_type.values().sum());
            for (t, n) in by_type {
                *counts_by_type.entry(t.clone()).or_insert(0) += n;
            }
        }
        let event_count = counts_by_role.values().sum();
        let retired = self.retired_visible(opts.roles);
        let mut threads: Vec<ThreadView> = self
            .threads
            .values()
            .filter(|t| t.counts.keys().any(visible))
            .map(|t| t.view(opts.roles))
            .collect();
        threads.sort_by(|a, b| {
            b.last_time
                .cmp(&a.last_time)
                .then_with(|| a.conversation_id.cmp(&b.conversation_id))
        });
        let last = self.last_visible_message(opts.roles);
        let usage = self.usage_views(opts.roles, opts.prices);
        let span = visible_span(
            &self.spans,
            opts.roles,
            Span {
                first: self.created_at.clone(),
                last: self.updated_at.clone(),
            },
        );
        Some(SessionView {
            id: self.id.clone(),
            work_session_id: self
                .work_session_id
                .clone()
                .unwrap_or_else(|| self.id.clone()),
            name: self.name(opts.roles),
            title: self.title(opts.roles),
            status: Status::at(
                span.last.as_deref(),
                opts.now,
                opts.quiet_after,
                opts.archive_after,
            ),
            created_at: span.first,
            updated_at: span.last,
            event_count,
            thread_count: threads.len() + retired.threads as usize,
            counts_by_role,
            counts_by_type,
            open_turns: threads.iter().map(|t| t.open_turns).sum::<u64>()
                + self.dormant_open_visible(opts.roles),
            blocked_turns: threads.iter().map(|t| t.blocked_turns).sum::<u64>()
                + retired.blocked_turns,
            answered_turns: threads.iter().map(|t| t.answered_turns).sum::<u64>()
                + retired.answered_turns,
            last_message_preview: last.map(|m| m.preview.clone()),
            last_message_timestamp: last.and_then(|m| m.timestamp.clone()),
            participants: self.participant_views(opts.roles),
            threads,
            usage: usage.0,
            usage_total: usage.1,
        })
    }

    /// The usage of the visible roles, per agent and model, costed with `prices`.
    fn usage_views(
        &self,
        roles: &[Role],
        prices: &crate::usage::Prices,
    ) -> (Vec<UsageView>, UsageTotal) {
        let mut merged: BTreeMap<(&str, &str), Tokens> = BTreeMap::new();
        for (_, by_agent) in self.usage.iter().filter(|(r, _)| roles.contains(r)) {
            for (agent, by_model) in by_agent {
                for (model, t) in by_model {
                    let m = merged.entry((agent, model)).or_default();
                    m.input += t.input;
                    m.output += t.output;
                    m.cached_input += t.cached_input;
                    m.reasoning += t.reasoning;
                    m.events += t.events;
                }
            }
        }
        let mut total = UsageTotal::default();
        let views = merged
            .into_iter()
            .map(|((agent, model), t)| {
                let cost = prices.cost(&crate::usage::Usage {
                    input_tokens: t.input,
                    output_tokens: t.output,
                    cached_input_tokens: Some(t.cached_input),
                    reasoning_tokens: Some(t.reasoning),
                    model: Some(model.to_string()),
                });
                total.input_tokens += t.input;
                total.output_tokens += t.output;
                total.cached_input_tokens += t.cached_input;
                total.reasoning_tokens += t.reasoning;
                match cost {
                    Some(c) => total.cost += c,
                    None => total.unpriced_tokens += t.input + t.output,
                }
                UsageView {
                    agent: agent.to_string(),
                    model: model.to_string(),
                    input_tokens: t.input,
                    output_tokens: t.output,
                    cached_input_tokens: t.cached_input,
                    reasoning_tokens: t.reasoning,
                    events: t.events,
                    cost,
                }
            })
            .collect();
        (views, total)
    }

    /// The participants seen in `roles`, each with its kind, name and roles as those roles gave
    /// them.
    fn participant_views(&self, roles: &[Role]) -> Vec<ParticipantView> {
        let visible = |r: &Role| roles.contains(r);
        self.participants
            .values()
            .filter(|p| p.roles.iter().any(visible))
            .map(|p| {
                let roles: Vec<Role> = Role::ALL
                    .into_iter()
                    .filter(|r| p.roles.contains(r) && visible(r))
                    .collect();
                ParticipantView {
                    id: p.id.clone(),
                    kind: roles
                        .iter()
                        .find_map(|r| p.kinds.get(r).copied())
                        .unwrap_or_default(),
                    role: roles.first().copied(),
                    display_name: roles.iter().find_map(|r| p.display_names.get(r).cloned()),
                    roles,
                    coordinator: p.coordinator && visible(&Role::DelegationSubagent),
                    worker: p.worker && visible(&Role::DelegationSubagent),
                }
            })
            .collect()
    }

    /// Open turns of the dormant conversations that held one of `roles`, when turns are visible.
    fn dormant_open_visible(&self, roles: &[Role]) -> u64 {
        if !roles.contains(&Role::ConversationMain) {
            return 0;
        }
        let visible_mask = role_mask(roles);
        self.dormant
            .values()
            .filter(|d| d.roles & visible_mask != 0)
            .map(|d| d.open.len() as u64)
            .sum()
    }

    /// Retired threads that held one of `roles`; their turns only when turns are visible.
    fn retired_visible(&self, roles: &[Role]) -> RetiredThreads {
        let turns_visible = roles.contains(&Role::ConversationMain);
        let visible_mask = role_mask(roles);
        self.retired
            .iter()
            .filter(|(mask, _)| *mask & visible_mask != 0)
            .fold(RetiredThreads::default(), |mut sum, (_, r)| {
                sum.threads += r.threads;
                if turns_visible {
                    sum.answered_turns += r.answered_turns;
                    sum.blocked_turns += r.blocked_turns;
                }
                sum
            })
    }

    /// The latest last message of the visible roles.
    fn last_visible_message(&self, roles: &[Role]) -> Option<&LastMessage> {
        self.last_message
            .iter()
            .filter(|(r, _)| roles.contains(r))
            .map(|(_, m)| m)
            .reduce(|a, b| match (&a.timestamp, &b.timestamp) {
                (Some(x), Some(y)) if later(y, x) => b,
                (None, Some(_)) => b,
                _ => a,
            })
    }
}

impl Thread {
    /// The thread as a caller who may see `roles` sees it (turns only with `conversation.main`).
    fn view(&self, roles: &[Role]) -> ThreadView {
        let visible = |r: &Role| roles.contains(r);
        let turns_visible = visible(&Role::ConversationMain);
        let count = |m: TurnMark| {
            if turns_visible {
                self.turns.values().filter(|x| **x == m).count() as u64
            } else {
                0
            }
        };
        let sides = Role::ALL
            .into_iter()
            .filter(visible)
            .find_map(|r| self.sides.get(&r));
        let span = visible_span(
            &self.spans,
            roles,
            Span {
                first: self.first_time.clone(),
                last: self.last_time.clone(),
            },
        );
        ThreadView {
            id: format!("conv:{}", self.conversation_id),
            conversation_id: self.conversation_id.clone(),
            from_agent: sides.and_then(|s| s.from_agent.clone()),
            to_agent: sides.and_then(|s| s.to_agent.clone()),
            roles: Role::ALL
                .into_iter()
                .filter(|r| self.counts.contains_key(r) && visible(r))
                .collect(),
            event_count: self
                .counts
                .iter()
                .filter(|(r, _)| visible(r))
                .map(|(_, n)| n)
                .sum(),
            start_time: span.first,
            last_time: span.last,
            open_turns: count(TurnMark::Open),
            blocked_turns: count(TurnMark::Blocked),
            answered_turns: count(TurnMark::Answered),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RawEventRef;
    use serde_json::json;

    /// `later` without its shortcut: parse both, else compare the text.
    fn later_by_parsing(a: &str, b: &str) -> bool {
        match (parse_time(a), parse_time(b)) {
            (Some(x), Some(y)) => x > y,
            _ => a > b,
        }
    }

    #[test]
    fn times_written_alike_order_as_parsed_times_do() {
        let times = [
            "2026-11-29T14:00:00Z",
            "2026-11-29T14:00:01Z",
            "2026-11-29T13:59:59Z",
            "2026-12-01T00:00:00Z",
            "2025-12-31T23:59:60Z",
            "2026-11-29T14:00:00.1Z",
            "2026-11-29T14:00:00.9Z",
            "2026-11-29T14:00:00.100Z",
            "2026-11-29T14:00:00.099Z",
            "2026-11-29T14:00:00.000000001Z",
            "2026-11-29T14:00:00.000000000Z",
            "2026-11-29T15:00:00+01:00",
            "2026-11-29T14:00:00+00:00",
            "2026-11-29t14:00:00z",
            "2026-13-29T14:00:00Z",
            "2026-02-30T14:00:00Z",
            "2026-11-29T24:00:00Z",
            "2026-11-29T14:00:00.Z",
            "2026-11-29 14:00:00Z",
            "not a time",
            "",
        ];
        let mut shortcut = 0;
        for a in times {
            for b in times {
                assert_eq!(later(a, b), later_by_parsing(a, b), "later({a:?}, {b:?})");
                shortcut += usize::from(same_utc_layout(a, b));
            }
        }
        // The shortcut is taken for the pairs written alike, not only for identical strings.
        assert!(shortcut > times.len(), "{shortcut}");
        assert!(same_utc_layout(
            "2026-11-29T14:00:00.123Z",
            "2025-01-01T00:00:00.999Z"
        ));
        assert!(!same_utc_layout(
            "2026-11-29T14:00:00.12Z",
            "2025-01-01T00:00:00.999Z"
        ));
        assert!(!same_utc_layout(
            "2026-11-29T14:00:00+00:00",
            "2026-11-29T14:00:00+00:00"
        ));
    }

    fn ids(ws: Option<&str>, conv: Option<&str>) -> SessionKeys {
        SessionKeys {
            work_session_id: ws.map(str::to_string),
            conversation_id: conv.map(str::to_string),
        }
    }

    #[test]
    fn a_conversation_goes_to_the_session_an_earlier_event_named_and_only_then() {
        let events = [
            ids(None, Some("c1")),
            ids(Some("ws_a"), Some("c1")),
            ids(None, Some("c1")),
            ids(Some("ws_b"), None),
            ids(None, None),
            ids(None, Some("c2")),
        ];
        let known = HashMap::from([("c2".to_string(), "ws_k".to_string())]);
        let (sessions, set) = route(&events, known);
        let sessions: Vec<Option<&str>> = sessions.iter().map(Option::as_deref).collect();
        assert_eq!(
            sessions,
            [
                Some("c1"),
                Some("ws_a"),
                Some("ws_a"),
                Some("ws_b"),
                None,
                Some("ws_k")
            ]
        );
        assert_eq!(
            set,
            HashMap::from([("c1".to_string(), vec![(1, "ws_a".to_string())])])
        );
    }

    #[test]
    fn an_alias_known_already_is_not_set_again_and_every_move_is_kept_in_order() {
        let known = HashMap::from([("c1".to_string(), "ws_a".to_string())]);
        let (_, set) = route(&[ids(Some("ws_a"), Some("c1"))], known.clone());
        assert!(set.is_empty(), "{set:?}");
        let events = [
            ids(Some("ws_b"), Some("c1")),
            ids(None, Some("c1")),
            ids(Some("ws_c"), Some("c1")),
        ];
        let (sessions, set) = route(&events, known);
        assert_eq!(sessions[1].as_deref(), Some("ws_b"));
        assert_eq!(
            set,
            HashMap::from([(
                "c1".to_string(),
                vec![(0, "ws_b".to_string()), (2, "ws_c".to_string())]
            )])
        );
    }

    fn env(role: Role, t: &str, ts: &str, payload: Value) -> Envelope {
        Envelope {
            event_type: t.into(),
            event_role: Some(role),
            timestamp: Some(ts.into()),
            conversation_id: payload.get("conversationId").cloned(),
            work_session_id: payload.get("workSessionId").cloned(),
            agent_id: payload.get("fromAgent").cloned(),
            payload: Some(payload),
            ..Envelope::default()
        }
    }

    fn send(turn: u64, ts: &str) -> Envelope {
        env(
            Role::ConversationMain,
            "a2a.send",
            ts,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_1", "turn": turn, "message": format!("please do {turn}")}),
        )
    }

    fn response(turn: u64, ts: &str, extra: Value) -> Envelope {
        let mut p = json!({"fromAgent": "eden", "toAgent": "ruda", "conversationId": "c1", "workSessionId": "ws_1", "turn": turn, "message": format!("done {turn}")});
        if let (Some(m), Value::Object(e)) = (p.as_object_mut(), extra) {
            m.extend(e);
        }
        env(Role::ConversationMain, "a2a.response", ts, p)
    }

    fn raw(p: u16, seq: u64) -> Identity {
        Identity {
            partition: p,
            position: Position(seq, 0),
        }
    }

    fn fold(events: &[(Envelope, Identity)]) -> Option<WorkSession> {
        let mut s = None;
        for (e, id) in events {
            if let Some(n) = apply_as(s.clone(), e, *id) {
                s = Some(n);
            }
        }
        s
    }

    fn opts(roles: &[Role]) -> ViewOptions<'_> {
        ViewOptions {
            roles,
            now: parse_time("2026-02-17T12:05:00Z").unwrap_or_default(),
            quiet_after: Duration::from_secs(900),
            archive_after: Duration::from_secs(86400),
            prices: &NO_PRICES,
        }
    }

    static NO_PRICES: crate::usage::Prices = crate::usage::Prices::EMPTY;

    /// Every envelope the projection fixtures hold, plus envelopes that read every kept field
    /// beside fields the fold skips.
    fn fold_corpus() -> Vec<Envelope> {
        let mut corpus = Vec::new();
        for dir in ["fixtures/a2a-spec", "fixtures/agui-spec"] {
            let mut files: Vec<_> = std::fs::read_dir(dir)
                .expect("fixture directory")
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(".expected.json"))
                .collect();
            files.sort();
            for path in files {
                let text = std::fs::read_to_string(&path).expect("fixture readable");
                let items: Vec<Value> = serde_json::from_str(&text).expect("a JSON array");
                corpus.extend(
                    items
                        .iter()
                        .filter_map(|i| i.get("envelope"))
                        .map(|e| serde_json::from_value::<Envelope>(e.clone()).expect("envelope")),
                );
            }
        }
        assert!(
            corpus.len() > 100,
            "the fixtures give {} envelopes",
            corpus.len()
        );
        let mut every = serde_json::Map::new();
        for (i, name) in FOLD_FIELDS.iter().enumerate() {
            every.insert((*name).into(), json!(format!("v{i}")));
        }
        every.insert(
            "participants".into(),
            json!([{"id": "p1", "kind": "human", "name": "Pat"}, 7, "x"]),
        );
        every.insert(
            "toolResult".into(),
            json!({"rows": [[1, 2], {"deep": {"er": null}}], "n": 1.5}),
        );
        every.insert("from\"Agent".into(), json!("a key written with an escape"));
        every.insert("outcome".into(), json!("blocked"));
        corpus.push(env(
            Role::ConversationMain,
            "a2a.response",
            "2026-02-17T12:00:09.000Z",
            Value::Object(every),
        ));
        corpus.push(env(
            Role::DelegationSubagent,
            "a2a.send",
            "2026-02-17T12:00:10.000Z",
            json!({"fromAgent": "lead", "toAgent": "w1", "fromKind": "human", "toDisplayName": "W",
                   "goal": "g", "args": {"a": [1, {"b": "c"}]}, "conversationName": "n"}),
        ));
        for payload in [
            json!([1, 2]),
            json!("text"),
            json!(3),
            json!(null),
            json!(true),
        ] {
            corpus.push(env(
                Role::SystemObservability,
                "tool.started",
                "2026-02-17T12:00:11.000Z",
                payload,
            ));
        }
        corpus
    }

    #[test]
    fn folding_the_fold_parse_gives_the_session_the_whole_envelope_gives() {
        let corpus = fold_corpus();
        let (mut whole, mut cut) = (None::<WorkSession>, None::<WorkSession>);
        for (i, e) in corpus.iter().enumerate() {
            // One session for all of them, so every event is folded.
            let mut e = e.clone();
            e.work_session_id = Some(json!("ws_all"));
            let bytes = serde_json::to_vec(&e).expect("serialises");
            let read = envelope_for_fold(&bytes).expect("the fold parse reads it");
            let id = raw(0, i as u64 + 1);
            whole = apply_as(whole.clone(), &e, id).or(whole);
            cut = apply_as(cut.clone(), &read, id).or(cut);
            assert_eq!(
                whole,
                cut,
                "after envelope {i}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        let s = whole.expect("a session");
        assert_eq!(
            s.applied[&0].floor,
            Position(corpus.len() as u64, 0),
            "the last envelope was folded"
        );
    }

    #[test]
    fn turns_participants_counts_and_preview() {
        let s = fold(&[
            (send(0, "2026-02-17T12:00:00.000Z"), raw(3, 10)),
            (
                response(0, "2026-02-17T12:00:05.000Z", json!({})),
                raw(3, 11),
            ),
            (send(1, "2026-02-17T12:01:00.000Z"), raw(3, 12)),
            (send(2, "2026-02-17T12:02:00.000Z"), raw(3, 13)),
            (
                response(
                    2,
                    "2026-02-17T12:03:00.000Z",
                    json!({"outcome": "blocked", "reason": "timeout"}),
                ),
                raw(3, 14),
            ),
        ])
        .expect("a session");
        assert_eq!(s.id, "ws_1");
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!(v.event_count, 5);
        assert_eq!(v.counts_by_type["a2a.send"], 3);
        assert_eq!(v.counts_by_type["a2a.response"], 2);
        assert_eq!(v.counts_by_role[&Role::ConversationMain], 5);
        assert_eq!((v.open_turns, v.blocked_turns, v.answered_turns), (1, 1, 1));
        assert_eq!(v.thread_count, 1);
        assert_eq!(v.threads[0].from_agent.as_deref(), Some("ruda"));
        assert_eq!(v.last_message_preview.as_deref(), Some("done 2"));
        assert_eq!(
            v.last_message_timestamp.as_deref(),
            Some("2026-02-17T12:03:00.000Z")
        );
        assert_eq!(v.created_at.as_deref(), Some("2026-02-17T12:00:00.000Z"));
        assert_eq!(v.status, Status::Active);
        let ids: Vec<_> = v.participants.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["eden", "ruda"]);
        assert!(v.participants.iter().all(|p| p.kind == Kind::Agent));
        assert_eq!(v.participants[0].role, Some(Role::ConversationMain));
        assert_eq!(v.title, "please do 0");
    }

    #[test]
    fn redelivered_events_never_count_twice() {
        let a = send(0, "2026-02-17T12:00:00.000Z");
        let b = response(0, "2026-02-17T12:00:05.000Z", json!({}));
        let once = fold(&[(a.clone(), raw(1, 5)), (b.clone(), raw(1, 6))]);
        let s = once.clone().expect("a session");
        // The same position, any earlier one, and the same turn's response anywhere: no change.
        assert_eq!(apply_as(Some(s.clone()), &a, raw(1, 5)), None);
        assert_eq!(apply_as(Some(s.clone()), &a, raw(1, 4)), None);
        assert_eq!(apply_as(Some(s.clone()), &b, raw(1, 6)), None);
        assert_eq!(apply_as(Some(s.clone()), &b, raw(1, 9)), None);
        assert_eq!(apply(Some(s.clone()), &a, 1, 5), None);
        // A whole replay of the partition after a restart changes nothing.
        let replay = fold(&[
            (a.clone(), raw(1, 5)),
            (b.clone(), raw(1, 6)),
            (a.clone(), raw(1, 5)),
            (b, raw(1, 6)),
        ]);
        assert_eq!(replay, once);
        // Another partition has its own positions; a later position counts.
        assert!(apply_as(Some(s.clone()), &a, raw(2, 5)).is_some());
        let mut later_one = a.clone();
        later_one.turn_id = Some(json!("7"));
        let n = apply_as(Some(s), &later_one, raw(1, 7)).expect("new");
        assert_eq!(n.counts[&Role::ConversationMain]["a2a.send"], 2);
        // Outputs of one raw message are told apart by their index.
        let second = Identity {
            partition: 1,
            position: Position(7, 1),
        };
        assert!(apply_as(Some(n), &a, second).is_some());
    }

    #[test]
    fn a_response_before_its_send_closes_the_turn() {
        let s = fold(&[
            (
                response(0, "2026-02-17T12:00:05.000Z", json!({})),
                raw(1, 2),
            ),
            (send(0, "2026-02-17T12:00:00.000Z"), raw(1, 3)),
        ])
        .expect("a session");
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!((v.open_turns, v.answered_turns), (0, 1));
        assert_eq!(v.created_at.as_deref(), Some("2026-02-17T12:00:00.000Z"));
        assert_eq!(v.updated_at.as_deref(), Some("2026-02-17T12:00:05.000Z"));
        // The title is the earliest message, whatever the order of application.
        assert_eq!(v.title, "please do 0");
        // The newest message wins the preview whatever the order of application.
        assert_eq!(v.last_message_preview.as_deref(), Some("done 0"));
    }

    #[test]
    fn keyed_by_work_session_else_conversation_and_skips_others() {
        let mut e = send(0, "2026-02-17T12:00:00.000Z");
        e.work_session_id = None;
        if let Some(p) = e.payload.as_mut().and_then(Value::as_object_mut) {
            p.remove("workSessionId");
        }
        assert_eq!(apply(None, &e, 0, 1).map(|s| s.id), Some("c1".into()));
        let health = Envelope {
            event_type: "health.ping".into(),
            event_role: Some(Role::SystemObservability),
            ..Envelope::default()
        };
        assert_eq!(apply(None, &health, 0, 1), None);
    }

    #[test]
    fn participants_kinds_names_and_delegation() {
        let mut e = env(
            Role::DelegationSubagent,
            "a2a.send",
            "2026-02-17T12:00:00.000Z",
            json!({"fromAgent": "lead", "toAgent": "w1", "conversationId": "d1", "workSessionId": "ws_2",
                   "fromKind": "human", "fromName": "Ada", "toDisplayName": "Worker One"}),
        );
        e.agent_id = None;
        let s = apply(None, &e, 0, 1).expect("session");
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        let lead = &v.participants[0];
        assert_eq!((lead.id.as_str(), lead.kind), ("lead", Kind::Human));
        assert_eq!(lead.display_name.as_deref(), Some("Ada"));
        assert!(lead.coordinator);
        assert_eq!(
            v.participants[1].display_name.as_deref(),
            Some("Worker One")
        );
        assert!(v.participants[1].worker);
        assert_eq!(v.participants[1].kind, Kind::Agent);
        // A later default never overrides a known kind.
        let mut again = e.clone();
        if let Some(p) = again.payload.as_mut().and_then(Value::as_object_mut) {
            p.remove("fromKind");
        }
        let s = apply(Some(s), &again, 0, 2).expect("new event");
        assert_eq!(
            s.participants["lead"].kinds.get(&Role::DelegationSubagent),
            Some(&Kind::Human)
        );
    }

    #[test]
    fn text_is_seen_only_through_the_role_of_its_event() {
        let sub = env(
            Role::DelegationSubagent,
            "a2a.send",
            "2026-02-17T12:00:00.000Z",
            json!({"fromAgent": "lead", "toAgent": "w1", "conversationId": "d1", "workSessionId": "ws_3",
                   "conversationName": "secret project", "goal": "secret goal", "message": "secret text",
                   "fromName": "Secret Lead", "fromKind": "human"}),
        );
        let task = env(
            Role::OrchestrationTask,
            "task.updated",
            "2026-02-17T12:01:00.000Z",
            json!({"fromAgent": "lead", "conversationId": "t1", "workSessionId": "ws_3", "text": "task text"}),
        );
        let s = fold(&[(sub, raw(0, 1)), (task, raw(0, 2))]).expect("session");
        let v = s.view(&opts(&[Role::OrchestrationTask])).expect("visible");
        let shown = serde_json::to_string(&v).unwrap_or_default();
        assert!(!shown.contains("secret"), "{shown}");
        assert_eq!(v.name, None);
        assert_eq!(v.title, "Work session ws_3");
        assert_eq!(v.last_message_preview.as_deref(), Some("task text"));
        let lead = &v.participants[0];
        assert_eq!(
            (lead.kind, lead.display_name.as_deref()),
            (Kind::Agent, None)
        );
        assert_eq!(v.threads.len(), 1);
        assert_eq!(v.threads[0].to_agent, None);
        assert_eq!(s.goal(&[Role::OrchestrationTask]), None);
        assert_eq!(s.first_message(&[Role::OrchestrationTask]), None);
        // The role that gave the text sees it.
        let v = s.view(&opts(&[Role::DelegationSubagent])).expect("visible");
        assert_eq!(v.name.as_deref(), Some("secret project"));
        assert_eq!(
            v.participants[0].display_name.as_deref(),
            Some("Secret Lead")
        );
        assert_eq!(v.threads[0].to_agent.as_deref(), Some("w1"));
        assert_eq!(s.goal(&Role::ALL).as_deref(), Some("secret goal"));
    }

    #[test]
    fn times_and_status_come_from_the_visible_roles_only() {
        let early_task = env(
            Role::OrchestrationTask,
            "task.created",
            "2026-02-17T12:00:00.000Z",
            json!({"conversationId": "t1", "workSessionId": "ws_4"}),
        );
        let late_sub = env(
            Role::DelegationSubagent,
            "a2a.send",
            "2026-02-17T13:00:00.000Z",
            json!({"fromAgent": "lead", "toAgent": "w1", "conversationId": "t1", "workSessionId": "ws_4"}),
        );
        let s = fold(&[(early_task, raw(0, 1)), (late_sub, raw(0, 2))]).expect("session");
        let now = parse_time("2026-02-17T13:05:00Z").unwrap_or_default();
        let v = s
            .view(&ViewOptions {
                now,
                ..opts(&[Role::OrchestrationTask])
            })
            .expect("visible");
        assert_eq!(v.updated_at.as_deref(), Some("2026-02-17T12:00:00.000Z"));
        assert_eq!(v.status, Status::Quiet);
        assert_eq!(
            v.threads[0].last_time.as_deref(),
            Some("2026-02-17T12:00:00.000Z")
        );
        let v = s
            .view(&ViewOptions {
                now,
                ..opts(&Role::ALL)
            })
            .expect("visible");
        assert_eq!(v.updated_at.as_deref(), Some("2026-02-17T13:00:00.000Z"));
        assert_eq!(v.status, Status::Active);
    }

    #[test]
    fn usage_rolls_up_per_agent_and_model_within_the_visible_roles_with_cost_from_the_table() {
        let main = |ts: &str, from: &str, usage: Value| {
            env(
                Role::ConversationMain,
                "a2a.response",
                ts,
                json!({"fromAgent": from, "toAgent": "main", "conversationId": "c1",
                    "workSessionId": "ws_u", "turnId": ts, "model": "m1", "usage": usage}),
            )
        };
        let runtime = env(
            Role::SystemObservability,
            "run.finished",
            "2026-02-17T12:00:03.000Z",
            json!({"conversationId": "c1", "workSessionId": "ws_u",
                "result": {"model": "m2", "usage": {"prompt_tokens": 7, "completion_tokens": 3}}}),
        );
        let s = fold(&[
            (
                main(
                    "2026-02-17T12:00:00.000Z",
                    "ruda",
                    json!({"input_tokens": 100, "output_tokens": 10,
                    "cache_read_input_tokens": 40}),
                ),
                raw(0, 1),
            ),
            (
                main(
                    "2026-02-17T12:00:01.000Z",
                    "ruda",
                    json!({"inputTokens": 50, "outputTokens": 5}),
                ),
                raw(0, 2),
            ),
            // Applied twice (a redelivery): counted once.
            (
                main(
                    "2026-02-17T12:00:01.000Z",
                    "ruda",
                    json!({"inputTokens": 50, "outputTokens": 5}),
                ),
                raw(0, 2),
            ),
            (runtime, raw(1, 1)),
        ])
        .expect("session");
        let prices = crate::usage::Prices::new(&[crate::usage::Price {
            model: "m1".into(),
            input_per_mtok: 1_000_000.0,
            output_per_mtok: 2_000_000.0,
            cached_input_per_mtok: Some(0.0),
        }])
        .unwrap_or_default();
        let main_only = [Role::ConversationMain];
        let v = s
            .view(&ViewOptions {
                prices: &prices,
                ..opts(&main_only)
            })
            .expect("visible");
        assert_eq!(v.usage.len(), 1, "{:?}", v.usage);
        let u = &v.usage[0];
        assert_eq!(
            (
                u.agent.as_str(),
                u.model.as_str(),
                u.input_tokens,
                u.output_tokens
            ),
            ("ruda", "m1", 150, 15)
        );
        assert_eq!((u.cached_input_tokens, u.events), (40, 2));
        // 110 fresh input at 1 each, 40 cached at 0, 15 output at 2 each.
        assert_eq!(u.cost, Some(140.0));
        assert_eq!(
            (v.usage_total.cost, v.usage_total.unpriced_tokens),
            (140.0, 0)
        );
        // The runtime's usage is visible only to those who may see its role; m2 has no price.
        let all = s
            .view(&ViewOptions {
                prices: &prices,
                ..opts(&Role::ALL)
            })
            .expect("visible");
        assert_eq!(all.usage.len(), 2);
        let m2 = all.usage.iter().find(|u| u.model == "m2").expect("m2");
        assert_eq!(
            (m2.agent.as_str(), m2.input_tokens, m2.cost),
            ("unknown", 7, None)
        );
        assert_eq!(all.usage_total.unpriced_tokens, 10);
    }

    #[test]
    fn usage_keeps_a_bounded_number_of_agents_and_models() {
        let mut s = WorkSession::default();
        let events: Vec<Envelope> = (0..MAX_USAGE_AGENTS + 5)
            .map(|i| {
                env(
                    Role::ConversationMain,
                    "a2a.response",
                    "2026-02-17T12:00:00.000Z",
                    json!({"fromAgent": format!("a{i}"), "conversationId": "c", "workSessionId": "w",
                        "turnId": i, "usage": {"input_tokens": 1, "output_tokens": 1}}),
                )
            })
            .collect();
        for (i, e) in events.iter().enumerate() {
            let keys = keys(e);
            fold_into(&mut s, e, &keys, raw(0, i as u64 + 1));
        }
        let by_agent = &s.usage[&Role::ConversationMain];
        assert_eq!(by_agent.len(), MAX_USAGE_AGENTS + 1);
        assert_eq!(by_agent["other"]["unknown"].events, 5);
    }

    #[test]
    fn text_stored_without_its_role_is_not_shown() {
        let old = json!({"id": "ws_9", "name": "old name", "firstMessage": "old text", "goal": "old goal",
            "counts": {"orchestration.task": {"task.updated": 1}},
            "participants": {"a": {"id": "a", "kind": "human", "displayName": "Old", "roles": ["orchestration.task"]}}});
        let s: WorkSession = serde_json::from_value(old).unwrap_or_else(|e| panic!("{e}"));
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        let shown = serde_json::to_string(&v).unwrap_or_default();
        assert!(!shown.contains("old"), "{shown}");
        assert_eq!(s.goal(&Role::ALL), None);
    }

    #[test]
    fn views_are_confined_to_roles() {
        let mut obs = env(
            Role::SystemObservability,
            "a2a.response.suppressed",
            "2026-02-17T12:04:00.000Z",
            json!({"fromAgent": "eden", "conversationId": "c1", "workSessionId": "ws_1", "message": "late secret"}),
        );
        obs.agent_id = None;
        let s = fold(&[
            (send(0, "2026-02-17T12:00:00.000Z"), raw(1, 1)),
            (obs, raw(1, 2)),
        ])
        .expect("session");
        let main_only = s.view(&opts(&[Role::ConversationMain])).expect("visible");
        assert_eq!(main_only.event_count, 1);
        assert_eq!(
            main_only.last_message_preview.as_deref(),
            Some("please do 0")
        );
        assert!(!main_only
            .counts_by_type
            .contains_key("a2a.response.suppressed"));
        let obs_only = s
            .view(&opts(&[Role::SystemObservability]))
            .expect("visible");
        assert_eq!(obs_only.open_turns, 0);
        assert_eq!(obs_only.participants.len(), 1);
        assert!(s.view(&opts(&[Role::OrchestrationTask])).is_none());
        assert!(s.matches(&[Role::ConversationMain], &["a2a.send".into()]));
        assert!(!s.matches(&[Role::ConversationMain], &["a2a.complete".into()]));
    }

    #[test]
    fn status_from_last_event_time() {
        let q = Duration::from_secs(900);
        let a = Duration::from_secs(86400);
        let now = parse_time("2026-02-18T12:00:00Z").unwrap_or_default();
        let at = |s: &str| Status::at(Some(s), now, q, a);
        assert_eq!(at("2026-02-18T11:59:00Z"), Status::Active);
        assert_eq!(at("2026-02-18T11:40:00Z"), Status::Quiet);
        assert_eq!(at("2026-02-17T11:00:00Z"), Status::Archived);
        assert_eq!(at("2026-02-19T00:00:00Z"), Status::Active);
        assert_eq!(Status::at(None, now, q, a), Status::Active);
        assert_eq!(Status::parse("quiet"), Some(Status::Quiet));
        assert_eq!(Status::parse("idle"), None);
    }

    #[test]
    fn preview_is_at_most_200_characters() {
        let long = "ü".repeat(500);
        let e = env(
            Role::ConversationMain,
            "a2a.send",
            "2026-02-17T12:00:00.000Z",
            json!({"conversationId": "c9", "message": long}),
        );
        let s = apply(None, &e, 0, 1).expect("session");
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!(
            v.last_message_preview.map(|p| p.chars().count()),
            Some(PREVIEW_CHARS)
        );
    }

    #[test]
    fn stored_form_round_trips() {
        let mut e = send(0, "2026-02-17T12:00:00.000Z");
        e.timestamp = None;
        e.raw_event_ref = Some(RawEventRef {
            stream: "COLLAB_RAW".into(),
            seq: 1,
            subject: "collab.raw.c1.a2a.send".into(),
            stored_at: "2026-02-17T12:00:00.100Z".into(),
        });
        let s = apply(None, &e, 9, 1).expect("session");
        assert_eq!(s.created_at.as_deref(), Some("2026-02-17T12:00:00.100Z"));
        let text = serde_json::to_string(&s).unwrap_or_default();
        assert!(text.contains("\"workSessionId\":\"ws_1\""), "{text}");
        assert!(
            text.contains("\"applied\":{\"9\":{\"floor\":[1,0]}}"),
            "{text}"
        );
        let back: WorkSession = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, s);
    }

    fn in_conversation(mut e: Envelope, conv: &str) -> Envelope {
        e.conversation_id = Some(json!(conv));
        if let Some(p) = e.payload.as_mut().and_then(Value::as_object_mut) {
            p.insert("conversationId".into(), json!(conv));
        }
        e
    }

    #[test]
    fn a_long_session_stays_bounded_and_keeps_its_totals() {
        let mut s = WorkSession::default();
        let mut seq = 0u64;
        let mut next = || {
            seq += 1;
            raw(0, seq)
        };
        // The oldest conversation keeps an open turn all along: it is never retired.
        let first = in_conversation(send(0, "2026-02-17T11:00:00.000Z"), "c-open");
        fold_into(&mut s, &first, &keys(&first), next());
        let n = 2000u64;
        for i in 0..n {
            let conv = format!("c{i}");
            let at = format!("2026-02-17T12:{:02}:{:02}.000Z", i / 60 % 60, i % 60);
            let send = in_conversation(send(0, &at), &conv);
            let outcome = if i % 4 == 0 {
                json!({"outcome": "blocked", "reason": "timeout"})
            } else {
                json!({})
            };
            let reply = in_conversation(response(0, &at, outcome), &conv);
            fold_into(&mut s, &send, &keys(&send), next());
            fold_into(&mut s, &reply, &keys(&reply), next());
        }
        assert!(
            s.threads.len() <= MAX_THREADS + RETIRE_SLACK,
            "{} threads kept",
            s.threads.len()
        );
        assert!(
            s.threads.contains_key("c-open"),
            "a thread with an open turn was retired"
        );
        let bytes = serde_json::to_vec(&s)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        assert!(bytes < 200 * 1024, "session value is {bytes} bytes");

        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!(v.thread_count as u64, n + 1);
        assert_eq!(v.open_turns, 1);
        assert_eq!(v.blocked_turns, n / 4);
        assert_eq!(v.answered_turns, n - n / 4);
        assert_eq!(v.event_count, 2 * n + 1);
        // The newest threads are the ones listed.
        assert!(v
            .threads
            .iter()
            .any(|t| t.conversation_id == format!("c{}", n - 1)));
        // Retired threads count only for roles they held.
        assert!(s.view(&opts(&[Role::SystemObservability])).is_none());

        // The value survives a round trip through the store.
        let text = serde_json::to_string(&s).unwrap_or_default();
        let back: WorkSession = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, s);
    }

    #[test]
    fn a_second_response_for_a_decided_turn_changes_nothing_wherever_it_stands() {
        let s = fold(&[
            (send(0, "2026-02-17T12:00:00.000Z"), raw(3, 10)),
            (
                response(0, "2026-02-17T12:00:05.000Z", json!({})),
                raw(3, 11),
            ),
        ])
        .expect("a session");
        let late = response(
            0,
            "2026-02-17T12:09:00.000Z",
            json!({"outcome": "blocked", "reason": "timeout"}),
        );
        let mut again = s.clone();
        assert!(!fold_into(&mut again, &late, &keys(&late), raw(3, 40)));
        assert!(!fold_into(&mut again, &late, &keys(&late), raw(4, 1)));
        assert_eq!(again, s);
    }

    #[test]
    fn a_session_held_open_by_unanswered_turns_stays_bounded_and_still_counts_their_responses() {
        let mut s = WorkSession::default();
        let mut seq = 0u64;
        let mut next = || {
            seq += 1;
            raw(0, seq)
        };
        let at = |i: u64| {
            format!(
                "2026-02-17T{:02}:{:02}:{:02}.000Z",
                i / 3600,
                i / 60 % 60,
                i % 60
            )
        };
        // Every conversation opens a turn that no response closes (as when no contract answers).
        let n = 2000u64;
        for i in 0..n {
            let e = in_conversation(send(0, &at(i)), &format!("c{i}"));
            fold_into(&mut s, &e, &keys(&e), next());
        }
        assert!(s.threads.len() <= MAX_THREADS + RETIRE_SLACK);
        assert_eq!(s.dormant.len(), MAX_DORMANT);
        let bytes = serde_json::to_vec(&s)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        assert!(bytes < 300 * 1024, "session value is {bytes} bytes");
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        let kept = s.threads.len() as u64;
        // The oldest beyond the dormant bound are forgotten; every other open turn is counted.
        let forgotten = n - kept - MAX_DORMANT as u64;
        assert_eq!(v.thread_count as u64, n);
        assert_eq!(v.open_turns, n - forgotten);
        assert!(s.dormant.contains_key(&format!("c{forgotten}")));
        assert!(!s.dormant.contains_key(&format!("c{}", forgotten - 1)));

        // A response to a dormant conversation's turn is counted, with no new thread.
        let c = format!("c{}", forgotten + 10);
        let reply = in_conversation(response(0, &at(n), json!({})), &c);
        assert!(fold_into(&mut s, &reply, &keys(&reply), next()));
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!(v.thread_count as u64, n);
        assert_eq!((v.open_turns, v.answered_turns), (n - forgotten - 1, 1));
        assert!(!s.dormant.contains_key(&c) && !s.threads.contains_key(&c));
        // So is a blocked outcome.
        let c = format!("c{}", forgotten + 11);
        let blocked = json!({"outcome": "blocked", "reason": "timeout"});
        let reply = in_conversation(response(0, &at(n), blocked), &c);
        fold_into(&mut s, &reply, &keys(&reply), next());
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!((v.open_turns, v.blocked_turns), (n - forgotten - 2, 1));

        // Any other event takes its conversation back as a thread, counted once, turn still open.
        let c = format!("c{}", forgotten + 12);
        let again = in_conversation(send(1, &at(n + 1)), &c);
        fold_into(&mut s, &again, &keys(&again), next());
        let v = s.view(&opts(&Role::ALL)).expect("visible");
        assert_eq!(v.thread_count as u64, n);
        assert_eq!(v.open_turns, n - forgotten - 1);
        let t = v
            .threads
            .iter()
            .find(|t| t.conversation_id == c)
            .expect("listed again");
        assert_eq!(t.open_turns, 2);
        assert!(s.threads.len() <= MAX_THREADS + RETIRE_SLACK);

        // Woken by an event of another role, a conversation stays where a caller who may see
        // only conversation.main saw it.
        let c = format!("c{}", forgotten + 13);
        let before = s.view(&opts(&[Role::ConversationMain])).expect("visible");
        let mut other = env(
            Role::SystemObservability,
            "health.ping",
            &at(n + 2),
            json!({"conversationId": c, "workSessionId": "ws_1"}),
        );
        other.conversation_id = Some(json!(c));
        fold_into(&mut s, &other, &keys(&other), next());
        assert!(s.threads.contains_key(&c) && !s.dormant.contains_key(&c));
        let after = s.view(&opts(&[Role::ConversationMain])).expect("visible");
        assert_eq!(
            (after.thread_count, after.open_turns),
            (before.thread_count, before.open_turns)
        );

        // Turns are not shown to a caller who may not see conversation.main.
        let obs = s.view(&opts(&[Role::DelegationSubagent]));
        assert!(obs.is_none_or(|v| v.open_turns == 0));
    }

    /// The same rule written plainly: every thread copied and sorted.
    fn retire_threads_by_sorting(s: &mut WorkSession) {
        if s.threads.len() <= MAX_THREADS + RETIRE_SLACK {
            return;
        }
        let mut candidates: Vec<(bool, Option<String>, String)> = s
            .threads
            .iter()
            .map(|(id, t)| {
                let open = t.turns.values().any(|m| *m == TurnMark::Open);
                (open, t.last_time.clone(), id.clone())
            })
            .collect();
        candidates.sort();
        let excess = s.threads.len() - MAX_THREADS;
        for (_, _, id) in candidates.into_iter().take(excess) {
            let Some(t) = s.threads.remove(&id) else {
                continue;
            };
            let roles = role_mask(t.counts.keys());
            let r = s.retired.entry(roles).or_default();
            r.threads += 1;
            let mut d = Dormant {
                roles,
                last_time: t.last_time.clone(),
                ..Dormant::default()
            };
            for (turn, m) in &t.turns {
                match m {
                    TurnMark::Answered => r.answered_turns += 1,
                    TurnMark::Blocked => r.blocked_turns += 1,
                    TurnMark::Open => {
                        d.open.insert(turn.clone());
                    }
                }
            }
            if !d.open.is_empty() {
                s.dormant.insert(id, d);
            }
        }
    }

    fn session_of(threads: &[(Option<u8>, Vec<u8>, u8)]) -> WorkSession {
        let mut s = WorkSession::default();
        for (i, (last, marks, roles)) in threads.iter().enumerate() {
            let id = format!("c{i:04}");
            let turns = marks
                .iter()
                .enumerate()
                .map(|(k, m)| {
                    let mark = match m % 3 {
                        0 => TurnMark::Open,
                        1 => TurnMark::Answered,
                        _ => TurnMark::Blocked,
                    };
                    (format!("t{k}"), mark)
                })
                .collect();
            let counts = mask_roles(*roles).map(|r| (r, 1)).collect();
            // Few distinct times, so many threads share one and the id decides.
            let last_time = last.map(|t| format!("2026-02-17T12:00:{:02}.000Z", t % 8));
            s.threads.insert(
                id.clone(),
                Thread {
                    conversation_id: id,
                    last_time,
                    counts,
                    turns,
                    ..Thread::default()
                },
            );
        }
        s
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Selecting the threads to retire by reference retires exactly the threads a full
        /// sort picks, with the same totals and dormant entries; a session held above the
        /// bound by open turns comes down to it too.
        #[test]
        fn retiring_by_selection_retires_what_sorting_did(
            threads in proptest::collection::vec(
                (
                    proptest::option::weighted(0.9, 0u8..16),
                    proptest::collection::vec(0u8..3, 0..3),
                    0u8..16,
                ),
                250..420,
            ),
        ) {
            let mut fast = session_of(&threads);
            let mut sorted = fast.clone();
            retire_threads(&mut fast);
            retire_threads_by_sorting(&mut sorted);
            if threads.len() > MAX_THREADS + RETIRE_SLACK {
                proptest::prop_assert_eq!(fast.threads.len(), MAX_THREADS);
            }
            proptest::prop_assert_eq!(fast, sorted);
        }
    }
}
