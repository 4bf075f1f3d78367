//! Answers that went with a reconnect.
//!
//! The server answers a request (a publish's ack, a key's read, a compare-and-set) on the
//! connection it came in on. When that connection drops, an answer already on its way is lost
//! with it, and the request would wait out its whole timeout for nothing. [`Reconnects`] watches
//! a connection's count of connects: an answer still missing once the connection has connected
//! again, and a short grace has passed, is given up, so the caller can ask again (a read) or
//! find out what became of it (a write).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often an answer not yet in looks for a reconnect of the connection it was asked on.
pub(crate) const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// How long an answer is still waited for once its connection has reconnected since the
/// request: the server answers to the request's reply subject, which the new connection
/// subscribes to again, so an answer sent after the reconnect (a replicated stream committing
/// late) still arrives; one sent before it went with the old connection.
pub(crate) const RECONNECT_GRACE: Duration = Duration::from_millis(500);

/// The last reconnect an answer asked before it saw: its count of connects, when it was first
/// seen, and whether an answer given up with it was told.
struct Seen {
    connects: u64,
    at: tokio::time::Instant,
    told: bool,
}

/// One connection's reconnects, as the requests sent on it see them.
pub(crate) struct Reconnects {
    stats: Arc<async_nats::Statistics>,
    seen: Mutex<Option<Seen>>,
}

impl Reconnects {
    pub(crate) fn new(client: &async_nats::Client) -> Reconnects {
        Reconnects {
            stats: client.statistics(),
            seen: Mutex::new(None),
        }
    }

    /// The connection's count of connects so far: read before a request is sent.
    pub(crate) fn connects(&self) -> u64 {
        self.stats.connects.load(Ordering::Relaxed)
    }

    /// The server's answer (`fut`) to what was sent when the connection had connected
    /// `connects_at_send` times, or `Err(connects)` when it has connected `connects` times
    /// since and no answer came within [`RECONNECT_GRACE`] of that being seen.
    pub(crate) async fn answer_unless_lost<F: std::future::IntoFuture>(
        &self,
        fut: F,
        connects_at_send: u64,
    ) -> Result<F::Output, u64> {
        let mut fut = std::pin::pin!(fut.into_future());
        // Most answers are in by the time they are looked for: no timer for those.
        if let std::task::Poll::Ready(r) = futures::poll!(fut.as_mut()) {
            return Ok(r);
        }
        loop {
            let connects = self.connects();
            if connects != connects_at_send {
                // One grace per reconnect, from when it was first seen: the answers lost with
                // it are given up together, not one grace after another.
                let until = self.grace_after(connects);
                return tokio::time::timeout_at(until, fut.as_mut())
                    .await
                    .map_err(|_| connects);
            }
            if let Ok(answer) = tokio::time::timeout(RECONNECT_CHECK, fut.as_mut()).await {
                return Ok(answer);
            }
        }
    }

    /// A read (`ask` sends it; asking again changes nothing), asked again for as long as its
    /// answer goes with a reconnect. Each read asked again is logged as `what` with its `key`.
    /// Callers bound the whole with their own timeout.
    pub(crate) async fn read<F, Fut>(&self, what: &str, key: &str, mut ask: F) -> Fut::Output
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future,
    {
        loop {
            let connects = self.connects();
            match self.answer_unless_lost(ask(), connects).await {
                Ok(answer) => return answer,
                Err(_) => {
                    tracing::info!(
                        key,
                        "{what}'s answer went with a reconnect; reading it again"
                    )
                }
            }
        }
    }

    /// A write (`fut`, sent when the connection had connected `connects_at_send` times): its
    /// answer, or `None` when the answer went with a reconnect, logged once per write as
    /// `what` with its `key`. Whether it was stored is then unknown: the caller reads again.
    pub(crate) async fn write<F: std::future::IntoFuture>(
        &self,
        what: &str,
        key: &str,
        fut: F,
        connects_at_send: u64,
    ) -> Option<F::Output> {
        match self.answer_unless_lost(fut, connects_at_send).await {
            Ok(answer) => Some(answer),
            Err(_) => {
                tracing::info!(
                    key,
                    "{what}'s answer went with a reconnect; reading what it left before going on"
                );
                None
            }
        }
    }

    /// When the grace for answers asked before the connection's `connects`-th connect ends:
    /// [`RECONNECT_GRACE`] after the first look at that count.
    fn grace_after(&self, connects: u64) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let Ok(mut seen) = self.seen.lock() else {
            return now;
        };
        match &*seen {
            Some(r) if r.connects == connects => r.at + RECONNECT_GRACE,
            _ => {
                *seen = Some(Seen {
                    connects,
                    at: now,
                    told: false,
                });
                now + RECONNECT_GRACE
            }
        }
    }

    /// Whether this is the first answer given up with the reconnect to `connects` (for a line
    /// said once per reconnect).
    pub(crate) fn first_lost_with(&self, connects: u64) -> bool {
        let Ok(mut seen) = self.seen.lock() else {
            return false;
        };
        match seen.as_mut() {
            Some(r) if r.connects == connects && !r.told => {
                r.told = true;
                true
            }
            _ => false,
        }
    }
}
