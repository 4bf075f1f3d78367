//! One exchange is one conversation, whatever context its answers reveal.
//!
//! A caller that starts an A2A conversation sends no `contextId`; the agent picks one and every
//! answer and stream frame carries it. The relay keys the exchange by an id of its own, and the
//! request, its answer, its frames and any blocked outcome the processor synthesises must land in
//! one conversation and one work session, whose turns end answered or blocked, never open.
//!
//! Real peers: the a2a-sdk client (`tests/e2e/a2a_client.py --fresh`) calls a2a-sdk agents
//! (`tests/e2e/a2a_agents.py`) through relays, onto a real nats-server, through the projector.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tempfile::NamedTempFile;

use crate::pipeline::read_all;
use crate::support::{provision_with_binary, wait_until, Projector, ReservedPort, TestNats};

/// Guards against hangs only.
const WAIT: Duration = Duration::from_secs(90);

/// The address a process printed after `prefix`.
fn printed(log: &str, prefix: &str) -> Option<String> {
    log.lines()
        .find_map(|l| l.split(prefix).nth(1))
        .map(|a| a.trim().to_string())
}

/// `collab-projector relay a2a` in front of `upstream`, answering as `to`; the caller is named by
/// the `X-Collab-Agent` header of the local client. Returns the process and its address.
async fn relay(nats_url: &str, upstream: &str, to: &str) -> (Projector, String) {
    let process = Projector::spawn_command(
        &[
            "relay",
            "a2a",
            "--nats-url",
            nats_url,
            "--listen",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--to-agent",
            to,
            "--from-agent",
            "caller-agent",
            "--from-agent-header",
            "X-Collab-Agent",
            "--trust-header-from",
            "127.0.0.0/8",
        ],
        &[("RUST_LOG", "info")],
    );
    wait_until(WAIT, "the relay prints its address", || {
        let log = process.log_text();
        async move { printed(&log, "relay listening on ").is_some() }
    })
    .await;
    let addr = printed(&process.log_text(), "relay listening on ")
        .unwrap_or_else(|| panic!("the relay printed no address"));
    (process, addr)
}

/// A Python script as a child process, killed on drop.
struct Script {
    child: Child,
    log: NamedTempFile,
}

impl Script {
    fn spawn(python: &Path, script: &str, args: &[&str]) -> Script {
        let log = NamedTempFile::new().unwrap_or_else(|e| panic!("a log file: {e}"));
        let out = |f: &NamedTempFile| {
            f.as_file()
                .try_clone()
                .unwrap_or_else(|e| panic!("the log file: {e}"))
        };
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/e2e")
            .join(script);
        let child = Command::new(python)
            .arg(&path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out(&log))
            .stderr(out(&log))
            .spawn()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", path.display()));
        Script { child, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- python log ---\n{}\n--- end ---", self.log_text());
        }
    }
}

/// The work sessions with a turn (an agent card fetched through the relay is an exchange of its
/// own, without one).
async fn sessions(http_port: u16) -> Vec<Value> {
    let url = format!("http://127.0.0.1:{http_port}/api/work-sessions?limit=1000");
    let body: Value = match reqwest::get(&url).await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let mut listed = body["sessions"].as_array().cloned().unwrap_or_default();
    listed.retain(|s| s["countsByType"]["a2a.send"].as_u64().is_some());
    listed
}

/// The work sessions once there are `count` of them, each with no open turn and exactly one
/// answered or blocked turn; fails if that does not happen within [`WAIT`].
async fn decided_sessions(http_port: u16, count: usize) -> Vec<Value> {
    let decided = |listed: &[Value]| {
        listed.len() == count
            && listed.iter().all(|s| {
                let n = |k: &str| s[k].as_u64().unwrap_or(0);
                n("openTurns") == 0 && n("answeredTurns") + n("blockedTurns") == 1
            })
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while !decided(&sessions(http_port).await) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listed = sessions(http_port).await;
    assert!(
        decided(&listed),
        "sessions: {:#}",
        Value::Array(listed.clone())
    );
    listed
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// The turn of a projected event: its `turnId`, or a synthesised outcome's `payload.turn`.
fn turn_of(env: &Value) -> String {
    let t = text(&env["turnId"]);
    if t.is_empty() {
        text(&env["payload"]["turn"])
    } else {
        t
    }
}

#[tokio::test]
async fn a_conversation_the_caller_starts_without_a_context_stays_one_conversation() {
    let Some(python) = crate::support::e2e_python(
        "import a2a.server.routes, a2a.client, uvicorn, starlette, httpx",
        "a2a-sdk and uvicorn",
    ) else {
        return;
    };
    let nats = TestNats::start().await;
    provision_with_binary(&nats.url(), [("RUST_LOG", "warn")]);
    let js = nats.jetstream().await;
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let addr = format!("127.0.0.1:{http_port}");
    let _projector = Projector::spawn_command(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--http-addr",
            &addr,
            "--main-agents",
            "planner,complete-agent,stream-agent,ask-agent,hang-agent",
            "--turn-timeout",
            "3s",
        ],
        &[("RUST_LOG", "info")],
    );

    let reserved = ReservedPort::for_server();
    let agents_port = reserved.port();
    let mut relays = BTreeMap::new();
    for name in ["complete", "stream", "ask", "hang"] {
        let upstream = format!("http://127.0.0.1:{agents_port}/{name}");
        relays.insert(
            name,
            relay(&nats.url(), &upstream, &format!("{name}-agent")).await,
        );
    }
    let port = agents_port.to_string();
    let publics: Vec<String> = relays
        .iter()
        .map(|(name, (_, a))| format!("{name}=http://{a}"))
        .collect();
    let mut args = vec!["--port", port.as_str()];
    for p in &publics {
        args.extend(["--public", p.as_str()]);
    }
    let agents = Script::spawn(&python, "a2a_agents.py", &args);
    wait_until(WAIT, "the agents listen", || {
        let log = agents.log_text();
        async move { printed(&log, "listening on ").is_some() }
    })
    .await;
    reserved.release();
    let url = |name: &str| format!("http://{}", relays[name].1);

    // Completed, streamed, and asked-then-completed conversations, each started without a
    // context id.
    let (c, s, a) = (url("complete"), url("stream"), url("ask"));
    let client_python = python.clone();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&client_python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/a2a_client.py"))
            .args(["--fresh", "--complete", &c, "--stream", &s, "--ask", &a])
            .output()
            .unwrap_or_else(|e| panic!("the SDK client did not run: {e}"))
    })
    .await
    .unwrap_or_else(|e| panic!("the client task: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success() && !stdout.contains("\"error\""),
        "the SDK client failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The agents chose the contexts: the first request of each scenario carried none.
    let agent_contexts: BTreeSet<String> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .flat_map(|v| {
            v["calls"][0]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|e| e["task"]["contextId"].as_str().map(str::to_string))
        })
        .collect();
    assert_eq!(agent_contexts.len(), 6, "{stdout}");

    // A streamed request the agent accepts (its frames carry the context it chose) and never
    // answers: its blocked outcome comes from the processor at the deadline.
    let hang = Script::spawn(
        &python,
        "a2a_client.py",
        &["--fresh", "--hang", &url("hang")],
    );
    wait_until(WAIT, "the hanging request's frame is projected", || {
        let js = js.clone();
        async move {
            read_all(&js, "COLLAB_PROJ", "collab.proj.orchestration.task.>")
                .await
                .iter()
                .any(|m| m.json()["agentId"] == "hang-agent")
        }
    })
    .await;
    drop(hang);

    // complete x3, stream x2, ask x2, hang x1: every send has its one response.
    let main = |js: async_nats::jetstream::Context| async move {
        read_all(&js, "COLLAB_PROJ", "collab.proj.conversation.main.>").await
    };
    wait_until(WAIT, "every request has its response", || {
        let js = js.clone();
        async move {
            let events = main(js).await;
            let n = |t: &str| events.iter().filter(|m| m.json()["type"] == t).count();
            n("a2a.send") == 8 && n("a2a.response") == 8
        }
    })
    .await;

    // Every event of an exchange (request, frames, answer, synthesised outcome), in any role,
    // shares the send's conversation and work session.
    let everything = read_all(&js, "COLLAB_PROJ", "collab.proj.>").await;
    let mut by_turn: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    let mut sends = BTreeMap::new();
    for m in &everything {
        let env = m.json();
        let turn = turn_of(&env);
        if turn.is_empty() {
            continue;
        }
        let ids = (text(&env["conversationId"]), text(&env["workSessionId"]));
        if env["type"] == "a2a.send" {
            sends.insert(turn.clone(), ids.clone());
        }
        by_turn.entry(turn).or_default().insert(ids);
    }
    assert_eq!(sends.len(), 8);
    for (turn, ids) in &by_turn {
        assert_eq!(ids.len(), 1, "exchange {turn} spans {ids:?}");
    }
    let timeout = main(js.clone())
        .await
        .into_iter()
        .map(|m| m.json())
        .find(|e| e["payload"]["reason"] == "timeout")
        .unwrap_or_else(|| panic!("no blocked timeout"));
    assert_eq!(timeout["payload"]["synthesized"], true);
    let hang_turn = turn_of(&timeout);
    let frames = everything
        .iter()
        .map(|m| m.json())
        .filter(|e| turn_of(e) == hang_turn && e["type"] == "task.updated")
        .count();
    assert!(frames >= 1, "the hanging exchange's frame is projected");
    assert_eq!(
        by_turn[&hang_turn].len(),
        1,
        "the outcome shares its frames' conversation"
    );

    // The work sessions: one per conversation the sends opened (the ask scenario's second
    // request names the agent's context, so it is that context's conversation), none left open,
    // none titled by a reply.
    let expected: BTreeSet<String> = sends.values().map(|(_, ws)| ws.clone()).collect();
    assert_eq!(expected.len(), 8, "{sends:?}");
    let listed = decided_sessions(http_port, expected.len()).await;
    let ids: BTreeSet<String> = listed.iter().map(|s| text(&s["workSessionId"])).collect();
    assert_eq!(ids, expected);
    for s in &listed {
        let title = text(&s["title"]);
        assert!(
            !title.starts_with("completed") && !title.starts_with("The relay"),
            "a session titled by a reply: {s:#}"
        );
    }
    let blocked: Vec<&Value> = listed.iter().filter(|s| s["blockedTurns"] == 1).collect();
    assert_eq!(blocked.len(), 1, "the hanging conversation ends blocked");
    assert_eq!(text(&blocked[0]["workSessionId"]), sends[&hang_turn].1);
}

/// Publish one wire body as a relay would: under the exchange's key, with its headers.
async fn relayed(
    js: &async_nats::jetstream::Context,
    exchange: &str,
    direction: &str,
    body: Value,
) {
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in [
        ("Collab-From-Agent", "ruda"),
        ("Collab-To-Agent", "eden"),
        ("Collab-Exchange", exchange),
        ("Collab-A2A-Method", "message/stream"),
        ("Collab-Direction", direction),
    ] {
        headers.insert(name, value);
    }
    js.publish_with_headers(
        format!("collab.raw.{exchange}.a2a.wire"),
        headers,
        serde_json::to_vec(&body)
            .unwrap_or_else(|e| panic!("{e}"))
            .into(),
    )
    .await
    .unwrap_or_else(|e| panic!("raw publish: {e}"))
    .await
    .unwrap_or_else(|e| panic!("raw publish not acknowledged: {e}"));
}

/// The same without the SDK or a relay: wire bodies published with the relay's headers straight
/// onto a real nats-server, through the worker. A streamed exchange whose frames carry the
/// agent's context and that is never answered: its request, frames and synthesised blocked
/// outcome are one conversation and one work session; an answered one likewise.
#[tokio::test]
async fn wire_bodies_of_one_exchange_share_its_conversation_through_the_worker() {
    let nats = TestNats::start().await;
    provision_with_binary(&nats.url(), [("RUST_LOG", "warn")]);
    let js = nats.jetstream().await;
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let addr = format!("127.0.0.1:{http_port}");
    let _projector = Projector::spawn_command(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--http-addr",
            &addr,
            "--main-agents",
            "ruda,eden",
            "--turn-timeout",
            "2s",
        ],
        &[("RUST_LOG", "info")],
    );
    let send = |id: &str| {
        serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "message/stream", "params": {"message": {
            "role": "user", "messageId": format!("m-{id}"), "parts": [{"kind": "text", "text": format!("ask {id}")}]}}})
    };
    let frame = |id: &str, state: &str, last: bool| {
        serde_json::json!({"jsonrpc": "2.0", "id": id, "result": {"kind": "status-update", "taskId": format!("t-{id}"),
            "contextId": format!("agent-ctx-{id}"), "final": last, "status": {"state": state,
            "message": {"role": "agent", "messageId": format!("r-{id}"), "parts": [{"kind": "text", "text": "done"}]}}}})
    };
    // Never answered: submitted, working, then silence.
    relayed(&js, "ex-silent", "request", send("ex-silent")).await;
    relayed(
        &js,
        "ex-silent",
        "answer",
        frame("ex-silent", "submitted", false),
    )
    .await;
    relayed(
        &js,
        "ex-silent",
        "answer",
        frame("ex-silent", "working", false),
    )
    .await;
    // Answered: working, then completed.
    relayed(&js, "ex-answered", "request", send("ex-answered")).await;
    relayed(
        &js,
        "ex-answered",
        "answer",
        frame("ex-answered", "working", false),
    )
    .await;
    relayed(
        &js,
        "ex-answered",
        "answer",
        frame("ex-answered", "completed", true),
    )
    .await;

    wait_until(WAIT, "both exchanges have their response", || {
        let js = js.clone();
        async move {
            read_all(
                &js,
                "COLLAB_PROJ",
                "collab.proj.conversation.main.*.a2a.response",
            )
            .await
            .len()
                == 2
        }
    })
    .await;
    let everything = read_all(&js, "COLLAB_PROJ", "collab.proj.>").await;
    for exchange in ["ex-silent", "ex-answered"] {
        let events: Vec<Value> = everything
            .iter()
            .map(|m| m.json())
            .filter(|e| turn_of(e) == exchange)
            .collect();
        let types: BTreeSet<String> = events.iter().map(|e| text(&e["type"])).collect();
        assert!(
            types.contains("a2a.send")
                && types.contains("a2a.response")
                && types.contains("task.updated"),
            "{exchange}: {types:?}"
        );
        for e in &events {
            assert_eq!(e["conversationId"], exchange, "{e:#}");
            assert_eq!(e["workSessionId"], exchange, "{e:#}");
        }
    }
    let listed = decided_sessions(http_port, 2).await;
    let silent = listed
        .iter()
        .find(|s| s["id"] == "ex-silent")
        .unwrap_or_else(|| panic!("no session ex-silent: {listed:#?}"));
    assert_eq!(silent["blockedTurns"], 1);
    assert_eq!(silent["title"], "ask ex-silent");
}
