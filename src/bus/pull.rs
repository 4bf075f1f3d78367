//! One pull request's deliveries for a partition's durable consumer.

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use std::time::Duration;

/// One pull request's deliveries.
///
/// Unlike the client's own batch, it never ends on a client-side timer while the server still
/// has messages of the batch in flight: a partition that spends longer on a batch than the pull's
/// expiry would otherwise lose the unread rest until its ack wait, and meet it behind newer
/// messages. The batch ends when it is full, or when the server says the request expired.
pub(crate) struct PullBatch {
    sub: async_nats::Subscriber,
    js: jetstream::Context,
    left: usize,
    /// When silence ends the batch. Absolute, so a caller that drops `next` (a timer in a
    /// `select!`) and calls again does not restart the wait: a pull request the server lost
    /// (a restart, a leader change) must still end the batch.
    silent_until: tokio::time::Instant,
    /// The connection's count of successful connects when the request was made. A reconnect
    /// since may have lost the request: a restarted server has forgotten it, and an expiry
    /// notice sent while the link was down never arrives. From then on, silence ends the batch
    /// after [`RECONNECT_SILENCE`] rather than [`PULL_SILENCE`].
    connects_at_request: u64,
    stats: std::sync::Arc<async_nats::Statistics>,
}

/// Silence after which a batch is over even without the server's expiry notice.
pub(crate) const PULL_SILENCE: Duration = Duration::from_secs(11);

/// Silence after which a batch whose connection reconnected since its request is over. Three
/// expiries: a server that still holds the request (a link that dropped and came back to the
/// same server) delivers on it or says it expired well within that; one that forgot it (a
/// restart) never answers, and waiting the whole [`PULL_SILENCE`] would leave the partition
/// idle that long. Ending a batch whose request is in fact alive costs a restart of the
/// partition (its next delivery is out of sequence), never an input.
pub(crate) const RECONNECT_SILENCE: Duration = Duration::from_millis(1500);

/// How often a silent batch looks for a reconnect (only silence is checked: deliveries mean the
/// request is alive).
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// How long a pull request waits on the server for messages.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_millis(500);

impl PullBatch {
    pub(crate) async fn request(
        js: &jetstream::Context,
        consumer: &PullConsumer,
        batch: usize,
    ) -> Result<PullBatch, String> {
        let client = js.client();
        let stats = client.statistics();
        // Read before the request is sent, so a reconnect that races with it counts as one.
        let connects_at_request = stats.connects.load(std::sync::atomic::Ordering::Relaxed);
        let inbox = async_nats::Subject::from(client.new_inbox());
        let sub = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| e.to_string())?;
        let config = jetstream::consumer::pull::BatchConfig {
            batch,
            expires: Some(PULL_EXPIRES),
            ..Default::default()
        };
        consumer
            .request_batch(config, inbox)
            .await
            .map_err(|e| e.to_string())?;
        Ok(PullBatch {
            sub,
            js: js.clone(),
            left: batch,
            silent_until: tokio::time::Instant::now() + PULL_SILENCE,
            connects_at_request,
            stats,
        })
    }

    /// Whether the connection reconnected since the request.
    fn reconnected(&self) -> bool {
        let connects = self
            .stats
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        connects != self.connects_at_request
    }

    /// The next message; `None` when the batch is over. Silence well past the expiry (a lost
    /// status message) also ends it, sooner once the connection has reconnected.
    pub(crate) async fn next(&mut self) -> Option<Result<jetstream::Message, String>> {
        use async_nats::StatusCode;
        while self.left > 0 {
            // Wake at least every RECONNECT_CHECK while silent, to notice a reconnect.
            let wake = self
                .silent_until
                .min(tokio::time::Instant::now() + RECONNECT_CHECK);
            let message = match tokio::time::timeout_at(wake, self.sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => return None,
                Err(_) => {
                    let now = tokio::time::Instant::now();
                    if self.reconnected() {
                        self.silent_until = self.silent_until.min(now + RECONNECT_SILENCE);
                    }
                    if now >= self.silent_until {
                        return None;
                    }
                    continue;
                }
            };
            self.silent_until = tokio::time::Instant::now() + PULL_SILENCE;
            match message.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    self.left -= 1;
                    return Some(Ok(jetstream::Message {
                        message,
                        context: self.js.clone(),
                    }));
                }
                StatusCode::IDLE_HEARTBEAT => continue,
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => return None,
                status => {
                    self.left = 0;
                    return Some(Err(format!(
                        "pull request ended: {status} {}",
                        message.description.unwrap_or_default()
                    )));
                }
            }
        }
        None
    }
}
