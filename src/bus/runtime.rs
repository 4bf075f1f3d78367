//! Threads of their own for work that must neither hold the partitions' threads nor wait for
//! them (the lease loop, the work-session fold), each with its own NATS connection.

use super::error::Source;
use crate::config::Settings;
use async_nats::jetstream;
use tokio_util::sync::CancellationToken;

/// A single-threaded runtime on a thread of its own, stopped when dropped: for work that must
/// neither hold the partitions' threads nor wait for them.
pub struct ThreadRuntime {
    pub handle: tokio::runtime::Handle,
    stop: CancellationToken,
}

impl ThreadRuntime {
    pub fn start(name: &str) -> std::io::Result<ThreadRuntime> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || rt.block_on(stopped.cancelled()))?;
        Ok(ThreadRuntime { handle, stop })
    }

    /// A NATS connection of its own whose I/O runs on this thread, so a busy partition runtime
    /// never delays what this thread sends or receives.
    pub async fn connect(
        &self,
        settings: &Settings,
        name: &'static str,
    ) -> Result<jetstream::Context, super::ConnectError> {
        let failed = |source: Source| super::ConnectError::Connect {
            url: super::display_url(&settings.nats.url),
            source,
        };
        let settings = settings.clone();
        self.handle
            .spawn(async move { super::connect_as(&settings, name).await.map(|(_, js)| js) })
            .await
            .map_err(|e| failed(Box::new(e)))?
    }
}

impl Drop for ThreadRuntime {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A thread of its own and JetStream over a connection whose I/O runs on it.
pub struct Side {
    pub rt: ThreadRuntime,
    pub js: jetstream::Context,
}

impl Side {
    /// Start the thread `thread` and connect on it as `client_name`.
    pub async fn start(
        settings: &Settings,
        thread: &str,
        client_name: &'static str,
    ) -> Result<Side, super::error::WorkerError> {
        use super::error::WorkerError;
        let rt = ThreadRuntime::start(thread)
            .map_err(|e| WorkerError::setup(0, format!("thread {thread}"), e))?;
        let js = rt
            .connect(settings, client_name)
            .await
            .map_err(|e| WorkerError::setup(0, format!("the connection of thread {thread}"), e))?;
        Ok(Side { rt, js })
    }
}
