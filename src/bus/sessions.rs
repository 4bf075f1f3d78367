//! The work-session writer: folds stored projections into the work-session KV bucket.
//!
//! [`run_fold`] reads the projection stream in order (off the projection path: no partition waits
//! for it) and hands each round to [`SessionWriter::commit`]. One committer task per worker takes
//! every group that arrived while the previous round was being written, merges them by session,
//! applies each session's events with `sessions::fold_into` and writes each session
//! once, with compare-and-set, all sessions of a round concurrently. A hot session that
//! every partition touches therefore costs one write per round, not one per group. The committer
//! keeps the sessions it wrote, decoded, with their revision, and re-reads one only on a revision
//! conflict (another worker wrote it). Applying is idempotent, so a redelivered group, or a
//! retried round, changes nothing twice.
//!
//! Keys: a session is stored under `encode_id(session id)`. Events that name a conversation but no
//! work session (a synthesised blocked response, for example) are resolved through an alias entry
//! `alias.<encode_id(conversation id)>`, written when an event names both. A turn's send is stored in
//! the projection stream before its response, so the alias exists before such an event comes.
//! An alias records where in the projection stream it moved (see [`Alias`]), so a round folded
//! again routes each event as the alias stood at that event, whatever a failed attempt of the
//! round wrote, and a fold that another has overtaken cannot set an alias back.

use super::error::{NoAnswer, Source};
use super::reconnects::Reconnects;
use crate::config::Names;
use crate::model::{encode_id, Envelope};
use crate::sessions::{self, SessionKeys, WorkSession};
pub use crate::sessions::{Identity, Position};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use lru::LruCache;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

/// Largest session value written; a session that would grow beyond it stops being updated (it
/// would exceed the server's message size) and a warning is logged.
pub const MAX_SESSION_BYTES: usize = 900 * 1024;
/// The retry schedule of work-session and alias reads and writes.
const STORE_RETRY_MIN: Duration = Duration::from_millis(20);
const STORE_RETRY_MAX: Duration = Duration::from_millis(500);
/// Attempts per session write or alias read and write (conflicts and transient errors) before a
/// round gives up.
const MAX_ATTEMPTS: u32 = 50;
/// Conversations whose alias (or its absence) is remembered in memory, the most recently used
/// kept, to skip rewriting and rereading them. An event that names a conversation and its work
/// session after the writer forgot the conversation costs a refused write, a read and a write
/// (the alias moved by this round, to where it was): a turn's blocked outcome comes its timeout
/// after the send, and as many conversations may start meanwhile (about 10 s of 10,000 new
/// conversations a second fit). It grows as conversations come (nothing allocated up front),
/// to about 32 MiB when full (131,072 aliases of one move each).
const ALIAS_CACHE: NonZeroUsize = capacity(131_072);
/// Decoded sessions the committer keeps between rounds, the most recently written kept: a session
/// it no longer keeps is read before its next write.
const SESSION_CACHE: NonZeroUsize = capacity(4096);
/// The stored size of the sessions the committer keeps, at most, all together: past it the least
/// recently written are let go (read again before their next write), so large sessions bound
/// the committer's memory by bytes as well as by count.
const SESSION_CACHE_BYTES: usize = 128 * 1024 * 1024;
/// Session ids the committer remembers having read or written (beyond the decoded ones it
/// keeps), the most recently met kept: a session it has never met is written as new without a
/// read first, and one it has met but no longer keeps is read first (one it has forgotten costs
/// a refused write before the read).
const SEEN_SESSIONS: NonZeroUsize = capacity(65_536);
/// A memory's capacity as the `lru` crate takes it (at least one: the crate denies `unwrap`).
const fn capacity(n: usize) -> NonZeroUsize {
    match NonZeroUsize::new(n) {
        Some(n) => n,
        None => NonZeroUsize::MIN,
    }
}
/// Sessions written at once in a round.
const CONCURRENT_WRITES: usize = 32;
/// Conversation aliases read, or written, at once in a round.
const CONCURRENT_ALIASES: usize = 64;
/// Rounds start at most this often: groups arriving meanwhile wait and share the round, so a hot
/// session is written (and serialised) a few dozen times a second at most. Only the
/// acknowledgement of an input waits; its projections are already stored.
const ROUND_INTERVAL: Duration = Duration::from_millis(20);
/// Session bytes serialised and written per second, at most: after a round that wrote B bytes
/// the next waits B / this (up to [`MAX_ROUND_INTERVAL`]), so large sessions cost a bounded
/// share of the worker's and the server's CPU instead of one rewrite per round each.
const WRITE_BUDGET_BYTES_PER_S: f64 = 64.0 * 1024.0 * 1024.0;
const MAX_ROUND_INTERVAL: Duration = Duration::from_secs(1);
/// The longest one session's write (reads and retries included) may hold a round.
const SESSION_WRITE_LIMIT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("work-session bucket {bucket}: {source}")]
    Open {
        bucket: String,
        #[source]
        source: jetstream::context::KeyValueError,
    },
    #[error("work session {key}: {source}")]
    Kv {
        key: String,
        #[source]
        source: Source,
    },
    /// A round of writes in which one session could not be stored: every request of the round
    /// is answered with it.
    #[error("a work-session round failed: {0}")]
    Round(#[source] Arc<SessionError>),
    #[error("the work-session committer stopped")]
    Stopped,
    /// An alias written by a round that started after this one's start: another worker's fold
    /// has gone past this one, which must start again from the checkpoint.
    #[error("conversation alias {key} was written by a later round (from projection {from}, this round from {round}): another fold is ahead of this one")]
    Overtaken { key: String, from: u64, round: u64 },
}

/// The KV key of a session.
pub fn session_key(id: &str) -> String {
    encode_id(id)
}

/// The KV key of a conversation's alias to its work session (an [`Alias`]).
pub fn alias_key(conversation_id: &str) -> String {
    format!("alias.{}", encode_id(conversation_id))
}

/// Where versions before positioned aliases kept a conversation's alias: the session id alone.
/// Read when a conversation has no [`alias_key`] yet, never written; a version that knows only
/// these keys keeps reading them, so a rollback finds valid (if older) aliases.
pub fn legacy_alias_key(conversation_id: &str) -> String {
    format!("conv.{}", encode_id(conversation_id))
}

/// Events to fold, by session id, in processing order. Envelopes are boxed: a round moves each
/// event a few times (into its group, into the round's merge), and an envelope is over a
/// kilobyte.
/// A round's events by session, each with the keys it was routed by (read once per event).
type Groups = BTreeMap<String, Vec<(Box<Envelope>, SessionKeys, Identity)>>;

struct Request {
    groups: Groups,
    done: oneshot::Sender<Result<(), SessionError>>,
}

/// A conversation's alias as stored under [`alias_key`], written by the round that starts at
/// projection `from`: the alias that round found (`before`) and where in the round it moved
/// (the projection that moved it, and the session it moved to, in order). So anyone folding
/// from `from` on reads the alias as it stood at the event in hand: a round folded again after
/// a failure that came after its aliases were written, or with fewer projections, routes each
/// event as the first attempt did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Alias {
    from: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    before: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    moves: Vec<(u64, String)>,
}

/// Moves one alias records at most: past them a round records the ones it made first and its
/// last one (the alias it leaves). Only an event inside a round that then fails, read again by a
/// round that starts among the dropped moves, could be routed by an outdated one.
const MAX_ALIAS_MOVES: usize = 256;

/// `moves` bounded to [`MAX_ALIAS_MOVES`]: the first ones, and always the last.
fn bounded_moves(mut moves: Vec<(u64, String)>) -> Vec<(u64, String)> {
    if moves.len() > MAX_ALIAS_MOVES {
        let last = moves.swap_remove(moves.len() - 1);
        moves.truncate(MAX_ALIAS_MOVES - 1);
        moves.push(last);
    }
    moves
}

impl Alias {
    /// An alias of a version that stored the session id alone ([`legacy_alias_key`]): it holds
    /// from the stream's start.
    fn legacy(bytes: &[u8]) -> Alias {
        Alias {
            from: 0,
            before: Some(String::from_utf8_lossy(bytes).into_owned()),
            moves: Vec::new(),
        }
    }

    /// The alias as it stood just before projection `at`; `None` when `at` is before the round
    /// that wrote it, which a fold overtaken by another reads.
    fn as_at(&self, at: u64) -> Option<Option<&str>> {
        if at < self.from {
            return None;
        }
        let moved = self.moves.iter().rev().find(|(seq, _)| *seq < at);
        Some(moved.map(|(_, ws)| ws.as_str()).or(self.before.as_deref()))
    }

    /// The alias it leaves: its last move, else what its round found.
    fn last(&self) -> Option<&str> {
        self.moves
            .last()
            .map(|(_, ws)| ws.as_str())
            .or(self.before.as_deref())
    }

    /// [`Self::as_at`] for a round of `mode`, of the alias stored at `revision`: a round that
    /// knows no fold is ahead of it takes an alias a later round wrote before its checkpoint went
    /// back as it stands.
    fn at_round_start(&self, at: u64, mode: Aliases, revision: u64) -> Option<Option<&str>> {
        match (self.as_at(at), mode) {
            (None, Aliases::AsTheyStand { written_before }) if revision < written_before => {
                Some(self.last())
            }
            (found, _) => found,
        }
    }
}

/// How a round treats an alias written by a round that started after its own start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Aliases {
    /// As another fold's that is ahead: the round fails ([`SessionError::Overtaken`]).
    Positioned,
    /// As it stands when stored before the checkpoint's revision `written_before`: no fold is
    /// ahead (the checkpoint went back, say set back by hand, after the earlier pass over the
    /// stream wrote it). One stored later is another fold's, ahead of this one after all.
    AsTheyStand { written_before: u64 },
}

/// A round of the fold: the projections `from..=to`, and how it treats aliases written by later
/// rounds.
#[derive(Debug, Clone, Copy)]
struct Round {
    from: u64,
    to: u64,
    aliases: Aliases,
}

/// What a writer knows of a conversation's alias: the stored one (`None`: there is none) and
/// the revision it is stored at (0 when it never was), to replace it by compare-and-set.
#[derive(Debug, Clone)]
struct KnownAlias {
    alias: Option<Alias>,
    revision: u64,
}

pub struct SessionWriter {
    kv: kv::Store,
    /// Whether the bucket may hold aliases of earlier versions ([`legacy_alias_key`]), read
    /// when a conversation has no alias of its own. Looked up when a fold starts; until then
    /// assumed.
    legacy: std::sync::atomic::AtomicBool,
    /// The aliases this writer wrote or read (a conversation whose events name no work session
    /// asks again only once one of its events names one, which this writer then writes).
    /// Forgotten when a fold starts: another worker may have folded, and written aliases,
    /// meanwhile.
    aliases: Mutex<LruCache<String, KnownAlias>>,
    commits: mpsc::Sender<Request>,
    /// The sessions connection's reconnects: a read or write whose answer went with one is
    /// asked again, or read back, after a short grace rather than waited for until it times out.
    reconnects: Arc<Reconnects>,
}

impl SessionWriter {
    pub async fn new(js: &jetstream::Context, names: &Names) -> Result<Self, SessionError> {
        let kv = js
            .get_key_value(&names.sessions_bucket)
            .await
            .map_err(|source| SessionError::Open {
                bucket: names.sessions_bucket.clone(),
                source,
            })?;
        let (commits, rx) = mpsc::channel(1024);
        let reconnects = Arc::new(Reconnects::new(&js.client()));
        tokio::spawn(committer(kv.clone(), reconnects.clone(), rx));
        Ok(SessionWriter {
            kv,
            legacy: std::sync::atomic::AtomicBool::new(true),
            aliases: Mutex::new(LruCache::sparse(ALIAS_CACHE)),
            commits,
            reconnects,
        })
    }

    /// The work-session bucket (the fold's and the export's checkpoints are kept in it too).
    pub fn store(&self) -> &kv::Store {
        &self.kv
    }

    /// Fold envelopes, each with its identity, in the order given, into their sessions, as one
    /// round that starts at the first position given. Events that belong to no session are
    /// skipped. Returns once the sessions are written.
    pub async fn commit(&self, events: Vec<(Envelope, Identity)>) -> Result<(), SessionError> {
        let positions = events.iter().map(|(_, ident)| ident.position.0);
        let round = Round {
            from: positions.clone().min().unwrap_or(0),
            to: positions.max().unwrap_or(0),
            aliases: Aliases::Positioned,
        };
        self.commit_boxed(
            events
                .into_iter()
                .map(|(env, ident)| (Box::new(env), ident)),
            round,
        )
        .await
    }

    /// [`Self::commit`] for envelopes already boxed, as `round` (the events' positions are
    /// projection-stream sequences within it).
    ///
    /// Events go to their sessions as [`sessions::route`] says, from the aliases as they stood
    /// at the round's start. The aliases it needs are read, and the ones it moves written, all
    /// at once per call rather than one round trip per event: the fold keeps up with the
    /// projections only that way.
    async fn commit_boxed(
        &self,
        events: impl IntoIterator<Item = (Box<Envelope>, Identity)>,
        round: Round,
    ) -> Result<(), SessionError> {
        let (events, keys): (Vec<_>, Vec<_>) = events
            .into_iter()
            .map(|(env, ident)| {
                let keys = sessions::keys(&env);
                ((env, ident), keys)
            })
            .unzip();
        let known = self.aliases_before(&keys, round).await?;
        let (routes, moved) = sessions::route(&keys, known);
        // One write per conversation: where the round moved its alias, by projection.
        let moved: Vec<(String, Vec<(u64, String)>)> = moved
            .into_iter()
            .map(|(conv, moves)| {
                let moves = moves
                    .into_iter()
                    .map(|(i, ws)| (events[i].1.position.0, ws))
                    .collect();
                (conv, bounded_moves(moves))
            })
            .collect();
        futures::stream::iter(moved)
            .map(|(conv, moves)| async move { self.write_alias(&conv, round, moves).await })
            .buffer_unordered(CONCURRENT_ALIASES)
            .try_collect::<Vec<()>>()
            .await?;
        let mut groups: Groups = BTreeMap::new();
        for (((env, ident), keys), session) in events.into_iter().zip(keys).zip(routes) {
            if let Some(id) = session {
                groups.entry(id).or_default().push((env, keys, ident));
            }
        }
        if groups.is_empty() {
            return Ok(());
        }
        let (done, wait) = oneshot::channel();
        self.commits
            .send(Request { groups, done })
            .await
            .map_err(|_| SessionError::Stopped)?;
        wait.await.map_err(|_| SessionError::Stopped)?
    }

    /// The aliases of the conversations `keys` name as they stood at projection `from`, as far
    /// as routing needs them: the ones this writer knows, and those of conversations named
    /// without a session, read (concurrently) when it does not know them. A conversation missing
    /// from the answer has none, or is named only with a session (which sets its alias anyway).
    async fn aliases_before(
        &self,
        keys: &[sessions::SessionKeys],
        round: Round,
    ) -> Result<HashMap<String, String>, SessionError> {
        let from = round.from;
        let mut known = HashMap::new();
        let mut unknown = HashSet::new();
        let mut note = |conv: &str, stored: &KnownAlias| -> Result<(), SessionError> {
            let Some(alias) = &stored.alias else {
                return Ok(());
            };
            match alias.at_round_start(from, round.aliases, stored.revision) {
                Some(Some(ws)) => {
                    known.insert(conv.to_string(), ws.to_string());
                    Ok(())
                }
                Some(None) => Ok(()),
                None => Err(overtaken(conv, alias, from)),
            }
        };
        for k in keys {
            let Some(conv) = &k.conversation_id else {
                continue;
            };
            match self.cached(conv) {
                Some(k) => note(conv, &k)?,
                None if k.work_session_id.is_none() => {
                    unknown.insert(conv.clone());
                }
                None => {}
            }
        }
        let read: Vec<(String, KnownAlias)> = futures::stream::iter(unknown)
            .map(|conv| async move {
                let alias = self.read_alias(&conv).await?;
                Ok::<_, SessionError>((conv, alias))
            })
            .buffer_unordered(CONCURRENT_ALIASES)
            .try_collect()
            .await?;
        for (conv, alias) in read {
            note(&conv, &alias)?;
            self.cache(&conv, alias);
        }
        Ok(known)
    }
}

/// The error of a fold that found `alias` (of `conv`) written by a round after its own, which
/// starts at `from`.
fn overtaken(conv: &str, alias: &Alias, from: u64) -> SessionError {
    SessionError::Overtaken {
        key: alias_key(conv),
        from: alias.from,
        round: from,
    }
}

/// A session as last written (or read) by this worker, decoded, with its revision and the size of
/// its stored value.
struct Cached {
    session: Option<WorkSession>,
    revision: u64,
    bytes: usize,
}

impl Cached {
    /// What an absent key (or a deleted session) leaves: no session, at `revision`.
    fn absent(revision: u64) -> Cached {
        Cached {
            session: None,
            revision,
            bytes: 0,
        }
    }
}

/// The sessions the committer keeps between rounds: at most [`SESSION_CACHE`] of them and
/// [`SESSION_CACHE_BYTES`] of stored values, the least recently kept let go first.
struct SessionCache {
    kept: LruCache<String, Cached>,
    bytes: usize,
    max_bytes: usize,
}

impl SessionCache {
    fn new(max_bytes: usize) -> SessionCache {
        SessionCache {
            // Grows as sessions come, nothing allocated up front.
            kept: LruCache::sparse(SESSION_CACHE),
            bytes: 0,
            max_bytes,
        }
    }

    /// Take session `id` out (it comes back with [`Self::keep`] once written).
    fn take(&mut self, id: &str) -> Option<Cached> {
        let c = self.kept.pop(id)?;
        self.bytes -= c.bytes;
        Some(c)
    }

    /// Keep session `id`, letting the least recently kept go while past either bound.
    fn keep(&mut self, id: String, c: Cached) {
        self.bytes += c.bytes;
        if let Some((_, old)) = self.kept.push(id, c) {
            self.bytes -= old.bytes;
        }
        while self.bytes > self.max_bytes {
            match self.kept.pop_lru() {
                Some((_, old)) => self.bytes -= old.bytes,
                None => break,
            }
        }
    }
}

/// Commit rounds until every writer is gone: take what is queued, merge it by session, write each
/// session once, answer every request of the round.
async fn committer(kv: kv::Store, reconnects: Arc<Reconnects>, mut rx: mpsc::Receiver<Request>) {
    let mut cache = SessionCache::new(SESSION_CACHE_BYTES);
    // Sessions read or written by this committer (a superset of `cache`'s): one it has not met
    // is most likely new, and costs a refused write instead of a read when it is not.
    let mut seen: LruCache<String, ()> = LruCache::sparse(SEEN_SESSIONS);
    // Sessions past MAX_SESSION_BYTES: no longer aggregated (reported once).
    let mut oversized: HashSet<String> = HashSet::new();
    let mut last_round = tokio::time::Instant::now();
    let mut interval = ROUND_INTERVAL;
    while let Some(first) = rx.recv().await {
        tokio::time::sleep_until(last_round + interval).await;
        last_round = tokio::time::Instant::now();
        let mut requests = vec![first];
        while requests.len() < 1024 {
            match rx.try_recv() {
                Ok(r) => requests.push(r),
                Err(_) => break,
            }
        }
        let mut merged: Groups = BTreeMap::new();
        for r in &mut requests {
            for (id, events) in std::mem::take(&mut r.groups) {
                merged.entry(id).or_default().extend(events);
            }
        }
        merged.retain(|id, _| !oversized.contains(id));
        let (kv, reconnects) = (&kv, &*reconnects);
        let jobs: Vec<_> = merged
            .into_iter()
            .map(|(id, events)| {
                let cached = cache.take(&id);
                let never_met = !seen.contains(&id);
                async move {
                    // A round never waits on one session for long: every other partition's
                    // acknowledgements wait for the round.
                    let outcome = match tokio::time::timeout(
                        SESSION_WRITE_LIMIT,
                        update(kv, reconnects, &id, &events, cached, never_met),
                    )
                    .await
                    {
                        Ok(o) => o,
                        Err(_) => {
                            warn!(key = %session_key(&id), "work session write took too long; the round fails and is retried");
                            Outcome {
                                result: Err(SessionError::Kv {
                                    key: session_key(&id),
                                    source: Box::new(NoAnswer::new(
                                        "writing the session",
                                        SESSION_WRITE_LIMIT,
                                    )),
                                }),
                                ..Outcome::default_ok()
                            }
                        }
                    };
                    (id, outcome)
                }
            })
            .collect();
        let results: Vec<_> = futures::stream::iter(jobs)
            .buffer_unordered(CONCURRENT_WRITES)
            .collect()
            .await;
        let mut failure = None;
        let mut written = 0usize;
        for (id, outcome) in results {
            written += outcome.written;
            if let Err(e) = outcome.result {
                failure = Some(Arc::new(e));
            }
            if let Some(bytes) = outcome.oversized {
                warn!(key = %session_key(&id), bytes, "work session too large to store; further events are not aggregated");
                oversized.insert(id);
                continue;
            }
            if let Some(k) = outcome.kept {
                seen.put(id.clone(), ());
                cache.keep(id, k);
            }
        }
        interval = Duration::from_secs_f64(written as f64 / WRITE_BUDGET_BYTES_PER_S)
            .clamp(ROUND_INTERVAL, MAX_ROUND_INTERVAL);
        for r in requests {
            let answer = match &failure {
                None => Ok(()),
                Some(e) => Err(SessionError::Round(e.clone())),
            };
            let _ = r.done.send(answer);
        }
    }
}

/// What writing one session in a round came to.
struct Outcome {
    result: Result<(), SessionError>,
    /// The session as written (or found unchanged), to keep for the next round.
    kept: Option<Cached>,
    /// Bytes serialised and written.
    written: usize,
    /// The session would exceed [`MAX_SESSION_BYTES`] (its size): not written.
    oversized: Option<usize>,
}

/// Apply and compare-and-set, re-reading on conflict. `never_met` (and nothing `cached`): the
/// first attempt takes the session as absent (a write as new, which the bucket refuses if the
/// key has any entry) instead of reading it.
async fn update(
    kv: &kv::Store,
    reconnects: &Reconnects,
    id: &str,
    events: &[(Box<Envelope>, SessionKeys, Identity)],
    mut cached: Option<Cached>,
    never_met: bool,
) -> Outcome {
    let key = session_key(id);
    let failed = |key: String, source: Source| Outcome {
        result: Err(SessionError::Kv { key, source }),
        ..Outcome::default_ok()
    };
    let mut written = 0usize;
    let mut attempt = 0u32;
    let mut retry = super::Retry::new(STORE_RETRY_MIN, STORE_RETRY_MAX);
    loop {
        attempt += 1;
        // Taken as absent without a read: only a write as new, which the bucket refuses if the
        // key has any entry, confirms it.
        let guessed = cached.is_none() && never_met && attempt == 1;
        let current = match cached.take() {
            Some(c) => c,
            None if guessed => Cached::absent(0),
            None => match read(kv, reconnects, &key).await {
                Ok(Some(c)) => c,
                // Unreadable: never silently reset a session; it is reported and left alone.
                Ok(None) => return Outcome::default_ok(),
                Err(detail) => {
                    if attempt >= MAX_ATTEMPTS {
                        return failed(key, detail);
                    }
                    warn!(key = %key, error = %detail, "work session read failed; retrying");
                    tokio::time::sleep(retry.next_delay()).await;
                    continue;
                }
            },
        };
        let Cached {
            mut session,
            revision,
            bytes: stored,
        } = current;
        let mut changed = false;
        for (env, keys, ident) in events {
            let s = session.get_or_insert_with(|| WorkSession {
                id: id.to_string(),
                ..WorkSession::default()
            });
            changed |= sessions::fold_into(s, env, keys, *ident);
        }
        let unchanged = |session, revision, bytes, written| Outcome {
            kept: Some(Cached {
                session,
                revision,
                bytes,
            }),
            written,
            ..Outcome::default_ok()
        };
        if !changed {
            if guessed {
                // Nothing to write to a new session, which says nothing of a stored one.
                continue;
            }
            return unchanged(session, revision, stored, written);
        }
        let Some(value) = session.as_ref() else {
            return unchanged(session, revision, stored, written);
        };
        let bytes = match serde_json::to_vec(value) {
            Ok(b) => b,
            Err(e) => return failed(key, Box::new(e)),
        };
        written += bytes.len();
        if bytes.len() > MAX_SESSION_BYTES {
            if guessed {
                // Too large as a new session: the stored one decides.
                continue;
            }
            return Outcome {
                written,
                oversized: Some(bytes.len()),
                ..Outcome::default_ok()
            };
        }
        let size = bytes.len();
        let connects = reconnects.connects();
        let write = kv.update(&key, Bytes::from(bytes), revision);
        match reconnects
            .write("a work-session write", &key, write, connects)
            .await
        {
            Some(Ok(rev)) => return unchanged(session, rev, size, written),
            Some(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                debug!(key = %key, "work session changed meanwhile; re-reading");
            }
            Some(Err(e)) => {
                warn!(key = %key, error = %e, "work session write failed; retrying");
                tokio::time::sleep(retry.next_delay()).await;
            }
            // Stored or not, the session read again says: a stored write left nothing to apply.
            None => {}
        }
        if attempt >= MAX_ATTEMPTS {
            return failed(key, "revision conflicts persisted".into());
        }
    }
}

impl Outcome {
    fn default_ok() -> Outcome {
        Outcome {
            result: Ok(()),
            kept: None,
            written: 0,
            oversized: None,
        }
    }
}

/// The stored session and its revision (revision 0 and no session when absent); `None` when the
/// stored value is unreadable.
async fn read(
    kv: &kv::Store,
    reconnects: &Reconnects,
    key: &str,
) -> Result<Option<Cached>, Source> {
    let after = Duration::from_secs(10);
    let entry = reconnects.read("a work-session read", key, || kv.entry(key.to_string()));
    let entry = tokio::time::timeout(after, entry)
        .await
        .map_err(|_| NoAnswer::new("reading the session", after))??;
    Ok(match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            match serde_json::from_slice::<WorkSession>(&e.value) {
                Ok(s) => Some(Cached {
                    session: Some(s),
                    revision: e.revision,
                    bytes: e.value.len(),
                }),
                Err(err) => {
                    warn!(key = %key, error = %err, "stored work session is unreadable; not updated");
                    None
                }
            }
        }
        Some(e) => Some(Cached::absent(e.revision)),
        None => Some(Cached::absent(0)),
    })
}

/// Run a KV operation on `key` until it succeeds, [`MAX_ATTEMPTS`] attempts at most, with the
/// work-session store's back-off between them; each failure is logged as `what`.
async fn with_retries<T, E, Fut>(
    key: &str,
    what: &str,
    op: impl FnMut() -> Fut,
) -> Result<T, SessionError>
where
    E: std::fmt::Display + Into<Source>,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    use backon::Retryable;
    let schedule = super::Retry::schedule(STORE_RETRY_MIN, STORE_RETRY_MAX)
        .with_max_times(MAX_ATTEMPTS as usize - 1);
    op.retry(schedule)
        .sleep(tokio::time::sleep)
        .notify(|e, _| warn!(key = %key, error = %e, "{what} failed; retrying"))
        .await
        .map_err(|e| SessionError::Kv {
            key: key.to_string(),
            source: e.into(),
        })
}

impl SessionWriter {
    /// Store where the round that starts at projection `from` moved `conv`'s alias (`moves`, in
    /// order), with the alias as that round found it, by compare-and-set: a conversation this
    /// writer does not know is written as new and read only when it exists already. An alias
    /// written by a later round is never replaced: this fold has been overtaken.
    async fn write_alias(
        &self,
        conv: &str,
        round: Round,
        moves: Vec<(u64, String)>,
    ) -> Result<(), SessionError> {
        let from = round.from;
        let key = alias_key(conv);
        // A conversation this writer does not know is written as new, and read only when that
        // fails. Its `before` is then none even where an earlier version's alias exists: it is
        // never read, since no event of the conversation naming no session came before its
        // first move from this round's start (the round would have read the alias for it), and
        // every round of the same stream from that start has the same events.
        let mut known = Some(self.cached(conv).unwrap_or(KnownAlias {
            alias: None,
            revision: 0,
        }));
        let mut retry = super::Retry::new(STORE_RETRY_MIN, STORE_RETRY_MAX);
        for _ in 0..MAX_ATTEMPTS {
            let current = match known.take() {
                Some(k) => k,
                None => self.read_alias(conv).await?,
            };
            let before = match &current.alias {
                None => None,
                Some(a) => match a.at_round_start(from, round.aliases, current.revision) {
                    Some(ws) => ws.map(str::to_string),
                    None => return Err(overtaken(conv, a, from)),
                },
            };
            // Another attempt of a round from the same start (a retry, or another owner's) that
            // read further: its moves past this round's end are facts of the same stream, kept.
            let further = current
                .alias
                .as_ref()
                .filter(|a| a.from == from)
                .map(|a| a.moves.iter().filter(|(seq, _)| *seq > round.to).cloned());
            let next = Alias {
                from,
                before,
                moves: bounded_moves(
                    moves
                        .iter()
                        .cloned()
                        .chain(further.into_iter().flatten())
                        .collect(),
                ),
            };
            if current.alias.as_ref() == Some(&next) {
                self.cache(conv, current);
                return Ok(());
            }
            let value = serde_json::to_vec(&next).map_err(|e| SessionError::Kv {
                key: key.clone(),
                source: Box::new(e),
            })?;
            let connects = self.reconnects.connects();
            let write = self.kv.update(&key, Bytes::from(value), current.revision);
            match self
                .reconnects
                .write("a conversation-alias write", &key, write, connects)
                .await
            {
                // Stored or not, the alias read again says: a stored one is found as written.
                None => {}
                Some(Ok(revision)) => {
                    self.cache(
                        conv,
                        KnownAlias {
                            alias: Some(next),
                            revision,
                        },
                    );
                    return Ok(());
                }
                // Written meanwhile, or not as this writer knew it: read it and decide again.
                Some(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                Some(Err(e)) => {
                    warn!(key = %key, error = %e, "conversation alias write failed; retrying");
                    tokio::time::sleep(retry.next_delay()).await;
                }
            }
        }
        Err(SessionError::Kv {
            key,
            source: "conversation alias write: conflicts or failures persisted".into(),
        })
    }

    /// `conv`'s stored alias, if it has one, and its revision.
    async fn read_alias(&self, conv: &str) -> Result<KnownAlias, SessionError> {
        let key = alias_key(conv);
        let mut known = match self.read_entry(&key).await? {
            Some(e) if e.put => KnownAlias {
                alias: match serde_json::from_slice::<Alias>(&e.value) {
                    Ok(a) => Some(a),
                    Err(err) => {
                        warn!(key = %key, error = %err, "stored conversation alias is unreadable; taken as none and replaced");
                        None
                    }
                },
                revision: e.revision,
            },
            // Deleted or purged: none, replaced from the marker's revision.
            Some(e) => KnownAlias {
                alias: None,
                revision: e.revision,
            },
            None => KnownAlias {
                alias: None,
                revision: 0,
            },
        };
        // An earlier version's alias stored after this one (that version folded since, during a
        // rolling upgrade or a rollback) is the newer: it holds, replaced by compare-and-set from
        // this key's revision.
        if self.legacy.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(e) = self.read_entry(&legacy_alias_key(conv)).await? {
                if e.put && e.revision > known.revision {
                    known.alias = Some(Alias::legacy(&e.value));
                }
            }
        }
        Ok(known)
    }

    /// `key`'s last entry as the bucket stream's leader holds it (a lagging replica could
    /// answer a direct get with an alias another fold has replaced), with the store's retries.
    async fn read_entry(&self, key: &str) -> Result<Option<super::LeaderEntry>, SessionError> {
        with_retries(key, "conversation alias read", || {
            self.reconnects.read("a conversation-alias read", key, || {
                super::leader_entry(&self.kv, key)
            })
        })
        .await
    }

    /// What this writer knows of `conv`'s alias (`None`: nothing).
    fn cached(&self, conv: &str) -> Option<KnownAlias> {
        self.aliases
            .lock()
            .ok()
            .and_then(|mut m| m.get(conv).cloned())
    }

    fn cache(&self, conv: &str, alias: KnownAlias) {
        if let Ok(mut m) = self.aliases.lock() {
            m.put(conv.to_string(), alias);
        }
    }

    /// Ready for a fold that starts from its checkpoint: forget every alias known (it reads
    /// them again), and look up whether the bucket holds aliases of earlier versions.
    async fn start_fold(&self) -> Result<(), String> {
        if let Ok(mut m) = self.aliases.lock() {
            m.clear();
        }
        let legacy = format!("{}conv.*", self.kv.prefix);
        let any = super::publish::last_from_leader(&self.kv.stream, &legacy)
            .await
            .map_err(|e| format!("looking for aliases of earlier versions: {e}"))?;
        self.legacy
            .store(any.is_some(), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// The partition under which a session records what the fold applied: the projection stream is
/// folded in its own order, as one partition whose positions are projection-stream sequences.
pub const FOLD_PARTITION: u16 = u16::MAX;
/// The fold's checkpoint: the last projection-stream sequence whose sessions are written.
/// Two tokens, so it is never taken for a session (nor for an `alias.` or `conv.` alias).
pub const FOLD_KEY: &str = "fold.position";
/// Where the fold first started in this bucket (as a checkpoint: the sequence before it),
/// written once beside [`FOLD_KEY`]. The projections before it were never the fold's to apply
/// (a version that wrote sessions from the partitions counted them), so a fold whose
/// checkpoint was deleted starts again no earlier.
pub const FOLD_ORIGIN_KEY: &str = "fold.origin";
/// Most projections folded in one round.
const FOLD_BATCH: usize = 20_000;
/// How long a round gathers projections after its first one.
const FOLD_GATHER: Duration = Duration::from_millis(200);

/// The most projections a round of the fold holds: [`FOLD_BATCH`], or for tests that need a
/// backlog of many rounds without tens of thousands of inputs, `COLLAB_TEST_FOLD_ROUND`.
fn fold_round() -> usize {
    match super::test_hook_every("COLLAB_TEST_FOLD_ROUND") {
        0 => FOLD_BATCH,
        n => usize::try_from(n).unwrap_or(FOLD_BATCH),
    }
}

/// A checkpoint `key` of the work-session bucket: the last projection-stream sequence a reader
/// handled under it and the entry's revision (to move it by compare-and-set), or `None` when
/// it holds none.
async fn read_checkpoint(
    kv: &kv::Store,
    reconnects: &Reconnects,
    key: &str,
) -> Result<Option<(u64, u64)>, String> {
    Ok(match read_stored(kv, reconnects, key).await? {
        Stored::At { last, revision } => Some((last, revision)),
        Stored::Deleted | Stored::Never => None,
    })
}

/// A reader's checkpoint as its key stands in the work-session bucket.
pub(crate) enum Stored {
    /// The last projection-stream sequence handled, and the entry's revision.
    At { last: u64, revision: u64 },
    /// The key's last entry is a delete or purge marker: a checkpoint was written and removed
    /// (by hand: the workers never delete one).
    Deleted,
    /// No entry.
    Never,
}

/// A checkpoint `key` of the work-session bucket as it stands, within 10 s.
pub(crate) async fn read_stored(
    kv: &kv::Store,
    reconnects: &Reconnects,
    key: &str,
) -> Result<Stored, String> {
    let entry = reconnects.read("a checkpoint read", key, || kv.entry(key));
    let entry = tokio::time::timeout(Duration::from_secs(10), entry)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| e.to_string())?;
    stored(key, entry)
}

/// What the entry read under checkpoint `key` (`None`: there is none) says.
pub(crate) fn stored(key: &str, entry: Option<kv::Entry>) -> Result<Stored, String> {
    let Some(entry) = entry else {
        return Ok(Stored::Never);
    };
    if entry.operation != kv::Operation::Put {
        return Ok(Stored::Deleted);
    }
    let text = String::from_utf8_lossy(&entry.value);
    let last = text
        .trim()
        .parse::<u64>()
        .map_err(|_| format!("checkpoint {key} is not a sequence: {text:?}"))?;
    Ok(Stored::At {
        last,
        revision: entry.revision,
    })
}

/// Where the fold starts: after its checkpoint. Without one, at the start of the projection
/// stream for a new deployment, or at its end when the bucket already holds sessions (they were
/// folded by a version that wrote sessions from the partitions, so folding the stream again
/// would count those events twice); where it starts then is kept as [`FOLD_ORIGIN_KEY`]. A
/// checkpoint deleted by hand starts it at the stream's first message, or at that origin when
/// later: what lies between was folded by this fold, which no longer knows how far, and each
/// session passes over what it applied (as after a checkpoint set back). That choice is
/// written as the checkpoint before anything is folded, so a fold restarted after a failed
/// first round starts where the first one did (its own alias and session writes would
/// otherwise make the bucket look like an older version's and move the start past the round
/// it failed to write).
///
/// Also the checkpoint's revision: the fold moves it only from there (see [`fold`]).
async fn fold_start(
    kv: &kv::Store,
    reconnects: &Reconnects,
    proj: &mut jetstream::stream::Stream,
) -> Result<(u64, u64), String> {
    let start = match read_stored(kv, reconnects, FOLD_KEY).await? {
        Stored::At { last, revision } => return Ok((last + 1, revision)),
        Stored::Deleted => {
            let first = state(proj).await?.first_sequence.max(1);
            let from = match read_stored(kv, reconnects, FOLD_ORIGIN_KEY).await? {
                Stored::At { last, .. } => first.max(last + 1),
                Stored::Deleted | Stored::Never => first,
            };
            warn!(
                from,
                "the fold's checkpoint was deleted from the work-session bucket: folding the \
                 projection stream again from its first message the fold applied (each session \
                 passes over what it applied already); do not delete fold.position"
            );
            from
        }
        Stored::Never => {
            let start = first_fold_start(kv, proj).await?;
            // A create: the origin of a fold that started here before stands.
            if let Err(e) = kv
                .create(FOLD_ORIGIN_KEY, Bytes::from((start - 1).to_string()))
                .await
            {
                debug!(error = %e, "the fold's origin was not written");
            }
            start
        }
    };
    let connects = reconnects.connects();
    let create = kv.create(FOLD_KEY, Bytes::from((start - 1).to_string()));
    let why = match reconnects
        .write(
            "the fold's first checkpoint write",
            FOLD_KEY,
            create,
            connects,
        )
        .await
    {
        Some(Ok(revision)) => return Ok((start, revision)),
        Some(Err(e)) => e.to_string(),
        None => "its answer went with a reconnect, and it was not stored".to_string(),
    };
    // Another worker's fold wrote it first (a brief overlap of two owners), or this one did
    // with its answer lost: start after it.
    match read_checkpoint(kv, reconnects, FOLD_KEY).await? {
        Some((last, revision)) => Ok((last + 1, revision)),
        None => Err(format!("checkpoint {FOLD_KEY}: {why}")),
    }
}

/// A stream's state as the server reports it now.
async fn state(s: &mut jetstream::stream::Stream) -> Result<jetstream::stream::State, String> {
    s.info()
        .await
        .map(|i| i.state.clone())
        .map_err(|e| e.to_string())
}

/// Where a fold with no checkpoint starts (see [`fold_start`]).
async fn first_fold_start(
    kv: &kv::Store,
    proj: &mut jetstream::stream::Stream,
) -> Result<u64, String> {
    // Sessions are stored under one-token keys; the bucket's others (`fold.position`,
    // `otel.position` of the span export, `alias.<id>` and `conv.<id>` aliases) say nothing about whether this
    // stream's projections were folded.
    let any_session = format!("{}*", kv.prefix);
    match super::publish::last_from_leader(&kv.stream, &any_session).await {
        Ok(None) => return Ok(1),
        Ok(Some(_)) => {}
        Err(e) => return Err(format!("reading the work sessions: {e}")),
    }
    let last = state(proj).await?.last_sequence;
    warn!(
        from = last + 1,
        "work sessions exist but the fold has no checkpoint: folding new projections only"
    );
    Ok(last + 1)
}

/// One projection read back from the projection stream, as the fold applies it: identified by
/// its position in that stream, so a round applied again (a crash before its checkpoint) changes
/// nothing twice. A turn's response is also recognised by its turn (see `sessions::fold_into`).
/// `None` for a projection that belongs to no session (most runtime and health events), for a
/// partition's fence claim, and for a message that is no envelope this version reads, which the
/// round then never holds; the last are counted in `unreadable`.
fn fold_event(
    msg: &jetstream::Message,
    unreadable: &mut Unreadable,
) -> Option<(Box<Envelope>, Identity)> {
    let seq = msg.info().ok()?.stream_sequence;
    let env = match read_back(msg.subject.as_str(), &msg.payload) {
        ReadBack::Event(env) => env,
        ReadBack::NotAnEvent => return None,
        ReadBack::Unreadable(e) => {
            unreadable.note(seq, e);
            return None;
        }
    };
    let keys = sessions::keys(&env);
    if keys.work_session_id.is_none() && keys.conversation_id.is_none() {
        return None;
    }
    let ident = Identity {
        partition: FOLD_PARTITION,
        position: Position(seq, 0),
    };
    Some((env, ident))
}

/// What a message of the projection stream is to the fold.
enum ReadBack {
    /// An envelope.
    Event(Box<Envelope>),
    /// A partition's fence claim, which is no event.
    NotAnEvent,
    /// Neither: no envelope this version reads (one written by a newer version, say).
    Unreadable(serde_json::Error),
}

fn read_back(subject: &str, payload: &[u8]) -> ReadBack {
    if super::publish::is_fence_subject(subject) {
        return ReadBack::NotAnEvent;
    }
    match sessions::envelope_for_fold(payload) {
        Ok(env) => ReadBack::Event(Box::new(env)),
        Err(e) => ReadBack::Unreadable(e),
    }
}

/// The projections of a round the fold could not read: counted
/// (`collab_session_fold_unreadable_total`) and logged once per round, with the first.
#[derive(Default)]
struct Unreadable {
    count: u64,
    first: Option<(u64, serde_json::Error)>,
}

impl Unreadable {
    fn note(&mut self, seq: u64, e: serde_json::Error) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some((seq, e));
        }
    }

    fn report(self) {
        let Some((seq, error)) = self.first else {
            return;
        };
        metrics::counter!(crate::telemetry::SESSION_FOLD_UNREADABLE).increment(self.count);
        warn!(
            count = self.count,
            first = seq,
            error = %error,
            "projections the work-session fold cannot read (no envelope this version knows: written by a newer version?); their events are missing from the work sessions"
        );
    }
}

/// Fold the projection stream into the work sessions until `cancel`, restarting from the
/// checkpoint after a failure. Run by the owner of partition 0, so one worker folds at a time;
/// a brief overlap of two owners only repeats work (sessions remember what they applied).
///
/// The fold is off the projection path: projections and acknowledgements never wait for it.
/// It reads the projections in stream order from its checkpoint, a round at a time
/// ([`super::rounds::Rounds`]: a round's first projection, then what was stored within
/// `FOLD_GATHER`, 200 ms, fetched in bursts), applies the round to the sessions it touches,
/// writes each changed session once, then moves the checkpoint. A crash between the two re-applies the round,
/// which changes nothing twice. The next round is read while one is written (at most two rounds
/// in memory), so a fold behind the partitions does not wait for the server between the two;
/// the rounds are still written one after the other, in order.
pub async fn run_fold(
    writer: std::sync::Arc<SessionWriter>,
    js: jetstream::Context,
    proj_stream: String,
    cancel: tokio_util::sync::CancellationToken,
    lease_valid_until: std::sync::Arc<super::LeaseValidity>,
    state: std::sync::Arc<super::stats::WorkerState>,
) {
    // However the fold ends (cancelled, or its task aborted with partition 0's), this worker
    // stops reporting it: the worker that folds next reports the lag.
    let report = state.fold_report();
    let mut retry = super::Retry::new(Duration::from_millis(200), Duration::from_secs(5));
    // The last projection-stream sequence whose sessions are written, once known.
    let mut position = None;
    while !cancel.is_cancelled() {
        match fold(
            &writer,
            &js,
            &proj_stream,
            &cancel,
            &lease_valid_until,
            &report,
            &mut position,
        )
        .await
        {
            Ok(()) => break,
            Err(e) => {
                warn!(error = %e, "work-session fold failed; restarting from its checkpoint");
                // A fold that fails before it reads a round (its bucket without a leader, say)
                // still reports what it leaves unfolded.
                if let Some(at) = position {
                    if let Some(last) = last_sequence(&js, &proj_stream).await {
                        report.behind(last.saturating_sub(at));
                    }
                }
                if !retry.wait(&cancel).await {
                    break;
                }
            }
        }
    }
}

/// The projection stream's last sequence, if the server answers within 5 s.
pub(crate) async fn last_sequence(js: &jetstream::Context, proj_stream: &str) -> Option<u64> {
    // Looking the stream up reads its info.
    let info = async {
        let s = js.get_stream(proj_stream).await.ok()?;
        Some(s.cached_info().state.last_sequence)
    };
    tokio::time::timeout(Duration::from_secs(5), info)
        .await
        .ok()
        .flatten()
}

async fn fold(
    writer: &SessionWriter,
    js: &jetstream::Context,
    proj_stream: &str,
    cancel: &tokio_util::sync::CancellationToken,
    lease_valid_until: &super::LeaseValidity,
    report: &super::stats::FoldReport,
    position: &mut Option<u64>,
) -> Result<(), String> {
    let mut proj = js
        .get_stream(proj_stream)
        .await
        .map_err(|e| format!("stream {proj_stream}: {e}"))?;
    writer.start_fold().await?;
    let (start, mut checkpoint) = fold_start(&writer.kv, &writer.reconnects, &mut proj).await?;
    *position = Some(start - 1);
    let stored = proj.cached_info().state.last_sequence;
    warn_if_recreated(stored, start - 1);
    report.at(start - 1, stored.saturating_sub(start - 1));
    let mut rounds = super::rounds::Rounds::new(&proj, start)
        .await?
        .watching(writer.reconnects.clone());
    debug!(from = start, "work-session fold started");
    // Where the next round starts: after the checkpoint, then after each round written.
    let mut from = start;
    let max = fold_round();
    let mut next = rounds
        .next(cancel, lease_valid_until, FOLD_GATHER, max)
        .await?;
    loop {
        let Some(round) = next else {
            return Ok(());
        };
        let (last, pending) = round
            .last()
            .and_then(|m| m.info().ok())
            .map_or((0, 0), |i| (i.stream_sequence, i.pending));
        let gaps = gaps(
            from,
            round
                .iter()
                .filter_map(|m| m.info().ok())
                .map(|i| i.stream_sequence),
        );
        // What is not folded yet: this round until it is written, and what was stored after it.
        // A round that cannot be written keeps reporting itself, growing as it is read again.
        report.behind((round.len() as u64).saturating_add(pending));
        let mut unreadable = Unreadable::default();
        let events: Vec<_> = round
            .iter()
            .filter_map(|m| fold_event(m, &mut unreadable))
            .collect();
        unreadable.report();
        let folded = events.len();
        let span = Round {
            from,
            to: last,
            aliases: Aliases::Positioned,
        };
        let commit = write_round(
            writer,
            &round,
            events,
            span,
            checkpoint,
            lease_valid_until,
            &gaps,
        );
        // The next round is read while this one is written: the rounds are still written one
        // after the other, in order, each checkpoint after its sessions. A write that fails
        // drops the read ahead with the fold, which starts again from its checkpoint.
        let ahead = rounds.next(cancel, lease_valid_until, FOLD_GATHER, max);
        tokio::pin!(commit, ahead);
        let mut read = None;
        let written = loop {
            tokio::select! {
                written = &mut commit => break written,
                r = &mut ahead, if read.is_none() => read = Some(r),
            }
        };
        checkpoint = written?;
        remove_claims_read(&proj, &round);
        // Counted once the round is folded, so a round read again does not count its gaps twice.
        report_gaps(&gaps);
        metrics::counter!(crate::telemetry::SESSION_EVENTS_FOLDED).increment(folded as u64);
        report.at(last, pending);
        *position = Some(last);
        from = last + 1;
        next = match read {
            Some(r) => r?,
            None => ahead.await?,
        };
    }
}

/// Write `round` (its `events`, as `span`), then move the checkpoint from `checkpoint` to the
/// round's end. Returns the checkpoint's new revision.
async fn write_round(
    writer: &SessionWriter,
    round: &[jetstream::Message],
    events: Vec<(Box<Envelope>, Identity)>,
    span: Round,
    checkpoint: u64,
    lease_valid_until: &super::LeaseValidity,
    gaps: &[(u64, u64)],
) -> Result<u64, String> {
    let last = span.to;
    commit_round(writer, round, events, span, checkpoint, lease_valid_until).await?;
    move_checkpoint(&writer.kv, &writer.reconnects, last, checkpoint, gaps).await
}

/// The last fence claim `round` read on each fence subject, by sequence.
fn claims_read(round: &[jetstream::Message]) -> BTreeMap<String, u64> {
    let mut last = BTreeMap::new();
    for m in round {
        if !super::publish::is_fence_subject(&m.subject) {
            continue;
        }
        if let Ok(info) = m.info() {
            let seq = last.entry(m.subject.to_string()).or_insert(0);
            *seq = (*seq).max(info.stream_sequence);
        }
    }
    last
}

/// Remove, on each fence subject `round` read a claim on, the claims stored before the last
/// one it read: every one of them is at or before the checkpoint just written, so no reader
/// that reports gaps is still to read it, and the last claim on a subject (the one its
/// partition's outputs expect) is at or after the one kept. The fold is what removes earlier
/// claims from the projection stream (a partition's claim leaves them to it, see
/// [`super::publish::Fence::claim`]), so they do not pile up. Off the fold's path.
fn remove_claims_read(proj: &jetstream::stream::Stream, round: &[jetstream::Message]) {
    let claims = claims_read(round);
    if claims.is_empty() {
        return;
    }
    let proj = proj.clone();
    tokio::spawn(async move {
        for (subject, last) in claims {
            super::publish::remove_claims_before(&proj, &subject, last).await;
        }
    });
}

/// Write `round` (its `events`) as `span`, unless partition 0's lease has lapsed (another worker
/// may fold). A round overtaken while the checkpoint is still at `checkpoint`, where this fold
/// found it, is written again taking the aliases stored before it as they stand.
async fn commit_round(
    writer: &SessionWriter,
    round: &[jetstream::Message],
    events: Vec<(Box<Envelope>, Identity)>,
    mut span: Round,
    checkpoint: u64,
    lease_valid_until: &super::LeaseValidity,
) -> Result<(), String> {
    let lease_held = || {
        if lease_valid_until.lapsed() {
            return Err(
                "partition 0's lease lapsed during the round; starting again from the checkpoint"
                    .to_string(),
            );
        }
        Ok(())
    };
    lease_held()?;
    match writer.commit_boxed(events, span).await {
        Ok(()) => Ok(()),
        Err(SessionError::Overtaken { key, .. })
            if unmoved(&writer.kv, &writer.reconnects, checkpoint).await? =>
        {
            // No fold moved the checkpoint, yet an alias says a round after it was folded: the
            // checkpoint went back (set back by hand, or the projection stream was recreated),
            // so the aliases are from an earlier pass. Taken as they stand, rather than stopping
            // the fold for good.
            warn!(alias = %key, from = span.from, "an alias was written by a round after the fold's checkpoint, and no fold is ahead: the checkpoint went back; taking aliases as they stand");
            lease_held()?;
            span.aliases = Aliases::AsTheyStand {
                written_before: checkpoint,
            };
            // The round as read above: what it could not read was reported by that read, so
            // this pass's own count is dropped.
            let mut reported = Unreadable::default();
            let events: Vec<_> = round
                .iter()
                .filter_map(|m| fold_event(m, &mut reported))
                .collect();
            writer
                .commit_boxed(events, span)
                .await
                .map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Move the fold's checkpoint to `last`, only from `checkpoint`, where this fold found it: a
/// checkpoint another worker's fold moved meanwhile (a deposed owner coming back, or a write
/// stored with its answer lost) stops this fold, which starts again from the checkpoint as it
/// is. Returns the new revision. `gaps`, the round's, are reported when a failed write was
/// stored after all (its answer lost): the next fold starts after this round, so now or never.
/// A write whose answer went with a reconnect is read back: found stored, the fold goes on from
/// it; not stored, the fold starts again from the checkpoint.
async fn move_checkpoint(
    kv: &kv::Store,
    reconnects: &Reconnects,
    last: u64,
    checkpoint: u64,
    gaps: &[(u64, u64)],
) -> Result<u64, String> {
    let connects = reconnects.connects();
    let write = kv.update(FOLD_KEY, Bytes::from(last.to_string()), checkpoint);
    let failed = match reconnects
        .write("the fold's checkpoint write", FOLD_KEY, write, connects)
        .await
    {
        Some(Ok(revision)) => return Ok(revision),
        Some(Err(e)) => match e.kind() {
            kv::UpdateErrorKind::WrongLastRevision => {
                format!("checkpoint {FOLD_KEY} moved by another fold; starting again from it")
            }
            _ => format!("checkpoint {FOLD_KEY}: {e}"),
        },
        None => match read_checkpoint(kv, reconnects, FOLD_KEY).await? {
            // Stored, as the next write after `checkpoint` (one by another fold would have
            // moved it past this round or left it where it was).
            Some((at, revision)) if at == last && revision > checkpoint => return Ok(revision),
            _ => format!(
                "checkpoint {FOLD_KEY}: its write's answer went with a reconnect, and it was not stored; starting again from it"
            ),
        },
    };
    if read_checkpoint(kv, reconnects, FOLD_KEY)
        .await
        .is_ok_and(|c| c.is_some_and(|(at, _)| at == last))
    {
        report_gaps(gaps);
    }
    Err(failed)
}

/// A projection stream that ends (`last`) before the fold's checkpoint was recreated (its
/// sequences started again): its projections up to the checkpoint are never folded. Said once
/// per fold start, with what to do, rather than left silent.
fn warn_if_recreated(last: u64, checkpoint: u64) -> bool {
    if last >= checkpoint {
        return false;
    }
    warn!(
        stream_last = last,
        checkpoint,
        "the projection stream ends before the work-session fold's checkpoint: it was recreated, and its projections up to the checkpoint will not be folded; to fold it whole, stop the workers and empty the work-session bucket (docs/operations.md, \"Folding the work sessions again\")"
    );
    true
}

/// Whether the fold's checkpoint is still at `revision`, where this fold found it.
async fn unmoved(kv: &kv::Store, reconnects: &Reconnects, revision: u64) -> Result<bool, String> {
    Ok(read_checkpoint(kv, reconnects, FOLD_KEY)
        .await?
        .is_some_and(|(_, now)| now == revision))
}

/// The ranges of projections missing from a round that starts at projection `from` and reads
/// `seqs`: gone from the stream before the fold read them (aged out, purged or deleted).
fn gaps(from: u64, seqs: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut expected = from;
    let mut found = Vec::new();
    for seq in seqs {
        if seq > expected {
            found.push((expected, seq - 1));
        }
        expected = expected.max(seq + 1);
    }
    found
}

/// Count and log `gaps` (see [`gaps`]): their events are missing from the work sessions, never
/// silently.
fn report_gaps(gaps: &[(u64, u64)]) {
    for &(from, to) in gaps {
        let missing = to - from + 1;
        metrics::counter!(crate::telemetry::SESSION_FOLD_SKIPPED).increment(missing);
        warn!(
            from,
            to,
            missing,
            "projections were gone from the stream before the work-session fold read them (aged out, purged or deleted); their events are not in the work sessions"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cache_lets_the_least_recently_kept_go_past_its_bytes() {
        let kept = |bytes| Cached {
            session: None,
            revision: 1,
            bytes,
        };
        let mut cache = SessionCache::new(1000);
        cache.keep("a".into(), kept(400));
        cache.keep("b".into(), kept(400));
        assert_eq!(cache.bytes, 800);
        // Taken out while written, back in after: its size counts once.
        let a = cache.take("a").map(|c| c.bytes);
        assert_eq!((a, cache.bytes), (Some(400), 400));
        cache.keep("a".into(), kept(500));
        assert_eq!(cache.bytes, 900);
        // Past the bound: the least recently kept (b) goes, then as many as it takes.
        cache.keep("c".into(), kept(300));
        assert!(cache.take("b").is_none());
        assert_eq!(cache.bytes, 800);
        cache.keep("d".into(), kept(950));
        assert!(cache.take("a").is_none() && cache.take("c").is_none());
        assert_eq!(cache.bytes, 950);
        // A session larger than the whole bound is not kept at all.
        cache.keep("e".into(), kept(2000));
        assert_eq!(cache.bytes, 0);
        assert!(cache.take("e").is_none() && cache.take("d").is_none());
        // Kept again under the same id: the older size is replaced, not added.
        cache.keep("f".into(), kept(100));
        cache.keep("f".into(), kept(200));
        assert_eq!(cache.bytes, 200);
    }

    #[test]
    fn what_the_fold_reads_back_is_an_event_a_fence_claim_or_unreadable() {
        let env =
            br#"{"type":"task.updated","eventRole":"orchestration.task","conversationId":"c1"}"#;
        assert!(matches!(
            read_back("collab.proj.orchestration.task.c1.task.updated", env),
            ReadBack::Event(_)
        ));
        assert!(
            matches!(read_back("collab.proj._fence.3", b""), ReadBack::NotAnEvent),
            "a partition's fence claim is no event and nothing unreadable"
        );
        let newer = br#"{"type":"a2a.send","eventRole":"conversation.future"}"#;
        assert!(matches!(
            read_back("collab.proj.conversation.future.c1.a2a.send", newer),
            ReadBack::Unreadable(_)
        ));
        assert!(matches!(
            read_back("collab.proj.conversation.main.c1.a2a.send", b"not json"),
            ReadBack::Unreadable(_)
        ));
    }

    #[test]
    fn an_alias_reads_as_it_stood_at_each_projection_of_its_round_and_after() {
        let alias = Alias {
            from: 10,
            before: Some("ws_a".into()),
            moves: vec![(12, "ws_b".into()), (15, "ws_c".into())],
        };
        let at = |seq| alias.as_at(seq).map(|ws| ws.map(str::to_string));
        assert_eq!(at(9), None, "before the round that wrote it: overtaken");
        assert_eq!(at(10), Some(Some("ws_a".into())));
        assert_eq!(
            at(12),
            Some(Some("ws_a".into())),
            "the move at 12 is after 12's start"
        );
        assert_eq!(at(13), Some(Some("ws_b".into())));
        assert_eq!(at(16), Some(Some("ws_c".into())));
        assert_eq!(at(1_000), Some(Some("ws_c".into())));
        let new = Alias {
            from: 3,
            before: None,
            moves: vec![(4, "ws_a".into())],
        };
        assert_eq!(new.as_at(3), Some(None), "none before its first move");
        let round_trip: Alias =
            serde_json::from_slice(&serde_json::to_vec(&alias).expect("encoded")).expect("decoded");
        assert_eq!(round_trip, alias);
        assert_eq!(alias.last(), Some("ws_c"));
        assert_eq!(alias.at_round_start(9, Aliases::Positioned, 5), None);
        let set_back = Aliases::AsTheyStand { written_before: 7 };
        assert_eq!(
            alias.at_round_start(9, set_back, 5),
            Some(Some("ws_c")),
            "stored before the checkpoint went back: taken as it stands"
        );
        assert_eq!(
            alias.at_round_start(9, set_back, 8),
            None,
            "stored after: another fold's, ahead of this one"
        );
    }

    #[test]
    fn a_round_that_moves_an_alias_too_often_keeps_its_first_moves_and_its_last() {
        let moves: Vec<(u64, String)> = (1..=1000).map(|seq| (seq, format!("ws_{seq}"))).collect();
        let kept = bounded_moves(moves);
        assert_eq!(kept.len(), MAX_ALIAS_MOVES);
        assert_eq!(kept[0], (1, "ws_1".to_string()));
        assert_eq!(kept[MAX_ALIAS_MOVES - 2], (255, "ws_255".to_string()));
        assert_eq!(kept[MAX_ALIAS_MOVES - 1], (1000, "ws_1000".to_string()));
        let alias = Alias {
            from: 1,
            before: None,
            moves: kept,
        };
        assert_eq!(
            alias.as_at(1001),
            Some(Some("ws_1000")),
            "the alias the round left"
        );
        assert_eq!(alias.as_at(100), Some(Some("ws_99")));
        let few = vec![(3, "ws_a".to_string())];
        assert_eq!(bounded_moves(few.clone()), few);
    }

    #[test]
    fn an_alias_stored_as_a_bare_session_holds_from_the_start() {
        for stored in ["ws_d", "1234", "{\"from\":3}"] {
            let alias = Alias::legacy(stored.as_bytes());
            assert_eq!(alias.as_at(0), Some(Some(stored)), "{stored}");
            assert_eq!(alias.as_at(u64::MAX), Some(Some(stored)), "{stored}");
        }
    }

    #[test]
    fn a_stream_that_ends_before_the_checkpoint_is_said_to_be_recreated() {
        assert!(warn_if_recreated(10, 500));
        assert!(!warn_if_recreated(500, 500), "caught up exactly");
        assert!(!warn_if_recreated(900, 500));
        assert!(!warn_if_recreated(0, 0), "a new deployment");
    }

    #[test]
    fn gaps_in_a_round_are_found_at_its_start_and_inside_it() {
        assert_eq!(gaps(5, [5, 6, 7]), []);
        assert_eq!(gaps(5, [9, 10]), [(5, 8)], "gone before the round");
        assert_eq!(gaps(5, [5, 8, 9, 12]), [(6, 7), (10, 11)], "gone inside it");
        assert_eq!(gaps(5, []), []);
    }

    #[test]
    fn keys_are_kv_safe_and_aliases_never_collide_with_sessions() {
        assert_eq!(session_key("ws_1"), "ws_1");
        assert_eq!(session_key("agent:x"), "_bYWdlbnQ6eA");
        assert_eq!(alias_key("c1"), "alias.c1");
        assert_eq!(legacy_alias_key("c1"), "conv.c1");
        // Session keys never hold a dot; alias keys always do.
        assert!(!session_key("a.b").contains('.'));
    }
}
