//! Reading the projection stream and the work-session bucket for the API: always from JetStream
//! (ephemeral consumers with server-side subject filters), never from a worker's memory.
//!
//! "The newest N before a sequence" cannot be read backwards, so it is found by counting: an
//! ephemeral consumer created at a start sequence reports how many filtered messages lie at or
//! after it (`num_pending`). The start of the last N is found by galloping back and bisecting on
//! that count, then the range is read forwards. Counts are estimates when the stream grows
//! meanwhile; the read itself is exact, and the search continues further back whenever it found
//! fewer than it needed.

use super::error::ApiError;
use super::query::encode_cursor;
use crate::model::{Envelope, Role};
use async_nats::jetstream::{self, consumer, stream::Stream};
use bytes::Bytes;
use chrono::SecondsFormat;
use futures::{StreamExt, TryStreamExt};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;
use std::time::Duration;

/// How long one fetch of stored messages may go without a word from the server.
const FETCH_SILENCE: Duration = Duration::from_secs(10);

/// One stored message.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub seq: u64,
    pub subject: String,
    pub payload: Bytes,
    pub headers: Option<async_nats::HeaderMap>,
    /// Store time, RFC 3339.
    pub stored_at: String,
}

impl StoredEvent {
    pub fn from_message(m: &jetstream::Message) -> Option<StoredEvent> {
        let info = m.info().ok()?;
        Some(StoredEvent {
            seq: info.stream_sequence,
            subject: m.subject.to_string(),
            payload: m.payload.clone(),
            headers: m.headers.clone(),
            stored_at: info.published.to_rfc3339_opts(SecondsFormat::Millis, true),
        })
    }

    /// The API's item: cursor, sequence, subject facts and the envelope.
    /// `tag`: the cursor tag of the version whose stream it was read from.
    pub fn item(&self, prefix: &str, tag: u16) -> EventItem {
        let (role, key, event_type) = subject_parts(prefix, &self.subject);
        EventItem {
            cursor: encode_cursor(tag, self.seq),
            seq: self.seq,
            subject: self.subject.clone(),
            role: role.and_then(|r| r.parse().ok()),
            key,
            event_type,
            stored_at: self.stored_at.clone(),
            msg_id: self
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_string()),
            event: serde_json::from_slice(&self.payload).unwrap_or(Value::Null),
        }
    }
}

/// One projected event as `/api/events` lists it and `/api/events/stream` sends it (`data`).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct EventItem {
    /// Its cursor: pass it as `after`/`before`, or as `Last-Event-ID`.
    pub cursor: String,
    /// Its `COLLAB_PROJ` stream sequence.
    pub seq: u64,
    /// Its projection subject (`<prefix>.proj.<role>.<key>.<type>`).
    pub subject: String,
    /// Its role, from the subject.
    pub role: Option<Role>,
    /// Its ordering key token, from the subject.
    pub key: Option<String>,
    /// Its event type, from the subject.
    #[serde(rename = "type")]
    pub event_type: Option<String>,
    /// When the projection was stored (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub stored_at: String,
    /// The projection's unique id, its `Nats-Msg-Id` header: a NATS subscriber sees the same id
    /// on the live message, so a UI that merges a snapshot with a subscription drops the overlap
    /// by it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_id: Option<String>,
    /// The projected envelope.
    #[schemars(with = "Envelope")]
    pub event: Value,
}

/// `<prefix>.proj.<r1>.<r2>.<key>.<type...>` -> (role, key, type).
pub fn subject_parts(
    prefix: &str,
    subject: &str,
) -> (Option<String>, Option<String>, Option<String>) {
    let Some(rest) = subject
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix(".proj."))
    else {
        return (None, None, None);
    };
    match crate::config::proj_subject_parts(rest) {
        Some((role, key, ty)) => (
            Some(role.to_string()),
            Some(key.to_string()),
            Some(ty.to_string()),
        ),
        None => (None, None, None),
    }
}

/// The stream and its first and last sequence.
pub async fn bounds(js: &jetstream::Context, name: &str) -> Result<(Stream, u64, u64), ApiError> {
    let stream = js
        .get_stream(name)
        .await
        .map_err(|e| ApiError::unavailable("projection stream", e))?;
    let state = &stream.cached_info().state;
    let (first, last) = (state.first_sequence.max(1), state.last_sequence);
    Ok((stream, first, last))
}

fn consumer_config(
    filters: &[String],
    start: u64,
    policy: Option<consumer::DeliverPolicy>,
) -> consumer::pull::Config {
    let (filter_subject, filter_subjects) = match filters {
        [one] => (one.clone(), Vec::new()),
        many => (String::new(), many.to_vec()),
    };
    consumer::pull::Config {
        deliver_policy: policy.unwrap_or(consumer::DeliverPolicy::ByStartSequence {
            start_sequence: start.max(1),
        }),
        ack_policy: consumer::AckPolicy::None,
        filter_subject,
        filter_subjects,
        inactive_threshold: Duration::from_secs(10),
        memory_storage: true,
        num_replicas: 1,
        max_batch: 0,
        ..Default::default()
    }
}

async fn create(
    stream: &Stream,
    config: consumer::pull::Config,
) -> Result<consumer::Consumer<consumer::pull::Config>, ApiError> {
    stream
        .create_consumer(config)
        .await
        .map_err(|e| ApiError::unavailable("ephemeral consumer", e))
}

/// Delete an ephemeral consumer without waiting (it also expires by itself).
fn discard(stream: &Stream, c: &consumer::Consumer<consumer::pull::Config>) {
    let stream = stream.clone();
    let name = c.cached_info().name.clone();
    tokio::spawn(async move {
        let _ = stream.delete_consumer(&name).await;
    });
}

/// Filters read or counted one consumer each at most; more go to one consumer of them all.
const MAX_SPLIT: usize = 32;
/// Consumers of a split read or count asked for at once.
const AT_ONCE: usize = 8;

/// Filtered messages at or after `start` (through the current end of the stream). Filters that
/// no subject matches two of are counted one consumer each and summed: the server counts for a
/// consumer of several filters many times slower than for several consumers of one.
pub async fn count_from(stream: &Stream, filters: &[String], start: u64) -> Result<u64, ApiError> {
    if (2..=MAX_SPLIT).contains(&filters.len()) && pairwise_disjoint(filters) {
        let counts: Vec<u64> = futures::stream::iter(filters.to_vec())
            .map(|f| async move { count_one(stream, &[f], start).await })
            .buffer_unordered(AT_ONCE)
            .try_collect()
            .await?;
        return Ok(counts.iter().sum());
    }
    count_one(stream, filters, start).await
}

async fn count_one(stream: &Stream, filters: &[String], start: u64) -> Result<u64, ApiError> {
    let c = create(stream, consumer_config(filters, start, None)).await?;
    let n = c.cached_info().num_pending;
    discard(stream, &c);
    Ok(n)
}

/// Whether no subject matches two of `filters` (each pair has a position where both are
/// literal tokens that differ, or a different number of tokens and no `>`).
fn pairwise_disjoint(filters: &[String]) -> bool {
    let split: Vec<Vec<&str>> = filters.iter().map(|f| f.split('.').collect()).collect();
    split.iter().enumerate().all(|(i, a)| {
        split[i + 1..].iter().all(|b| {
            for (x, y) in a.iter().zip(b) {
                match (*x, *y) {
                    (">", _) | (_, ">") => return false,
                    ("*", _) | (_, "*") => {}
                    (x, y) if x != y => return true,
                    _ => {}
                }
            }
            a.len() != b.len()
        })
    })
}

/// Read every message a consumer delivers (at most `max`, and none after `until`).
async fn drain(
    stream: &Stream,
    config: consumer::pull::Config,
    until: u64,
    max: usize,
) -> Result<Vec<StoredEvent>, ApiError> {
    let c = create(stream, config).await?;
    let result = drain_consumer(&c, until, max).await;
    discard(stream, &c);
    result
}

async fn drain_consumer(
    c: &consumer::Consumer<consumer::pull::Config>,
    until: u64,
    max: usize,
) -> Result<Vec<StoredEvent>, ApiError> {
    let mut out = Vec::new();
    visit_consumer(c, until, max, |ev| {
        out.push(ev);
        true
    })
    .await?;
    Ok(out)
}

/// Hand every message a consumer delivers to `visit`, in order (none after `until`), holding
/// one fetched batch at a time, until `visit` has kept `max` (it returns whether it kept one).
async fn visit_consumer(
    c: &consumer::Consumer<consumer::pull::Config>,
    until: u64,
    max: usize,
    mut visit: impl FnMut(StoredEvent) -> bool,
) -> Result<(), ApiError> {
    let mut seen = 0usize;
    let mut pending = c.cached_info().num_pending;
    while pending > 0 && seen < max {
        let want = (max - seen)
            .min(512)
            .min(usize::try_from(pending).unwrap_or(512));
        let mut batch = c
            .fetch()
            .max_messages(want)
            .messages()
            .await
            .map_err(|e| ApiError::unavailable("fetch", e))?;
        let mut got = 0usize;
        // The fetch asks for what is stored already and is answered at once; a request lost
        // with a connection is never answered, and the client library has no timer on it.
        loop {
            let m = match tokio::time::timeout(FETCH_SILENCE, batch.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(_) => {
                    let silence = format!("no answer within {} s", FETCH_SILENCE.as_secs());
                    return Err(ApiError::unavailable("fetch", silence));
                }
            };
            let m = m.map_err(|e| ApiError::unavailable("fetch", e))?;
            got += 1;
            let Some(ev) = StoredEvent::from_message(&m) else {
                continue;
            };
            pending = m.info().map(|i| i.pending).unwrap_or(0);
            if ev.seq > until {
                pending = 0;
                break;
            }
            if visit(ev) {
                seen += 1;
            }
            if seen >= max {
                break;
            }
        }
        if got == 0 {
            break;
        }
    }
    Ok(())
}

/// Filtered messages with `from <= seq <= to`, oldest first, at most `max`.
pub async fn read_range(
    stream: &Stream,
    filters: &[String],
    from: u64,
    to: u64,
    max: usize,
) -> Result<Vec<StoredEvent>, ApiError> {
    if from > to || max == 0 {
        return Ok(Vec::new());
    }
    if let Some(merged) = one_filter_over_roles(filters) {
        return read_merged(stream, &merged, filters, from, to, max).await;
    }
    let groups = groups_over_roles(filters);
    if (2..=MAX_SPLIT).contains(&groups.len()) && pairwise_disjoint(&groups) {
        // Filters that differ in type (or key) as well as role: a consumer of one filter for
        // each, their messages put back in stream order.
        let reads: Vec<Vec<StoredEvent>> = futures::stream::iter(groups)
            .map(|g| async move { read_merged(stream, &g, filters, from, to, max).await })
            .buffer_unordered(AT_ONCE)
            .try_collect()
            .await?;
        let mut out: Vec<StoredEvent> = reads.into_iter().flatten().collect();
        out.sort_by_key(|e| e.seq);
        out.truncate(max);
        return Ok(out);
    }
    drain(stream, consumer_config(filters, from, None), to, max).await
}

/// Messages of `filter` with `from <= seq <= to` that one of `filters` selects, at most `max`.
async fn read_merged(
    stream: &Stream,
    filter: &str,
    filters: &[String],
    from: u64,
    to: u64,
    max: usize,
) -> Result<Vec<StoredEvent>, ApiError> {
    let c = create(stream, consumer_config(&[filter.to_string()], from, None)).await?;
    let mut out = Vec::new();
    let result = visit_consumer(&c, to, max, |ev| {
        let kept = filters.iter().any(|f| subject_matches(f, &ev.subject));
        if kept {
            out.push(ev);
        }
        kept
    })
    .await;
    discard(stream, &c);
    result.map(|()| out)
}

/// `filters` grouped by all but their role ([`one_filter_over_roles`] of each group, or the
/// filter itself when alone in it), in the order first seen.
fn groups_over_roles(filters: &[String]) -> Vec<String> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for f in filters {
        let tokens: Vec<&str> = f.split('.').collect();
        let role_at =
            (1..tokens.len()).find(|&i| tokens[i - 1] == "proj" && is_role_pair(&tokens, i));
        let shape = match role_at {
            Some(at) => tokens
                .iter()
                .enumerate()
                .map(|(i, t)| if i == at || i == at + 1 { "*" } else { t })
                .collect::<Vec<_>>()
                .join("."),
            None => f.clone(),
        };
        match groups.iter_mut().find(|(s, _)| *s == shape) {
            Some((_, members)) => members.push(f.clone()),
            None => groups.push((shape, vec![f.clone()])),
        }
    }
    groups
        .into_iter()
        .map(|(shape, members)| match members.as_slice() {
            [one] => one.clone(),
            _ => one_filter_over_roles(&members).unwrap_or(shape),
        })
        .collect()
}

/// One filter for `filters` that differ only in their role (the third and fourth tokens of
/// `<prefix>.proj.<role>.<key>.<type>`): the same subject with `*` for the role. The server
/// walks a consumer with several filters at many times the cost per stored message of one with
/// a single filter (a search over 50,000 events with every role's filter took 40-45 s, with one
/// role's 0.7 s), so a read over several roles asks for every role and drops the other roles'
/// messages itself ([`subject_matches`] against the filters asked for). At most the four roles'
/// messages are read. Filters that differ in key or type as well are not merged into one (they
/// are selective, and one filter over them could read far more): [`read_range`] reads them one
/// group per key and type ([`groups_over_roles`]) when no subject matches two groups.
fn one_filter_over_roles(filters: &[String]) -> Option<String> {
    let [first, rest @ ..] = filters else {
        return None;
    };
    if rest.is_empty() {
        return None;
    }
    let tokens: Vec<&str> = first.split('.').collect();
    let others: Vec<Vec<&str>> = rest.iter().map(|f| f.split('.').collect()).collect();
    if others.iter().any(|o| o.len() != tokens.len()) {
        return None;
    }
    // The role's two tokens are where the filters first differ (the prefix may have any number
    // of tokens); they must differ nowhere else, and be a role in every filter.
    let at = (0..tokens.len()).find(|&i| others.iter().any(|o| o[i] != tokens[i]))?;
    let role_at = if at > 0 && is_role_pair(&tokens, at - 1) {
        at - 1
    } else {
        at
    };
    let is_role = |t: &[&str]| is_role_pair(t, role_at);
    let differs_elsewhere = others.iter().any(|o| {
        o.iter()
            .zip(&tokens)
            .enumerate()
            .any(|(i, (a, b))| i != role_at && i != role_at + 1 && a != b)
    });
    if differs_elsewhere || !is_role(&tokens) || !others.iter().all(|o| is_role(o)) {
        return None;
    }
    Some(
        tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if i == role_at || i == role_at + 1 {
                    "*"
                } else {
                    t
                }
            })
            .collect::<Vec<_>>()
            .join("."),
    )
}

/// Whether `tokens[at]` and `tokens[at + 1]` name a role (`conversation` `main`, ...).
fn is_role_pair(tokens: &[&str], at: usize) -> bool {
    match (tokens.get(at), tokens.get(at + 1)) {
        (Some(a), Some(b)) => format!("{a}.{b}").parse::<Role>().is_ok(),
        _ => false,
    }
}

/// Whether `subject` is one a consumer filtered by `filter` receives (`*` one token, `>` one or
/// more to the end).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for f in filter.split('.') {
        match (f, subject.next()) {
            (">", Some(_)) => return true,
            (_, None) => return false,
            ("*", Some(_)) => {}
            (f, Some(t)) if f == t => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

/// The newest `limit` filtered messages with `first <= seq < before`, oldest first, and whether
/// older ones exist.
pub async fn newest_before(
    stream: &Stream,
    filters: &[String],
    before: u64,
    first: u64,
    limit: usize,
) -> Result<(Vec<StoredEvent>, bool), ApiError> {
    let mut chunks: Vec<Vec<StoredEvent>> = Vec::new();
    let mut have = 0usize;
    let mut hi = before;
    while have < limit && hi > first {
        let need = limit - have;
        let lo = start_of_last(stream, filters, first, hi, need).await?;
        let mut got = read_range(stream, filters, lo, hi - 1, usize::MAX).await?;
        let surplus = got.len().saturating_sub(need);
        let older_in_window = surplus > 0;
        got.drain(..surplus);
        have += got.len();
        chunks.push(got);
        if older_in_window {
            return Ok((flatten(chunks), true));
        }
        if lo <= first {
            return Ok((flatten(chunks), false));
        }
        hi = lo;
    }
    // Full: there is more only if anything matches below the window read last.
    let more = hi > first && count_below(stream, filters, first, hi).await? > 0;
    Ok((flatten(chunks), more))
}

fn flatten(mut chunks: Vec<Vec<StoredEvent>>) -> Vec<StoredEvent> {
    chunks.reverse();
    chunks.into_iter().flatten().collect()
}

async fn count_below(
    stream: &Stream,
    filters: &[String],
    first: u64,
    hi: u64,
) -> Result<u64, ApiError> {
    let all = count_from(stream, filters, first).await?;
    let above = count_from(stream, filters, hi).await?;
    Ok(all.saturating_sub(above))
}

/// A start sequence `lo` in `[first, hi)` with about `need` (at least `need`, unless `lo ==
/// first`) filtered messages in `[lo, hi)`.
async fn start_of_last(
    stream: &Stream,
    filters: &[String],
    first: u64,
    hi: u64,
    need: usize,
) -> Result<u64, ApiError> {
    let need = need as u64;
    // Small ranges are read whole.
    if hi - first <= need * 4 + 64 {
        return Ok(first);
    }
    let base = count_from(stream, filters, hi).await?;
    let within = |c: u64| c.saturating_sub(base);
    // Gallop back until the window holds enough.
    let mut step = (need * 2).max(64);
    let mut inner = hi; // holds fewer than `need`
    let mut lo;
    loop {
        lo = hi.saturating_sub(step).max(first);
        let c = within(count_from(stream, filters, lo).await?);
        if c <= need * 2 + 16 && c >= need {
            return Ok(lo);
        }
        if c >= need || lo == first {
            if c < need {
                return Ok(first);
            }
            break;
        }
        inner = lo;
        step = step.saturating_mul(4);
    }
    // Bisect [lo, inner): count(lo) >= need, count(inner) < need.
    let mut outer = lo;
    while inner - outer > 1 {
        let mid = outer + (inner - outer) / 2;
        let c = within(count_from(stream, filters, mid).await?);
        if c >= need {
            outer = mid;
            if c <= need * 2 + 16 {
                break;
            }
        } else {
            inner = mid;
        }
    }
    Ok(outer)
}

/// Hand the latest value of every session key (`$KV.<bucket>.*`; aliases have two tokens and
/// are left out) to `visit`, skipping deleted ones, one fetched batch in memory at a time (the
/// bucket may be far larger than a request should hold).
pub async fn each_session(
    js: &jetstream::Context,
    bucket: &str,
    mut visit: impl FnMut(Bytes),
) -> Result<(), ApiError> {
    let stream = js
        .get_stream(format!("KV_{bucket}"))
        .await
        .map_err(|e| ApiError::unavailable("work-session bucket", e))?;
    let config = consumer_config(
        &[format!("$KV.{bucket}.*")],
        1,
        Some(consumer::DeliverPolicy::LastPerSubject),
    );
    let c = create(&stream, config).await?;
    let result = visit_consumer(&c, u64::MAX, usize::MAX, |e| {
        let op = e
            .headers
            .as_ref()
            .and_then(|h| h.get("KV-Operation"))
            .map(|v| v.as_str().to_string());
        if !matches!(op.as_deref(), Some("DEL" | "PURGE")) {
            visit(e.payload);
        }
        true
    })
    .await;
    discard(&stream, &c);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_that_differ_in_type_too_are_read_one_group_per_type_and_counted_apart() {
        let prefix = "collab.proj";
        let mut filters = Vec::new();
        for role in ["conversation.main", "orchestration.task"] {
            for ty in ["a2a.send", "run.started"] {
                filters.push(format!("{prefix}.{role}.*.{ty}"));
            }
        }
        assert_eq!(one_filter_over_roles(&filters), None);
        assert_eq!(
            groups_over_roles(&filters),
            [
                "collab.proj.*.*.*.a2a.send",
                "collab.proj.*.*.*.run.started"
            ]
        );
        assert!(pairwise_disjoint(&filters));
        assert!(pairwise_disjoint(&groups_over_roles(&filters)));
        // One role alone keeps its own filter.
        let one = vec![
            "collab.proj.conversation.main.*.a2a.send".to_string(),
            "collab.proj.conversation.main.*.run.started".to_string(),
        ];
        assert_eq!(groups_over_roles(&one), one);
        // Filters a subject can match two of are not disjoint, so they are never summed.
        for (a, b) in [
            (
                "collab.proj.conversation.main.>",
                "collab.proj.*.*.c1.a2a.send",
            ),
            (
                "collab.proj.conversation.main.*.a2a.send",
                "collab.proj.*.main.c1.*.send",
            ),
            (
                "collab.proj.conversation.main.c1",
                "collab.proj.conversation.main.c1",
            ),
        ] {
            assert!(
                !pairwise_disjoint(&[a.to_string(), b.to_string()]),
                "{a} {b}"
            );
        }
        assert!(pairwise_disjoint(&[
            "collab.proj.conversation.main.c1.a2a.send".to_string(),
            "collab.proj.conversation.main.c1.a2a".to_string(),
        ]));
    }

    #[test]
    fn filters_over_several_roles_read_as_one_and_keep_only_their_own() {
        let roles = [
            "collab.proj.conversation.main.>",
            "collab.proj.orchestration.task.>",
        ]
        .map(String::from);
        let merged = one_filter_over_roles(&roles);
        assert_eq!(merged.as_deref(), Some("collab.proj.*.*.>"));
        // The merged filter reaches no fence claim (two tokens after `proj`).
        assert!(!subject_matches(
            "collab.proj.*.*.>",
            "collab.proj._fence.3"
        ));
        for (subject, kept) in [
            ("collab.proj.conversation.main.c1.a2a.send", true),
            ("collab.proj.orchestration.task.t1.task.created", true),
            (
                "collab.proj.system.observability.c1.a2a.response.suppressed",
                false,
            ),
            ("collab.proj.delegation.subagent.d1.a2a.send", false),
        ] {
            assert!(subject_matches("collab.proj.*.*.>", subject), "{subject}");
            assert_eq!(
                roles.iter().any(|f| subject_matches(f, subject)),
                kept,
                "{subject}"
            );
        }
        let typed = [
            "collab.proj.conversation.main.*.a2a.response",
            "collab.proj.system.observability.*.a2a.response",
        ]
        .map(String::from);
        assert_eq!(
            one_filter_over_roles(&typed).as_deref(),
            Some("collab.proj.*.*.*.a2a.response")
        );
        assert_eq!(one_filter_over_roles(&roles[..1]), None);
        assert_eq!(one_filter_over_roles(&[]), None);
        for (pair, merged) in [
            // Filters that differ in key stay as they are, also across roles.
            (
                [
                    "collab.proj.conversation.main.a.>",
                    "collab.proj.conversation.main.b.>",
                ],
                None,
            ),
            (
                [
                    "collab.proj.conversation.main.a.>",
                    "collab.proj.delegation.subagent.b.>",
                ],
                None,
            ),
            // A prefix of several tokens (a projection version's) moves the role, not the rule.
            (
                [
                    "collab.v.v2.proj.conversation.main.*.>",
                    "collab.v.v2.proj.delegation.subagent.*.>",
                ],
                Some("collab.v.v2.proj.*.*.*.>"),
            ),
        ] {
            let filters = pair.map(String::from);
            assert_eq!(
                one_filter_over_roles(&filters).as_deref(),
                merged,
                "{pair:?}"
            );
        }
        // The matcher: `*` one token, `>` at least one, literals exactly.
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.c.d"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.b", "a.c"));
    }

    #[test]
    fn subjects_split_into_role_key_type() {
        assert_eq!(
            subject_parts(
                "collab",
                "collab.proj.conversation.main.conv-1.a2a.response"
            ),
            (
                Some("conversation.main".into()),
                Some("conv-1".into()),
                Some("a2a.response".into())
            )
        );
        assert_eq!(subject_parts("collab", "other.proj.x"), (None, None, None));
    }
}
