//! Which projection the deployment's API serves: its own, or a version `reproject` computed
//! (blue/green). The choice is the key `served` of the deployment's control bucket
//! (`<prefix>_control`, history kept: the switch log), written by
//! `collab-projector reproject --version v2 --switch` and, for the way back,
//! `collab-projector reproject --switch`. Every API server of the deployment reads it once a
//! second ([`follow`]) and moves with it: requests read the served version's streams and
//! buckets, event streams open on the old version end, and cursors it issued are refused with a
//! 410 (`version_switched`), since a cursor is a position in one version's projection stream.

use crate::bus::error::Source;
use crate::config::Names;
use async_nats::jetstream::{self, kv};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The key of the control bucket that names the served version.
pub const SERVED_KEY: &str = "served";

/// Switches the control bucket keeps (the switch log).
const HISTORY: i64 = 16;

/// How often an API server reads the served version.
pub const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// The value of [`SERVED_KEY`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Switch {
    /// The version served; empty for the deployment's own projections.
    pub version: String,
    /// The version served before.
    #[serde(default)]
    pub previous: String,
    /// When the switch was made (RFC 3339).
    #[serde(default)]
    pub at: String,
}

/// What an API server serves now: the version's names, and the tag its cursors carry.
#[derive(Debug, Clone)]
pub struct Served {
    pub names: Arc<Names>,
    pub tag: u16,
}

impl Served {
    /// Version `version` (empty: the deployment's own) of the deployment named by `base`.
    pub fn of(base: &Names, version: &str) -> Served {
        let mut names = Names::versioned(&base.raw_prefix, version);
        names.raw_depth = base.raw_depth;
        Served {
            names: Arc::new(names),
            tag: cursor_tag(version),
        }
    }
}

/// The tag of a version's cursors (see `api::query::cursor_prefix`): 0 for the deployment's own
/// projections (so cursors issued before versions existed stay valid), 1..=676 for a version
/// (FNV-1a of its name). Two versions with the same tag are told apart by nothing: a cursor of
/// one would be taken for the other's, as any cursor was before the switch existed.
pub fn cursor_tag(version: &str) -> u16 {
    if version.is_empty() {
        return 0;
    }
    let mut h: u32 = 0x811c_9dc5;
    for b in version.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    u16::try_from(h % 676).unwrap_or(0) + 1
}

/// The control bucket of the deployment named by `base`.
pub fn control_bucket(base: &Names) -> String {
    format!("{}_control", base.raw_prefix)
}

/// The served switch, as the control bucket holds it (`None`: never switched, or switched back
/// and the bucket removed: the deployment's own).
pub async fn read(js: &jetstream::Context, base: &Names) -> Result<Option<Switch>, Source> {
    match open(js, base).await? {
        Some(store) => read_from(&store, base).await,
        None => Ok(None),
    }
}

/// The control bucket, `None` when it does not exist.
async fn open(js: &jetstream::Context, base: &Names) -> Result<Option<kv::Store>, Source> {
    let bucket = control_bucket(base);
    if let Err(e) = js.get_stream(format!("KV_{bucket}")).await {
        return if crate::bus::error::stream_not_found(&e) {
            Ok(None)
        } else {
            Err(e.into())
        };
    }
    Ok(Some(js.get_key_value(&bucket).await?))
}

/// The served switch in the open control bucket `store`.
async fn read_from(store: &kv::Store, base: &Names) -> Result<Option<Switch>, Source> {
    let bucket = control_bucket(base);
    match store.get(SERVED_KEY).await? {
        Some(v) => Ok(Some(serde_json::from_slice(&v).map_err(|e| {
            Source::from(format!(
                "key {SERVED_KEY} of {bucket} is not a switch record: {e}"
            ))
        })?)),
        None => Ok(None),
    }
}

/// Record that `version` (empty: the deployment's own) is served from now on; creates the
/// control bucket if need be. Returns the switch written.
pub async fn write(
    js: &jetstream::Context,
    base: &Names,
    version: &str,
    replicas: usize,
) -> Result<Switch, Source> {
    let previous = read(js, base).await?.map(|s| s.version).unwrap_or_default();
    let store = js
        .create_key_value(kv::Config {
            bucket: control_bucket(base),
            description: "collab-projector: the projection version the API serves".into(),
            history: HISTORY,
            num_replicas: replicas.max(1),
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    let switch = Switch {
        version: version.to_string(),
        previous,
        at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    };
    let value = serde_json::to_vec(&switch).map_err(Source::from)?;
    store.put(SERVED_KEY, value.into()).await?;
    Ok(switch)
}

/// Keep `served` on what the control bucket says, reading it every [`FOLLOW_EVERY`] until
/// `cancel`. A read that fails keeps what is served (and is logged once per failure spell).
pub async fn follow(
    js: jetstream::Context,
    base: Names,
    served: Arc<watch::Sender<Arc<Served>>>,
    cancel: CancellationToken,
) {
    let mut failing = false;
    // Opened once and read each time (one request); opened again after a failed read, since
    // the bucket may have been removed and made again.
    let mut store: Option<kv::Store> = None;
    loop {
        let found = match &store {
            Some(s) => read_from(s, &base).await,
            None => match open(&js, &base).await {
                Ok(Some(s)) => {
                    let r = read_from(&s, &base).await;
                    store = Some(s);
                    r
                }
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            },
        };
        if found.is_err() {
            store = None;
        }
        match found {
            Ok(switch) => {
                failing = false;
                let version = switch.map(|s| s.version).unwrap_or_default();
                let now = served.borrow().names.version.clone();
                if version != now {
                    info!(from = %now, to = %version, "the API now serves another projection version");
                    served.send_replace(Arc::new(Served::of(&base, &version)));
                }
            }
            Err(e) => {
                if !failing {
                    warn!(error = %e, "the served projection version could not be read; serving what was served");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(FOLLOW_EVERY) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deployment_keeps_tag_zero_and_versions_get_a_tag_that_fits_15_bits() {
        assert_eq!(cursor_tag(""), 0);
        for v in ["v2", "v32", "p8", "blue", "green", "x"] {
            let t = cursor_tag(v);
            assert!((1..=676).contains(&t), "{v}: {t}");
            assert_eq!(t, cursor_tag(v), "stable");
        }
        assert_ne!(cursor_tag("v2"), cursor_tag("v3"));
    }

    #[test]
    fn a_served_version_reads_its_own_streams_over_the_deployments_raw_stream() {
        let base = Names::new("collab");
        let s = Served::of(&base, "v2");
        assert_eq!(s.names.proj_stream, "COLLAB_V2_PROJ");
        assert_eq!(s.names.raw_stream, "COLLAB_RAW");
        assert_eq!(s.names.prefix, "collab_v2");
        assert_eq!(control_bucket(&s.names), "collab_control");
        let own = Served::of(&base, "");
        assert_eq!(own.names.proj_stream, "COLLAB_PROJ");
        assert_eq!(own.tag, 0);
    }
}
