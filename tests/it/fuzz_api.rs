//! The OpenAPI document against the server it describes: schemathesis (pinned in
//! tests/e2e/requirements.txt) generates requests from `/api/openapi.json`, valid and invalid, and
//! checks every answer against the document: a schema-valid request must be accepted, an invalid
//! one rejected with a documented 4xx, every status, body and header must be documented, and no
//! request may cause a 5xx.
//!
//! The API runs with access control on (one token granting two of the four roles), over a store
//! holding conversations, tasks and their work sessions, so pages are not empty and both 401 and
//! 403 are reachable.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use collab_projector::config::TokenGrant;
use collab_projector::model::Role;
use serde_json::json;
use tempfile::NamedTempFile;

use crate::api::{collab_event, drained, serve, settings, start_worker, state};
use crate::pipeline::publish;
use crate::support::{e2e_python, TestNats};

/// The token the fuzzer presents; it may read two of the four roles.
const TOKEN: &str = "fuzz-token-7f3a";
/// Examples per operation and phase: enough to reach every parameter, within a couple of minutes
/// on two cores.
const MAX_EXAMPLES: &str = "40";
/// The whole run is stopped (and the test fails) after this long.
const DEADLINE: Duration = Duration::from_secs(300);
/// How long a request may take, the event stream's excepted.
const REQUEST_TIMEOUT: &str = "10";
/// schemathesis's configuration: the live event stream sends its headers at once and then only
/// what is published, which is nothing while the fuzzer runs, so each of its accepted requests
/// ends at its timeout (a refused one is answered in full at once). Half a second reads the
/// stream's opening; at the default the stream's 150-odd cases took most of the run, and at one
/// second its coverage phase took 44 s where it takes about 24 at half a second.
///
/// A cursor is schema-valid whatever sequence it names, and one past the newest event is
/// answered `410 cursor_ahead` (documented), as most cursors the fuzzer makes up are: the two
/// operations that take cursors count a 410 as a valid request refused for the stream's state,
/// as schemathesis already counts a 404 or a 409. Every other check stays as it is.
const CONFIG: &str = r#"
[[operations]]
include-path = "/api/events/stream"
request-timeout = 0.5
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "410", "429", "5xx"]

[[operations]]
include-path = "/api/events"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "410", "429", "5xx"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_failure() {
    let Some(python) = e2e_python("import schemathesis.cli", "schemathesis") else {
        return;
    };

    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    s.http.tokens = vec![TokenGrant {
        name: "fuzz".into(),
        token: TOKEN.into(),
        token_env: None,
        roles: vec![Role::ConversationMain, Role::OrchestrationTask],
    }];
    let (_running, cancel) = start_worker(&s).await;

    // Conversations (sends, responses, completions) and task updates, in two work sessions.
    let mut step = 0;
    for conv in ["conv-1", "conv-2", "ctx-3"] {
        for (t, from, to, extra) in [
            (
                "a2a.send",
                "ruda",
                "eden",
                json!({"text": "draft the notes"}),
            ),
            ("a2a.response", "eden", "ruda", json!({"text": "done"})),
            ("a2a.complete", "eden", "ruda", json!({})),
            (
                "task.updated",
                "eden",
                "ruda",
                json!({"taskId": format!("t-{conv}"), "status": "completed"}),
            ),
        ] {
            step += 1;
            let (subject, body) = collab_event(step, t, from, to, conv, extra);
            publish(&js, &subject, body).await;
        }
    }
    drained(&js).await;

    let (addr, stop) = serve(state(&js, &s), None).await;
    let output = tokio::task::spawn_blocking(move || run_schemathesis(&python, &addr.to_string()))
        .await
        .expect("the schemathesis runner");
    stop.cancel();
    cancel.cancel();
    if let Err(report) = output {
        panic!("{report}");
    }
}

/// Run schemathesis against `http://{addr}` with every check; `Err` carries its output.
fn run_schemathesis(python: &Path, addr: &str) -> Result<(), String> {
    let log = NamedTempFile::new().map_err(|e| e.to_string())?;
    // Hypothesis keeps its example database in the working directory: a fresh one each run.
    let workdir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = log.as_file().try_clone().map_err(|e| e.to_string())?;
    let err = log.as_file().try_clone().map_err(|e| e.to_string())?;
    let config = workdir.path().join("schemathesis.toml");
    std::fs::write(&config, CONFIG).map_err(|e| e.to_string())?;
    let mut child = Command::new(python)
        .args(["-m", "schemathesis.cli", "--config-file"])
        .arg(&config)
        .arg("run")
        .arg(format!("http://{addr}/api/openapi.json"))
        .args(["--checks", "all"])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
        .args(["--request-timeout", REQUEST_TIMEOUT])
        .args(["--workers", "2"])
        .args(["--generation-database", ":memory:"])
        .arg("--no-color")
        .current_dir(workdir.path())
        .env("SCHEMATHESIS_TELEMETRY", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(|e| {
            format!(
                "could not run {} -m schemathesis.cli: {e}",
                python.display()
            )
        })?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
    println!("{text}");
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => Err(format!(
            "schemathesis found failures against the OpenAPI document ({s}); its report is above"
        )),
        None => Err(format!(
            "schemathesis did not finish within {DEADLINE:?}; its report so far is above"
        )),
    }
}
