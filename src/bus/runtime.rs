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
        Self::start_lowered(name, 0).map(|(rt, _)| rt)
    }

    /// Start the thread with its scheduling priority lowered by `by` nice levels below the
    /// calling thread's (capped at 19, the lowest), before it runs anything. Also returns what
    /// the thread's niceness was and is (`None` for `by` 0, which touches nothing), or why it
    /// could not be lowered (the thread then runs at the caller's priority).
    pub fn start_lowered(
        name: &str,
        by: u8,
    ) -> std::io::Result<(ThreadRuntime, std::io::Result<Option<Niceness>>)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let (lowered_tx, lowered_rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let lowered = if by == 0 {
                    Ok(None)
                } else {
                    lower_priority(by).map(Some)
                };
                // The receiver waits for this before `start_lowered` returns.
                let _ = lowered_tx.send(lowered);
                rt.block_on(stopped.cancelled())
            })?;
        let lowered = lowered_rx
            .recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("the thread ended as it started")));
        Ok((ThreadRuntime { handle, stop }, lowered))
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

/// A thread's niceness (-20 runs first, 19 last) before and after [`ThreadRuntime::start_lowered`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Niceness {
    pub before: i32,
    pub after: i32,
}

/// Lower the calling thread's priority by `by` nice levels, capped at 19. Linux schedules
/// threads one by one (`setpriority` with a thread id): the rest of the process keeps its
/// priority.
#[cfg(target_os = "linux")]
fn lower_priority(by: u8) -> std::io::Result<Niceness> {
    use rustix::process::{getpriority_process, setpriority_process};
    let me = Some(rustix::thread::gettid());
    let before = getpriority_process(me)?;
    let wanted = (before + i32::from(by)).min(19);
    if wanted != before {
        setpriority_process(me, wanted)?;
    }
    Ok(Niceness {
        before,
        after: getpriority_process(me)?,
    })
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(_by: u8) -> std::io::Result<Niceness> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "per-thread priorities are set on Linux only",
    ))
}

/// A thread of its own and JetStream over a connection whose I/O runs on it.
pub struct Side {
    pub rt: ThreadRuntime,
    pub js: jetstream::Context,
}

impl Side {
    /// Start the thread `thread`, its priority lowered by `niceness` nice levels (0: the
    /// process's), and connect on it as `client_name`.
    pub async fn start(
        settings: &Settings,
        thread: &str,
        client_name: &'static str,
        niceness: u8,
    ) -> Result<Side, super::error::WorkerError> {
        use super::error::WorkerError;
        let (rt, lowered) = ThreadRuntime::start_lowered(thread, niceness)
            .map_err(|e| WorkerError::setup(0, format!("thread {thread}"), e))?;
        match lowered {
            Ok(None) => {}
            Ok(Some(n)) => tracing::info!(
                thread,
                niceness = n.after,
                process_niceness = n.before,
                "thread runs at a lower priority than the partitions"
            ),
            Err(e) => tracing::warn!(
                thread,
                error = %e,
                "could not lower the thread's priority; it runs at the partitions' priority"
            ),
        }
        let js = rt
            .connect(settings, client_name)
            .await
            .map_err(|e| WorkerError::setup(0, format!("the connection of thread {thread}"), e))?;
        Ok(Side { rt, js })
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_the_started_thread_is_lowered() {
        let niceness_of =
            |tid| rustix::process::getpriority_process(Some(tid)).expect("getpriority");
        let own_niceness = || niceness_of(rustix::thread::gettid());
        // The niceness of the thread `rt` runs its tasks on.
        let niceness_on = |rt: &ThreadRuntime| {
            let (tx, rx) = std::sync::mpsc::channel();
            rt.handle.spawn(async move {
                let _ = tx.send(rustix::thread::gettid());
            });
            niceness_of(
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("the thread answers"),
            )
        };
        let mine = own_niceness();
        let (rt, lowered) = ThreadRuntime::start_lowered("lowered-by-5", 5).expect("starts");
        let n = lowered
            .expect("lowering one's own priority needs no privilege")
            .expect("asked");
        assert_eq!(n.before, mine);
        assert_eq!(n.after, (mine + 5).min(19));
        assert_eq!(niceness_on(&rt), n.after, "the runtime runs on that thread");
        assert_eq!(own_niceness(), mine, "the caller keeps its priority");

        let (capped, lowered) = ThreadRuntime::start_lowered("lowered-by-19", 19).expect("starts");
        let n = lowered.expect("lowered").expect("asked");
        assert_eq!(n.after, 19, "19 is the lowest");
        assert_eq!(niceness_on(&capped), 19);

        let (same, lowered) = ThreadRuntime::start_lowered("not-lowered", 0).expect("starts");
        assert_eq!(lowered.expect("nothing to do"), None, "0 reads nothing");
        assert_eq!(niceness_on(&same), mine, "0 leaves the caller's priority");
    }
}
