//! The OpenTelemetry export (docs/otel.md) against a real OTLP receiver agent developers run:
//! Arize Phoenix (`phoenix serve`, pinned in tests/e2e/phoenix-requirements.txt), its spans read
//! back through its REST API (`GET /v1/projects/{project}/spans`, one project per test).
//!
//! The real `collab-projector` binary runs with `OTEL_EXPORTER_OTLP_ENDPOINT` set to Phoenix, a
//! price table in its config file, and `turns.default_timeout` short enough for a turn to time
//! out. Raw traffic: a main-main turn answered with usage, a turn nobody answers, and an AG-UI
//! run (published as its agent, as the relay does) with a streamed tool call and a child run
//! that fails, and a run that stops for a person's approval (an AG-UI interrupt).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::{collab_event, Projector, ReservedPort, TestNats};

/// Guards against hangs only.
const WAIT: Duration = Duration::from_secs(120);

/// Phoenix's Python (`COLLAB_PHOENIX_PYTHON`, else `.ci/.venv-phoenix/bin/python`), if Phoenix
/// imports there. `None` (reason printed) outside CI; in CI a missing Phoenix fails the test.
fn phoenix_python() -> Option<PathBuf> {
    crate::support::python_with(
        "COLLAB_PHOENIX_PYTHON",
        ".ci/.venv-phoenix",
        false,
        "import phoenix.server.main",
        "Arize Phoenix",
        "tests/e2e/phoenix-requirements.txt",
    )
}

/// `phoenix serve` on loopback with a throwaway database, started once and shared by this file's
/// tests, each of which exports into a Phoenix project of its own (its spans carry the
/// `openinference.project.name` resource attribute). Phoenix takes about 25 s to start on two
/// cores; the tests used to start one each.
///
/// A static is never dropped, so Phoenix cannot be killed on drop: its standard input is a pipe
/// from this process, and `phoenix_serve.py` exits, removing its working directory, when that
/// pipe closes, which it does when this process ends however it ends.
struct Phoenix {
    port: u16,
    log: PathBuf,
    _child: Child,
    _stdin: std::process::ChildStdin,
    /// Its HTTP and gRPC ports, held while it runs (it binds them with SO_REUSEADDR), so no other
    /// test's server is given them.
    _ports: [ReservedPort; 2],
}

static PHOENIX: tokio::sync::OnceCell<Phoenix> = tokio::sync::OnceCell::const_new();

impl Phoenix {
    async fn shared(python: &Path) -> &'static Phoenix {
        PHOENIX.get_or_init(|| Phoenix::start(python)).await
    }

    async fn start(python: &Path) -> Phoenix {
        // Kept after the handle is gone: phoenix_serve.py removes it when it exits.
        let dir = tempfile::tempdir()
            .expect("a temporary directory for Phoenix")
            .keep();
        let log_path = dir.join("phoenix.log");
        let ports = [(); 2].map(|()| ReservedPort::for_server());
        let [port, grpc_port] = ports.each_ref().map(ReservedPort::port);
        let log = std::fs::File::create(&log_path).expect("Phoenix's log");
        let mut child = Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/phoenix_serve.py"))
            .env("PHOENIX_WORKING_DIR", &dir)
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", port.to_string())
            .env("PHOENIX_GRPC_PORT", grpc_port.to_string())
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .env("PHOENIX_ALLOW_EXTERNAL_RESOURCES", "false")
            .env("COLLAB_EXIT_ON_STDIN_EOF", "1")
            .stdin(Stdio::piped())
            .stdout(log.try_clone().expect("Phoenix's log"))
            .stderr(log)
            .spawn()
            .expect("could not start Phoenix");
        let stdin = child.stdin.take().expect("Phoenix's standard input");
        let phoenix = Phoenix {
            port,
            log: log_path,
            _child: child,
            _stdin: stdin,
            _ports: ports,
        };
        let client = reqwest::Client::new();
        let start = Instant::now();
        loop {
            let ready = client
                .get(format!("{}/healthz", phoenix.url()))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return phoenix;
            }
            assert!(
                start.elapsed() < WAIT,
                "Phoenix did not become ready: {}",
                phoenix.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// At least `n` spans of `project`, waited for (the projector's log in the failure message).
    async fn wait_for_spans(&self, project: &str, n: usize, projector: &Projector) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let spans = self.spans(project).await;
            if spans.len() >= n {
                return spans;
            }
            assert!(
                start.elapsed() < WAIT,
                "Phoenix has {} spans of {n} in project {project}: {spans:#?}\nprojector log:\n{}",
                spans.len(),
                projector.log_text()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Every span of `project` (Phoenix answers 404 until the project's first span).
    async fn spans(&self, project: &str) -> Vec<Value> {
        let url = format!("{}/v1/projects/{project}/spans?limit=1000", self.url());
        let Ok(resp) = reqwest::get(url).await else {
            return Vec::new();
        };
        if !resp.status().is_success() {
            return Vec::new();
        }
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        body["data"].as_array().cloned().unwrap_or_default()
    }
}

/// The resource attribute that puts a projector's spans in Phoenix project `project`.
fn project_attribute(project: &str) -> String {
    format!("openinference.project.name={project}")
}

const PRICES: &str = r#"
[usage]
prices = [{ model = "claude-sonnet-4", input_per_mtok = 3.0, output_per_mtok = 15.0 }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_runs_and_tools_reach_phoenix_as_genai_spans_with_parents_usage_and_errors() {
    let Some(python) = phoenix_python() else {
        return;
    };
    let phoenix = Phoenix::shared(&python).await;
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(config.path(), PRICES).expect("the config file is written");
    let config_path = config.path().to_string_lossy().to_string();
    let endpoint = phoenix.url();
    let projector = Projector::spawn(
        &nats.url(),
        &["--main-agents", "main,ruda,eden", "-c", &config_path],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_SERVICE_NAME", "otel-test"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                project_attribute("otel-turns-runs").as_str(),
            ),
            ("COLLAB_TURNS__DEFAULT_TIMEOUT", "2s"),
            ("RUST_LOG", "info,collab_projector=debug"),
        ],
    );
    // The export starts at the end of the projection stream when it first runs: wait until the
    // worker is up before publishing.
    projector
        .wait_logged("exporting turns, runs and tool calls", WAIT)
        .await;

    let publish = |subject: String, body: Value, run: Option<&'static str>| {
        let js = js.clone();
        async move {
            let bytes = serde_json::to_vec(&body).expect("an event serialises");
            let ack = match run {
                Some(run) => {
                    let mut h = async_nats::HeaderMap::new();
                    h.insert("Collab-Run-Id", run);
                    js.publish_with_headers(subject, h, bytes.into()).await
                }
                None => js.publish(subject, bytes.into()).await,
            };
            ack.expect("published").await.expect("stored");
        }
    };
    let now = chrono::Utc::now().timestamp_millis();
    // A main-main turn answered, with usage; and one that nobody answers.
    publish(
        "collab.raw.otel-c1.a2a.send".into(),
        with_ts(
            collab_event(
                "a2a.send",
                "main",
                "ruda",
                "otel-c1",
                json!({"turnId": "1", "message": "plan the trip"}),
            ),
            now,
        ),
        None,
    )
    .await;
    publish(
        "collab.raw.otel-c1.a2a.response".into(),
        with_ts(
            collab_event(
                "a2a.response",
                "ruda",
                "main",
                "otel-c1",
                json!({"turnId": "1",
                "message": "done", "model": "claude-sonnet-4",
                "usage": {"input_tokens": 1000, "output_tokens": 200}}),
            ),
            now + 1500,
        ),
        None,
    )
    .await;
    publish(
        "collab.raw.otel-c2.a2a.send".into(),
        with_ts(
            collab_event(
                "a2a.send",
                "main",
                "eden",
                "otel-c2",
                json!({"turnId": "1", "message": "check the budget"}),
            ),
            now,
        ),
        None,
    )
    .await;
    // An AG-UI run of the planner with a streamed tool call and a child run that fails.
    let planner = "collab.raw.otel-th._as.planner.agui";
    let researcher = "collab.raw.otel-th._as.researcher.agui";
    let approver = "collab.raw.otel-th2._as.approver.agui";
    for (subject, ev, run) in [
        (
            planner,
            json!({"type": "RUN_STARTED", "threadId": "otel-th", "runId": "otel-r1", "timestamp": now}),
            "otel-r1",
        ),
        (
            planner,
            json!({"type": "TOOL_CALL_START", "toolCallId": "call-1", "toolCallName": "get_weather", "timestamp": now + 10}),
            "otel-r1",
        ),
        (
            planner,
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "call-1", "delta": "{\"city\":", "timestamp": now + 11}),
            "otel-r1",
        ),
        (
            planner,
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "call-1", "delta": "\"Oslo\"}", "timestamp": now + 12}),
            "otel-r1",
        ),
        (
            planner,
            json!({"type": "TOOL_CALL_END", "toolCallId": "call-1", "timestamp": now + 13}),
            "otel-r1",
        ),
        (
            planner,
            json!({"type": "TOOL_CALL_RESULT", "messageId": "m-1", "toolCallId": "call-1", "content": "sunny", "timestamp": now + 50}),
            "otel-r1",
        ),
        (
            researcher,
            json!({"type": "RUN_STARTED", "threadId": "otel-th", "runId": "otel-r2", "parentRunId": "otel-r1", "timestamp": now + 60}),
            "otel-r2",
        ),
        (
            researcher,
            json!({"type": "RUN_ERROR", "message": "quota exhausted", "code": "rate_limited", "timestamp": now + 90}),
            "otel-r2",
        ),
        (
            approver,
            json!({"type": "RUN_STARTED", "threadId": "otel-th2", "runId": "otel-r3", "timestamp": now}),
            "otel-r3",
        ),
        (
            approver,
            json!({"type": "RUN_FINISHED", "threadId": "otel-th2", "runId": "otel-r3", "timestamp": now + 30,
                "outcome": {"type": "interrupt", "interrupts": [{"id": "int-1", "reason": "approval", "assignee": "alice"}]}}),
            "otel-r3",
        ),
        (
            planner,
            json!({"type": "RUN_FINISHED", "threadId": "otel-th", "runId": "otel-r1", "timestamp": now + 100,
            "result": {"usage": {"inputTokens": 40, "outputTokens": 8}}}),
            "otel-r1",
        ),
    ] {
        publish(subject.to_string(), ev, Some(run)).await;
    }

    // Six spans: the answered turn, the timed-out turn, the run, its tool call, its child run,
    // and the run that stopped for a person's approval.
    let spans = phoenix
        .wait_for_spans("otel-turns-runs", 6, &projector)
        .await;
    let by_name: HashMap<&str, &Value> = spans
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?, s)))
        .collect();
    let span = |name: &str| -> &Value {
        by_name
            .get(name)
            .unwrap_or_else(|| panic!("no span {name} in {spans:#?}"))
    };
    assert_eq!(spans.len(), 6, "{spans:#?}");

    let answered = span("invoke_agent ruda");
    let a = &answered["attributes"];
    assert_eq!(a["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(a["gen_ai.agent.name"], "ruda");
    assert_eq!(a["gen_ai.conversation.id"], "otel-c1");
    assert_eq!(a["gen_ai.usage.input_tokens"], 1000);
    assert_eq!(a["gen_ai.usage.output_tokens"], 200);
    assert_eq!(a["gen_ai.request.model"], "claude-sonnet-4");
    let cost = a["collab.usage.cost"].as_f64().unwrap_or(-1.0);
    assert!((cost - 0.006).abs() < 1e-9, "cost {cost}");
    assert_ne!(answered["status_code"], "ERROR");
    assert_eq!(duration_ms(answered), 1500);
    assert!(answered["parent_id"].is_null());

    let timed_out = span("invoke_agent eden");
    assert_eq!(timed_out["status_code"], "ERROR");
    assert_eq!(timed_out["attributes"]["error.type"], "timeout");
    assert_eq!(timed_out["attributes"]["gen_ai.conversation.id"], "otel-c2");

    let run = span("invoke_agent planner");
    let tool = span("execute_tool get_weather");
    let child = span("invoke_agent researcher");
    let run_id = &run["context"]["span_id"];
    let trace = &run["context"]["trace_id"];
    assert!(run["parent_id"].is_null());
    assert_eq!(&tool["parent_id"], run_id);
    assert_eq!(&child["parent_id"], run_id);
    assert_eq!(&tool["context"]["trace_id"], trace);
    assert_eq!(&child["context"]["trace_id"], trace);
    assert_eq!(run["attributes"]["gen_ai.conversation.id"], "otel-th");
    assert_eq!(run["attributes"]["gen_ai.usage.input_tokens"], 40);
    assert_eq!(tool["attributes"]["gen_ai.tool.name"], "get_weather");
    assert_eq!(tool["attributes"]["gen_ai.tool.call.id"], "call-1");
    assert_eq!(
        tool["attributes"]["gen_ai.tool.call.arguments"],
        "{\"city\":\"Oslo\"}"
    );
    assert_eq!(tool["attributes"]["gen_ai.tool.call.result"], "sunny");
    assert_eq!(duration_ms(tool), 40);
    assert_eq!(child["status_code"], "ERROR");
    assert_eq!(child["attributes"]["error.type"], "rate_limited");
    assert_eq!(duration_ms(run), 100);

    // Waiting for a person is a state, not a failure.
    let waiting = span("invoke_agent approver");
    assert_ne!(waiting["status_code"], "ERROR");
    assert_eq!(waiting["attributes"]["collab.outcome"], "waiting");
    assert_eq!(waiting["attributes"]["collab.waiting.for"], "approval");
    assert_eq!(waiting["attributes"]["collab.waiting.on"], "alice");
    assert_eq!(answered["attributes"]["collab.outcome"], "answered");
    assert_eq!(timed_out["attributes"]["collab.outcome"], "blocked");
}

fn with_ts(mut ev: Value, ts: i64) -> Value {
    ev["ts"] = json!(ts);
    ev
}

fn duration_ms(span: &Value) -> i64 {
    let t = |k: &str| {
        span[k]
            .as_str()
            .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            .map_or(0, |t| t.timestamp_millis())
    };
    t("end_time") - t("start_time")
}

/// An AG-UI run of a real AG-UI SDK server (tests/e2e/agui_server.py) through the relay, exported
/// to Phoenix: the agent's run with its tool call as a child, the arguments and result as the
/// SDK streamed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_through_the_relay_reaches_phoenix_with_its_tool_call() {
    let Some(python) = phoenix_python() else {
        return;
    };
    let Some(sdk_python) = crate::relay::e2e_python() else {
        return;
    };
    let phoenix = Phoenix::shared(&python).await;
    let nats = TestNats::start().await;
    let _js = crate::relay::provisioned(&nats.url()).await;
    let endpoint = phoenix.url();
    let projector = Projector::spawn(
        &nats.url(),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                project_attribute("otel-relay-run").as_str(),
            ),
            ("RUST_LOG", "info,collab_projector=debug"),
        ],
    );
    projector
        .wait_logged("exporting turns, runs and tool calls", WAIT)
        .await;
    let server = crate::relay::Script::spawn(&sdk_python, "agui_server.py", &["--port", "0"]);
    let upstream = format!("http://127.0.0.1:{}", server.port().await);
    let relay = crate::relay::start_relay("agui", &nats.url(), &upstream, &[]).await;
    let input = json!({
        "threadId": "otel-relay-thread", "runId": "otel-relay-run", "state": {}, "tools": [],
        "context": [], "messages": [{"id": "u-1", "role": "user", "content": "Weather?"}],
        "forwardedProps": {"scenario": "ok"}
    })
    .to_string();
    let answer =
        crate::relay::post_json(&relay.url("/"), &input, &[("accept", "text/event-stream")]).await;
    assert_eq!(answer.status(), 200);
    let _ = answer.text().await;

    let spans = phoenix
        .wait_for_spans("otel-relay-run", 2, &projector)
        .await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no span {name} in {spans:#?}"))
    };
    let run = named("invoke_agent callee-agent");
    let tool = named("execute_tool get_weather");
    assert_eq!(
        run["attributes"]["gen_ai.conversation.id"],
        "otel-relay-thread"
    );
    assert_eq!(run["attributes"]["collab.run.id"], "otel-relay-run");
    assert_eq!(run["attributes"]["collab.outcome"], "finished");
    // The usage the SDK agent reported in its RUN_FINISHED result.
    assert_eq!(
        run["attributes"]["gen_ai.usage.input_tokens"], 120,
        "{run:#}"
    );
    assert_eq!(
        run["attributes"]["gen_ai.usage.output_tokens"], 45,
        "{run:#}"
    );
    assert_eq!(
        run["attributes"]["gen_ai.request.model"], "gpt-4o",
        "{run:#}"
    );
    assert_eq!(tool["parent_id"], run["context"]["span_id"]);
    assert_eq!(tool["context"]["trace_id"], run["context"]["trace_id"]);
    assert_eq!(
        tool["attributes"]["gen_ai.tool.call.arguments"],
        "{\"city\": \"Oslo\"}"
    );
    assert_eq!(
        tool["attributes"]["gen_ai.tool.call.result"],
        "{\"sky\": \"clear\"}"
    );
}

/// A2A between the real a2a-python SDK's client and agents (tests/e2e/a2a_client.py,
/// tests/e2e/a2a_agents.py), with the relay in front of each agent, exported to Phoenix: each
/// turn is an `invoke_agent` span of the answering agent whose `gen_ai.conversation.id` is the
/// A2A contextId; a turn whose answer asks for input is marked waiting, and the turn that
/// answers it is another span of the same conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a2a_sdk_turn_through_the_relay_reaches_phoenix_under_its_context_id() {
    let Some(python) = phoenix_python() else {
        return;
    };
    let Some(sdk_python) = crate::relay::e2e_python() else {
        return;
    };
    let phoenix = Phoenix::shared(&python).await;
    let nats = TestNats::start().await;
    let _js = crate::relay::provisioned(&nats.url()).await;
    let endpoint = phoenix.url();
    let projector = Projector::spawn(
        &nats.url(),
        &[
            "--main-agents",
            "planner,complete-agent,stream-agent,ask-agent",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                project_attribute("otel-a2a-sdk").as_str(),
            ),
            ("RUST_LOG", "info,collab_projector=debug"),
        ],
    );
    projector
        .wait_logged("exporting turns, runs and tool calls", WAIT)
        .await;
    let (relays, _agents) = crate::relay::sdk_agents_behind_relays(
        &sdk_python,
        &nats.url(),
        &["complete", "stream", "ask"],
    )
    .await;
    let url = |name: &str| format!("http://{}", relays[name].addr);
    let client_args = [
        "--complete".to_string(),
        url("complete"),
        "--stream".to_string(),
        url("stream"),
        "--ask".to_string(),
        url("ask"),
        "--caller".to_string(),
        "planner".to_string(),
    ];
    let output = tokio::task::spawn_blocking({
        let python = sdk_python.clone();
        move || {
            Command::new(&python)
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/a2a_client.py"))
                .args(&client_args)
                .output()
        }
    })
    .await
    .expect("the SDK client's thread")
    .expect("the SDK client runs");
    assert!(
        output.status.success(),
        "the SDK client failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );

    // 7 sends: one per scenario, two for the one that asks for input.
    let spans = phoenix.wait_for_spans("otel-a2a-sdk", 7, &projector).await;
    let of_context = |ctx: &str| -> Vec<&Value> {
        spans
            .iter()
            .filter(|s| s["attributes"]["gen_ai.conversation.id"] == ctx)
            .collect()
    };
    let complete = of_context("e2e-complete-jsonrpc-v1");
    assert_eq!(complete.len(), 1, "{spans:#?}");
    let span = complete[0];
    assert_eq!(span["name"], "invoke_agent complete-agent", "{span:#}");
    assert_eq!(span["attributes"]["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(span["attributes"]["gen_ai.agent.name"], "complete-agent");
    assert_eq!(span["attributes"]["collab.outcome"], "answered", "{span:#}");
    assert_ne!(span["status_code"], "ERROR", "{span:#}");
    // The usage the SDK agent put in its answer's metadata.
    assert_eq!(
        span["attributes"]["gen_ai.usage.input_tokens"], 30,
        "{span:#}"
    );
    assert_eq!(
        span["attributes"]["gen_ai.usage.output_tokens"], 12,
        "{span:#}"
    );
    assert_eq!(
        span["attributes"]["gen_ai.request.model"], "gpt-4o",
        "{span:#}"
    );
    // v0.3 from the same SDK and the streamed answer: the same, under their own contexts.
    for ctx in ["e2e-complete-jsonrpc-v03", "e2e-stream-jsonrpc-v1"] {
        let found = of_context(ctx);
        assert_eq!(found.len(), 1, "{ctx}: {spans:#?}");
        assert!(
            found[0]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("invoke_agent ")),
            "{:#}",
            found[0]
        );
    }
    // The agent that asks for input: two turns of one conversation, the first one waiting.
    let mut ask = of_context("e2e-ask-jsonrpc-v1");
    ask.sort_by_key(|s| s["start_time"].as_str().unwrap_or_default().to_string());
    assert_eq!(ask.len(), 2, "{spans:#?}");
    assert_eq!(
        ask[0]["attributes"]["collab.outcome"], "waiting",
        "{:#}",
        ask[0]
    );
    assert_eq!(
        ask[1]["attributes"]["collab.outcome"], "answered",
        "{:#}",
        ask[1]
    );
    for s in &ask {
        assert_eq!(s["name"], "invoke_agent ask-agent", "{s:#}");
    }

    // The same traffic through the API: the streamed turn's tree holds the A2A task the agent
    // worked through (its status frames), completed; the asking agent's first answer was resumed
    // by the second send, so nothing of it waits.
    let api = projector.http_addr();
    let get = |path: &str| {
        let url = format!("http://{api}{path}");
        async move {
            reqwest::get(&url)
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .json::<Value>()
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"))
        }
    };
    // The answered turn's usage in its thread, and the thread's total.
    let thread = get("/api/threads/e2e-complete-jsonrpc-v1").await;
    let usage = &thread["thread"]["turns"][0]["usage"];
    assert_eq!(usage["inputTokens"], 30, "{thread:#}");
    assert_eq!(usage["outputTokens"], 12, "{thread:#}");
    assert_eq!(usage["model"], "gpt-4o", "{thread:#}");
    assert_eq!(thread["thread"]["total"]["inputTokens"], 30, "{thread:#}");
    let body = get("/api/tree/e2e-stream-jsonrpc-v1").await;
    let turn = &body["tree"]["children"][0];
    assert_eq!(turn["kind"], "turn", "{body:#}");
    assert_eq!(turn["label"], "planner → stream-agent: report", "{body:#}");
    assert_eq!(turn["outcome"], "answered", "{body:#}");
    let task = &turn["children"][0];
    assert_eq!(task["kind"], "task", "{body:#}");
    assert_eq!(task["outcome"], "completed", "{body:#}");
    assert!(
        task["durationMs"].as_i64().is_some_and(|d| d > 0),
        "{body:#}"
    );
    let waits = get("/api/waiting").await;
    assert!(
        waits["waits"]
            .as_array()
            .is_some_and(|w| w.iter().all(|w| w["key"] != "e2e-ask-jsonrpc-v1")),
        "{waits:#}"
    );
}

/// The export's first start saves where it starts (the projection stream's end) before it
/// exports anything: a worker that crashes before its first round is saved leaves that
/// position, and the next one exports what was projected in between, instead of starting at a
/// later end past it. The collector here refuses every connection (a bound port nobody
/// listens on), so a span the job tried to send is counted as failed, and that count is what
/// shows the turn was read.
#[tokio::test]
async fn an_export_restarted_before_its_first_saved_round_skips_nothing() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let collector = ReservedPort::new();
    let endpoint = format!("http://127.0.0.1:{}", collector.port());
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    ];
    let args = ["--main-agents", "main,ruda"];
    let mut first = Projector::spawn(&nats.url(), &args, &env);
    first
        .wait_logged("exporting turns, runs and tool calls", WAIT)
        .await;
    let kv = async {
        loop {
            if let Ok(kv) = js.get_key_value("collab_work_sessions").await {
                return kv;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let kv = tokio::time::timeout(WAIT, kv)
        .await
        .expect("the work-session bucket");
    let start = Instant::now();
    while kv.get("otel.position").await.ok().flatten().is_none() {
        assert!(
            start.elapsed() < WAIT,
            "the export saved no starting position:\n{}",
            first.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.kill9();
    first.wait_exit(WAIT).await;

    // A turn answered while no worker runs.
    for (subject, from, to, kind) in [
        ("collab.raw.otel-gap.a2a.send", "main", "ruda", "a2a.send"),
        (
            "collab.raw.otel-gap.a2a.response",
            "ruda",
            "main",
            "a2a.response",
        ),
    ] {
        let body = collab_event(kind, from, to, "otel-gap", json!({"turnId": "1"}));
        js.publish(subject, serde_json::to_vec(&body).expect("json").into())
            .await
            .expect("published")
            .await
            .expect("stored");
    }

    let second = Projector::spawn(&nats.url(), &args, &env);
    second.wait_logged("http listening on", WAIT).await;
    let metrics = format!("http://{}/metrics", second.http_addr());
    let start = Instant::now();
    loop {
        let text = match reqwest::get(&metrics).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let tried = text.lines().any(|l| {
            l.starts_with("collab_otel_spans_total{")
                && l.contains("outcome=\"export_failed\"")
                && l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v >= 1.0)
        });
        if tried {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the turn answered between the two workers was never exported:\n{text}\n{}",
            second.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
