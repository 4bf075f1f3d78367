//! What UIs get, tested as a UI gets it.
//!
//! The built-in viewer in a real browser: headless Chromium driven over WebDriver (chromedriver),
//! against the real binary and a real nats-server.
//! With access control on, the page asks for a token, then shows a turn published after it
//! loaded, a blocked timeout with its reason, goal and next action, the debug view, a role switch,
//! and the events published while the server was down (killed with SIGKILL and started again),
//! without a repeat. A second test stops and restarts NATS under the page, which must recover by
//! itself; it also checks the order by event time and the debug view's suppressed replies. A
//! third shows a delegation tree two levels deep with tokens and cost rolled up, the Waiting
//! panel with a run waiting for approval, rows older than the snapshot (Load older) and a
//! thread's token and cost total. Screenshots are saved as `viewer.png` and `viewer-tree.png`
//! in `COLLAB_ARTIFACTS_DIR` (`.ci/run` sets `.ci/artifacts`), else in Cargo's test temporary
//! directory.
//!
//! Chromium comes from Debian's `chromium` and `chromium-driver` packages (`.ci/run` installs
//! them). Where they cannot be installed, `.ci/run` says why in `COLLAB_BROWSER_UNAVAILABLE` and
//! the test prints that reason and skips; in CI without that explanation a missing browser fails
//! the test.
//!
//! The page is also checked with axe-core (WCAG 2.1 A and AA rules: contrast, names, labels),
//! pinned in `tests/a11y`.
//!
//! The demo prints the viewer's address first. The compose file's nats-server configuration
//! serves projections to a browser UI over WebSocket.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};

use crate::support::{
    collab_event, provision_with_binary, wait_until, Projector, ReservedPort, TestNats,
};

const TOKEN: &str = "viewer-test-token";
/// Guards against hangs only.
const WAIT: Duration = Duration::from_secs(90);

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Chromium and chromedriver, or `None` with the reason printed (a failure in CI unless
/// `.ci/run` explained why they are missing).
fn browser() -> Option<(PathBuf, PathBuf)> {
    let chromium = std::env::var_os("COLLAB_CHROMIUM")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| {
            ["chromium", "chromium-browser", "google-chrome"]
                .iter()
                .find_map(|n| on_path(n))
        });
    let driver = std::env::var_os("COLLAB_CHROMEDRIVER")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| on_path("chromedriver"));
    if let (Some(c), Some(d)) = (&chromium, &driver) {
        return Some((c.clone(), d.clone()));
    }
    let missing = match (chromium, driver) {
        (None, None) => "chromium and chromedriver are",
        (None, Some(_)) => "chromium is",
        _ => "chromedriver is",
    };
    let mut reason = format!(
        "{missing} not on PATH (install Debian's chromium and chromium-driver packages, or set \
         COLLAB_CHROMIUM and COLLAB_CHROMEDRIVER)"
    );
    if let Ok(why) = std::env::var("COLLAB_BROWSER_UNAVAILABLE") {
        reason = format!("{reason}: {why}");
    } else {
        assert!(std::env::var_os("CI").is_none(), "{reason}");
    }
    eprintln!("SKIPPED browser test: {reason}");
    None
}

/// chromedriver as a child process leading its own process group, which holds the Chromium it
/// starts. On drop the whole group is killed: a test that fails before closing its session
/// leaves no browser running.
struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        use nix::sys::signal::{killpg, Signal};
        use nix::unistd::Pid;
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_driver(path: &Path) -> Driver {
    // Held until chromedriver answers on it (it binds with SO_REUSEADDR), so no other test's
    // server is given the port meanwhile.
    let reserved = ReservedPort::for_server();
    let port = reserved.port();
    let child = Command::new(path)
        .arg(format!("--port={port}"))
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("could not start chromedriver");
    let driver = Driver { child, port };
    let status = format!("http://127.0.0.1:{port}/status");
    wait_until(WAIT, "chromedriver answers", || {
        let status = status.clone();
        async move { reqwest::get(status).await.is_ok() }
    })
    .await;
    reserved.release();
    driver
}

async fn open_browser(chromium: &Path, driver: &Driver, profile: &Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                format!("--user-data-dir={}", profile.display()),
            ]
        }),
    );
    ClientBuilder::new(HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .expect("chromedriver started a Chromium session")
}

/// Evaluate `script` (a function body that returns a value) in the page.
async fn eval(client: &Client, script: &str) -> Value {
    client.execute(script, vec![]).await.unwrap_or(Value::Null)
}

/// Wait until `script` returns `true`; on timeout the message carries the page's status line.
async fn wait_for(client: &Client, what: &str, script: &str) {
    let check = async {
        loop {
            if eval(client, script).await == Value::Bool(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    if tokio::time::timeout(WAIT, check).await.is_err() {
        let status = eval(
            client,
            "const s = document.getElementById('status'); return s.dataset.state + ': ' + s.textContent;",
        )
        .await;
        panic!("timed out waiting until {what}; the page's status: {status}");
    }
}

/// Click the element `css` selects.
async fn click(client: &Client, css: &str) {
    client
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no element {css}: {e}"))
        .click()
        .await
        .unwrap_or_else(|e| panic!("could not click {css}: {e}"));
}

async fn count(client: &Client, selector: &str) -> u64 {
    eval(
        client,
        &format!("return document.querySelectorAll({selector:?}).length;"),
    )
    .await
    .as_u64()
    .unwrap_or(0)
}

async fn text_of(client: &Client, selector: &str) -> String {
    eval(
        client,
        &format!(
            "const e = document.querySelector({selector:?}); return e ? e.textContent : null;"
        ),
    )
    .await
    .as_str()
    .unwrap_or("")
    .to_string()
}

/// axe-core (pinned in tests/a11y, installed by `.ci/run`), or `None` with the reason printed
/// (a failure in CI).
fn axe_source() -> Option<String> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/a11y/node_modules/axe-core/axe.min.js");
    match std::fs::read_to_string(&path) {
        Ok(src) => Some(src),
        Err(e) => {
            let reason = format!(
                "the accessibility engine is not installed ({}: {e}); run `npm ci --prefix tests/a11y`",
                path.display()
            );
            assert!(std::env::var_os("CI").is_none(), "{reason}");
            eprintln!("SKIPPED accessibility check: {reason}");
            None
        }
    }
}

/// The WCAG 2 A and AA rules axe-core finds broken on the page as it is now: rule, impact, how
/// many elements, and the first offender.
async fn accessibility_violations(client: &Client, axe: &str) -> Vec<Value> {
    client
        .execute(&format!("{axe}\nreturn typeof axe;"), vec![])
        .await
        .expect("axe-core loads into the page");
    let found = client
        .execute_async(
            "const done = arguments[arguments.length - 1];
             axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa']}})
               .then(r => done(r.violations.map(v => ({rule: v.id, impact: v.impact, help: v.help,
                  elements: v.nodes.length, first: v.nodes[0] && v.nodes[0].html}))))
               .catch(e => done([{rule: 'axe-error', help: String(e)}]));",
            vec![],
        )
        .await
        .expect("axe-core runs");
    found.as_array().cloned().unwrap_or_default()
}

async fn publish(js: &async_nats::jetstream::Context, key: &str, ev: &Value) {
    let kind = ev["type"].as_str().expect("events carry a type");
    js.publish(
        format!("collab.raw.{key}.{kind}"),
        serde_json::to_vec(ev).expect("an event serialises").into(),
    )
    .await
    .expect("raw publish was not sent")
    .await
    .expect("raw publish was not acknowledged");
}

/// AG-UI events published on `subject` as the relay does, each with its run in `Collab-Run-Id`.
async fn publish_agui<const N: usize>(
    js: &async_nats::jetstream::Context,
    subject: &'static str,
    events: [(Value, &'static str); N],
) {
    for (ev, run) in events {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Collab-Run-Id", run);
        js.publish_with_headers(
            subject,
            h,
            serde_json::to_vec(&ev).expect("an event serialises").into(),
        )
        .await
        .expect("raw publish was not sent")
        .await
        .expect("raw publish was not acknowledged");
    }
}

/// A turn from ruda to eden on conversation `key`, asked and then answered.
async fn answered_turn(js: &async_nats::jetstream::Context, key: &str, ask: &str, answer: &str) {
    let send = json!({"message": ask, "timeoutMs": 60_000});
    publish(
        js,
        key,
        &collab_event("a2a.send", "ruda", "eden", key, send),
    )
    .await;
    let reply = json!({"message": answer, "model": "m-test",
        "usage": {"input_tokens": 1200, "output_tokens": 300}});
    publish(
        js,
        key,
        &collab_event("a2a.response", "eden", "ruda", key, reply),
    )
    .await;
}

const ENV: [(&str, &str); 2] = [
    ("COLLAB_CONSUMER__ACK_WAIT", "5s"),
    ("RUST_LOG", "info,collab_projector=debug"),
];

fn projector(nats_url: &str, http_port: u16, config: &Path) -> Projector {
    let addr = format!("127.0.0.1:{http_port}");
    let config = config.display().to_string();
    Projector::spawn_command(
        &[
            "run",
            "--nats-url",
            nats_url,
            "--http-addr",
            &addr,
            "--config",
            &config,
            "--main-agents",
            "ruda,eden",
            "--turn-timeout",
            "2s",
        ],
        &ENV,
    )
}

async fn ready(http_port: u16) -> bool {
    reqwest::get(format!("http://127.0.0.1:{http_port}/readyz"))
        .await
        .is_ok_and(|r| r.status().is_success())
}

fn artifacts_dir() -> PathBuf {
    std::env::var_os("COLLAB_ARTIFACTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
}

/// A configuration file in `dir` with the viewer's token, allowed to read `roles`.
fn viewer_config(dir: &std::path::Path, roles: &[&str]) -> std::path::PathBuf {
    let config = dir.join("viewer.toml");
    let roles: Vec<String> = roles.iter().map(|r| format!("{r:?}")).collect();
    std::fs::write(
        &config,
        format!(
            "[usage]\nprices = [{{ model = \"m-test\", input_per_mtok = 10.0, output_per_mtok = 20.0 }}]\n\n[[http.tokens]]\nname = \"viewer\"\ntoken = \"{TOKEN}\"\nroles = [{}]\n",
            roles.join(", ")
        ),
    )
    .expect("the configuration file is written");
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewer_shows_turns_blocked_outcomes_roles_and_resumes_after_a_dropped_stream() {
    let Some((chromium, driver_bin)) = browser() else {
        return;
    };
    let nats = TestNats::start().await;
    provision_with_binary(&nats.url(), ENV);
    let js = nats.jetstream().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = viewer_config(dir.path(), &["conversation.main", "orchestration.task"]);
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let mut proj = projector(&nats.url(), http_port, &config);
    wait_until(WAIT, "the projector is ready", || ready(http_port)).await;

    let driver = start_driver(&driver_bin).await;
    let client = open_browser(&chromium, &driver, &dir.path().join("profile")).await;
    let page = format!("http://127.0.0.1:{http_port}/");
    client.goto(&page).await.expect("the viewer loads");
    assert_eq!(
        client.title().await.expect("a title"),
        "collab-projector viewer"
    );

    // Access control is on: the page asks for a token, and shows only the granted roles.
    wait_for(
        &client,
        "the page asks for a token",
        "return document.getElementById('status').dataset.state === 'token';",
    )
    .await;
    client
        .find(Locator::Id("token"))
        .await
        .expect("a token field")
        .send_keys(TOKEN)
        .await
        .expect("typing the token");
    click(&client, "#token-form button[type=submit]").await;
    let live = "return document.getElementById('status').dataset.state === 'live';";
    wait_for(&client, "the stream is live", live).await;
    let denied = client
        .find(Locator::Css(r#"input[value="delegation.subagent"]"#))
        .await
        .expect("the delegation role")
        .is_enabled()
        .await
        .expect("its state");
    assert!(!denied, "a role outside the token's grant must be disabled");

    // A turn published after the page loaded: exactly one row, its response.
    answered_turn(
        &js,
        "browser-1",
        "what is the build status?",
        "green since nine",
    )
    .await;
    wait_for(
        &client,
        "the turn's response is shown",
        r#"return [...document.querySelectorAll('li.row[data-key="browser-1"]')].some(r => r.textContent.includes('green since nine'));"#,
    )
    .await;
    assert_eq!(count(&client, r#"li.row[data-key="browser-1"]"#).await, 1);

    // A turn nobody answers: its blocked outcome, with the reason, goal and next action.
    publish(
        &js,
        "browser-2",
        &collab_event(
            "a2a.send",
            "ruda",
            "eden",
            "browser-2",
            json!({"message": "who owns the canary?", "timeoutMs": 1000}),
        ),
    )
    .await;
    let blocked = r#"li.row[data-key="browser-2"][data-outcome="blocked"]"#;
    wait_for(
        &client,
        "the blocked timeout is shown",
        &format!("return document.querySelector({blocked:?}) !== null;"),
    )
    .await;
    let text = text_of(&client, blocked).await;
    for needle in [
        "Blocked: timeout",
        "who owns the canary?",
        "Next action",
        "ruda asked eden",
    ] {
        assert!(
            text.contains(needle),
            "the blocked row lacks {needle:?}: {text}"
        );
    }

    // An answer that asks for input: the turn is answered and waiting, not failed.
    publish(
        &js,
        "browser-wait",
        &collab_event(
            "a2a.send",
            "ruda",
            "eden",
            "browser-wait",
            json!({"message": "book the flight", "timeoutMs": 60_000}),
        ),
    )
    .await;
    publish(
        &js,
        "browser-wait",
        &collab_event(
            "a2a.response",
            "eden",
            "ruda",
            "browser-wait",
            json!({"message": "which date?", "state": "input-required"}),
        ),
    )
    .await;
    let waiting = r#"li.row[data-key="browser-wait"][data-outcome="waiting"]"#;
    wait_for(
        &client,
        "the waiting answer is shown as waiting",
        &format!("return document.querySelector({waiting:?}) !== null;"),
    )
    .await;
    let text = text_of(&client, waiting).await;
    assert!(
        text.contains("Waiting for input from ruda")
            && text.contains("ruda asked eden")
            && !text.contains("Blocked"),
        "{text}"
    );

    // The detail pane: the envelope with its rawEventRef.
    click(&client, r#"li.row[data-key="browser-1"] > button"#).await;
    let detail = text_of(&client, "#detail-body").await;
    assert!(
        detail.contains("rawEventRef") && detail.contains("collab.raw.browser-1.a2a.response"),
        "{detail}"
    );

    // Accessibility: no WCAG 2.1 A/AA rule broken (contrast, names, labels, landmarks), with a
    // blocked outcome, the sessions and the detail pane on screen.
    if let Some(axe) = axe_source() {
        let violations = accessibility_violations(&client, &axe).await;
        assert!(
            violations.is_empty(),
            "accessibility violations: {}",
            serde_json::to_string_pretty(&violations).unwrap_or_default()
        );
    }

    // Debug: the send and the complete of the same turn appear beside its response.
    click(&client, "#debug").await;
    wait_for(
        &client,
        "the debug view shows the send",
        r#"return document.querySelector('li.row[data-key="browser-1"][data-type="a2a.send"]') !== null;"#,
    )
    .await;
    // This token may not read system.observability, where suppressed replies are: the view
    // says so rather than promising them.
    let note = text_of(&client, "#timeline-note").await;
    assert!(
        note.contains("Suppressed replies are system.observability events"),
        "{note}"
    );
    click(&client, "#debug").await;
    wait_for(
        &client,
        "the conversations view is back",
        r#"return document.querySelector('li.row[data-type="a2a.send"]') === null && document.querySelector('li.row[data-key="browser-1"]') !== null;"#,
    )
    .await;

    // A session's tokens and their cost from the price table (1200 in at 10, 300 out at 20 per
    // million).
    wait_for(
        &client,
        "the answered turn's session shows its tokens and cost",
        r#"const b = document.querySelector('#sessions button[data-session="browser-1"]'); return b !== null && b.textContent.includes('1,200 in · 300 out tokens · cost 0.0180');"#,
    )
    .await;

    // A work session narrows the timeline to its conversations; choosing it again widens it.
    let session = r#"#sessions button[data-session="browser-2"]"#;
    wait_for(
        &client,
        "the blocked turn's work session is listed",
        &format!(
            "const b = document.querySelector({session:?}); return b !== null && b.textContent.includes('1 blocked');"
        ),
    )
    .await;
    click(&client, session).await;
    wait_for(
        &client,
        "only the session's turn is shown",
        r#"return document.getElementById('status').dataset.state === 'live' && document.querySelector('li.row[data-key="browser-2"]') !== null && document.querySelector('li.row[data-key="browser-1"]') === null;"#,
    )
    .await;
    click(&client, "#session-clear").await;
    wait_for(
        &client,
        "every turn is shown again",
        r#"return document.querySelector('li.row[data-key="browser-1"]') !== null && document.querySelector('li.row[data-key="browser-2"]') !== null;"#,
    )
    .await;

    // Another role: only its events. Switching back and forth without waiting must end on the
    // last view chosen, whatever order the earlier views' answers arrive in.
    for role in [
        "orchestration.task",
        "conversation.main",
        "orchestration.task",
        "conversation.main",
        "orchestration.task",
    ] {
        click(&client, &format!(r#"input[value="{role}"]"#)).await;
    }
    wait_for(&client, "the task view is live", live).await;
    publish(
        &js,
        "task-b1",
        &json!({"type": "task.created", "agentId": "eden", "ts": chrono::Utc::now().timestamp_millis(),
                "data": {"taskId": "task-b1", "title": "Rotate the browser keys", "status": "queued"}}),
    )
    .await;
    wait_for(
        &client,
        "the task appears",
        r#"return [...document.querySelectorAll('li.row[data-type="task.created"]')].some(r => r.textContent.includes('Rotate the browser keys'));"#,
    )
    .await;
    assert_eq!(count(&client, r#"li.row[data-key="browser-1"]"#).await, 0);
    assert_eq!(text_of(&client, "#timeline-heading").await, "Tasks");

    // Back to conversations; then the server goes away mid-stream (SIGKILL), a turn is answered
    // while it is down, and a new process comes up on the same address.
    click(&client, r#"input[value="conversation.main"]"#).await;
    wait_for(&client, "the conversations view is live", live).await;
    wait_for(
        &client,
        "the conversations are hydrated again",
        r#"return document.querySelector('li.row[data-key="browser-1"]') !== null && document.querySelector('li.row[data-key="browser-2"]') !== null;"#,
    )
    .await;
    proj.kill9();
    wait_for(
        &client,
        "the page notices the dropped stream",
        "return document.getElementById('status').dataset.state === 'reconnecting';",
    )
    .await;
    answered_turn(
        &js,
        "browser-3",
        "anything new?",
        "answered while the server was down",
    )
    .await;
    let mut proj = projector(&nats.url(), http_port, &config);
    wait_until(WAIT, "the new projector is ready", || ready(http_port)).await;
    wait_for(
        &client,
        "the turn answered during the outage is shown",
        r#"return [...document.querySelectorAll('li.row[data-key="browser-3"]')].some(r => r.textContent.includes('answered while the server was down'));"#,
    )
    .await;
    wait_for(&client, "the stream is live again", live).await;
    for key in ["browser-1", "browser-2", "browser-3"] {
        assert_eq!(
            count(&client, &format!(r#"li.row[data-key="{key}"]"#)).await,
            1,
            "one row for turn {key}"
        );
    }
    assert_eq!(
        eval(&client, "return document.body.dataset.repeats;").await,
        json!("0"),
        "no event may arrive twice"
    );

    let shot = client.screenshot().await.expect("a screenshot");
    let dir = artifacts_dir();
    std::fs::create_dir_all(&dir).expect("the artefact directory");
    let path = dir.join("viewer.png");
    std::fs::write(&path, shot).expect("the screenshot is saved");
    eprintln!("viewer screenshot: {}", path.display());

    client.close().await.expect("the browser closes");
    proj.sigterm();
    let _ = proj.wait_exit(Duration::from_secs(10)).await;
}

/// An event from `from` to `to` on conversation `conv` stamped `ts_ms`.
fn stamped(kind: &str, from: &str, to: &str, conv: &str, extra: Value, ts_ms: i64) -> Value {
    let mut ev = collab_event(kind, from, to, conv, extra);
    ev["ts"] = json!(ts_ms);
    ev
}

/// Whether the status line is in `state`.
fn status_is(state: &str) -> String {
    format!("return document.getElementById('status').dataset.state === '{state}';")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewer_orders_by_event_time_shows_suppressed_replies_and_recovers_from_a_nats_outage()
{
    let Some((chromium, driver_bin)) = browser() else {
        return;
    };
    let mut nats = TestNats::start().await;
    if nats.local().is_none() {
        eprintln!("SKIPPED: stopping NATS needs a local nats-server, not a container");
        return;
    }
    provision_with_binary(&nats.url(), ENV);
    let js = nats.jetstream().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = viewer_config(
        dir.path(),
        &[
            "conversation.main",
            "delegation.subagent",
            "orchestration.task",
            "system.observability",
        ],
    );
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let mut proj = projector(&nats.url(), http_port, &config);
    wait_until(WAIT, "the projector is ready", || ready(http_port)).await;

    let driver = start_driver(&driver_bin).await;
    let client = open_browser(&chromium, &driver, &dir.path().join("profile")).await;
    client
        .goto(&format!("http://127.0.0.1:{http_port}/"))
        .await
        .expect("the viewer loads");
    wait_for(&client, "the page asks for a token", &status_is("token")).await;
    client
        .find(Locator::Id("token"))
        .await
        .expect("a token field")
        .send_keys(TOKEN)
        .await
        .expect("typing the token");
    click(&client, "#token-form button[type=submit]").await;
    let live = status_is("live");
    wait_for(&client, "the stream is live", &live).await;

    // Order by event time: a turn that happened yesterday, published after one of now, sits
    // below it, labelled with its date; today's is labelled with the time of day only.
    let now = chrono::Utc::now().timestamp_millis();
    let yesterday = now - 86_400_000;
    for (key, ts, reply) in [
        ("order-now", now, "the current answer"),
        ("order-old", yesterday, "yesterday's answer"),
    ] {
        let ask = json!({"message": "status?", "timeoutMs": 60_000});
        publish(&js, key, &stamped("a2a.send", "ruda", "eden", key, ask, ts)).await;
        let answer = json!({"message": reply});
        publish(
            &js,
            key,
            &stamped("a2a.response", "eden", "ruda", key, answer, ts + 1),
        )
        .await;
    }
    wait_for(
        &client,
        "both answers are shown",
        r#"return document.querySelector('li.row[data-key="order-now"]') !== null && document.querySelector('li.row[data-key="order-old"]') !== null;"#,
    )
    .await;
    let keys = eval(
        &client,
        "return [...document.querySelectorAll('li.row')].map(r => r.dataset.key);",
    )
    .await;
    assert_eq!(
        keys,
        json!(["order-now", "order-old"]),
        "newest event first"
    );
    let labels = eval(
        &client,
        r#"const t = (k) => document.querySelector(`li.row[data-key="${k}"] time`);
           const now = t('order-now'), old = t('order-old');
           return [now.textContent === new Date(now.dateTime).toLocaleTimeString(),
                   old.textContent === new Date(old.dateTime).toLocaleString()];"#,
    )
    .await;
    assert_eq!(
        labels,
        json!([true, true]),
        "today's time, another day's date"
    );

    // A turn answered twice: the second reply is suppressed, a system.observability event that
    // the debug view shows beside the turn's send and response.
    answered_turn(&js, "dup-1", "deploy?", "first reply").await;
    publish(
        &js,
        "dup-1",
        &collab_event(
            "a2a.response",
            "eden",
            "ruda",
            "dup-1",
            json!({"message": "second reply"}),
        ),
    )
    .await;
    wait_for(
        &client,
        "the first reply is shown",
        r#"return document.querySelector('li.row[data-key="dup-1"]') !== null;"#,
    )
    .await;
    // The detail pane shows a selected event until the view changes.
    click(&client, r#"li.row[data-key="dup-1"] > button"#).await;
    assert!(text_of(&client, "#detail-body").await.contains("dup-1"));
    click(&client, "#debug").await;
    wait_for(
        &client,
        "the debug view shows the suppressed reply",
        r#"return document.querySelector('li.row[data-key="dup-1"][data-type="a2a.response.suppressed"]') !== null;"#,
    )
    .await;
    assert_eq!(
        eval(
            &client,
            "const b = document.getElementById('detail-body'); return b.hidden && b.children.length === 0 && !document.getElementById('detail-empty').hidden;"
        )
        .await,
        json!(true),
        "a view switch empties the detail pane"
    );
    click(&client, "#debug").await;
    wait_for(&client, "the conversations view is live", &live).await;

    // A thread as people read it: an AG-UI run (published as the relay does, its run named by
    // Collab-Run-Id) opened from its shareable address, its message assembled from the deltas
    // and its tool call with arguments and result; and a turn opened from its row.
    let events = [
        (
            json!({"type": "RUN_STARTED", "threadId": "browser-run", "runId": "run-b1"}),
            "run-b1",
        ),
        (
            json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
            "run-b1",
        ),
        (
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "It is "}),
            "run-b1",
        ),
        (
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "sunny in Oslo."}),
            "run-b1",
        ),
        (
            json!({"type": "TEXT_MESSAGE_END", "messageId": "m1"}),
            "run-b1",
        ),
        (
            json!({"type": "TOOL_CALL_START", "toolCallId": "t1", "toolCallName": "get_weather"}),
            "run-b1",
        ),
        (
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "t1", "delta": "{\"city\":\"Oslo\"}"}),
            "run-b1",
        ),
        (
            json!({"type": "TOOL_CALL_END", "toolCallId": "t1"}),
            "run-b1",
        ),
        (
            json!({"type": "TOOL_CALL_RESULT", "messageId": "m2", "toolCallId": "t1", "content": "clear sky"}),
            "run-b1",
        ),
        // A delegation two levels deep: run-b1 starts run-b2, which starts run-b3.
        (
            json!({"type": "RUN_STARTED", "threadId": "browser-run", "runId": "run-b2", "parentRunId": "run-b1"}),
            "run-b2",
        ),
        (
            json!({"type": "RUN_STARTED", "threadId": "browser-run", "runId": "run-b3", "parentRunId": "run-b2"}),
            "run-b3",
        ),
        (
            json!({"type": "RUN_FINISHED", "threadId": "browser-run", "runId": "run-b3"}),
            "run-b3",
        ),
        (
            json!({"type": "RUN_FINISHED", "threadId": "browser-run", "runId": "run-b2"}),
            "run-b2",
        ),
        (
            json!({"type": "RUN_FINISHED", "threadId": "browser-run", "runId": "run-b1"}),
            "run-b1",
        ),
    ];
    publish_agui(&js, "collab.raw.browser-run._as.planner.agui", events).await;
    let finished = format!("http://127.0.0.1:{http_port}/api/threads/browser-run");
    wait_until(WAIT, "the run is projected to its end", || async {
        let body: Value = match reqwest::Client::new()
            .get(&finished)
            .bearer_auth(TOKEN)
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        body["thread"]["runs"][0]["outcome"] == "finished"
    })
    .await;
    eval(
        &client,
        "location.hash = '#thread=browser-run'; return true;",
    )
    .await;
    let run = r#"#detail-body section.run[data-run="run-b1"]"#;
    wait_for(
        &client,
        "the run is shown with its assembled message and tool call",
        &format!(
            "const r = document.querySelector({run:?}); return r !== null && r.dataset.outcome === 'finished' && r.textContent.includes('It is sunny in Oslo.') && r.textContent.includes('get_weather') && r.textContent.includes('clear sky');"
        ),
    )
    .await;
    let text = text_of(&client, run).await;
    assert!(text.contains("planner"), "the run's agent: {text}");
    let nested = eval(
        &client,
        r#"const b2 = document.querySelector('section.run[data-run="run-b1"] > details[data-child="run-b2"]');
           const b3 = b2 && b2.querySelector('section.run[data-run="run-b2"] > details[data-child="run-b3"]');
           return [b2 !== null, b3 !== null, document.querySelectorAll('#detail-body > section.run').length];"#,
    )
    .await;
    assert_eq!(
        nested,
        json!([true, true, 1]),
        "the delegation tree, two levels deep, under its root run"
    );
    // A run's own address marks it in its thread.
    let link = eval(
        &client,
        r#"return document.querySelector('section.run[data-run="run-b2"] a.permalink').getAttribute('href');"#,
    )
    .await;
    assert_eq!(link, json!("#thread=browser-run&item=run%3Arun-b2"));
    eval(
        &client,
        "location.hash = '#thread=browser-run&item=run%3Arun-b2'; return true;",
    )
    .await;
    wait_for(
        &client,
        "the linked run is marked",
        r#"const r = document.querySelector('section.run[data-run="run-b2"]'); return r !== null && r.classList.contains('linked');"#,
    )
    .await;
    assert!(text.contains(r#"get_weather({"city":"Oslo"})"#), "{text}");
    // A run that stopped for a person's approval reads as waiting, for what and on whom.
    publish_agui(&js, "collab.raw.browser-approval._as.planner.agui", [
        (
            json!({"type": "RUN_STARTED", "threadId": "browser-approval", "runId": "run-a1"}),
            "run-a1",
        ),
        (
            json!({"type": "RUN_FINISHED", "threadId": "browser-approval", "runId": "run-a1",
                "outcome": {"type": "interrupt", "interrupts": [{"id": "i1", "reason": "approval", "assignee": "alice"}]}}),
            "run-a1",
        ),
    ]).await;
    let approval = format!("http://127.0.0.1:{http_port}/api/threads/browser-approval");
    wait_until(WAIT, "the interrupted run is projected", || async {
        let body: Value = match reqwest::Client::new()
            .get(&approval)
            .bearer_auth(TOKEN)
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        body["thread"]["runs"][0]["outcome"] == "waiting"
    })
    .await;
    eval(
        &client,
        "location.hash = '#thread=browser-approval'; return true;",
    )
    .await;
    wait_for(
        &client,
        "the run waiting for approval is shown as waiting",
        r#"const r = document.querySelector('#detail-body section.run[data-run="run-a1"]'); return r !== null && r.dataset.outcome === 'waiting' && r.textContent.includes('waiting for approval on alice');"#,
    )
    .await;

    // Search: text and agent over every readable role; a hit opens its thread.
    eval(
        &client,
        "document.getElementById('search-q').value = 'CLEAR SKY'; document.getElementById('search-agent').value = 'planner'; return true;",
    )
    .await;
    click(&client, "#search-form button[type=submit]").await;
    wait_for(
        &client,
        "the search finds the tool result",
        r#"const c = document.getElementById('search-count'); return c !== null && c.textContent.startsWith('1 event(s) found') && document.querySelector('.results button[data-key="browser-run"]') !== null;"#,
    )
    .await;
    assert!(
        eval(&client, "return location.hash;")
            .await
            .as_str()
            .is_some_and(|h| h.starts_with("#search=")),
        "the search's address can be shared"
    );
    click(&client, r#".results button[data-key="browser-run"]"#).await;
    wait_for(
        &client,
        "the hit opens its thread",
        &format!("return document.querySelector({run:?}) !== null;"),
    )
    .await;

    click(&client, r#"li.row[data-key="dup-1"] > button"#).await;
    click(&client, "#open-thread").await;
    wait_for(
        &client,
        "the turn is shown with its request and reply in place",
        r#"const t = document.querySelector('#detail-body section.turn'); return t !== null && t.dataset.outcome === 'answered' && t.textContent.includes('deploy?') && t.textContent.includes('first reply');"#,
    )
    .await;
    assert_eq!(
        eval(&client, "return location.hash;").await,
        json!("#thread=dup-1"),
        "the thread's address can be shared"
    );

    // NATS goes away. A view loaded while it is down says the server is unavailable and keeps
    // trying; once NATS is back (same port, same store) the page recovers by itself and shows
    // what was published after, without a reload.
    nats.local().expect("a local nats-server").kill_now();
    click(&client, r#"input[value="orchestration.task"]"#).await;
    click(&client, r#"input[value="conversation.main"]"#).await;
    wait_for(
        &client,
        "the page says the server is unavailable",
        &status_is("down"),
    )
    .await;
    nats.restart().await;
    let js = nats.jetstream().await;
    wait_until(WAIT, "the projector is ready again", || ready(http_port)).await;
    answered_turn(&js, "after-outage", "back?", "answered after the outage").await;
    wait_for(
        &client,
        "the turn answered after the outage is shown",
        r#"return [...document.querySelectorAll('li.row[data-key="after-outage"]')].some(r => r.textContent.includes('answered after the outage'));"#,
    )
    .await;
    wait_for(&client, "the stream is live again", &live).await;
    for key in ["order-now", "order-old", "dup-1", "after-outage"] {
        assert_eq!(
            count(&client, &format!(r#"li.row[data-key="{key}"]"#)).await,
            1,
            "one row for turn {key}"
        );
    }
    assert_eq!(
        eval(&client, "return document.body.dataset.repeats;").await,
        json!("0"),
        "no event may arrive twice"
    );

    client.close().await.expect("the browser closes");
    proj.sigterm();
    let _ = proj.wait_exit(Duration::from_secs(10)).await;
}

/// `GET` an API path with the viewer's token, as JSON (`null` when it cannot be read).
async fn api_json(http_port: u16, path: &str) -> Value {
    match reqwest::Client::new()
        .get(format!("http://127.0.0.1:{http_port}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
    {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewer_shows_a_delegation_tree_what_waits_older_rows_and_token_totals() {
    let Some((chromium, driver_bin)) = browser() else {
        return;
    };
    let nats = TestNats::start().await;
    provision_with_binary(&nats.url(), ENV);
    let js = nats.jetstream().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = viewer_config(
        dir.path(),
        &[
            "conversation.main",
            "delegation.subagent",
            "orchestration.task",
            "system.observability",
        ],
    );
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let mut proj = projector(&nats.url(), http_port, &config);
    wait_until(WAIT, "the projector is ready", || ready(http_port)).await;

    // More answered turns than one snapshot holds (200), published before the page loads.
    let base = chrono::Utc::now().timestamp_millis() - 600_000;
    const OLD_TURNS: i64 = 230;
    for i in 0..OLD_TURNS {
        let key = format!("older-{i}");
        let ts = base + i * 100;
        publish(
            &js,
            &key,
            &stamped(
                "a2a.send",
                "ruda",
                "eden",
                &key,
                json!({"message": "status?", "timeoutMs": 60_000}),
                ts,
            ),
        )
        .await;
        publish(
            &js,
            &key,
            &stamped(
                "a2a.response",
                "eden",
                "ruda",
                &key,
                json!({"message": format!("answer {i}")}),
                ts + 1,
            ),
        )
        .await;
    }
    // A delegation two levels deep below tree-main, each answer with its tokens (m-test is
    // priced 10 per million input and 20 per million output tokens).
    let t0 = base + 100_000;
    let usage = |i: u64, o: u64| json!({"input_tokens": i, "output_tokens": o});
    for (key, parent, from, to, at, ask, tokens) in [
        (
            "tree-main",
            None,
            "ruda",
            "eden",
            0,
            "triage the nightly build",
            usage(3000, 300),
        ),
        (
            "tree-sub",
            Some("tree-main"),
            "eden",
            "eden-worker",
            1000,
            "collect the failing logs",
            usage(2000, 200),
        ),
        (
            "tree-sub2",
            Some("tree-sub"),
            "eden-worker",
            "log-reader",
            2000,
            "read test 7's log",
            usage(1000, 100),
        ),
    ] {
        let mut send = json!({"message": ask, "timeoutMs": 600_000});
        let mut reply =
            json!({"message": format!("done: {ask}"), "model": "m-test", "usage": tokens});
        if let Some(p) = parent {
            for v in [&mut send, &mut reply] {
                v["parentConversationId"] = json!(p);
                v["depth"] = json!(1);
            }
        }
        publish(&js, key, &stamped("a2a.send", from, to, key, send, t0 + at)).await;
        publish(
            &js,
            key,
            &stamped("a2a.response", to, from, key, reply, t0 + 10_000 - at),
        )
        .await;
    }
    // A run stopped for a person's approval.
    publish_agui(&js, "collab.raw.browser-wait._as.planner.agui", [
        (json!({"type": "RUN_STARTED", "threadId": "browser-wait", "runId": "run-w1"}), "run-w1"),
        (json!({"type": "RUN_FINISHED", "threadId": "browser-wait", "runId": "run-w1",
            "outcome": {"type": "interrupt", "interrupts": [{"id": "i1", "reason": "approval", "assignee": "alice"}]}}), "run-w1"),
    ]).await;
    let started = std::time::Instant::now();
    loop {
        let main = api_json(http_port, "/api/events?view=conversations&limit=1000").await;
        let waits = api_json(http_port, "/api/waiting").await;
        let tree = api_json(http_port, "/api/tree/tree-main").await;
        let answers = main["events"].as_array().map_or(0, Vec::len);
        let waiting = waits["waits"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["item"] == "run:run-w1"));
        let keys = tree["keys"].as_array().map_or(0, Vec::len);
        if answers as i64 == OLD_TURNS + 1 && waiting && keys == 3 {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "not everything is projected: {answers} answers, {keys} keys in the tree, waits: {waits}, thread: {}",
            api_json(http_port, "/api/threads/browser-wait").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let driver = start_driver(&driver_bin).await;
    let client = open_browser(&chromium, &driver, &dir.path().join("profile")).await;
    client
        .goto(&format!("http://127.0.0.1:{http_port}/"))
        .await
        .expect("the viewer loads");
    wait_for(&client, "the page asks for a token", &status_is("token")).await;
    client
        .find(Locator::Id("token"))
        .await
        .expect("a token field")
        .send_keys(TOKEN)
        .await
        .expect("typing the token");
    click(&client, "#token-form button[type=submit]").await;
    wait_for(&client, "the stream is live", &status_is("live")).await;

    // Older rows: the snapshot holds 200; Load older brings the rest.
    wait_for(
        &client,
        "the snapshot is shown",
        "return document.querySelectorAll('li.row').length === 200;",
    )
    .await;
    // The snapshot is the newest 200 in stream order, which is not event order across
    // partitions (each projects its keys' events at its own pace): the page shows exactly the
    // 200 the API names as newest, whichever they are.
    let newest = api_json(http_port, "/api/events?view=conversations&limit=200").await;
    let mut expected: Vec<String> = newest["events"]
        .as_array()
        .map(|events| {
            events
                .iter()
                .filter_map(|e| e["key"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    expected.sort();
    assert_eq!(expected.len(), 200, "{newest}");
    let mut shown: Vec<String> = serde_json::from_value(
        eval(
            &client,
            "return [...document.querySelectorAll('li.row')].map(r => r.dataset.key);",
        )
        .await,
    )
    .unwrap_or_default();
    shown.sort();
    assert_eq!(
        shown, expected,
        "the snapshot is not the newest 200 answered turns"
    );
    wait_for(
        &client,
        "Load older is offered",
        "return !document.getElementById('load-older').hidden;",
    )
    .await;
    click(&client, "#load-older").await;
    wait_for(
        &client,
        "the older rows are shown below",
        &format!(
            "return document.querySelectorAll('li.row').length === {};",
            OLD_TURNS + 1
        ),
    )
    .await;
    for i in 0..OLD_TURNS {
        assert_eq!(
            count(&client, &format!(r#"li.row[data-key="older-{i}"]"#)).await,
            1,
            "older-{i}"
        );
    }
    assert_eq!(count(&client, r#"li.row[data-key="tree-main"]"#).await, 1);
    assert_eq!(
        eval(&client, "const rows = [...document.querySelectorAll('li.row')]; return rows[rows.length - 1].dataset.key;").await,
        json!("older-0"),
        "the oldest row is last"
    );
    assert!(
        text_of(&client, "#older-note")
            .await
            .contains("Nothing older is kept"),
        "{}",
        text_of(&client, "#older-note").await
    );
    assert_eq!(
        eval(
            &client,
            "return document.getElementById('load-older').hidden;"
        )
        .await,
        json!(true)
    );
    assert_eq!(
        eval(&client, "return document.body.dataset.repeats;").await,
        json!("0")
    );

    // Waiting: the run stopped for approval, with whom it waits on; its row opens it.
    let waiting = r##"#waiting a[data-item="run:run-w1"]"##;
    wait_for(
        &client,
        "the waiting panel lists the run waiting for approval",
        &format!("const a = document.querySelector({waiting:?}); return a !== null && a.textContent.includes('planner waits on alice for approval');"),
    )
    .await;
    assert_eq!(
        eval(
            &client,
            &format!("return document.querySelector({waiting:?}).getAttribute('href');")
        )
        .await,
        json!("#thread=browser-wait&item=run%3Arun-w1")
    );
    // The panel refreshes every 5 s; a refresh that finds the same waits leaves its links in
    // place (keyboard focus and a click under way are kept).
    eval(
        &client,
        &format!(
            "document.querySelector({waiting:?}).dataset.mark = 'kept'; window.waitLoads = 0; \
             const f = window.fetch; window.fetch = (...a) => {{ if (String(a[0]).startsWith('/api/waiting')) window.waitLoads += 1; return f(...a); }}; return true;"
        ),
    )
    .await;
    wait_for(
        &client,
        "two more refreshes of the waiting panel",
        "return window.waitLoads >= 2;",
    )
    .await;
    assert_eq!(
        eval(
            &client,
            &format!("const a = document.querySelector({waiting:?}); return a.dataset.mark === 'kept' && a.isConnected;")
        )
        .await,
        json!(true),
        "the waiting panel's link was replaced by a refresh that found nothing new"
    );
    click(&client, waiting).await;
    wait_for(
        &client,
        "the waiting run opens, marked",
        r#"const r = document.querySelector('#detail-body section.run[data-run="run-w1"]'); return r !== null && r.classList.contains('linked') && r.dataset.outcome === 'waiting';"#,
    )
    .await;

    // The thread's total and the delegation tree, two levels deep, with tokens and cost rolled up.
    eval(&client, "location.hash = '#thread=tree-main'; return true;").await;
    wait_for(
        &client,
        "the thread's token and cost total is shown",
        "const t = document.getElementById('thread-total'); return t !== null && t.textContent === 'Total: 3,000 in · 300 out tokens · cost 0.0360';",
    )
    .await;
    click(&client, "#thread-tree button").await;
    let deepest = r#"#thread-tree details[data-kind="conversation"][data-id="tree-main"] details[data-kind="conversation"][data-id="tree-sub"] details[data-kind="conversation"][data-id="tree-sub2"]"#;
    wait_for(
        &client,
        "the tree shows both levels of delegation",
        &format!("return document.querySelector({deepest:?}) !== null;"),
    )
    .await;
    let root = text_of(
        &client,
        r#"#thread-tree > details[data-id="tree-main"] > summary"#,
    )
    .await;
    assert!(
        root.contains("6,000 in · 600 out tokens · cost 0.0720"),
        "{root}"
    );
    // The nested levels are expandable; opened, the deepest turn shows its outcome, duration,
    // tokens and cost.
    eval(&client, "document.querySelectorAll('#thread-tree details').forEach(d => { d.open = true; }); return true;").await;
    let turn = text_of(&client, &format!(r#"{deepest} [data-kind="turn"]"#)).await;
    for part in [
        "eden-worker → log-reader: read test 7's log",
        "answered",
        "6.0 s",
        "1,000 in · 100 out tokens · cost 0.0120",
    ] {
        assert!(turn.contains(part), "{part:?} in {turn}");
    }
    assert_eq!(
        eval(&client, &format!(r#"return document.querySelector({deepest:?}).closest('details[data-id="tree-sub"]').open;"#)).await,
        json!(true)
    );
    // A run's own tree (from the run's section).
    eval(
        &client,
        "location.hash = '#thread=browser-wait'; return true;",
    )
    .await;
    wait_for(
        &client,
        "the run's section",
        r#"return document.querySelector('section.run[data-run="run-w1"] .tree button') !== null;"#,
    )
    .await;
    click(&client, r#"section.run[data-run="run-w1"] .tree button"#).await;
    wait_for(
        &client,
        "the run's tree is rooted at the run",
        r#"const n = document.querySelector('section.run[data-run="run-w1"] .tree [data-kind="run"][data-id="run-w1"]'); return n !== null && n.dataset.outcome === 'waiting';"#,
    )
    .await;

    if let Some(axe) = axe_source() {
        eval(&client, "location.hash = '#thread=tree-main'; return true;").await;
        wait_for(
            &client,
            "the thread again",
            "return document.querySelector('#thread-tree button') !== null;",
        )
        .await;
        click(&client, "#thread-tree button").await;
        wait_for(
            &client,
            "its tree",
            &format!("return document.querySelector({deepest:?}) !== null;"),
        )
        .await;
        let violations = accessibility_violations(&client, &axe).await;
        assert!(
            violations.is_empty(),
            "accessibility violations: {}",
            serde_json::to_string_pretty(&violations).unwrap_or_default()
        );
    }
    let shot = client.screenshot().await.expect("a screenshot");
    let path = artifacts_dir().join("viewer-tree.png");
    std::fs::write(&path, shot).expect("the screenshot is saved");
    eprintln!(
        "viewer screenshot with a delegation tree: {}",
        path.display()
    );

    client.close().await.expect("the browser closes");
    proj.sigterm();
    let _ = proj.wait_exit(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn the_demo_prints_the_viewer_url_first_and_serves_the_viewer_there() {
    use tokio::io::AsyncBufReadExt;
    let nats = TestNats::start().await;
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args([
            "demo",
            "--nats-url",
            &nats.url(),
            "--http-addr",
            "127.0.0.1:0",
            "--duration",
            "60s",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the demo starts");
    let stdout = demo.stdout.take().expect("the demo's output");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("the demo prints within the guard")
        .expect("the demo's output is readable")
        .expect("the demo prints a line");
    let url = first
        .strip_prefix("viewer: ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the first line is not the viewer's address: {first:?}"))
        .to_string();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with('/'),
        "{url}"
    );
    let page = reqwest::get(&url).await.expect("the viewer answers");
    assert!(page.status().is_success());
    assert!(page
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/html")));
    let html = page.text().await.expect("the page");
    assert!(
        html.contains("<title>collab-projector viewer</title>"),
        "{html}"
    );
    let script = reqwest::get(format!("{url}viewer/app.js"))
        .await
        .expect("the viewer's script answers");
    assert!(script.status().is_success());
    demo.kill().await.expect("the demo stops");
}

/// `config/nats-compose.conf`, which `docker-compose.yml` runs nats-server with.
const COMPOSE_CONF: &str = include_str!("../../config/nats-compose.conf");
const COMPOSE: &str = include_str!("../../docker-compose.yml");

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "config/nats-compose.conf no longer has `{from}`; update this test"
    );
    text.replace(from, to)
}

#[tokio::test]
async fn the_compose_nats_server_serves_projections_to_websocket_uis() {
    for needle in [
        r#"command: ["-c", "/etc/nats/nats-compose.conf"]"#,
        "./config/nats-compose.conf:/etc/nats/nats-compose.conf:ro",
        r#""127.0.0.1:8443:8443""#,
    ] {
        assert!(
            COMPOSE.contains(needle),
            "docker-compose.yml lacks {needle}"
        );
    }
    // The file as shipped, its ports moved to free ones and its store to a temporary directory
    // whose size is fixed, as every server of the suite's is (`localnats::LOCAL_MAX_FILE_STORE`):
    // left to the server, it would be 75 % of the free disk, too little on a small runner.
    let dir = tempfile::tempdir().expect("a temporary directory");
    // Held for the whole test: the server binds them with SO_REUSEADDR while no other test's
    // server can be given them.
    let held = [(); 3].map(|()| ReservedPort::for_server());
    let [port, monitor, ws] = held.each_ref().map(ReservedPort::port);
    let mut conf = replace_once(
        COMPOSE_CONF,
        "listen: 0.0.0.0:4222",
        &format!("listen: 127.0.0.1:{port}"),
    );
    conf = replace_once(
        &conf,
        "http: 0.0.0.0:8222",
        &format!("http: 127.0.0.1:{monitor}"),
    );
    conf = replace_once(
        &conf,
        "store_dir: /data",
        &format!(
            "store_dir: {:?}\n  max_file_store: {}",
            dir.path().join("js"),
            collab_projector::localnats::LOCAL_MAX_FILE_STORE
        ),
    );
    conf = replace_once(&conf, "port: 8443", &format!("port: {ws}"));
    let path = dir.path().join("nats.conf");
    std::fs::write(&path, conf).expect("the configuration is written");
    let bin = std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .or_else(|| on_path("nats-server"))
        .expect("nats-server on PATH (or NATS_SERVER_BIN)");
    let mut server = tokio::process::Command::new(bin)
        .arg("-c")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("nats-server starts");
    let url = format!("nats://127.0.0.1:{port}");
    wait_until(WAIT, "the compose nats-server accepts clients", || {
        let url = url.clone();
        async move { async_nats::connect(url).await.is_ok() }
    })
    .await;

    provision_with_binary(&url, ENV);
    // Held for the whole test, so no other test's server is given it while the projector (or a
    // restarted one) binds it.
    let http = ReservedPort::for_server();
    let http_port = http.port();
    let http_addr = format!("127.0.0.1:{http_port}");
    let mut proj = Projector::spawn_command(
        &[
            "run",
            "--nats-url",
            &url,
            "--http-addr",
            &http_addr,
            "--main-agents",
            "ruda,eden",
        ],
        &ENV,
    );
    wait_until(WAIT, "the projector is ready", || ready(http_port)).await;
    let ui = async_nats::connect(format!("ws://127.0.0.1:{ws}"))
        .await
        .expect("a browser UI connects over WebSocket");
    let mut sub = ui
        .subscribe("collab.proj.conversation.main.*.a2a.response")
        .await
        .expect("subscribe to the Conversations view");
    ui.flush().await.expect("flush");

    let js = async_nats::jetstream::new(async_nats::connect(&url).await.expect("a producer"));
    answered_turn(&js, "compose-1", "ping", "pong").await;
    let m = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut sub))
        .await
        .expect("the response reaches the WebSocket UI")
        .expect("the subscription is open");
    assert_eq!(
        m.subject.as_str(),
        "collab.proj.conversation.main.compose-1.a2a.response"
    );
    let env: Value = serde_json::from_slice(&m.payload).expect("an envelope");
    assert_eq!(env["payload"]["message"], "pong");
    let headers = m.headers.expect("projection headers");
    let msg_id = headers
        .get("Nats-Msg-Id")
        .map(|v| v.as_str().to_string())
        .expect("a Nats-Msg-Id header");
    // The same projection in the API carries that id, so a UI merging its snapshot with a live
    // subscription can drop the overlap.
    let page: Value = reqwest::get(format!(
        "http://{http_addr}/api/events?view=conversations&key=compose-1"
    ))
    .await
    .expect("the API answers")
    .json()
    .await
    .expect("a page");
    assert_eq!(page["events"][0]["msgId"], json!(msg_id), "{page}");
    assert_eq!(
        headers.get("Collab-Event-Role").map(|v| v.as_str()),
        Some("conversation.main")
    );
    proj.sigterm();
    let _ = proj.wait_exit(Duration::from_secs(10)).await;
    server.kill().await.expect("nats-server stops");
}
