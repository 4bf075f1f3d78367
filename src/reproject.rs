//! `reproject`: recompute past traffic under the current settings into a projection version
//! beside the deployment's own, then say what differs.
//!
//! A version (`nats.version`, e.g. `v2`) is a second set of workers over the same raw stream:
//! its consumers, turn state, leases, projections and dead letters live under `<prefix>_v2`
//! (docs/operations.md, "Reprojection"). Turn decisions are made in event time (the raw store
//! time against the recorded deadline), so a version run with unchanged settings publishes
//! byte for byte what the deployment published; with changed rules, the comparison below names
//! exactly what they change.
//!
//! This module holds the comparison, which is pure; [`run`] drives a version's workers over a
//! range of the raw stream and reads both sides back.

use crate::config::{Names, Settings};
use crate::pipeline::H_SOURCE_SEQ;
use async_nats::jetstream;
use serde::Serialize;
use sha2::Digest;
use std::collections::{BTreeMap, BTreeSet};

/// One output (a projection or a dead letter) as the comparison sees it: what identifies its
/// content, not the content itself, so a comparison over millions of outputs stays small.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The subject after the version's prefix: `proj.<role>.<key>.<type>` or `dlq.<reason>`.
    pub subject: String,
    /// SHA-256 of the payload.
    pub payload_sha: [u8; 32],
    /// The raw sequence it was made for (`Collab-Source-Seq`).
    pub source_seq: Option<u64>,
    /// Where it is stored in its stream, to read the payload back for an example.
    pub stream_seq: u64,
    /// A `conversation.main` response's turn id and outcome.
    pub turn: Option<(String, String)>,
}

impl Output {
    /// The output on `subject` (after the prefix) with `payload`.
    pub fn new(subject: &str, payload: &[u8], source_seq: Option<u64>, stream_seq: u64) -> Output {
        let mut o = Output {
            subject: subject.to_string(),
            payload_sha: sha2::Sha256::digest(payload).into(),
            source_seq,
            stream_seq,
            turn: None,
        };
        if o.parts()
            .is_some_and(|(role, _, ty)| role == "conversation.main" && ty == "a2a.response")
        {
            o.turn = turn_outcome(payload);
        }
        o
    }

    /// `(role, key, type)` of a projection; `None` for a dead letter.
    fn parts(&self) -> Option<(&str, &str, &str)> {
        crate::config::proj_subject_parts(self.subject.strip_prefix("proj.")?)
    }
}

/// Outputs by their `Nats-Msg-Id`, which names the raw sequence (or the turn) they stand for
/// and is the same in every version.
pub type Outputs = BTreeMap<String, Output>;

/// What one output's difference is, most significant first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    /// Published by the deployment, not by the version.
    OnlyLive,
    /// Published by the version, not by the deployment.
    OnlyVersion,
    /// A projection on one side, a dead letter on the other.
    Kind,
    Role,
    Type,
    /// Same role and type, another key.
    Subject,
    /// Same subject, other bytes.
    Payload,
}

/// One changed output, for the examples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Change {
    pub msg_id: String,
    pub kind: ChangeKind,
    pub live: Option<String>,
    pub version: Option<String>,
    /// For a payload change: the JSON paths whose values differ (at most a few), with both
    /// values; filled in by [`run`] from the stored payloads.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
    /// Where the two sides are stored (stream sequences), to read them back.
    #[serde(skip)]
    pub stored: (Option<u64>, Option<u64>),
}

/// Paths (`payload.evidence`, `tags[2]`) where two JSON values differ, at most `max`.
fn json_differences(a: &serde_json::Value, b: &serde_json::Value, max: usize) -> Vec<String> {
    use serde_json::Value;
    fn walk(a: &Value, b: &Value, path: &str, out: &mut Vec<String>, max: usize) {
        if out.len() >= max || a == b {
            return;
        }
        let join = |k: &str| {
            if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            }
        };
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    match (x.get(k), y.get(k)) {
                        (Some(p), Some(q)) => walk(p, q, &join(k), out, max),
                        (Some(_), None) => out.push(format!("{}: only before", join(k))),
                        _ => out.push(format!("{}: only after", join(k))),
                    }
                    if out.len() >= max {
                        return;
                    }
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(p, q, &format!("{path}[{i}]"), out, max);
                }
            }
            _ => {
                let shown = |v: &Value| {
                    let t = v.to_string();
                    match t.char_indices().nth(60) {
                        Some((i, _)) => format!("{}...", &t[..i]),
                        None => t,
                    }
                };
                let at = if path.is_empty() { "(whole)" } else { path };
                out.push(format!("{at}: {} -> {}", shown(a), shown(b)));
            }
        }
    }
    let mut out = Vec::new();
    walk(a, b, "", &mut out, max);
    out
}

/// The differing fields of two payloads, when both are JSON.
pub fn payload_fields(live: &[u8], version: &[u8]) -> Vec<String> {
    match (
        serde_json::from_slice::<serde_json::Value>(live),
        serde_json::from_slice::<serde_json::Value>(version),
    ) {
        (Ok(a), Ok(b)) => json_differences(&a, &b, 5),
        _ => Vec::new(),
    }
}

/// A turn whose response differs: `outcome` is `replied`, `blocked:<reason>` or `none`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnChange {
    pub key: String,
    pub turn: String,
    pub live: String,
    pub version: String,
}

/// The comparison of a version with the deployment over one range of raw sequences.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Diff {
    pub from: u64,
    pub to: u64,
    pub live_outputs: usize,
    pub version_outputs: usize,
    /// SHA-256 over every output of the range (Msg-Id, subject after the prefix, payload), in
    /// Msg-Id order: equal digests, equal projections.
    pub live_digest: String,
    pub version_digest: String,
    pub identical: usize,
    pub changed: BTreeMap<String, usize>,
    pub examples: Vec<Change>,
    pub turns: Vec<TurnChange>,
    /// The deployment had not processed the whole range when it was compared (its workers are
    /// stopped or far behind): outputs only in the version may be ones it has yet to publish.
    pub live_behind: bool,
}

impl Diff {
    pub fn same(&self) -> bool {
        self.live_digest == self.version_digest
    }
}

/// Add `m` (read back from a projection or dead-letter stream under `prefix`) to `outputs` when
/// it is an output whose raw sequence is in `from..=to`. Outputs that name no raw sequence are
/// kept; fence markers are not outputs.
pub fn add(outputs: &mut Outputs, m: &jetstream::Message, prefix: &str, from: u64, to: u64) {
    let subject = m.subject.as_str();
    if crate::bus::publish::is_fence_subject(subject) {
        return;
    }
    let Some(rest) = subject
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('.'))
    else {
        return;
    };
    let header = |name: &str| {
        m.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_string())
    };
    let source_seq = header(H_SOURCE_SEQ).and_then(|s| s.parse().ok());
    if source_seq.is_some_and(|s: u64| s < from || s > to) {
        return;
    }
    let Some(id) = header("Nats-Msg-Id") else {
        return;
    };
    let stream_seq = m.info().map_or(0, |i| i.stream_sequence);
    outputs.insert(id, Output::new(rest, &m.payload, source_seq, stream_seq));
}

/// SHA-256 (hex) over `outputs` in Msg-Id order: each one's Msg-Id, subject and payload digest.
pub fn digest(outputs: &Outputs) -> String {
    let mut h = sha2::Sha256::new();
    for (id, o) in outputs {
        for part in [id.as_bytes(), o.subject.as_bytes(), &o.payload_sha] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
    }
    hex::encode(h.finalize())
}

fn classify(live: &Output, version: &Output) -> Option<ChangeKind> {
    match (live.parts(), version.parts()) {
        _ if live.subject == version.subject && live.payload_sha == version.payload_sha => None,
        (Some(_), None) | (None, Some(_)) => Some(ChangeKind::Kind),
        (Some((lr, lk, lt)), Some((vr, vk, vt))) => Some(if lr != vr {
            ChangeKind::Role
        } else if lt != vt {
            ChangeKind::Type
        } else if lk != vk {
            ChangeKind::Subject
        } else {
            ChangeKind::Payload
        }),
        (None, None) => Some(if live.subject == version.subject {
            ChangeKind::Payload
        } else {
            ChangeKind::Subject
        }),
    }
}

fn kind_name(k: ChangeKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// A response's turn id and outcome (`replied` or `blocked:<reason>`), from its envelope.
fn turn_outcome(payload: &[u8]) -> Option<(String, String)> {
    let env = serde_json::from_slice::<serde_json::Value>(payload).ok()?;
    let turn = match env.get("turnId")? {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let body = env.get("payload");
    let outcome = match body.and_then(|p| p.get("outcome")).and_then(|o| o.as_str()) {
        Some("blocked") => format!(
            "blocked:{}",
            body.and_then(|p| p.get("reason"))
                .and_then(|r| r.as_str())
                .unwrap_or("?")
        ),
        _ => "replied".to_string(),
    };
    Some((turn, outcome))
}

/// Each turn's response outcomes, by (conversation key, turn id).
fn turn_outcomes(outputs: &Outputs) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut turns: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for o in outputs.values() {
        let (Some((_, key, _)), Some((turn, outcome))) = (o.parts(), &o.turn) else {
            continue;
        };
        turns
            .entry((key.to_string(), turn.clone()))
            .or_default()
            .insert(outcome.clone());
    }
    turns
}

/// Compare the deployment's outputs with a version's over `from..=to`, keeping at most
/// `examples` examples of each kind of change.
pub fn diff(live: &Outputs, version: &Outputs, from: u64, to: u64, examples: usize) -> Diff {
    let mut d = Diff {
        from,
        to,
        live_outputs: live.len(),
        version_outputs: version.len(),
        live_digest: digest(live),
        version_digest: digest(version),
        ..Diff::default()
    };
    let mut shown: BTreeMap<ChangeKind, usize> = BTreeMap::new();
    let ids: BTreeSet<&String> = live.keys().chain(version.keys()).collect();
    for id in ids {
        let (l, v) = (live.get(id), version.get(id));
        let kind = match (l, v) {
            (Some(l), Some(v)) => classify(l, v),
            (Some(_), None) => Some(ChangeKind::OnlyLive),
            (None, Some(_)) => Some(ChangeKind::OnlyVersion),
            (None, None) => None,
        };
        let Some(kind) = kind else {
            d.identical += 1;
            continue;
        };
        *d.changed.entry(kind_name(kind)).or_default() += 1;
        let n = shown.entry(kind).or_default();
        if *n < examples {
            *n += 1;
            d.examples.push(Change {
                msg_id: id.clone(),
                kind,
                live: l.map(|o| o.subject.clone()),
                version: v.map(|o| o.subject.clone()),
                fields: Vec::new(),
                stored: (l.map(|o| o.stream_seq), v.map(|o| o.stream_seq)),
            });
        }
    }
    let (lt, vt) = (turn_outcomes(live), turn_outcomes(version));
    let keys: BTreeSet<&(String, String)> = lt.keys().chain(vt.keys()).collect();
    let show = |s: Option<&BTreeSet<String>>| {
        s.map_or("none".to_string(), |s| {
            s.iter().cloned().collect::<Vec<_>>().join("+")
        })
    };
    for k in keys {
        let (l, v) = (lt.get(k), vt.get(k));
        if l != v {
            d.turns.push(TurnChange {
                key: k.0.clone(),
                turn: k.1.clone(),
                live: show(l),
                version: show(v),
            });
        }
    }
    d
}

/// The report `reproject` prints: counts, digests, examples and the turns that change.
pub fn render(d: &Diff, live: &Names, version: &Names) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let range = if d.to == u64::MAX {
        format!("all of raw streams {}", live.raw_streams.join(", "))
    } else {
        format!("raw sequences {}..={}", d.from, d.to)
    };
    let _ = writeln!(
        s,
        "{range}: {} outputs in {} ({}), {} in {} ({})",
        d.live_outputs,
        live.proj_stream,
        live.prefix,
        d.version_outputs,
        version.proj_stream,
        version.prefix
    );
    if d.live_behind {
        let _ = writeln!(
            s,
            "note: {} had not processed the whole range when compared (its workers stopped, or far behind); outputs only in {} may be ones it has yet to publish",
            live.prefix, version.prefix
        );
    }
    let _ = writeln!(s, "digest {}: {}", live.prefix, d.live_digest);
    let _ = writeln!(s, "digest {}: {}", version.prefix, d.version_digest);
    if d.same() {
        let _ = writeln!(s, "identical: every output is the same, byte for byte");
        return s;
    }
    let _ = writeln!(s, "identical outputs: {}", d.identical);
    for (kind, n) in &d.changed {
        let _ = writeln!(s, "changed ({kind}): {n}");
    }
    if !d.examples.is_empty() {
        let _ = writeln!(s, "examples:");
        for c in &d.examples {
            let _ = writeln!(
                s,
                "  {} {}: {} -> {}",
                kind_name(c.kind),
                c.msg_id,
                c.live.as_deref().unwrap_or("-"),
                c.version.as_deref().unwrap_or("-")
            );
            if !c.fields.is_empty() {
                for f in &c.fields {
                    let _ = writeln!(s, "    {f}");
                }
            }
        }
    }
    let _ = writeln!(s, "turns whose response changes: {}", d.turns.len());
    for t in &d.turns {
        let _ = writeln!(
            s,
            "  {} turn {}: {} -> {}",
            t.key, t.turn, t.live, t.version
        );
    }
    s
}

/// Where a run of [`run`] is, for a progress display.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Raw sequences of the range the version has finished (every partition counted up to
    /// where it stands).
    pub done: u64,
    pub total: u64,
}

#[cfg(test)]
mod tests;

mod drive;
pub use drive::*;

/// The names of the deployment a version is compared with.
pub fn live_names(s: &Settings) -> Names {
    let mut n = Names::new(&s.nats.prefix);
    n.set_raw_sets(s.nats.shards, s.nats.raw_base, &s.nats.earlier);
    n
}
