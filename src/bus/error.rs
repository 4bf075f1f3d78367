//! The partition runtime's errors. A bus error keeps the client library's error as its source,
//! with its kind (`source.downcast_ref::<async_nats::jetstream::context::GetStreamError>()`
//! and the like): callers decide on kinds, never on message text.

use super::publish::Failure;

/// The error a bus operation failed with, as the client library gave it.
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether the server answered that the stream does not exist (by its error code; no answer,
/// no permission and the like are other errors).
pub fn stream_not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    use async_nats::jetstream::{context::GetStreamErrorKind, ErrorCode};
    matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A step the partition needs before it can run failed (a stream, a consumer, a bucket, a
    /// thread): the partition is restarted with backoff.
    #[error("partition {partition}: {what}: {source}")]
    Setup {
        partition: u16,
        what: String,
        #[source]
        source: Source,
    },
    /// The partition skipped messages it had been delivered (a lapsed lease, a broken batch):
    /// run it again, which first takes over what is in flight, in order.
    #[error("partition {partition} interrupted: {why}")]
    Interrupted { partition: u16, why: &'static str },
    /// An output could not be stored and waiting will not change that: the partition stops
    /// (and is restarted, with backoff, until an operator fixes the cause).
    #[error("partition {partition} stopped: {source}")]
    Publish {
        partition: u16,
        #[source]
        source: Failure,
    },
}

impl WorkerError {
    /// A failed setup step of partition `partition` (0 for the worker's own).
    pub fn setup(
        partition: u16,
        what: impl Into<String>,
        source: impl Into<Source>,
    ) -> WorkerError {
        WorkerError::Setup {
            partition,
            what: what.into(),
            source: source.into(),
        }
    }

    /// What the partition does about an output that cannot be stored: a lost fence is an
    /// interruption (the new owner has the partition); anything else stops it loudly.
    pub fn of_failure(partition: u16, failure: Failure) -> WorkerError {
        match failure {
            Failure::Deposed { .. } => WorkerError::Interrupted {
                partition,
                why: "another owner claimed the partition",
            },
            source => WorkerError::Publish { partition, source },
        }
    }
}

/// A read or request the server stopped answering within its bound (a pause, a lost
/// connection): the step is retried from the start, never taken as complete.
#[derive(Debug, thiserror::Error)]
#[error("{what}: no answer within {after:?}")]
pub struct NoAnswer {
    pub what: String,
    pub after: std::time::Duration,
}

impl NoAnswer {
    pub fn new(what: impl Into<String>, after: std::time::Duration) -> NoAnswer {
        NoAnswer {
            what: what.into(),
            after,
        }
    }
}
