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
}

/// Silence after which a batch is over even without the server's expiry notice.
pub(crate) const PULL_SILENCE: Duration = Duration::from_secs(11);

/// How long a pull request waits on the server for messages.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_millis(500);

impl PullBatch {
    pub(crate) async fn request(
        js: &jetstream::Context,
        consumer: &PullConsumer,
        batch: usize,
    ) -> Result<PullBatch, String> {
        let client = js.client();
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
        })
    }

    /// The next message; `None` when the batch is over. Silence well past the expiry (a lost
    /// status message) also ends it.
    pub(crate) async fn next(&mut self) -> Option<Result<jetstream::Message, String>> {
        use async_nats::StatusCode;
        while self.left > 0 {
            let message = match tokio::time::timeout_at(self.silent_until, self.sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(_) => return None,
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
