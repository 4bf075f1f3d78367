//! Settings: one serde struct per section of `config/default.toml`, defaults shared between serde
//! and `Default`, unknown keys rejected, and validation into typed values once at start.
//!
//! Sources, later ones winning: built-in defaults, the TOML file (`--config`), environment
//! variables `COLLAB_<SECTION>__<KEY>` (e.g. `COLLAB_NATS__URL`, `COLLAB_TURNS__DEFAULT_TIMEOUT=90s`, `COLLAB_RUNS__TIMEOUT=2s`,
//! `COLLAB_ROLES__MAIN_AGENTS=ruda,eden`), then command-line flags.

use crate::ingest::adapter::{AdapterLimits, AdapterMode};
use crate::model::Role;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not the loader's error as a source: its text may repeat a mistyped secret, which
    /// [`describe_load_error`] leaves out.
    #[error("configuration: {}", describe_load_error(.0))]
    Load(config::ConfigError),
    #[error("configuration: {0}")]
    Invalid(String),
}

impl From<config::ConfigError> for ConfigError {
    fn from(e: config::ConfigError) -> Self {
        ConfigError::Load(e)
    }
}

/// A loading error as a user reads it: the key path with its dots (`usage.prices[0].input`), an
/// unknown enum value named as such, and no value of a key that may hold a secret (a token, a
/// password) repeated, however it was mistyped.
fn describe_load_error(e: &config::ConfigError) -> String {
    describe_at(e, None)
}

/// [`describe_load_error`] for an error found under `outer_key` (the key an `At` wrapping it
/// names), which decides whether a value may be shown when the error names no key itself.
fn describe_at(e: &config::ConfigError, outer_key: Option<&str>) -> String {
    use config::ConfigError as E;
    let where_ = |key: &Option<String>, origin: &Option<String>| {
        let mut s = String::new();
        if let Some(k) = key {
            s.push_str(&format!(" for key `{}`", dotted_key(k)));
        }
        if let Some(o) = origin {
            s.push_str(&format!(" in {o}"));
        }
        s
    };
    match e {
        E::Type {
            origin,
            unexpected,
            expected,
            key,
        } => {
            // The loader's type for what it found is private; its text is `string "<value>"`
            // for a string.
            let shown = unexpected.to_string();
            let secret = key.as_deref().or(outer_key).is_some_and(may_hold_secret);
            let found = if secret {
                shown
                    .split_once(' ')
                    .map_or(shown.as_str(), |(kind, _)| kind)
                    .to_string()
            } else {
                shown
            };
            format!(
                "invalid type: {found}, expected {expected}{}",
                where_(key, origin)
            )
        }
        E::At { error, origin, key } => {
            let inner = match error.as_ref() {
                E::Message(m) => match m.split_once(" does not have variant constructor ") {
                    Some((_, value)) if m.starts_with("enum ") => {
                        let value = if key.as_deref().or(outer_key).is_some_and(may_hold_secret) {
                            "the value".to_string()
                        } else {
                            format!("{value:?}")
                        };
                        format!(
                            "{value} is not one of the accepted values (config/default.toml lists them)"
                        )
                    }
                    _ if key.as_deref().or(outer_key).is_some_and(may_hold_secret) => {
                        hide_quoted(m)
                    }
                    _ => m.clone(),
                },
                other => describe_at(other, key.as_deref().or(outer_key)),
            };
            format!("{inner}{}", where_(key, origin))
        }
        other => other.to_string(),
    }
}

/// `m` with every double-quoted value in it (as serde quotes what it found) replaced by
/// `(hidden)`.
fn hide_quoted(m: &str) -> String {
    let mut out = String::with_capacity(m.len());
    let mut quoted = false;
    let mut escaped = false;
    for c in m.chars() {
        if quoted {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => {
                    quoted = false;
                    out.push_str("(hidden)");
                }
                _ => escaped = false,
            }
        } else if c == '"' {
            quoted = true;
        } else {
            out.push(c);
        }
    }
    if quoted {
        out.push_str("(hidden)");
    }
    out
}

/// A key path with a dot after each index (`a[0].b`, where the loader writes `a[0]b`).
fn dotted_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    let mut after_index = false;
    for c in key.chars() {
        if after_index && c != '.' && c != '[' {
            out.push('.');
        }
        after_index = c == ']';
        out.push(c);
    }
    out
}

/// Whether a setting's value may be a secret, and so never belongs in an error message.
fn may_hold_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "token", "password", "secret", "creds", "nkey", "jwt", "seed", "header",
    ]
    .iter()
    .any(|word| key.contains(word))
}

/// The whole configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub nats: NatsSettings,
    pub roles: RoleSettings,
    pub adapter: AdapterSettings,
    pub limits: LimitSettings,
    pub redaction: RedactionSettings,
    pub consumer: ConsumerSettings,
    pub turns: TurnSettings,
    pub runs: RunSettings,
    pub projection: ProjectionSettings,
    pub http: HttpSettings,
    pub workers: WorkerSettings,
    pub storage: StorageSettings,
    pub usage: UsageSettings,
    pub otel: OtelSettings,
}

/// Token usage and cost (docs/contract.md, section 2c).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct UsageSettings {
    /// The price table, per model; cost is computed from it only, never read from the wire.
    pub prices: Vec<crate::usage::Price>,
}

/// The OpenTelemetry export of turns, runs and tool calls (docs/otel.md). The standard
/// `OTEL_EXPORTER_OTLP_*` and `OTEL_SERVICE_NAME` variables override these.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OtelSettings {
    /// The OTLP endpoint's base URL (as `OTEL_EXPORTER_OTLP_ENDPOINT`); empty: no export.
    pub endpoint: String,
    /// `http/protobuf`, `http/json` or `grpc` (as `OTEL_EXPORTER_OTLP_PROTOCOL`).
    pub protocol: String,
    /// The exported spans' `service.name` (as `OTEL_SERVICE_NAME`).
    pub service_name: String,
    /// How long one export request may take before its spans are dropped (counted).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Open turns, runs and tool calls held while their end has not come, each; past it the
    /// oldest is given up (counted).
    pub max_open: usize,
}

impl Default for OtelSettings {
    fn default() -> Self {
        OtelSettings {
            endpoint: String::new(),
            protocol: "http/protobuf".into(),
            service_name: "collab-projector".into(),
            timeout: Duration::from_secs(10),
            max_open: 10_000,
        }
    }
}

const MIB: i64 = 1024 * 1024;
const GIB: i64 = 1024 * MIB;

/// Size limits of the streams and buckets `provision` creates (and adds to existing ones). What
/// happens when one is full is in docs/operations.md, "Storage limits": every stream and bucket
/// refuses new writes, so nothing accepted is ever dropped: producers get an error, workers
/// wait and retry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageSettings {
    /// Bytes the raw stream may hold; when full, producers' publishes are refused.
    pub raw_max_bytes: i64,
    /// Bytes the projection stream may hold; when full, publishing projections waits (and the
    /// partitions with it) until room is made.
    pub proj_max_bytes: i64,
    /// Bytes the dead-letter stream may hold; when full, dead-lettering waits (and the partition
    /// with it) until room is made.
    pub dlq_max_bytes: i64,
    /// Bytes of the turn bucket.
    pub turns_max_bytes: i64,
    /// Bytes of the work-session bucket.
    pub sessions_max_bytes: i64,
    /// Bytes of the lease bucket.
    pub leases_max_bytes: i64,
    /// Bytes of the object store of offloaded fields.
    pub blobs_max_bytes: i64,
}

impl Default for StorageSettings {
    fn default() -> Self {
        StorageSettings {
            raw_max_bytes: 2 * GIB,
            proj_max_bytes: 3 * GIB,
            dlq_max_bytes: 512 * MIB,
            turns_max_bytes: 256 * MIB,
            sessions_max_bytes: 256 * MIB,
            leases_max_bytes: 16 * MIB,
            blobs_max_bytes: 512 * MIB,
        }
    }
}

impl StorageSettings {
    /// Each limit with its setting name.
    pub fn limits(&self) -> [(&'static str, i64); 7] {
        [
            ("storage.raw_max_bytes", self.raw_max_bytes),
            ("storage.proj_max_bytes", self.proj_max_bytes),
            ("storage.dlq_max_bytes", self.dlq_max_bytes),
            ("storage.turns_max_bytes", self.turns_max_bytes),
            ("storage.sessions_max_bytes", self.sessions_max_bytes),
            ("storage.leases_max_bytes", self.leases_max_bytes),
            ("storage.blobs_max_bytes", self.blobs_max_bytes),
        ]
    }
}

/// Partition ownership among N workers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// This worker's id (default: host name, process id and a random suffix): dot-separated
    /// parts of ASCII letters, digits, `_` and `-` (at most 128 each); it names the worker's
    /// heartbeat key in the lease bucket.
    pub id: Option<String>,
    /// A partition lease lapses this long after its owner's last renewal (renewed every sixth of
    /// it; an owner cut off from the server stops working its partitions a third of it after its
    /// last renewal). Failover after a crash takes at most about this long.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How long a stopping worker (SIGTERM, Ctrl-C) waits for its partitions to drain: flush
    /// their open turn records, publish what they hold and acknowledge it. A partition still
    /// draining then is abandoned unacknowledged (its next owner processes those inputs again,
    /// and their outputs' Msg-Ids keep them single), its lease left to lapse, and the process
    /// exits with status 1 naming it. The process is gone within this and about 7 s more (at
    /// least 2 s to hand the leases back, at most 5 s to flush the last acknowledgements): keep
    /// that below the grace period of whatever stops the process (Kubernetes: 30 s).
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// How many nice levels (0 to 19) the thread that folds work sessions and exports
    /// OpenTelemetry spans runs below the rest of the worker (capped at 19, the lowest; Linux
    /// only, elsewhere ignored with a warning). Under load that thread then takes only the CPU
    /// the partitions leave: their throughput and latency gain, and work sessions and span
    /// exports lag further behind the input until the load drops (`collab_session_fold_behind`).
    /// 0 gives it the partitions' priority.
    pub fold_niceness: u8,
    /// Run no work-session fold on this worker. Not a setting: `bench --only breakdown` sets it
    /// to measure what the fold costs.
    #[serde(skip)]
    pub without_session_fold: bool,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            id: None,
            lease_ttl: Duration::from_secs(6),
            drain_timeout: Duration::from_secs(20),
            fold_niceness: 19,
            without_session_fold: false,
        }
    }
}

/// Connection and naming. Stream and bucket names derive from `prefix`.
///
/// A connection authenticates one way at most: `token`, `user` with `password`, an NKey
/// (`nkey_seed` or `nkey_seed_file`), or a credentials file (`creds_file`). TLS (`tls_*`) combines
/// with any of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NatsSettings {
    /// Server URL(s), comma-separated for a cluster.
    pub url: String,
    /// Subject prefix; streams are `<PREFIX>_RAW`, `_PROJ`, `_DLQ`, buckets `<prefix>_turns`, ...
    pub prefix: String,
    /// Projection version: empty for the deployment's own projections; a name (`v2`) for a
    /// version computed beside them from the same raw stream (`collab-projector reproject`),
    /// whose streams, buckets, consumers and subjects are under `<prefix>_<version>` while the
    /// raw stream stays `<PREFIX>_RAW`.
    pub version: String,
    /// Number of partitions: the units of order, ownership and parallelism. One of the counts
    /// the raw stream's layout carries (1, 2, 4, ... up to `max_partitions` for a stream made
    /// by this release); a projection version may use another one (repartitioning).
    pub partitions: u16,
    /// The largest partition count a new raw stream supports (a power of two, at most 1024):
    /// the stream stores a key's events under one token per power of two up to it,
    /// `<prefix>.in.<h%2>.<h%4>...<h%max>.<key>...`, so any of those counts reads its
    /// partitions with one filter each. Used only when the raw stream is created; an existing
    /// stream's layout is read from it.
    pub max_partitions: u16,
    /// How many streams raw traffic is spread over (1, or a power of two that divides
    /// `partitions`): with more than one, the server's subject mapping
    /// (`collab-projector shards`) sends a key's events to stream `h % shards` of
    /// `<PREFIX>_RAW_<i>OF<shards>`, so their leaders can sit on different nodes and partition `p`
    /// reads stream `p % shards` alone. Fixed when the raw streams are created.
    pub shards: u16,
    /// The raw stream's layout once read from the stream (`bus::provision::adopt_layout`).
    #[serde(skip)]
    pub layout: Option<Layout>,
    /// Raw streams written before the current ones, oldest first, as found on the server
    /// (`collab-projector reshard` leaves them sealed until every partition has read them).
    #[serde(skip)]
    pub earlier: Vec<RawGen>,
    /// The first sequence of the current raw streams (0 for streams made before any reshard).
    #[serde(skip)]
    pub raw_base: u64,
    /// Stream and bucket replicas (3 on a 3-node cluster).
    pub replicas: usize,
    /// How a partition stores its outputs: as atomic batches (one per stream per group of
    /// inputs the acker takes at once) or one acknowledged publish each.
    pub publish_batches: PublishBatches,
    /// How long raw events are kept.
    #[serde(with = "humantime_serde")]
    pub raw_max_age: Duration,
    /// How long dead letters are kept.
    #[serde(with = "humantime_serde")]
    pub dlq_max_age: Duration,
    /// Token authentication.
    pub token: Option<Secret>,
    /// User name for user/password authentication (with `password`).
    pub user: Option<String>,
    /// Password for `user`.
    pub password: Option<Secret>,
    /// NKey authentication: the user's seed (`SU...`).
    pub nkey_seed: Option<Secret>,
    /// NKey authentication: a file holding the user's seed.
    pub nkey_seed_file: Option<PathBuf>,
    /// Decentralised (JWT) authentication: a credentials file with the user's JWT and seed.
    pub creds_file: Option<PathBuf>,
    /// Refuse a connection that is not TLS. Also implied by a `tls://` URL and by any `tls_*` file.
    pub tls_required: bool,
    /// PEM file of the CA certificate(s) that signed the server's certificate; replaces the
    /// system's trusted roots.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM file of this client's certificate (with `tls_key_file`), for servers that verify
    /// clients.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM file of the private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Prefix of this client's reply subjects, for servers whose permissions give each user its
    /// own inboxes.
    pub inbox_prefix: String,
}

impl Default for NatsSettings {
    fn default() -> Self {
        NatsSettings {
            url: "nats://127.0.0.1:4222".into(),
            prefix: "collab".into(),
            version: String::new(),
            partitions: 16,
            max_partitions: DEFAULT_MAX_PARTITIONS,
            shards: 1,
            layout: None,
            earlier: Vec::new(),
            raw_base: 0,
            replicas: 1,
            publish_batches: PublishBatches::Auto,
            raw_max_age: Duration::from_secs(7 * 24 * 3600),
            dlq_max_age: Duration::from_secs(30 * 24 * 3600),
            token: None,
            user: None,
            password: None,
            nkey_seed: None,
            nkey_seed_file: None,
            creds_file: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            inbox_prefix: "_INBOX".into(),
        }
    }
}

/// A secret setting (a token, a password, an NKey seed). Its `Debug` and `Display` print
/// `[redacted]`, and so does its serialisation, so no log line or settings dump shows it; the
/// value is read only through [`Secret::expose`].
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("[redacted]")
    }
}

/// How a connection authenticates, as the settings say (see [`NatsSettings::auth`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsAuth<'a> {
    None,
    Token(&'a Secret),
    UserPassword(&'a str, &'a Secret),
    NkeySeed(&'a Secret),
    NkeySeedFile(&'a Path),
    CredsFile(&'a Path),
}

impl NatsAuth<'_> {
    /// The method and the settings that configure it, for error messages (never the secret).
    pub fn describe(&self) -> String {
        match self {
            NatsAuth::None => "no credentials".into(),
            NatsAuth::Token(_) => "token (nats.token)".into(),
            NatsAuth::UserPassword(user, _) => {
                format!("user {user:?} and password (nats.user, nats.password)")
            }
            NatsAuth::NkeySeed(_) => "NKey seed (nats.nkey_seed)".into(),
            NatsAuth::NkeySeedFile(path) => {
                format!("NKey seed file {} (nats.nkey_seed_file)", path.display())
            }
            NatsAuth::CredsFile(path) => {
                format!("credentials file {} (nats.creds_file)", path.display())
            }
        }
    }
}

/// `nats.publish_batches`: how partitions store their outputs: as batches sent one after the
/// other by each partition (atomic batches, NATS 2.12, `allow_atomic` on the projection and
/// dead-letter streams; fast-ingest batches, NATS 2.14, `allow_batched`), or one acknowledged
/// publish per output, pipelined.
///
/// On a replicated stream a partition's fenced outputs go one proposal at a time (the leader
/// refuses a second expectation on the fence subject while one is proposed), so one acknowledged
/// publish per output is slow there and its retries can reorder a key's outputs; one atomic batch
/// per stream per group of inputs, one group at a time, is one proposal for the whole group and
/// keeps every key's order. On one server an atomic batch costs the server more than the
/// publishes it replaces; a fast-ingest batch does not, and its gap detection keeps a key's
/// order across a dropped connection, where a pipelined publish lost with the connection would
/// be stored after the ones queued behind it (`fast`, and `auto` on one replica).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublishBatches {
    /// Atomic batches when the projection stream has more than one replica, fast-ingest
    /// batches otherwise (one publish per output on a server older than 2.14).
    Auto,
    /// Always atomic batches (`atomic` says the same).
    #[serde(alias = "atomic")]
    Always,
    /// Fast-ingest batches; atomic batches on a replicated projection stream (whose leader
    /// would propose a fast batch's messages one at a time), with a warning.
    Fast,
    /// Never batches: one acknowledged publish per output, pipelined (a key's order is not
    /// kept across a dropped connection).
    Never,
}

/// `[nats]` keys whose environment values are taken verbatim, never parsed as numbers or
/// booleans: a password `0012` must stay `0012`.
const VERBATIM_ENV_KEYS: &[&str] = &[
    "nats.token",
    "nats.user",
    "nats.password",
    "nats.nkey_seed",
    "nats.nkey_seed_file",
    "nats.creds_file",
    "nats.tls_ca_file",
    "nats.tls_cert_file",
    "nats.tls_key_file",
    "nats.inbox_prefix",
];

impl NatsSettings {
    /// The one authentication method configured (validation refuses more than one).
    pub fn auth(&self) -> NatsAuth<'_> {
        if let Some(token) = &self.token {
            NatsAuth::Token(token)
        } else if let (Some(user), Some(password)) = (&self.user, &self.password) {
            NatsAuth::UserPassword(user, password)
        } else if let Some(seed) = &self.nkey_seed {
            NatsAuth::NkeySeed(seed)
        } else if let Some(path) = &self.nkey_seed_file {
            NatsAuth::NkeySeedFile(path)
        } else if let Some(path) = &self.creds_file {
            NatsAuth::CredsFile(path)
        } else {
            NatsAuth::None
        }
    }

    /// Whether the connection must be TLS: asked for, or implied by a CA or client certificate.
    pub fn tls(&self) -> bool {
        self.tls_required
            || self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
            || self.tls_key_file.is_some()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.url.split(',').all(|u| u.trim().is_empty()) {
            return bad("nats.url is empty: name a server, e.g. nats://127.0.0.1:4222 (--nats-url, NATS_URL or COLLAB_NATS__URL; several separated by commas)".into());
        }
        for url in self.url.split(',').map(str::trim) {
            let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
            let authority = authority.split(['/', '?', '#']).next().unwrap_or_default();
            if authority.contains('@') {
                // The URL itself is not repeated: it holds a secret.
                return bad("nats.url embeds credentials (user:password@ or token@), which the client does not send and logs would show: remove them and set nats.user and nats.password, or nats.token".into());
            }
        }
        let empty = [
            ("nats.token", self.token.as_ref().map(Secret::expose)),
            ("nats.user", self.user.as_deref()),
            ("nats.password", self.password.as_ref().map(Secret::expose)),
            (
                "nats.nkey_seed",
                self.nkey_seed.as_ref().map(Secret::expose),
            ),
        ];
        for (key, value) in empty {
            if value.is_some_and(|v| v.trim().is_empty()) {
                return bad(format!(
                    "{key} is set but empty: give it a value or unset it"
                ));
            }
        }
        let mut methods = Vec::new();
        if self.token.is_some() {
            methods.push("nats.token");
        }
        if self.user.is_some() || self.password.is_some() {
            methods.push("nats.user/nats.password");
        }
        if self.nkey_seed.is_some() {
            methods.push("nats.nkey_seed");
        }
        if self.nkey_seed_file.is_some() {
            methods.push("nats.nkey_seed_file");
        }
        if self.creds_file.is_some() {
            methods.push("nats.creds_file");
        }
        if methods.len() > 1 {
            return bad(format!(
                "{} are all set, but a connection authenticates one way: keep one of them",
                methods.join(" and ")
            ));
        }
        match (&self.user, &self.password) {
            (Some(_), None) => {
                return bad("nats.user is set without nats.password: set both or neither".into())
            }
            (None, Some(_)) => {
                return bad("nats.password is set without nats.user: set both or neither".into())
            }
            _ => {}
        }
        if let Some(seed) = &self.nkey_seed {
            if !looks_like_user_seed(seed.expose().trim()) {
                return bad("nats.nkey_seed is not an NKey user seed (58 characters starting with SU): give the seed, not the public key (U...)".into());
            }
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => {
                return bad("nats.tls_cert_file is set without nats.tls_key_file (the certificate's private key): set both or neither".into())
            }
            (None, Some(_)) => {
                return bad("nats.tls_key_file is set without nats.tls_cert_file (the client certificate): set both or neither".into())
            }
            _ => {}
        }
        let files = [
            ("nats.nkey_seed_file", &self.nkey_seed_file),
            ("nats.creds_file", &self.creds_file),
            ("nats.tls_ca_file", &self.tls_ca_file),
            ("nats.tls_cert_file", &self.tls_cert_file),
            ("nats.tls_key_file", &self.tls_key_file),
        ];
        for (key, path) in files {
            if let Some(path) = path {
                if !path.is_file() {
                    return bad(format!("{key}: {} is not a file", path.display()));
                }
            }
        }
        let prefix = &self.inbox_prefix;
        if prefix.is_empty()
            || prefix.split('.').any(|token| {
                token.is_empty()
                    || token == "*"
                    || token == ">"
                    || token.chars().any(|c| c.is_whitespace())
            })
        {
            return bad(format!(
                "nats.inbox_prefix {prefix:?} must be one or more subject tokens without wildcards (e.g. _INBOX or _INBOX_workers)"
            ));
        }
        Ok(())
    }
}

/// The shape of an NKey user seed: 58 base32 characters starting with `SU`. The client checks
/// its checksum when it signs; this catches a public key or a truncated value at load.
pub fn looks_like_user_seed(seed: &str) -> bool {
    seed.len() == 58
        && seed.starts_with("SU")
        && seed
            .chars()
            .all(|c| c.is_ascii_uppercase() || ('2'..='7').contains(&c))
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoleSettings {
    /// Agent ids that are main agents (trimmed, case-insensitive).
    pub main_agents: Vec<String>,
    /// Dead-letter (`identity_missing`) every raw input whose subject names no publishing agent
    /// (`<prefix>.raw.<key>._as.<agent>.<type>`): for deployments where every producer has its
    /// own NATS user (docs/security.md, "Producer identity"). Inputs that name one are always
    /// checked: an event claiming another speaker is dead-lettered `identity_mismatch`. Off by
    /// default; `run` warns at start while it is off.
    pub require_identity: bool,
}

impl Default for RoleSettings {
    fn default() -> Self {
        RoleSettings {
            main_agents: vec!["main".into(), "ruda".into()],
            require_identity: false,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdapterSettings {
    /// `lenient` (substitute missing ids) or `strict` (reject them).
    pub mode: AdapterMode,
    /// Bounds an adapter packet must keep before it is mapped (`[adapter.limits]`); a packet
    /// past one is dead-lettered `adapter_rejected`, the detail naming the bound.
    pub limits: AdapterLimits,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitSettings {
    /// Largest raw message accepted; larger ones are dead-lettered `too_large`.
    pub max_payload_bytes: usize,
    /// Fields larger than this are offloaded to the object store.
    pub max_inline_bytes: usize,
    /// Deepest JSON nesting accepted (objects and arrays); deeper input is dead-lettered.
    pub max_depth: usize,
    /// Longest JSON string accepted, in bytes.
    pub max_string_bytes: usize,
    /// Most keys in one JSON object.
    pub max_object_keys: usize,
    /// Most items in one JSON array.
    pub max_array_items: usize,
}

impl Default for LimitSettings {
    fn default() -> Self {
        LimitSettings {
            max_payload_bytes: 1024 * 1024,
            max_inline_bytes: 64 * 1024,
            max_depth: 64,
            max_string_bytes: 1024 * 1024,
            max_object_keys: 10_000,
            max_array_items: 100_000,
        }
    }
}

/// Secret redaction beyond the built-in rules (see `redact`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RedactionSettings {
    /// More sensitive key names: a value under a key that, lower-cased without `_`, `-`, `.` and
    /// spaces, ends with one of them is replaced whole.
    pub keys: Vec<String>,
    /// More patterns to find secrets inside strings: `{ name, pattern }`, the match replaced by
    /// `[redacted:<name>]`.
    pub patterns: Vec<crate::redact::ExtraPattern>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumerSettings {
    /// Messages pulled per request.
    pub batch: usize,
    /// How long the server waits for an acknowledgement before redelivering.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// Deliveries allowed per message; on the last one the worker dead-letters it itself.
    pub max_deliver: i64,
    /// Unacknowledged messages allowed per partition consumer.
    pub max_ack_pending: i64,
    /// Projection publishes awaiting their ack, per worker.
    pub publish_window: usize,
    /// Partition consumers keep their state (deliveries, acknowledgements) in the server's
    /// memory instead of a file rewritten as acknowledgements move. A consumer lost with it (a
    /// server restart) is recreated from the partition's checkpoint like a deleted one.
    pub memory_state: bool,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        ConsumerSettings {
            batch: 500,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
            max_ack_pending: 2000,
            publish_window: 4096,
            memory_state: true,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TurnSettings {
    /// Deadline for a turn whose send names none.
    #[serde(with = "humantime_serde")]
    pub default_timeout: Duration,
    /// Cap on a send's own `timeoutMs` / deadline.
    #[serde(with = "humantime_serde")]
    pub max_timeout: Duration,
    /// How long a decided turn is remembered.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// Roles whose turns get exactly one response.
    pub enforce_roles: Vec<Role>,
    /// How far the NATS server's clock may lag this worker's; an idle partition's watermark is
    /// "now" minus this.
    #[serde(with = "humantime_serde")]
    pub clock_skew: Duration,
    /// How long a new turn's open record may wait to be written: a turn decided within it
    /// costs one state write (its decision) instead of two. Its send stays unacknowledged
    /// meanwhile. Zero writes every open record at once.
    #[serde(with = "humantime_serde")]
    pub open_write_delay: Duration,
    /// How long a response stored before its turn's send is held waiting for it (docs/contract.md
    /// section 4): the send then says whether its target spoke it. With no send by then, it
    /// decides the turn alone. A ping-pong reply (a turn `n` with no send, spoken between the
    /// two sides of turn `n - 1`) is never held. Zero takes every such response as the turn's at
    /// once, and lets any agent that can guess a turn's id answer it before its send arrives.
    #[serde(with = "humantime_serde")]
    pub early_hold: Duration,
    /// How many open turns' whole records each partition keeps in memory, the ones opened
    /// last (a turn gives its place up when it closes): a turn decided by its deadline, or
    /// answered, whose record is not kept reads it from the turns bucket first. 0 keeps none.
    pub kept_records: usize,
}

impl Default for TurnSettings {
    fn default() -> Self {
        TurnSettings {
            default_timeout: Duration::from_secs(300),
            max_timeout: Duration::from_secs(3600),
            retention: Duration::from_secs(7 * 24 * 3600),
            enforce_roles: vec![Role::ConversationMain],
            clock_skew: Duration::from_millis(100),
            open_write_delay: Duration::from_millis(500),
            early_hold: Duration::from_secs(60),
            kept_records: 512,
        }
    }
}

/// The run contract (docs/contract.md section 2b): one terminal event per AG-UI run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunSettings {
    /// A run with no `RUN_FINISHED` / `RUN_ERROR` stored this long after its `RUN_STARTED` gets
    /// a synthesised `run.failed` (reason `timeout`).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Enforce the run contract on every AG-UI run, whatever its role. Off: AG-UI events are
    /// projected as they come.
    pub enforce: bool,
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            timeout: Duration::from_secs(600),
            enforce: true,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProjectionSettings {
    /// Msg-Id duplicate window of the projection stream.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// How long projections are kept.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
}

impl Default for ProjectionSettings {
    fn default() -> Self {
        ProjectionSettings {
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// Serve HTTP on `addr`: `/healthz`, `/readyz`, `/metrics` and the projection API.
    pub enabled: bool,
    pub addr: String,
    /// Serve the projection API (`/api/...`) too.
    pub api: bool,
    /// Serve the built-in viewer at `/` (needs `api`).
    pub viewer: bool,
    /// Bearer tokens and the roles each may read. Access control is on when any is configured;
    /// the server refuses to bind a non-loopback address with it off.
    pub tokens: Vec<TokenGrant>,
    /// A work session with no event for this long is `QUIET`.
    #[serde(with = "humantime_serde")]
    pub quiet_after: Duration,
    /// A work session with no event for this long is `ARCHIVED`.
    #[serde(with = "humantime_serde")]
    pub archive_after: Duration,
    /// `/healthz` fails while a partition has had messages waiting this long without its
    /// acknowledgements moving (a wedged worker, which a restart would cure).
    #[serde(with = "humantime_serde")]
    pub stall_after: Duration,
    /// Event streams (`/api/events/stream`) open at once, all callers together; one more is
    /// refused with 503.
    pub sse_max_streams: usize,
    /// Event streams open at once per bearer token (grant); one more is refused with 429.
    pub sse_max_streams_per_token: usize,
    /// Events buffered for one stream's client before it counts as too slow.
    pub sse_buffer_events: usize,
    /// Bytes buffered for one stream's client before it counts as too slow.
    pub sse_buffer_bytes: usize,
    /// How long a response may wait on a client that takes nothing (what was sent is not
    /// acknowledged, or its receive window stays at zero) before the connection is closed
    /// (`TCP_USER_TIMEOUT` on each accepted connection, Linux only). An event stream whose
    /// client stopped reading frees its place (`sse_max_streams`) and its buffer then.
    #[serde(with = "humantime_serde")]
    pub client_stall_timeout: Duration,
    /// How long one event stream (`/api/events/stream`) stays open: then it ends with a final
    /// `event: error` (code `lifetime_reached`, with the cursor to resume from), so a client that
    /// stopped reading a quiet stream holds its place no longer than this. Clients reconnect at
    /// once with `Last-Event-ID` and miss nothing.
    #[serde(with = "humantime_serde")]
    pub sse_max_stream_lifetime: Duration,
    /// Work-session lists (`GET /api/work-sessions`, each a read of the whole bucket) being read
    /// at once, all callers together; one more is refused with 503.
    pub session_lists: usize,
    /// Work-session lists being read at once per bearer token (grant); one more is refused with
    /// 429.
    pub session_lists_per_token: usize,
    /// Reads of the projection stream (`/api/events` pages, `/api/search`, `/api/tree`,
    /// `/api/waiting`, `/api/threads`; a search, tree or waiting list reads up to tens of
    /// thousands of events) running at once, all callers together; one more is refused with 503.
    pub scans: usize,
    /// Scans running at once per bearer token (grant); one more is refused with 429.
    pub scans_per_token: usize,
    /// How long one scan may run: then it is stopped and answered 503 `scan_timeout`, so no
    /// request holds the server's reads (and its place) for longer.
    #[serde(with = "humantime_serde")]
    pub scan_timeout: Duration,
}

/// One bearer token and the roles it may read.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenGrant {
    /// A name for logs and metrics (the token itself is never logged).
    pub name: String,
    /// The bearer token. Prefer `token_env` to keep it out of files.
    #[serde(default)]
    pub token: String,
    /// Read the token from this environment variable at start.
    #[serde(default)]
    pub token_env: Option<String>,
    pub roles: Vec<Role>,
}

/// The largest configuration file read: far above any real one, and a bound on a path that is
/// no file (`--config /dev/zero`).
const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// The bytes of `path`, or an error when there are more than `max`.
fn read_capped(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "larger than {max} bytes: is it the configuration file?"
        )));
    }
    Ok(bytes)
}

/// The sections of the settings (`nats`, `http`, ...).
const SECTIONS: [&str; 14] = [
    "nats",
    "roles",
    "adapter",
    "limits",
    "redaction",
    "consumer",
    "turns",
    "runs",
    "projection",
    "http",
    "workers",
    "storage",
    "usage",
    "otel",
];

/// What to say of `var` when it reads as a setting's variable with one underscore between the
/// section and the key (`COLLAB_NATS_URL`: `url` is a key of `nats`), which the settings never
/// read. A name whose rest is no key of the section (`COLLAB_WORKERS_PASSWORD`, a server's
/// variable in docs/security.md) is not a setting's, and is left alone.
fn mistyped_setting(var: &str, defaults: &serde_json::Value) -> Option<String> {
    let rest = var.strip_prefix("COLLAB_")?;
    if rest.contains("__") {
        return None;
    }
    let lower = rest.to_ascii_lowercase();
    let section = SECTIONS.iter().find(|s| {
        lower
            .strip_prefix(**s)
            .and_then(|r| r.strip_prefix('_'))
            .is_some_and(|key| defaults[**s].get(key).is_some())
    })?;
    let key = &rest[section.len() + 1..];
    Some(format!(
        "environment variable {var} is not a setting: a setting's variable has two underscores between its section and its key, COLLAB_{}__{key}",
        section.to_ascii_uppercase()
    ))
}

impl HttpSettings {
    /// The HTTP settings' own checks (part of [`Settings::validate`]).
    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        for grant in &self.tokens {
            if grant.token.trim().is_empty() && grant.token_env.is_none() {
                return bad(format!(
                    "http.tokens \"{}\" has no token: set token or token_env",
                    grant.name
                ));
            }
            if grant.roles.is_empty() {
                return bad(format!("http.tokens \"{}\" grants no role", grant.name));
            }
        }
        for (name, n) in [
            ("http.sse_max_streams", self.sse_max_streams),
            (
                "http.sse_max_streams_per_token",
                self.sse_max_streams_per_token,
            ),
            ("http.sse_buffer_events", self.sse_buffer_events),
            ("http.session_lists", self.session_lists),
            ("http.session_lists_per_token", self.session_lists_per_token),
            ("http.scans", self.scans),
            ("http.scans_per_token", self.scans_per_token),
        ] {
            if n == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.sse_buffer_bytes < 64 * 1024 {
            return bad("http.sse_buffer_bytes must be at least 65536 (64 KiB)".into());
        }
        if self.sse_max_stream_lifetime < Duration::from_secs(1) {
            return bad("http.sse_max_stream_lifetime must be at least 1s (each event stream ends after it, and its client reconnects)".into());
        }
        if self.client_stall_timeout < Duration::from_secs(1) {
            return bad("http.client_stall_timeout must be at least 1s (a slow client's window may close for a moment)".into());
        }
        if self.scan_timeout < Duration::from_secs(1) {
            return bad("http.scan_timeout must be at least 1s (a search over a busy stream takes about a second)".into());
        }
        if self.stall_after < Duration::from_secs(10) {
            return bad("http.stall_after must be at least 10s (lag is sampled every 5s)".into());
        }
        Ok(())
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            enabled: true,
            addr: "127.0.0.1:8080".into(),
            api: true,
            viewer: true,
            tokens: Vec::new(),
            quiet_after: Duration::from_secs(15 * 60),
            archive_after: Duration::from_secs(24 * 3600),
            stall_after: Duration::from_secs(120),
            sse_max_streams: 64,
            sse_max_streams_per_token: 8,
            session_lists: 8,
            session_lists_per_token: 2,
            scans: 32,
            scans_per_token: 8,
            scan_timeout: Duration::from_secs(30),
            sse_buffer_events: 256,
            sse_buffer_bytes: 1024 * 1024,
            client_stall_timeout: Duration::from_secs(60),
            sse_max_stream_lifetime: Duration::from_secs(30 * 60),
        }
    }
}

impl Settings {
    /// Load defaults, then `file` (if any), then `COLLAB_*` environment variables, and validate.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        Settings::load_with(file, |_| {})
    }

    /// Like [`Settings::load`], with `overrides` (command-line flags) applied before the one
    /// validation.
    pub fn load_with(
        file: Option<&Path>,
        overrides: impl FnOnce(&mut Settings),
    ) -> Result<Settings, ConfigError> {
        let mut settings = Settings::read(file)?;
        overrides(&mut settings);
        settings.validate()?;
        Ok(settings)
    }

    fn read(file: Option<&Path>) -> Result<Settings, ConfigError> {
        Settings::read_env(file, std::env::vars())
    }

    /// [`Settings::read`] with the environment given.
    fn read_env(
        file: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Invalid(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            // The TOML parser's own errors give the line, the column and the text at fault;
            // the config crate's lose them for malformed numbers.
            let bytes = read_capped(path, MAX_CONFIG_BYTES).map_err(|e| {
                ConfigError::Invalid(format!("config file {}: {e}", path.display()))
            })?;
            let text = String::from_utf8(bytes).map_err(|e| {
                let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
                let line = good.iter().filter(|b| **b == b'\n').count() + 1;
                let column = good.iter().rev().take_while(|b| **b != b'\n').count() + 1;
                ConfigError::Invalid(format!(
                    "config file {} is not UTF-8 at line {line}, column {column}: save it as UTF-8",
                    path.display()
                ))
            })?;
            if let Err(e) = toml::from_str::<toml::Table>(&text) {
                // Where and why, never the line itself: it may be a password's or a token's.
                let at = e
                    .span()
                    .and_then(|span| text.get(..span.start))
                    .map(|before| {
                        let line = before.matches('\n').count() + 1;
                        let column =
                            before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                        format!(" at line {line}, column {column}")
                    })
                    .unwrap_or_default();
                return Err(ConfigError::Invalid(format!(
                    "config file {} is not valid TOML{at}: {}",
                    path.display(),
                    e.message().trim_end()
                )));
            }
            // The text read and checked above, not the path again: the file is read once (a
            // pipe such as `--config <(...)` has nothing left for a second read, and a file
            // rewritten meanwhile would be used unchecked).
            builder = builder.add_source(config::File::from_str(&text, config::FileFormat::Toml));
        }
        // Only COLLAB_<SECTION>__<KEY> variables are settings; others with the prefix
        // (COLLAB_CONFIG, COLLAB_LOG_FORMAT, test hooks) belong to the command line or the tests.
        // One that names a section with a single underscore (COLLAB_NATS_URL) is a setting
        // mistyped: refused, rather than left unread while the default is used.
        let env: Vec<(String, String)> = env.collect();
        if env.iter().any(|(k, _)| k.starts_with("COLLAB_")) {
            let defaults = serde_json::to_value(Settings::default()).unwrap_or_default();
            let mistyped = env.iter().find_map(|(k, _)| mistyped_setting(k, &defaults));
            if let Some(what) = mistyped {
                return Err(ConfigError::Invalid(what));
            }
        }
        let mut vars: config::Map<String, String> = env
            .into_iter()
            .filter(|(k, _)| {
                k.strip_prefix("COLLAB_")
                    .is_some_and(|rest| rest.contains("__"))
            })
            .collect();
        // Secrets and paths are strings as given: the parsing below would read `0012` as 12.
        let verbatim: Vec<(String, String)> = vars
            .keys()
            .filter_map(|var| {
                let key = var
                    .strip_prefix("COLLAB_")?
                    .to_ascii_lowercase()
                    .replace("__", ".");
                VERBATIM_ENV_KEYS
                    .contains(&key.as_str())
                    .then(|| (var.clone(), key))
            })
            .collect();
        for (var, key) in verbatim {
            if let Some(value) = vars.remove(&var) {
                builder = builder.set_override(key, value)?;
            }
        }
        builder = builder.add_source(
            config::Environment::with_prefix("COLLAB")
                .source(Some(vars))
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("roles.main_agents")
                .with_list_parse_key("turns.enforce_roles"),
        );
        let mut settings: Settings = builder.build()?.try_deserialize()?;
        for grant in &mut settings.http.tokens {
            if let Some(var) = &grant.token_env {
                grant.token = std::env::var(var).map_err(|_| {
                    ConfigError::Invalid(format!(
                        "http.tokens \"{}\": environment variable {var} (token_env) is not set",
                        grant.name
                    ))
                })?;
            }
        }
        Ok(settings)
    }

    /// Parse TOML text (tests).
    #[cfg(test)]
    pub fn from_toml(text: &str) -> Result<Settings, ConfigError> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// The ranges the server or the pipeline can use (part of [`Settings::validate`]).
    fn validate_ranges(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !(1..=5).contains(&self.nats.replicas) {
            return bad(format!(
                "nats.replicas is {}: give 1 to 5, JetStream's range (1 on one server, 3 on a 3-node cluster)",
                self.nats.replicas
            ));
        }
        let window = self.projection.duplicate_window;
        if window.is_zero() {
            return bad("projection.duplicate_window must be more than 0s (the server would put its own 2 minutes in its place, and the stream would then differ from the setting); e.g. 2m".into());
        }
        if !self.projection.max_age.is_zero() && window > self.projection.max_age {
            return bad(format!(
                "projection.duplicate_window ({}) must not be longer than projection.max_age ({}), which the server refuses",
                humantime::format_duration(window),
                humantime::format_duration(self.projection.max_age)
            ));
        }
        if self.limits.max_payload_bytes == 0 {
            return bad("limits.max_payload_bytes must be at least 1 (0 would dead-letter every input as too_large)".into());
        }
        if self.http.quiet_after >= self.http.archive_after {
            return bad(format!(
                "http.quiet_after ({}) must be shorter than http.archive_after ({}): a session goes quiet before it is archived",
                humantime::format_duration(self.http.quiet_after),
                humantime::format_duration(self.http.archive_after)
            ));
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        self.nats.validate()?;
        self.redactor()?;
        let l = &self.limits;
        if l.max_depth == 0 || l.max_depth > 128 {
            return bad("limits.max_depth must be between 1 and 128".into());
        }
        if l.max_inline_bytes != 0 && l.max_inline_bytes < crate::blobs::MIN_INLINE_BYTES {
            return bad(format!(
                "limits.max_inline_bytes must be 0 (never offload) or at least {}: a reference to an offloaded field is a few hundred bytes",
                crate::blobs::MIN_INLINE_BYTES
            ));
        }
        if l.max_string_bytes == 0 || l.max_object_keys == 0 || l.max_array_items == 0 {
            return bad(
                "limits.max_string_bytes, max_object_keys and max_array_items must be at least 1"
                    .into(),
            );
        }
        if !crate::model::is_key_token(&self.nats.prefix) {
            return bad(format!(
                "nats.prefix {:?} must be one subject token of [A-Za-z0-9_-]",
                self.nats.prefix
            ));
        }
        if !self.nats.version.is_empty() && !crate::model::is_key_token(&self.nats.version) {
            return bad(format!(
                "nats.version {:?} must be empty or one subject token of [A-Za-z0-9_-] (e.g. v2)",
                self.nats.version
            ));
        }
        let a = &self.adapter.limits;
        if a.max_bytes == 0 || a.max_depth == 0 || a.max_array_len == 0 {
            return bad(
                "adapter.limits.max_bytes, max_depth and max_array_len must be at least 1".into(),
            );
        }
        if self.nats.partitions == 0 || self.nats.partitions > 1024 {
            return bad("nats.partitions must be between 1 and 1024".into());
        }
        let m = self.nats.max_partitions;
        if !m.is_power_of_two() || !(2..=1024).contains(&m) {
            return bad(format!(
                "nats.max_partitions ({m}) must be a power of two between 2 and 1024"
            ));
        }
        let k = self.nats.shards;
        if !k.is_power_of_two() || k > m {
            return bad(format!(
                "nats.shards ({k}) must be 1 or a power of two up to nats.max_partitions ({m})"
            ));
        }
        if self.nats.partitions % k != 0 {
            return bad(format!(
                "nats.partitions ({}) must be a multiple of nats.shards ({k}), so each partition reads one raw stream",
                self.nats.partitions
            ));
        }
        if self.consumer.batch == 0 {
            return bad("consumer.batch must be at least 1".into());
        }
        self.validate_ranges()?;
        if self.consumer.max_deliver < 2 {
            return bad("consumer.max_deliver must be at least 2 (the last delivery is used to dead-letter)".into());
        }
        if self.consumer.publish_window == 0 || self.consumer.publish_window >= 5000 {
            return bad("consumer.publish_window must be between 1 and 4999 (the client caps unacknowledged publishes at 5000)".into());
        }
        self.http.validate()?;
        for (name, n) in self.storage.limits() {
            if n < MIB {
                return bad(format!(
                    "{name} ({n}) must be at least 1048576 (1 MiB); every stream and bucket is bounded"
                ));
            }
        }
        if let Some(id) = &self.workers.id {
            if !crate::model::is_key_path(id) {
                return bad(format!(
                    "workers.id {id:?} must be one or more dot-separated parts of 1 to {} ASCII letters, digits, '_' or '-' (e.g. host-1 or host.eu-1): it names the worker's heartbeat key in the lease bucket",
                    crate::model::MAX_TOKEN_LEN
                ));
            }
        }
        if self.workers.lease_ttl < Duration::from_secs(1) {
            return bad("workers.lease_ttl must be at least 1s".into());
        }
        if self.workers.drain_timeout < Duration::from_secs(1) {
            return bad("workers.drain_timeout must be at least 1s".into());
        }
        if self.workers.fold_niceness > 19 {
            return bad(format!(
                "workers.fold_niceness = {} is out of range: it must be 0 to 19 (nice levels the work-session thread runs below the partitions; 0 gives it their priority)",
                self.workers.fold_niceness
            ));
        }
        if self.turns.default_timeout.is_zero()
            || self.turns.max_timeout < self.turns.default_timeout
        {
            return bad(
                "turns.default_timeout must be positive and at most turns.max_timeout".into(),
            );
        }
        if self.runs.timeout.is_zero() {
            return bad("runs.timeout must be positive".into());
        }
        if self.turns.early_hold > self.turns.retention {
            return bad(format!(
                "turns.early_hold ({}) must be at most turns.retention ({}): a held response's record would be forgotten before its hold ends; lower turns.early_hold (60s by default; \"0s\" turns the hold off) or raise turns.retention",
                humantime::format_duration(self.turns.early_hold),
                humantime::format_duration(self.turns.retention)
            ));
        }
        let longest = self.turns.max_timeout.max(self.runs.timeout);
        if longest > self.turns.retention {
            return bad(format!(
                "turns.max_timeout ({}) and runs.timeout ({}) must be at most turns.retention ({}): an open turn's or run's record would be forgotten before its deadline, and it would end with no response; lower them or raise turns.retention",
                humantime::format_duration(self.turns.max_timeout),
                humantime::format_duration(self.runs.timeout),
                humantime::format_duration(self.turns.retention)
            ));
        }
        self.prices()?;
        if !["http/protobuf", "http/json", "grpc"].contains(&self.otel.protocol.as_str()) {
            return bad(format!(
                "otel.protocol is {:?}: use http/protobuf, http/json or grpc",
                self.otel.protocol
            ));
        }
        if self.otel.timeout.is_zero() || self.otel.max_open == 0 {
            return bad("otel.timeout and otel.max_open must be positive".into());
        }
        if self.turns.open_write_delay > self.consumer.ack_wait / 3 {
            return bad(format!(
                "turns.open_write_delay ({}) must be at most a third of consumer.ack_wait ({}): the send it holds unacknowledged would be redelivered",
                humantime::format_duration(self.turns.open_write_delay),
                humantime::format_duration(self.consumer.ack_wait)
            ));
        }
        Ok(())
    }

    /// The price table of `[usage] prices`; an error names the entry that cannot be used.
    pub fn prices(&self) -> Result<crate::usage::Prices, ConfigError> {
        crate::usage::Prices::new(&self.usage.prices).map_err(ConfigError::Invalid)
    }

    pub fn names(&self) -> Names {
        let mut n = Names::versioned(&self.nats.prefix, &self.nats.version);
        n.raw_depth = self.layout().depth();
        n.set_raw_sets(self.nats.shards, self.nats.raw_base, &self.nats.earlier);
        n
    }

    /// The raw stream's layout: the one read from the stream, else the one a new stream gets.
    pub fn layout(&self) -> Layout {
        self.nats
            .layout
            .clone()
            .unwrap_or_else(|| Layout::ladder(self.nats.max_partitions))
    }

    /// The raw subjects partition `p` reads (one filter, see [`Layout::filter`]).
    pub fn partition_filter(&self, p: u16) -> String {
        self.layout()
            .filter(&self.nats.prefix, self.nats.partitions, p)
    }

    /// What normalisation needs of these settings: the one place they are derived from.
    pub fn ingest(&self) -> Result<crate::ingest::Settings, ConfigError> {
        Ok(crate::ingest::Settings {
            main_agents: crate::classify::MainAgents::new(&self.roles.main_agents),
            adapter_mode: self.adapter.mode,
            adapter_limits: self.adapter.limits,
            max_payload_bytes: self.limits.max_payload_bytes,
            shape: crate::ingest::ShapeLimits {
                max_depth: self.limits.max_depth,
                max_string_bytes: self.limits.max_string_bytes,
                max_object_keys: self.limits.max_object_keys,
                max_array_items: self.limits.max_array_items,
            },
            redactor: std::sync::Arc::new(self.redactor()?),
            require_identity: self.roles.require_identity,
        })
    }

    /// The built-in redaction rules plus the configured ones.
    pub fn redactor(&self) -> Result<crate::redact::Redactor, ConfigError> {
        crate::redact::Redactor::new(&self.redaction.keys, &self.redaction.patterns)
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }
}

/// Every JetStream resource and subject name, derived from the prefix.
///
/// A projection version (`nats.version`) reads the same raw stream (`raw_prefix`) and keeps
/// everything it writes apart, under `prefix` = `<prefix>_<version>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// Prefix of everything the workers write: projections, dead letters, state.
    pub prefix: String,
    /// Prefix of the raw subjects producers publish to, and of the raw stream's partitions.
    pub raw_prefix: String,
    /// The version's name; empty for the deployment's own projections.
    pub version: String,
    /// How many partition tokens the raw stream stores between `in` and the key
    /// ([`Layout::depth`]).
    pub raw_depth: usize,
    /// The raw stream when there is one (`<PREFIX>_RAW`); the shards' base name otherwise.
    pub raw_stream: String,
    /// The raw streams, `raw_streams[i]` holding the keys with `h % len == i`: `[raw_stream]`
    /// unsharded, `<PREFIX>_RAW_<i>OF<k>` over `k` shards.
    pub raw_streams: Vec<String>,
    /// The first sequence of `raw_streams` (0 when they were made before any reshard): every
    /// sequence below it is in one of `earlier`.
    pub raw_base: u64,
    /// Raw streams written before `raw_streams` and still on the server, oldest first (see
    /// [`RawGen`]).
    pub earlier: Vec<RawGen>,
    pub proj_stream: String,
    pub dlq_stream: String,
    pub turns_bucket: String,
    pub sessions_bucket: String,
    pub leases_bucket: String,
    pub blobs_store: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        Names::versioned(prefix, "")
    }
    /// The names of projection version `version` (empty: the deployment's own) under `prefix`.
    pub fn versioned(prefix: &str, version: &str) -> Names {
        let out = if version.is_empty() {
            prefix.to_string()
        } else {
            format!("{prefix}_{version}")
        };
        let upper = out.to_ascii_uppercase();
        let raw_stream = format!("{}_RAW", prefix.to_ascii_uppercase());
        Names {
            raw_streams: vec![raw_stream.clone()],
            raw_stream,
            raw_base: 0,
            earlier: Vec::new(),
            proj_stream: format!("{upper}_PROJ"),
            dlq_stream: format!("{upper}_DLQ"),
            turns_bucket: format!("{out}_turns"),
            sessions_bucket: format!("{out}_work_sessions"),
            leases_bucket: format!("{out}_leases"),
            blobs_store: format!("{out}_blobs"),
            raw_prefix: prefix.to_string(),
            version: version.to_string(),
            raw_depth: Layout::ladder(DEFAULT_MAX_PARTITIONS).depth(),
            prefix: out,
        }
    }
    /// Spread the raw streams over `shards` streams (1: the one raw stream).
    pub fn set_shards(&mut self, shards: u16) {
        self.raw_streams = self.shard_stream_names(shards);
    }
    /// The names of `shards` raw streams: `[<PREFIX>_RAW]` for 1, `<PREFIX>_RAW_<i>OF<shards>`
    /// otherwise.
    pub fn shard_stream_names(&self, shards: u16) -> Vec<String> {
        if shards <= 1 {
            vec![self.raw_stream.clone()]
        } else {
            (0..shards)
                .map(|i| format!("{}_{i}OF{shards}", self.raw_stream))
                .collect()
        }
    }
    /// Raw traffic in `shards` streams from sequence `base` on, after the `earlier` sets.
    pub fn set_raw_sets(&mut self, shards: u16, base: u64, earlier: &[RawGen]) {
        self.set_shards(shards);
        self.raw_base = base;
        self.earlier = earlier.to_vec();
    }
    /// The shard count a raw stream's name gives (`<PREFIX>_RAW` 1, `<PREFIX>_RAW_<i>OF<k>`
    /// `k`) with its index; `None` for any other name.
    pub fn shard_of_stream_name(&self, name: &str) -> Option<(u16, u16)> {
        if name == self.raw_stream {
            return Some((0, 1));
        }
        let (i_text, k_text) = name
            .strip_prefix(self.raw_stream.as_str())?
            .strip_prefix('_')?
            .split_once("OF")?;
        let (i, k) = (i_text.parse::<u16>().ok()?, k_text.parse::<u16>().ok()?);
        // Only the names `shard_stream_names` makes: no sign, no leading zero.
        let canonical = i.to_string() == i_text && k.to_string() == k_text;
        (canonical && i < k && k > 1).then_some((i, k))
    }
    /// The raw stream that stored partition `p`'s input of sequence `seq`: the current streams
    /// from [`Names::raw_base`] on, the earlier set the sequence falls in below it.
    pub fn raw_stream_at(&self, p: u16, seq: u64) -> &str {
        match self.earlier_at(seq) {
            Some(g) => g.stream_of(usize::from(p)),
            None => self.raw_stream_of(p),
        }
    }
    /// The raw stream that stored `key`'s input of sequence `seq` (see [`Names::raw_stream_at`]).
    pub fn raw_stream_of_key_at(&self, key: &str, seq: u64) -> &str {
        match self.earlier_at(seq) {
            Some(g) => g.stream_of(g.shard_of_key(key)),
            None => self
                .raw_streams
                .get(self.shard_of_key(key))
                .map_or(self.raw_stream.as_str(), String::as_str),
        }
    }
    /// Partition `p`'s raw streams that hold sequences from `from` on, oldest first, each with
    /// the sequence to read it from.
    pub fn raw_streams_from(&self, p: u16, from: u64) -> Vec<(&str, u64)> {
        let mut bases: Vec<(u64, &str)> = self
            .earlier
            .iter()
            .map(|g| (g.base, g.stream_of(usize::from(p))))
            .collect();
        bases.push((self.raw_base, self.raw_stream_of(p)));
        let ends: Vec<u64> = bases
            .iter()
            .skip(1)
            .map(|(b, _)| *b)
            .chain(std::iter::once(u64::MAX))
            .collect();
        bases
            .into_iter()
            .zip(ends)
            .filter(|((_, _), end)| from < *end)
            .map(|((base, name), _)| (name, from.max(base)))
            .collect()
    }
    /// The earlier set of raw streams sequence `seq` was written to, if it is below the current
    /// streams' first sequence.
    fn earlier_at(&self, seq: u64) -> Option<&RawGen> {
        if seq >= self.raw_base {
            return None;
        }
        self.earlier
            .iter()
            .rev()
            .find(|g| g.base <= seq)
            .or(self.earlier.first())
    }
    /// Every raw stream on the server: the earlier sets', oldest first, then the current ones.
    pub fn all_raw_streams(&self) -> Vec<&str> {
        self.earlier
            .iter()
            .flat_map(|g| g.streams.iter())
            .chain(self.raw_streams.iter())
            .map(String::as_str)
            .collect()
    }
    /// How many streams hold raw traffic.
    pub fn shards(&self) -> u16 {
        u16::try_from(self.raw_streams.len()).unwrap_or(u16::MAX)
    }
    /// The raw stream partition `p` reads (every count of partitions is a multiple of the
    /// shard count, so a partition's keys are all in one shard).
    pub fn raw_stream_of(&self, p: u16) -> &str {
        nth_of(&self.raw_streams, usize::from(p)).unwrap_or(self.raw_stream.as_str())
    }
    /// Subjects producers publish to.
    pub fn raw_subjects(&self) -> String {
        format!("{}.raw.*.>", self.raw_prefix)
    }
    /// What raw stream `i` of the shards captures: the subjects the server's mapping
    /// ([`Names::shard_mapping`]) sends its keys to. Unsharded: [`Names::raw_subjects`].
    pub fn shard_subjects(&self, i: usize) -> String {
        match self.shards() {
            0 | 1 => self.raw_subjects(),
            k => format!("{}.shard.{k}.{i}.*.>", self.raw_prefix),
        }
    }
    /// The account subject mapping sharded raw streams need, as `(source, destination)`:
    /// `<prefix>.raw.<key>.<rest>` to `<prefix>.shard.<k>.<h % k>.<key>.<rest>`, with `h` the
    /// same FNV-1a hash of the key the partition tokens use. `None` when unsharded.
    pub fn shard_mapping(&self) -> Option<(String, String)> {
        let k = self.shards();
        (k > 1).then(|| {
            (
                self.raw_subjects(),
                format!(
                    "{}.shard.{k}.{{{{partition({k},1)}}}}.{{{{wildcard(1)}}}}.>",
                    self.raw_prefix
                ),
            )
        })
    }
    /// The server configuration block that sends raw traffic to the shards (`mappings`, at the
    /// top level of a server without accounts, inside the account's block otherwise); `None`
    /// when unsharded.
    pub fn shard_mapping_config(&self) -> Option<String> {
        let (from, to) = self.shard_mapping()?;
        Some(format!(
            "# collab-projector: raw traffic under {prefix}.raw.> over {k} streams {first}..{last}\nmappings = {{\n  \"{from}\": \"{to}\"\n}}\n",
            prefix = self.raw_prefix,
            k = self.shards(),
            first = self.raw_streams.first().map_or("", String::as_str),
            last = self.raw_streams.last().map_or("", String::as_str),
        ))
    }
    /// The server block that sends raw traffic back to the one raw stream after a sharded
    /// layout: a mapping of the raw subjects onto themselves. A configuration reload does not
    /// drop a mapping removed from the file, but it does replace one.
    pub fn unsharded_mapping_config(&self) -> String {
        let from = self.raw_subjects();
        format!(
            "# collab-projector: raw traffic under {prefix}.raw.> in the one stream {stream}\nmappings = {{\n  \"{from}\": \"{prefix}.raw.{{{{wildcard(1)}}}}.>\"\n}}\n",
            prefix = self.raw_prefix,
            stream = self.raw_stream,
        )
    }
    /// Which raw stream (index into [`Names::raw_streams`]) stores `key`'s events: the same
    /// hash the server's mapping uses.
    pub fn shard_of_key(&self, key: &str) -> usize {
        shard_of_key_among(key, self.raw_streams.len())
    }
    /// The raw stream and sequence of the input an output's Msg-Id names
    /// (`<stream>:<seq>:<n>`), if it names one of these raw streams.
    pub fn input_of_msg_id<'a>(&self, msg_id: &'a str) -> Option<(&'a str, u64)> {
        // Any raw stream name this prefix makes, not only the ones known here: a reshard after
        // these names were made adds streams.
        let (stream, _) = msg_id.split_once(':')?;
        self.shard_of_stream_name(stream)?;
        Some((stream, input_of_msg_id(msg_id, stream)?))
    }
    /// Where the raw stream stores `key`'s messages, whatever its partition tokens.
    pub fn key_filter(&self, key: &str) -> String {
        format!(
            "{}.in.{}{key}.>",
            self.raw_prefix,
            "*.".repeat(self.raw_depth)
        )
    }
    /// A raw subject as the raw stream stores it, with every partition token 0 (for
    /// measurements and tests that build stored messages themselves).
    pub fn stored_subject(&self, raw_subject: &str) -> String {
        let zeros = "0.".repeat(self.raw_depth);
        raw_subject.replacen(".raw.", &format!(".in.{zeros}"), 1)
    }
    /// A raw subject the stream's partition transform maps to partition `p` of `partitions`,
    /// for the partition's barriers (see `bus::worker`): its key token is the first
    /// `_watermark<n>` that hashes to `p`. Barriers are told apart by their header, not by this
    /// subject.
    pub fn barrier_subject(&self, p: u16, partitions: u16) -> String {
        format!(
            "{}.raw.{}.barrier",
            self.raw_prefix,
            partition_token(p, partitions)
        )
    }
    /// The raw subject of the reshard marker for partition `p` of `partitions`: a barrier that
    /// `collab-projector reshard` stores in every partition of the current raw streams before
    /// the servers map raw subjects to a new set (see `bus::reader`). Its key token is the
    /// partition's barrier token; it ends in `reshard`, so a partition starting in the middle of
    /// its stream finds the last one by subject.
    pub fn reshard_marker_subject(&self, p: u16, partitions: u16) -> String {
        format!(
            "{}.raw.{}.reshard",
            self.raw_prefix,
            partition_token(p, partitions)
        )
    }
    pub fn consumer_name(&self, p: u16) -> String {
        format!("{}-proj-{p}", self.prefix)
    }
    /// The partition whose consumer `name` is, if it is one of these names' partition consumers.
    pub fn consumer_partition(&self, name: &str) -> Option<u16> {
        name.strip_prefix(&self.prefix)?
            .strip_prefix("-proj-")?
            .parse()
            .ok()
    }
    pub fn proj_subject(&self, role: Role, key: &str, event_type: &str) -> String {
        format!("{}.proj.{}.{key}.{event_type}", self.prefix, role.as_str())
    }
    pub fn dlq_subject(&self, reason: crate::model::DlqReason) -> String {
        format!("{}.dlq.{}", self.prefix, reason.as_str())
    }
}

/// The raw sequence an output's Msg-Id (`<stream>:<seq>:<n>`) names, if it names `stream`.
pub fn input_of_msg_id(msg_id: &str, stream: &str) -> Option<u64> {
    let rest = msg_id.strip_prefix(stream)?.strip_prefix(':')?;
    let (seq, _) = rest.split_once(':')?;
    seq.parse().ok()
}

/// How many sequences one set of raw streams may use: a reshard's streams start at the next
/// multiple of it (their `first_seq`), so sequences stay unique over a partition's whole history
/// and a checkpoint or turn record taken on earlier streams keeps its meaning (2^48, about nine
/// years at a million inputs a second).
pub const GENERATION_SPAN: u64 = 1 << 48;

/// A set of raw streams written before the current ones (`collab-projector reshard`): sealed
/// once the server's mapping sends raw traffic elsewhere, read to their end by every partition,
/// then kept for audits and reprojections until dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawGen {
    /// Their first sequence (0 for streams made before any reshard).
    pub base: u64,
    /// `streams[i]` holds the keys with `h % len == i`.
    pub streams: Vec<String>,
}

impl RawGen {
    /// The stream partition (or shard index) `i` of this set reads.
    pub fn stream_of(&self, i: usize) -> &str {
        nth_of(&self.streams, i).unwrap_or("")
    }
    /// The index of the stream holding `key`.
    pub fn shard_of_key(&self, key: &str) -> usize {
        shard_of_key_among(key, self.streams.len())
    }
}

/// The stream partition (or shard index) `i` reads among `streams`: the `i % len`-th.
fn nth_of(streams: &[String], i: usize) -> Option<&str> {
    streams.get(i % streams.len().max(1)).map(String::as_str)
}

/// The index, among `count` raw streams, of the one holding `key`: the server's mapping's hash.
fn shard_of_key_among(key: &str, count: usize) -> usize {
    let k = u32::try_from(count.max(1)).unwrap_or(1);
    usize::try_from(transform_partition(key.as_bytes(), k)).unwrap_or(0)
}

/// `(role, key, type)` of a projection subject's part after `<prefix>.proj.`, the inverse of
/// [`Names::proj_subject`] (the role is two tokens, the type may hold dots).
pub fn proj_subject_parts(after_proj: &str) -> Option<(&str, &str, &str)> {
    let mut it = after_proj.splitn(4, '.');
    let (r1, r2, key, ty) = (it.next()?, it.next()?, it.next()?, it.next()?);
    Some((&after_proj[..r1.len() + 1 + r2.len()], key, ty))
}

/// The partition NATS's `partition(n, ...)` subject transform gives a key: FNV-1a (32 bit) of
/// the key's bytes, modulo `n`.
/// The largest partition count a new raw stream supports unless `nats.max_partitions` says
/// otherwise.
pub const DEFAULT_MAX_PARTITIONS: u16 = 256;

/// How the raw stream stores a key's events: one token per partition count it supports, each the
/// key's hash modulo that count (`<prefix>.in.<h%2>.<h%4>...<key>...` for the power-of-two
/// ladder), so partition `p` of any of those counts is one filter with `p` at that count's token
/// and wildcards elsewhere: the server reads it as fast as a single-token filter, where a
/// consumer with several filter subjects costs it several times more per message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The partition counts, in token order.
    pub levels: Vec<u16>,
}

impl Layout {
    /// Every power of two from 2 to `max`.
    pub fn ladder(max: u16) -> Layout {
        Layout {
            levels: std::iter::successors(Some(2u16), |l| l.checked_mul(2))
                .take_while(|l| *l <= max)
                .collect(),
        }
    }
    /// Partition tokens between `in` and the key.
    pub fn depth(&self) -> usize {
        self.levels.len()
    }
    /// Whether `partitions` can read this layout (1 always can).
    pub fn supports(&self, partitions: u16) -> bool {
        partitions == 1 || self.levels.contains(&partitions)
    }
    /// The partition counts this layout supports, for an error message.
    pub fn counts(&self) -> String {
        std::iter::once(1)
            .chain(self.levels.iter().copied())
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
    /// The subject filter of partition `p` of `partitions` over a raw stream with prefix
    /// `raw_prefix`.
    pub fn filter(&self, raw_prefix: &str, partitions: u16, p: u16) -> String {
        let tokens: Vec<String> = self
            .levels
            .iter()
            .map(|&l| {
                if l == partitions {
                    p.to_string()
                } else {
                    "*".to_string()
                }
            })
            .collect();
        if partitions == 1 || tokens.is_empty() {
            return format!("{raw_prefix}.in.>");
        }
        format!("{raw_prefix}.in.{}.>", tokens.join("."))
    }
    /// The raw stream's subject-transform destination for this layout.
    pub fn destination(&self, raw_prefix: &str) -> String {
        let tokens: String = self
            .levels
            .iter()
            .map(|l| format!("{{{{partition({l},1)}}}}."))
            .collect();
        format!("{raw_prefix}.in.{tokens}{{{{wildcard(1)}}}}.>")
    }
    /// The subject a raw stream with this layout stores `raw_subject`
    /// (`<raw_prefix>.raw.<key>.<rest>`) under, as the server's transform writes it: a partition
    /// token per level, then the key and the rest. `None` for a subject not of that shape.
    pub fn stored_subject(&self, raw_prefix: &str, raw_subject: &str) -> Option<String> {
        let after = raw_subject
            .strip_prefix(raw_prefix)?
            .strip_prefix(".raw.")?;
        let key = after.split('.').next().filter(|k| !k.is_empty())?;
        let tokens: String = self
            .levels
            .iter()
            .map(|&l| format!("{}.", transform_partition(key.as_bytes(), u32::from(l))))
            .collect();
        Some(format!("{raw_prefix}.in.{tokens}{after}"))
    }
    /// The layout of a transform destination made by [`Layout::destination`] (or by a release
    /// with one `partition(N,1)` token); `None` when it holds none.
    pub fn of_destination(destination: &str) -> Option<Layout> {
        let levels: Vec<u16> = destination
            .split("{{partition(")
            .skip(1)
            .map(|rest| rest.split(',').next().unwrap_or("").trim().parse())
            .collect::<Result<_, _>>()
            .ok()?;
        (!levels.is_empty()).then_some(Layout { levels })
    }
}

/// The first key token `_watermark<n>` the partition transform maps to partition `p` of
/// `partitions`.
fn partition_token(p: u16, partitions: u16) -> String {
    let partitions = u32::from(partitions.max(1));
    (0u32..)
        .map(|n| format!("_watermark{n}"))
        .find(|t| transform_partition(t.as_bytes(), partitions) == u32::from(p) % partitions)
        .unwrap_or_default()
}

pub fn transform_partition(key: &[u8], n: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let hash = key
        .iter()
        .fold(OFFSET, |h, b| (h ^ u32::from(*b)).wrapping_mul(PRIME));
    hash % n.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_toml_loads_and_equals_the_built_in_defaults() {
        let text = include_str!("../config/default.toml");
        let loaded = Settings::from_toml(text).expect("config/default.toml must load");
        assert_eq!(loaded, Settings::default());
    }

    #[test]
    fn unknown_keys_are_rejected_by_name() {
        let err = Settings::from_toml("[nats]\nurll = \"nats://x\"\n").expect_err("must fail");
        assert!(err.to_string().contains("urll"), "{err}");
        let err = Settings::from_toml("[natz]\n").expect_err("must fail");
        assert!(err.to_string().contains("natz"), "{err}");
    }

    #[test]
    fn durations_and_roles_parse() {
        let s = Settings::from_toml(
            "[turns]\ndefault_timeout = \"90s\"\nenforce_roles = [\"conversation.main\", \"delegation.subagent\"]\n",
        )
        .expect("loads");
        assert_eq!(s.turns.default_timeout, Duration::from_secs(90));
        assert_eq!(s.turns.enforce_roles.len(), 2);
        assert!(Settings::from_toml("[turns]\nenforce_roles = [\"conversation.mian\"]\n").is_err());
        let r = Settings::from_toml("[runs]\ntimeout = \"2s\"\nenforce = false\n")
            .unwrap_or_else(|e| panic!("runs settings: {e}"));
        assert_eq!(r.runs.timeout, Duration::from_secs(2));
        assert!(!r.runs.enforce);
        assert_eq!(Settings::default().runs.timeout, Duration::from_secs(600));
        assert!(Settings::from_toml("[runs]\ntimeout = \"0s\"\n").is_err());
    }

    #[test]
    fn values_the_server_or_the_pipeline_cannot_use_are_named() {
        for (text, words) in [
            ("[nats]\nreplicas = 0\n", "nats.replicas is 0"),
            ("[nats]\nreplicas = 9\n", "nats.replicas is 9"),
            (
                "[projection]\nduplicate_window = \"0s\"\n",
                "projection.duplicate_window must be more than 0s",
            ),
            (
                "[projection]\nduplicate_window = \"2h\"\nmax_age = \"1h\"\n",
                "must not be longer than projection.max_age",
            ),
            (
                "[limits]\nmax_payload_bytes = 0\n",
                "limits.max_payload_bytes",
            ),
            (
                "[http]\nquiet_after = \"48h\"\n",
                "http.quiet_after (2days) must be shorter",
            ),
        ] {
            let err = Settings::from_toml(text).expect_err(text).to_string();
            assert!(err.contains(words), "{text}: {err}");
        }
        let ok =
            Settings::from_toml("[nats]\nreplicas = 3\n[projection]\nduplicate_window = \"1s\"\n");
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn an_empty_nats_url_is_named() {
        for url in ["", " ", ","] {
            let err = Settings::from_toml(&format!("[nats]\nurl = \"{url}\"\n"))
                .expect_err("must fail")
                .to_string();
            assert!(err.contains("nats.url is empty"), "{err}");
        }
    }

    #[test]
    fn load_errors_name_the_key_and_never_repeat_a_secret() {
        for text in [
            "[http]\ntokens = \"hunter2\"\n",
            "[[http.tokens]]\nname = \"a\"\ntoken = [\"hunter2\"]\nroles = [\"conversation.main\"]\n",
        ] {
            let e = Settings::from_toml(text).expect_err("must fail");
            // No source either: a report of the whole chain would repeat the loader's text.
            assert!(std::error::Error::source(&e).is_none());
            let err = e.to_string();
            assert!(err.contains("http.tokens"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
        // An unknown enum value is named as such, not by the type behind it.
        let err = Settings::from_toml("[adapter]\nmode = \"strickt\"\n")
            .expect_err("must fail")
            .to_string();
        assert!(
            err.contains("\"strickt\" is not one of the accepted values"),
            "{err}"
        );
        assert!(err.contains("adapter.mode"), "{err}");
        assert!(!err.contains("AdapterMode"), "{err}");
        // An index is followed by a dot in the key path.
        assert_eq!(
            dotted_key("usage.prices[0]input_per_mtok"),
            "usage.prices[0].input_per_mtok"
        );
        assert_eq!(dotted_key("a[0][1].b[2]"), "a[0][1].b[2]");
        assert_eq!(
            hide_quoted(r#"invalid type: string "a\"b", expected x "y"#),
            "invalid type: string (hidden), expected x (hidden)"
        );
    }

    #[test]
    fn invalid_values_are_explained() {
        let err = Settings::from_toml("[nats]\nprefix = \"a.b\"\n").expect_err("must fail");
        assert!(err.to_string().contains("nats.prefix"), "{err}");
        // The worker id names a KV key: a space or an empty part would make the heartbeat
        // unwritable. Dots between parts are fine (ids like host.eu-1 ran before the check).
        for id in ["w..1", ".w", "w 1", ""] {
            let err =
                Settings::from_toml(&format!("[workers]\nid = \"{id}\"\n")).expect_err("must fail");
            assert!(err.to_string().contains("workers.id"), "{err}");
        }
        for id in ["host-1_a", "w.1", "host.eu-1"] {
            let ok = Settings::from_toml(&format!("[workers]\nid = \"{id}\"\n")).expect("loads");
            assert_eq!(ok.workers.id.as_deref(), Some(id));
        }
        let err = Settings::from_toml("[turns]\nearly_hold = \"8d\"\n").expect_err("must fail");
        assert!(err.to_string().contains("turns.early_hold"), "{err}");
        // A retention lowered below the default hold says which setting to change.
        let err = Settings::from_toml("[turns]\nretention = \"30s\"\n").expect_err("must fail");
        assert!(
            err.to_string()
                .contains("lower turns.early_hold (60s by default"),
            "{err}"
        );
        // A retention below the longest deadline a turn or run can have: its record would be
        // gone before the deadline is decided.
        let err = Settings::from_toml("[turns]\nretention = \"20m\"\n").expect_err("must fail");
        assert!(
            err.to_string().contains("turns.max_timeout (1h)")
                && err.to_string().contains("raise turns.retention"),
            "{err}"
        );
        Settings::from_toml("[turns]\nretention = \"20m\"\nmax_timeout = \"15m\"\n")
            .expect("deadlines within the retention load");
        let ok = Settings::from_toml("[turns]\nearly_hold = \"5m\"\n").expect("a hold loads");
        assert_eq!(ok.turns.early_hold, Duration::from_secs(300));
        assert_eq!(
            Settings::default().turns.early_hold,
            Duration::from_secs(60),
            "on by default"
        );
        let off = Settings::from_toml("[turns]\nearly_hold = \"0s\"\n").expect("zero turns it off");
        assert!(off.turns.early_hold.is_zero());
        let err = Settings::from_toml("[http]\nclient_stall_timeout = \"500ms\"\n")
            .expect_err("must fail");
        assert!(
            err.to_string().contains("http.client_stall_timeout"),
            "{err}"
        );
        let ok = Settings::from_toml("[http]\nclient_stall_timeout = \"5m\"\n").expect("loads");
        assert_eq!(ok.http.client_stall_timeout, Duration::from_secs(300));
        for n in [20, 255] {
            let err = Settings::from_toml(&format!("[workers]\nfold_niceness = {n}\n"))
                .expect_err("must fail");
            assert!(
                err.to_string().contains("workers.fold_niceness")
                    && err.to_string().contains("0 to 19"),
                "{err}"
            );
        }
        let err = Settings::from_toml("[workers]\nfold_niceness = -1\n").expect_err("must fail");
        assert!(err.to_string().contains("fold_niceness"), "{err}");
        for n in [0, 19] {
            let ok =
                Settings::from_toml(&format!("[workers]\nfold_niceness = {n}\n")).expect("loads");
            assert_eq!(ok.workers.fold_niceness, n);
        }
    }

    fn nats_error(toml: &str) -> String {
        Settings::from_toml(toml)
            .expect_err("must be refused")
            .to_string()
    }

    #[test]
    fn secrets_never_show_in_debug_display_or_serialisation() {
        let s = Settings::from_toml("[nats]\nuser = \"worker\"\npassword = \"hunter2-pass\"\n")
            .expect("loads");
        assert_eq!(
            s.nats.password.as_ref().map(Secret::expose),
            Some("hunter2-pass")
        );
        let debug = format!("{s:?} {:?}", s.nats);
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("[redacted]"), "{debug}");
        let json = serde_json::to_string(&s).expect("serialises");
        assert!(!json.contains("hunter2"), "{json}");
        let token = Secret::new("tok-123");
        assert_eq!(format!("{token} {token:?}"), "[redacted] [redacted]");
        assert!(!NatsAuth::Token(&token).describe().contains("tok-123"));
    }

    #[test]
    fn one_authentication_method_at_a_time() {
        let err = nats_error("[nats]\ntoken = \"t\"\nuser = \"u\"\npassword = \"p\"\n");
        assert!(
            err.contains("nats.token") && err.contains("nats.user/nats.password"),
            "{err}"
        );
        assert!(!err.contains("\"t\"") && !err.contains("\"p\""), "{err}");
        let seed = format!("SU{}", "A".repeat(56));
        let err = nats_error(&format!(
            "[nats]\nnkey_seed = \"{seed}\"\ncreds_file = \"/etc/hostname\"\n"
        ));
        assert!(err.contains("nats.nkey_seed and nats.creds_file"), "{err}");
        assert!(!err.contains(&seed), "{err}");
        let err = nats_error(&format!(
            "[nats]\nnkey_seed = \"{seed}\"\nnkey_seed_file = \"/etc/hostname\"\n"
        ));
        assert!(err.contains("nats.nkey_seed_file"), "{err}");
    }

    #[test]
    fn incomplete_or_malformed_credentials_are_named() {
        let err = nats_error("[nats]\nuser = \"u\"\n");
        assert!(
            err.contains("nats.user is set without nats.password"),
            "{err}"
        );
        let err = nats_error("[nats]\npassword = \"p\"\n");
        assert!(
            err.contains("nats.password is set without nats.user"),
            "{err}"
        );
        let err = nats_error("[nats]\ntoken = \" \"\n");
        assert!(err.contains("nats.token is set but empty"), "{err}");
        let public = format!("UA{}", "B".repeat(54));
        let err = nats_error(&format!("[nats]\nnkey_seed = \"{public}\"\n"));
        assert!(
            err.contains("nats.nkey_seed is not an NKey user seed"),
            "{err}"
        );
        assert!(!err.contains(&public), "{err}");
        let err = nats_error("[nats]\nurl = \"nats://alice:s3cret@host:4222\"\n");
        assert!(err.contains("nats.url embeds credentials"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
        let err = nats_error("[nats]\ninbox_prefix = \"_INBOX.>\"\n");
        assert!(err.contains("nats.inbox_prefix"), "{err}");
    }

    #[test]
    fn a_toml_syntax_error_names_where_not_the_line() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("collab.toml");
        std::fs::write(&path, "[nats]\nuser = \"u\"\npassword = \"s3cret-value\n").expect("write");
        let err = Settings::load(Some(&path))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("is not valid TOML at line 3"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[test]
    fn tls_files_come_in_pairs_and_must_exist() {
        let dir = tempfile::tempdir().expect("temp dir");
        let pem = dir.path().join("client.pem");
        std::fs::write(&pem, "not checked here").expect("write");
        let pem = pem.display().to_string();
        let err = nats_error(&format!("[nats]\ntls_cert_file = {pem:?}\n"));
        assert!(
            err.contains("nats.tls_cert_file is set without nats.tls_key_file"),
            "{err}"
        );
        let err = nats_error(&format!("[nats]\ntls_key_file = {pem:?}\n"));
        assert!(
            err.contains("nats.tls_key_file is set without nats.tls_cert_file"),
            "{err}"
        );
        let missing = dir.path().join("missing.pem").display().to_string();
        let err = nats_error(&format!("[nats]\ntls_ca_file = {missing:?}\n"));
        assert!(
            err.contains("nats.tls_ca_file") && err.contains("is not a file"),
            "{err}"
        );
        let s = Settings::from_toml(&format!(
            "[nats]\ntls_cert_file = {pem:?}\ntls_key_file = {pem:?}\ntls_ca_file = {pem:?}\n"
        ))
        .expect("a complete TLS setting loads");
        assert!(s.nats.tls());
        assert_eq!(s.nats.auth(), NatsAuth::None);
    }

    #[test]
    fn secrets_from_the_environment_are_taken_verbatim() {
        let env = [
            ("COLLAB_NATS__USER", "007"),
            ("COLLAB_NATS__PASSWORD", "0012"),
            ("COLLAB_NATS__PARTITIONS", "8"),
            ("COLLAB_NATS__TLS_REQUIRED", "true"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let s = Settings::read_env(None, env.into_iter()).expect("loads");
        s.validate().expect("valid");
        assert_eq!(s.nats.user.as_deref(), Some("007"));
        assert_eq!(s.nats.password.as_ref().map(Secret::expose), Some("0012"));
        assert_eq!(s.nats.partitions, 8);
        assert!(s.nats.tls_required);
    }

    #[test]
    fn a_setting_variable_with_one_underscore_is_refused_naming_the_right_one() {
        let read = |var: &str| {
            let env = [(var.to_string(), "nats://elsewhere:4222".to_string())];
            Settings::read_env(None, env.into_iter())
        };
        for (var, right) in [
            ("COLLAB_NATS_URL", "COLLAB_NATS__URL"),
            ("COLLAB_HTTP_ADDR", "COLLAB_HTTP__ADDR"),
            ("COLLAB_workers_lease_ttl", "COLLAB_WORKERS__lease_ttl"),
        ] {
            match read(var) {
                Err(ConfigError::Invalid(m)) => {
                    assert!(m.contains(var) && m.contains(right), "{m}");
                    assert!(!m.contains("elsewhere"), "the value is not repeated: {m}");
                }
                other => panic!("{var} was not refused: {other:?}"),
            }
        }
        // The command line's, the tests' and CI's own variables are no settings, and stay
        // allowed; so are a section's name alone, and a name whose rest is no key of the section
        // (a server's variable, as in docs/security.md).
        for var in [
            "COLLAB_CONFIG",
            "COLLAB_LOG_FORMAT",
            "COLLAB_TEST_CRASH_AT",
            "COLLAB_ARTIFACTS_DIR",
            "COLLAB_BENCH_PREFIX",
            "COLLAB_NATS",
            "COLLAB_NATS_",
            "COLLAB_WORKERS_PASSWORD",
            "COLLAB_AGENT_RUDA_PASSWORD",
        ] {
            assert!(read(var).is_ok(), "{var}");
        }
    }

    #[test]
    fn the_sections_named_are_the_settings_sections() {
        let value = serde_json::to_value(Settings::default()).unwrap_or_default();
        let mut keys: Vec<&str> = value
            .as_object()
            .map(|m| m.keys().map(String::as_str).collect())
            .unwrap_or_default();
        keys.sort_unstable();
        let mut sections = SECTIONS.to_vec();
        sections.sort_unstable();
        assert_eq!(keys, sections);
    }

    #[test]
    fn a_config_path_that_never_ends_is_refused_at_the_cap() {
        let e = read_capped(Path::new("/dev/zero"), 1024)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("larger than"), "{e}");
        let e = Settings::read_env(Some(Path::new("/dev/zero")), std::iter::empty());
        assert!(
            matches!(&e, Err(ConfigError::Invalid(m)) if m.contains("/dev/zero") && m.contains("4194304 bytes")),
            "{e:?}"
        );
    }

    #[test]
    fn run_settings_come_from_the_environment_like_the_others() {
        let env = [
            ("COLLAB_RUNS__TIMEOUT", "2s"),
            ("COLLAB_RUNS__ENFORCE", "false"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let s = Settings::read_env(None, env.into_iter()).expect("loads");
        s.validate().expect("valid");
        assert_eq!(s.runs.timeout, Duration::from_secs(2));
        assert!(!s.runs.enforce);
    }

    #[test]
    fn partitions_follow_the_servers_fnv1a_hash() {
        // FNV-1a 32-bit reference values: "" -> 0x811c9dc5, "a" -> 0xe40c292c.
        assert_eq!(transform_partition(b"", u32::MAX), 0x811c_9dc5);
        assert_eq!(transform_partition(b"a", u32::MAX), 0xe40c_292c);
        assert_eq!(transform_partition(b"a", 64), 0xe40c_292c % 64);
        let n = Settings::default().names();
        for p in 0..64 {
            let subject = n.barrier_subject(p, 64);
            let token = subject.split('.').nth(2).unwrap_or_default();
            assert_eq!(transform_partition(token.as_bytes(), 64), u32::from(p));
        }
    }

    #[test]
    fn a_reshard_marker_reaches_the_partition_of_every_count_its_token_is_made_for() {
        let n = Settings::default().names();
        let layout = Layout::ladder(256);
        for p in 0..256u16 {
            let marker = n.reshard_marker_subject(p, 256);
            assert!(marker.ends_with(".reshard"), "{marker}");
            // The barrier and the marker of a partition share its key token.
            assert_eq!(
                marker.trim_end_matches(".reshard"),
                n.barrier_subject(p, 256).trim_end_matches(".barrier")
            );
            let stored = layout.stored_subject("collab", &marker).unwrap_or_default();
            // Partition `p % count` of every count of the ladder reads it.
            for &count in &layout.levels {
                let filter = layout.filter("collab", count, p % count);
                assert!(
                    subject_matches(&filter, &stored),
                    "{stored} is not read by partition {} of {count} ({filter})",
                    p % count
                );
            }
        }
        assert_eq!(
            Layout::ladder(4).stored_subject("collab", "collab.raw.k.a2a.send"),
            Some(format!(
                "collab.in.{}.{}.k.a2a.send",
                transform_partition(b"k", 2),
                transform_partition(b"k", 4)
            ))
        );
        assert_eq!(
            Layout::ladder(4).stored_subject("collab", "other.raw.k.x"),
            None
        );
        assert_eq!(
            Layout::ladder(4).stored_subject("collab", "collab.raw..x"),
            None
        );
    }

    /// Whether NATS subject filter `filter` matches `subject` (`*` one token, `>` the rest).
    fn subject_matches(filter: &str, subject: &str) -> bool {
        let (mut f, mut s) = (filter.split('.'), subject.split('.'));
        loop {
            match (f.next(), s.next()) {
                (Some(">"), Some(_)) => return true,
                (Some("*"), Some(_)) => {}
                (Some(a), Some(b)) if a == b => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }

    #[test]
    fn a_partition_of_any_supported_count_keeps_the_keys_it_hashes_to() {
        let layout = Layout::ladder(256);
        assert_eq!(layout.levels, vec![2, 4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(
            layout.destination("collab"),
            "collab.in.{{partition(2,1)}}.{{partition(4,1)}}.{{partition(8,1)}}.{{partition(16,1)}}.{{partition(32,1)}}.{{partition(64,1)}}.{{partition(128,1)}}.{{partition(256,1)}}.{{wildcard(1)}}.>"
        );
        assert_eq!(
            Layout::of_destination(&layout.destination("x")),
            Some(layout.clone())
        );
        // A stream made before the ladder: one token, 16 partitions.
        let old = Layout::of_destination("collab.in.{{partition(16,1)}}.{{wildcard(1)}}.>");
        assert_eq!(old.as_ref().map(Layout::depth), Some(1));
        assert_eq!(
            old.map(|l| l.filter("collab", 16, 7)).as_deref(),
            Some("collab.in.7.>")
        );
        assert_eq!(Layout::of_destination("collab.in.{{wildcard(1)}}.>"), None);
        assert_eq!(
            layout.filter("collab", 32, 5),
            "collab.in.*.*.*.*.5.*.*.*.>"
        );
        assert_eq!(layout.filter("collab", 1, 0), "collab.in.>");
        assert!(layout.supports(8) && layout.supports(1) && !layout.supports(24));
        // The token a key is stored under at each count is the key's hash modulo it, the same
        // partition the barriers of that count are computed for.
        let n = Names::new("collab");
        for partitions in [2u16, 8, 16, 32] {
            for p in 0..partitions {
                let subject = n.barrier_subject(p, partitions);
                let key = subject.split('.').nth(2).unwrap_or_default();
                let h = transform_partition(key.as_bytes(), u32::from(partitions));
                assert_eq!(h, u32::from(p));
            }
        }
        let mut s = Settings::default();
        s.nats.max_partitions = 24;
        let e = s
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("power of two"), "{e}");
        s.nats.max_partitions = 64;
        assert_eq!(s.names().raw_depth, 6);
        assert_eq!(s.partition_filter(3), "collab.in.*.*.*.3.*.*.>");
        assert_eq!(s.names().key_filter("c1"), "collab.in.*.*.*.*.*.*.c1.>");
        assert_eq!(
            s.names().stored_subject("collab.raw.c1.a2a.send"),
            "collab.in.0.0.0.0.0.0.c1.a2a.send"
        );
    }

    #[test]
    fn shards_name_their_streams_and_the_mapping_that_feeds_them() {
        let mut n = Names::new("collab");
        assert_eq!(n.raw_streams, vec!["COLLAB_RAW".to_string()]);
        assert_eq!(n.shard_mapping(), None);
        assert_eq!(n.shard_subjects(0), "collab.raw.*.>");
        n.set_shards(4);
        assert_eq!(n.raw_streams[3], "COLLAB_RAW_3OF4");
        assert_eq!(n.raw_stream_of(13), "COLLAB_RAW_1OF4");
        assert_eq!(n.shard_subjects(2), "collab.shard.4.2.*.>");
        assert_eq!(
            n.shard_mapping(),
            Some((
                "collab.raw.*.>".to_string(),
                "collab.shard.4.{{partition(4,1)}}.{{wildcard(1)}}.>".to_string()
            ))
        );
        // A key's shard is the server's partition of it: the partition of any count that is a
        // multiple of 4 reads that shard.
        for key in ["c1", "conv-3", "x", "_watermark0"] {
            let h = transform_partition(key.as_bytes(), 16);
            assert_eq!(
                n.raw_stream_of(h as u16),
                n.raw_streams[n.shard_of_key(key)]
            );
        }
        assert_eq!(
            n.input_of_msg_id("COLLAB_RAW_2OF4:41:0"),
            Some(("COLLAB_RAW_2OF4", 41))
        );
        // Any raw stream name of the prefix, not only the current ones: after a reshard an
        // output's input may be in an earlier set (`COLLAB_RAW` before the shards, here).
        assert_eq!(
            n.input_of_msg_id("COLLAB_RAW:41:0"),
            Some(("COLLAB_RAW", 41))
        );
        assert_eq!(
            n.input_of_msg_id("COLLAB_RAW_1OF8:7:dlq"),
            Some(("COLLAB_RAW_1OF8", 7))
        );
        assert_eq!(n.input_of_msg_id("COLLAB_PROJ:41:0"), None);
        assert_eq!(n.input_of_msg_id("turn:c1:4"), None);
    }

    #[test]
    fn a_shard_count_must_divide_the_partitions() {
        let err = nats_error("[nats]\nshards = 3\n");
        assert!(err.contains("nats.shards (3)"), "{err}");
        let err = nats_error("[nats]\nshards = 32\npartitions = 16\n");
        assert!(err.contains("multiple of nats.shards"), "{err}");
        let s = Settings::from_toml("[nats]\nshards = 4\npartitions = 16\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.names().shards(), 4);
    }

    #[test]
    fn a_partition_consumer_is_told_from_another_sets() {
        let live = Names::new("collab");
        let v2 = Names::versioned("collab", "v2");
        assert_eq!(live.consumer_partition(&live.consumer_name(7)), Some(7));
        assert_eq!(v2.consumer_partition(&v2.consumer_name(31)), Some(31));
        assert_eq!(live.consumer_partition(&v2.consumer_name(7)), None);
        assert_eq!(v2.consumer_partition(&live.consumer_name(7)), None);
        assert_eq!(live.consumer_partition("replay-3-abc"), None);
    }

    #[test]
    fn names_derive_from_the_prefix() {
        let n = Names::new("collab");
        assert_eq!(n.raw_stream, "COLLAB_RAW");
        assert_eq!(n.turns_bucket, "collab_turns");
        assert_eq!(
            n.proj_subject(Role::ConversationMain, "c1", "a2a.response"),
            "collab.proj.conversation.main.c1.a2a.response"
        );
        assert_eq!(n.key_filter("c1"), "collab.in.*.*.*.*.*.*.*.*.c1.>");
    }
}
