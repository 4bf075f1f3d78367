//! What the API's handlers share: the JetStream context, the grants, the session periods, the
//! event-stream limits and slots, and the API's counters.

use super::auth::Grants;
use super::error::ApiError;
use super::slots;
use crate::config::{HttpSettings, Names};
use async_nats::jetstream::{self, kv, object_store::ObjectStore};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex};
use tokio_util::sync::CancellationToken;

/// Per-client bounds of the event stream.
#[derive(Debug, Clone, Copy)]
pub struct SseLimits {
    /// Events buffered for a client before it counts as too slow.
    pub buffer_events: usize,
    /// Bytes buffered for a client before it counts as too slow.
    pub buffer_bytes: usize,
    /// Keep-alive comment interval.
    pub keep_alive: Duration,
    /// How long one stream stays open before it ends with `lifetime_reached`.
    pub lifetime: Duration,
}

impl Default for SseLimits {
    fn default() -> Self {
        SseLimits::from_settings(&HttpSettings::default())
    }
}

impl SseLimits {
    /// The limits `http.sse_buffer_events`, `http.sse_buffer_bytes` and
    /// `http.sse_max_stream_lifetime` set.
    pub fn from_settings(http: &HttpSettings) -> SseLimits {
        SseLimits {
            buffer_events: http.sse_buffer_events,
            buffer_bytes: http.sse_buffer_bytes,
            keep_alive: Duration::from_secs(15),
            lifetime: http.sse_max_stream_lifetime,
        }
    }
}

/// Counters of the API, for tests and the demo.
#[derive(Debug, Default)]
pub struct ApiStats {
    /// Event streams open now.
    pub sse_clients: AtomicUsize,
    /// Event streams closed because their client was too slow.
    pub sse_overflows: AtomicU64,
}

/// What the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    js: jetstream::Context,
    /// The projection version served (the deployment's own unless switched, see
    /// [`crate::served`]).
    served: Arc<watch::Sender<Arc<crate::served::Served>>>,
    grants: Arc<Grants>,
    quiet_after: Duration,
    archive_after: Duration,
    sse: SseLimits,
    slots: Arc<slots::Slots>,
    list_slots: Arc<slots::Slots>,
    scan_slots: Arc<slots::Slots>,
    scan_timeout: Duration,
    shutdown: CancellationToken,
    /// The served version's work-session bucket and object store, opened once per version.
    sessions: Arc<Mutex<Option<(String, kv::Store)>>>,
    blobs: Arc<Mutex<Option<(String, ObjectStore)>>>,
    stats: Arc<ApiStats>,
    prices: Arc<crate::usage::Prices>,
}

impl ApiState {
    /// The API over `js`, with the tokens and session periods of `http`.
    pub fn new(js: jetstream::Context, names: Names, http: &HttpSettings) -> ApiState {
        ApiState {
            js,
            served: Arc::new(watch::Sender::new(Arc::new(crate::served::Served::of(
                &names,
                &names.version,
            )))),
            grants: Arc::new(Grants::new(http)),
            quiet_after: http.quiet_after,
            archive_after: http.archive_after,
            sse: SseLimits::from_settings(http),
            slots: Arc::new(slots::Slots::new(
                slots::Capped::EVENT_STREAMS,
                http.sse_max_streams,
                http.sse_max_streams_per_token,
            )),
            list_slots: Arc::new(slots::Slots::new(
                slots::Capped::SESSION_LISTS,
                http.session_lists,
                http.session_lists_per_token,
            )),
            scan_slots: Arc::new(slots::Slots::new(
                slots::Capped::SCANS,
                http.scans,
                http.scans_per_token,
            )),
            scan_timeout: http.scan_timeout,
            shutdown: CancellationToken::new(),
            sessions: Arc::new(Mutex::new(None)),
            blobs: Arc::new(Mutex::new(None)),
            stats: Arc::new(ApiStats::default()),
            prices: Arc::new(crate::usage::Prices::EMPTY),
        }
    }

    /// End open event streams when `token` is cancelled, so a graceful shutdown is not held up
    /// by clients that never disconnect.
    pub fn with_shutdown(mut self, token: CancellationToken) -> ApiState {
        self.shutdown = token;
        self
    }

    pub fn with_sse_limits(mut self, limits: SseLimits) -> ApiState {
        self.sse = limits;
        self
    }

    pub fn js(&self) -> &jetstream::Context {
        &self.js
    }
    /// The names of the projection version served now.
    pub fn names(&self) -> Arc<Names> {
        Arc::clone(&self.served.borrow().names)
    }
    /// What is served now: the version's names and the tag of its cursors.
    pub fn served(&self) -> Arc<crate::served::Served> {
        Arc::clone(&self.served.borrow())
    }
    /// Told of every switch of the served version (event streams end on one).
    pub fn switches(&self) -> watch::Receiver<Arc<crate::served::Served>> {
        self.served.subscribe()
    }
    /// The sender [`crate::served::follow`] keeps on the control bucket's choice.
    pub fn served_sender(&self) -> Arc<watch::Sender<Arc<crate::served::Served>>> {
        Arc::clone(&self.served)
    }
    pub fn grants(&self) -> &Grants {
        &self.grants
    }
    /// The grants, shared with the access-control middleware.
    pub fn shared_grants(&self) -> Arc<Grants> {
        Arc::clone(&self.grants)
    }
    /// The API with `prices` costing the usage it shows.
    pub fn with_prices(mut self, prices: crate::usage::Prices) -> ApiState {
        self.prices = Arc::new(prices);
        self
    }
    pub fn prices(&self) -> &crate::usage::Prices {
        &self.prices
    }
    pub fn quiet_after(&self) -> Duration {
        self.quiet_after
    }
    pub fn archive_after(&self) -> Duration {
        self.archive_after
    }
    pub fn sse_limits(&self) -> SseLimits {
        self.sse
    }
    pub fn stream_slots(&self) -> &Arc<slots::Slots> {
        &self.slots
    }

    /// The places for work-session lists being read (each reads the whole bucket).
    pub fn list_slots(&self) -> &Arc<slots::Slots> {
        &self.list_slots
    }
    /// The places for scans of the projection stream, and how long one may run.
    pub fn scan_slots(&self) -> &Arc<slots::Slots> {
        &self.scan_slots
    }
    pub fn scan_timeout(&self) -> Duration {
        self.scan_timeout
    }
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
    pub fn stats(&self) -> &ApiStats {
        &self.stats
    }

    /// The served version's work-session bucket, looked up once per version.
    pub async fn sessions_kv(&self) -> Result<kv::Store, ApiError> {
        let bucket = self.names().sessions_bucket.clone();
        once_per_name(&self.sessions, bucket, |b| async move {
            self.js
                .get_key_value(&b)
                .await
                .map_err(|e| ApiError::unavailable("work-session bucket", e))
        })
        .await
    }

    /// How far the work sessions are written: the fold's checkpoint (`fold.position` in the
    /// work-session bucket) and how many messages the projection stream holds after it. `None`
    /// when there is no checkpoint (no fold has run) or either is not read within 2 s: a
    /// response is answered without it rather than failed.
    pub async fn fold_progress(&self) -> Option<(u64, u64)> {
        use crate::bus::sessions::{last_sequence, stored, Stored, FOLD_KEY};
        let read = async {
            let kv = self.sessions_kv().await.ok()?;
            let entry = kv.entry(FOLD_KEY).await.ok()?;
            let Ok(Stored::At { last: position, .. }) = stored(FOLD_KEY, entry) else {
                return None;
            };
            // Read after the checkpoint, so what it counts is never less than what is left.
            let last = last_sequence(&self.js, &self.names().proj_stream).await?;
            Some((position, last.saturating_sub(position)))
        };
        tokio::time::timeout(Duration::from_secs(2), read)
            .await
            .ok()
            .flatten()
    }

    /// The served version's object store of offloaded fields, looked up once per version.
    pub async fn blobs_store(&self) -> Result<ObjectStore, ApiError> {
        let name = self.names().blobs_store.clone();
        once_per_name(&self.blobs, name, |n| async move {
            self.js
                .get_object_store(&n)
                .await
                .map_err(|e| ApiError::unavailable("object store", e))
        })
        .await
    }
}

/// The handle `cache` holds for `name`, or a new one from `open` (kept in place of the handle of
/// another name: the version served changed).
async fn once_per_name<T, F, Fut>(
    cache: &Mutex<Option<(String, T)>>,
    name: String,
    open: F,
) -> Result<T, ApiError>
where
    T: Clone,
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let mut cached = cache.lock().await;
    if let Some((have, handle)) = cached.as_ref() {
        if *have == name {
            return Ok(handle.clone());
        }
    }
    let handle = open(name.clone()).await?;
    *cached = Some((name, handle.clone()));
    Ok(handle)
}
