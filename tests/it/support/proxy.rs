//! A TCP proxy between a worker and its nats-server, for network faults without netem: each
//! direction can be held (bytes already read are kept and delivered when it resumes, as a
//! stalled network delivers them late), and the whole link can be cut (connections dropped, new
//! ones refused) and healed.
//!
//! A direction can also be held from the moment the client sends a given request
//! ([`Proxy::hold_answers_once_sent`]): the request reaches the server, its answer (and
//! everything after it) waits, which catches one chosen kind of request in flight at a cut.
//!
//! One connection, named by its client's `CONNECT`, can also be held and cut on its own
//! ([`Proxy::hold_down_on`], [`Proxy::cut_on`]), leaving the client's other connections as they
//! are.
//!
//! Loopback only; it stops with the test (dropped, every task ends).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// One direction's switch: open (bytes flow) or held.
struct Gate {
    open: watch::Sender<bool>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            open: watch::channel(true).0,
        }
    }

    fn set(&self, open: bool) {
        self.open.send_replace(open);
    }

    async fn wait_open(&self) {
        let mut rx = self.open.subscribe();
        // The sender lives as long as the proxy; a closed channel only ends the wait.
        let _ = rx.wait_for(|open| *open).await;
    }
}

struct Shared {
    /// Client to server (what the worker sends: publishes, pulls, acks, lease renewals).
    up: Gate,
    /// Server to client (deliveries, acks of publishes).
    down: Gate,
    cut: AtomicBool,
    links: Mutex<Vec<Link>>,
    /// The connection whose server-to-client direction alone is held ([`Proxy::hold_down_on`]).
    held_name: watch::Sender<Option<String>>,
    /// The request that, once sent, holds what the server sends ([`Proxy::hold_answers_once_sent`]).
    trigger: Mutex<Option<Trigger>>,
}

/// One proxied connection: the name its client gave (once its `CONNECT` is read) and its two
/// directions' tasks.
struct Link {
    name: Arc<Mutex<Option<String>>>,
    up: JoinHandle<()>,
    down: JoinHandle<()>,
}

impl Link {
    fn is_finished(&self) -> bool {
        self.up.is_finished() && self.down.is_finished()
    }

    fn abort(&self) {
        self.up.abort();
        self.down.abort();
    }

    fn named(&self, name: &str) -> bool {
        self.name
            .lock()
            .map(|n| n.as_deref() == Some(name))
            .unwrap_or(false)
    }
}

/// Bytes the client may send, and who to tell once it has (what the server sends is held from
/// then on).
struct Trigger {
    pattern: Vec<u8>,
    /// Only on a connection that named itself so in its `CONNECT` (any when `None`).
    connection: Option<String>,
    sent: oneshot::Sender<()>,
}

pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listen on a free loopback port and forward every connection to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("proxy listener: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("proxy address: {e}"))
            .port();
        let shared = Arc::new(Shared {
            up: Gate::new(),
            down: Gate::new(),
            cut: AtomicBool::new(false),
            links: Mutex::new(Vec::new()),
            held_name: watch::channel(None).0,
            trigger: Mutex::new(None),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if s.cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let name = Arc::new(Mutex::new(None));
                let up = tokio::spawn(pump(cr, sw, s.clone(), true, name.clone()));
                let down = tokio::spawn(pump(sr, cw, s.clone(), false, name.clone()));
                if let Ok(mut links) = s.links.lock() {
                    links.retain(|l| !l.is_finished());
                    links.push(Link { name, up, down });
                }
            }
        });
        Proxy {
            port,
            shared,
            accept,
        }
    }

    /// The URL a worker connects to instead of the server's.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Hold (or release) what the client sends.
    pub fn hold_up(&self, held: bool) {
        self.shared.up.set(!held);
    }

    /// Hold (or release) what the server sends.
    pub fn hold_down(&self, held: bool) {
        self.shared.down.set(!held);
    }

    /// Hold what the server sends from the moment any connection's client sends `pattern`
    /// (anywhere in its bytes: a subject, a header, a payload), once: the bytes that hold it
    /// still reach the server, its answer is held. The receiver resolves when that happened.
    pub fn hold_answers_once_sent(&self, pattern: &str) -> oneshot::Receiver<()> {
        self.hold_answers_once_sent_on(None, pattern)
    }

    /// [`Proxy::hold_answers_once_sent`], counting only what a connection named `connection`
    /// (the `name` of its `CONNECT`) sends, when given.
    pub fn hold_answers_once_sent_on(
        &self,
        connection: Option<&str>,
        pattern: &str,
    ) -> oneshot::Receiver<()> {
        let (sent, rx) = oneshot::channel();
        if let Ok(mut t) = self.shared.trigger.lock() {
            *t = Some(Trigger {
                pattern: pattern.as_bytes().to_vec(),
                connection: connection.map(str::to_string),
                sent,
            });
        }
        rx
    }

    /// A full partition: every connection dropped, new ones refused until [`Proxy::heal`].
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        if let Ok(mut links) = self.shared.links.lock() {
            for l in links.drain(..) {
                l.abort();
            }
        }
    }

    /// Hold what the server sends on the connections named `name` only (`None`: release).
    pub fn hold_down_on(&self, name: Option<&str>) {
        self.shared.held_name.send_replace(name.map(str::to_string));
    }

    /// Drop the connections named `name` only; the client may connect again at once.
    pub fn cut_on(&self, name: &str) {
        if let Ok(mut links) = self.shared.links.lock() {
            links.retain(|l| {
                if l.named(name) {
                    l.abort();
                    false
                } else {
                    true
                }
            });
        }
    }

    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copy `from` to `to`, waiting at the gate before reading and again before writing, so a held
/// direction keeps what it read and delivers it late.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    up: bool,
    link_name: Arc<Mutex<Option<String>>>,
) {
    let gate = if up { &shared.up } else { &shared.down };
    let mut buf = vec![0u8; 64 * 1024];
    // The end of what came before, so a trigger's bytes split over two reads are found.
    let mut tail: Vec<u8> = Vec::new();
    // The name the client gave in its `CONNECT`, the first thing it sends.
    let mut name: Option<String> = None;
    let mut first = true;
    loop {
        gate.wait_open().await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if up && first {
            name = connect_name(&buf[..n]);
            if let Ok(mut shared_name) = link_name.lock() {
                shared_name.clone_from(&name);
            }
            first = false;
        }
        if up {
            tail.extend_from_slice(&buf[..n]);
            if !fire_if_sent(&shared, &tail, name.as_deref()) {
                // Nothing sent before a trigger is armed counts for it.
                tail.clear();
            }
            let keep = tail.len().min(4096);
            tail.drain(..tail.len() - keep);
        }
        gate.wait_open().await;
        if !up {
            held_while_named(&shared, &link_name).await;
        }
        if shared.cut.load(Ordering::SeqCst) || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Wait while this link's connection is the one held on its own ([`Proxy::hold_down_on`]).
async fn held_while_named(shared: &Shared, link_name: &Mutex<Option<String>>) {
    let mine = link_name.lock().ok().and_then(|n| n.clone());
    let Some(mine) = mine else {
        return;
    };
    let mut held = shared.held_name.subscribe();
    // The sender lives as long as the proxy; a closed channel only ends the wait.
    let _ = held.wait_for(|h| h.as_deref() != Some(mine.as_str())).await;
}

/// The `name` of a client's `CONNECT` in `bytes`, if they hold one with a name.
fn connect_name(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    let connect = &text[text.find("CONNECT {")?..];
    let rest = &connect[connect.find("\"name\":\"")? + 8..];
    Some(rest[..rest.find('"')?].to_string())
}

/// Hold what the server sends, and tell the waiter, when `seen` (sent on the connection named
/// `connection`) holds the armed trigger's bytes. Whether a trigger is (still) armed.
fn fire_if_sent(shared: &Shared, seen: &[u8], connection: Option<&str>) -> bool {
    let Ok(mut trigger) = shared.trigger.lock() else {
        return false;
    };
    let hit = trigger.as_ref().is_some_and(|t| {
        t.connection
            .as_deref()
            .is_none_or(|c| Some(c) == connection)
            && seen.windows(t.pattern.len()).any(|w| w == t.pattern)
    });
    if hit {
        shared.down.set(false);
        if let Some(t) = trigger.take() {
            let _ = t.sent.send(());
        }
    }
    trigger.is_some()
}
