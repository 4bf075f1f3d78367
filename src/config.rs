//! Settings: one serde struct per section of `config/default.toml`, defaults shared between serde
//! and `Default`, unknown keys rejected, and validation into typed values once at start.
//!
//! Sources, later ones winning: built-in defaults, the TOML file (`--config`), environment
//! variables `COLLAB_<SECTION>__<KEY>` (e.g. `COLLAB_NATS__URL`, `COLLAB_TURNS__DEFAULT_TIMEOUT=90s`,
//! `COLLAB_ROLES__MAIN_AGENTS=ruda,eden`), then command-line flags.

use crate::ingest::adapter::{AdapterLimits, AdapterMode};
use crate::model::Role;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("configuration: {0}")]
    Invalid(String),
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
    pub projection: ProjectionSettings,
    pub http: HttpSettings,
    pub workers: WorkerSettings,
}

/// Partition ownership among N workers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// This worker's id (default: host name, process id and a random suffix).
    pub id: Option<String>,
    /// A partition lease lapses this long after its owner's last renewal (renewed every third of
    /// it). Failover after a crash takes about this long.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            id: None,
            lease_ttl: Duration::from_secs(6),
        }
    }
}

/// Connection and naming. Stream and bucket names derive from `prefix`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NatsSettings {
    /// Server URL(s), comma-separated for a cluster.
    pub url: String,
    /// Subject prefix; streams are `<PREFIX>_RAW`, `_PROJ`, `_DLQ`, buckets `<prefix>_turns`, ...
    pub prefix: String,
    /// Number of partitions of the raw stream. Fixed once the stream exists.
    pub partitions: u16,
    /// Stream and bucket replicas (3 on a 3-node cluster).
    pub replicas: usize,
    /// How long raw events are kept.
    #[serde(with = "humantime_serde")]
    pub raw_max_age: Duration,
    /// How long dead letters are kept.
    #[serde(with = "humantime_serde")]
    pub dlq_max_age: Duration,
    /// Optional credentials file.
    pub creds_file: Option<String>,
}

impl Default for NatsSettings {
    fn default() -> Self {
        NatsSettings {
            url: "nats://127.0.0.1:4222".into(),
            prefix: "collab".into(),
            partitions: 16,
            replicas: 1,
            raw_max_age: Duration::from_secs(7 * 24 * 3600),
            dlq_max_age: Duration::from_secs(30 * 24 * 3600),
            creds_file: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoleSettings {
    /// Agent ids that are main agents (trimmed, case-insensitive).
    pub main_agents: Vec<String>,
}

impl Default for RoleSettings {
    fn default() -> Self {
        RoleSettings {
            main_agents: vec!["main".into(), "ruda".into()],
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdapterSettings {
    /// `lenient` (substitute missing ids) or `strict` (reject them).
    pub mode: AdapterMode,
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
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        ConsumerSettings {
            batch: 500,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
            max_ack_pending: 2000,
            publish_window: 1024,
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
    /// Bearer tokens and the roles each may read. Access control is on when any is configured;
    /// the server refuses to bind a non-loopback address with it off.
    pub tokens: Vec<TokenGrant>,
    /// A work session with no event for this long is `QUIET`.
    #[serde(with = "humantime_serde")]
    pub quiet_after: Duration,
    /// A work session with no event for this long is `ARCHIVED`.
    #[serde(with = "humantime_serde")]
    pub archive_after: Duration,
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

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            enabled: true,
            addr: "127.0.0.1:8080".into(),
            api: true,
            tokens: Vec::new(),
            quiet_after: Duration::from_secs(15 * 60),
            archive_after: Duration::from_secs(24 * 3600),
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
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Invalid(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        // Only COLLAB_<SECTION>__<KEY> variables are settings; others with the prefix
        // (COLLAB_CONFIG, COLLAB_LOG_FORMAT, test hooks) belong to the command line or the tests.
        let vars: config::Map<String, String> = std::env::vars()
            .filter(|(k, _)| {
                k.strip_prefix("COLLAB_")
                    .is_some_and(|rest| rest.contains("__"))
            })
            .collect();
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

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
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
        if self.nats.partitions == 0 || self.nats.partitions > 1024 {
            return bad("nats.partitions must be between 1 and 1024".into());
        }
        if self.consumer.batch == 0 {
            return bad("consumer.batch must be at least 1".into());
        }
        if self.consumer.max_deliver < 2 {
            return bad("consumer.max_deliver must be at least 2 (the last delivery is used to dead-letter)".into());
        }
        if self.consumer.publish_window == 0 || self.consumer.publish_window >= 5000 {
            return bad("consumer.publish_window must be between 1 and 4999 (the client caps unacknowledged publishes at 5000)".into());
        }
        for grant in &self.http.tokens {
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
        if self.workers.lease_ttl < Duration::from_secs(1) {
            return bad("workers.lease_ttl must be at least 1s".into());
        }
        if self.turns.default_timeout.is_zero()
            || self.turns.max_timeout < self.turns.default_timeout
        {
            return bad(
                "turns.default_timeout must be positive and at most turns.max_timeout".into(),
            );
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

    pub fn names(&self) -> Names {
        Names::new(&self.nats.prefix)
    }

    /// What normalisation needs of these settings: the one place they are derived from.
    pub fn ingest(&self) -> Result<crate::ingest::Settings, ConfigError> {
        Ok(crate::ingest::Settings {
            main_agents: crate::classify::MainAgents::new(&self.roles.main_agents),
            adapter_mode: self.adapter.mode,
            adapter_limits: AdapterLimits::default(),
            max_payload_bytes: self.limits.max_payload_bytes,
            shape: crate::ingest::ShapeLimits {
                max_depth: self.limits.max_depth,
                max_string_bytes: self.limits.max_string_bytes,
                max_object_keys: self.limits.max_object_keys,
                max_array_items: self.limits.max_array_items,
            },
            redactor: std::sync::Arc::new(self.redactor()?),
        })
    }

    /// The built-in redaction rules plus the configured ones.
    pub fn redactor(&self) -> Result<crate::redact::Redactor, ConfigError> {
        crate::redact::Redactor::new(&self.redaction.keys, &self.redaction.patterns)
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }
}

/// Every JetStream resource and subject name, derived from the prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub prefix: String,
    pub raw_stream: String,
    pub proj_stream: String,
    pub dlq_stream: String,
    pub turns_bucket: String,
    pub sessions_bucket: String,
    pub leases_bucket: String,
    pub blobs_store: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        let upper = prefix.to_ascii_uppercase();
        Names {
            prefix: prefix.to_string(),
            raw_stream: format!("{upper}_RAW"),
            proj_stream: format!("{upper}_PROJ"),
            dlq_stream: format!("{upper}_DLQ"),
            turns_bucket: format!("{prefix}_turns"),
            sessions_bucket: format!("{prefix}_work_sessions"),
            leases_bucket: format!("{prefix}_leases"),
            blobs_store: format!("{prefix}_blobs"),
        }
    }
    /// Subjects producers publish to.
    pub fn raw_subjects(&self) -> String {
        format!("{}.raw.*.>", self.prefix)
    }
    /// Where the raw stream stores partition `p`'s messages.
    pub fn partition_filter(&self, p: u16) -> String {
        format!("{}.in.{p}.>", self.prefix)
    }
    pub fn consumer_name(&self, p: u16) -> String {
        format!("{}-proj-{p}", self.prefix)
    }
    pub fn proj_subject(&self, role: Role, key: &str, event_type: &str) -> String {
        format!("{}.proj.{}.{key}.{event_type}", self.prefix, role.as_str())
    }
    pub fn dlq_subject(&self, reason: crate::model::DlqReason) -> String {
        format!("{}.dlq.{}", self.prefix, reason.as_str())
    }
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
    }

    #[test]
    fn invalid_values_are_explained() {
        let err = Settings::from_toml("[nats]\nprefix = \"a.b\"\n").expect_err("must fail");
        assert!(err.to_string().contains("nats.prefix"), "{err}");
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
        assert_eq!(n.partition_filter(7), "collab.in.7.>");
    }
}
