//! The command line as a newcomer and an operator meet it, through the real binary and a real
//! nats-server: shutdown with a closed log pipe, a second `run` on a taken HTTP port, flags a
//! command would ignore, errors printed once, plain logs off a terminal, waiting for NATS, and
//! `status` with an API-only process.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::pipeline::{start_projector, GUARD};
use crate::support::{wait_until, Projector, ReservedPort, TestNats};

const BIN: &str = env!("CARGO_BIN_EXE_collab-projector");

/// Generous: it only stops a wedged process from hanging the test; a drain takes about a second.
const EXIT_BOUND: Duration = Duration::from_secs(20);

/// Partition -> owner, from the leases bucket (an empty map when the bucket does not exist yet).
async fn lease_owners(js: &async_nats::jetstream::Context) -> BTreeMap<u16, String> {
    let mut out = BTreeMap::new();
    let Ok(kv) = js.get_key_value("collab_leases").await else {
        return out;
    };
    let Ok(mut keys) = kv.keys().await else {
        return out;
    };
    let mut names = Vec::new();
    while let Some(Ok(k)) = keys.next().await {
        names.push(k);
    }
    for k in names {
        let Some(p) = k.strip_prefix("l.").and_then(|p| p.parse::<u16>().ok()) else {
            continue;
        };
        if let Ok(Some(v)) = kv.get(&k).await {
            out.insert(p, String::from_utf8_lossy(&v).into_owned());
        }
    }
    out
}

/// Wait until every one of the 16 default partitions has an owner.
async fn wait_all_leased(js: &async_nats::jetstream::Context) {
    wait_until(GUARD, "the worker holds all 16 partition leases", || {
        let js = js.clone();
        async move { lease_owners(&js).await.len() == 16 }
    })
    .await;
}

fn sigterm(child: &Child) {
    let pid = i32::try_from(child.id()).unwrap_or_else(|e| panic!("pid: {e}"));
    kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap_or_else(|e| panic!("SIGTERM: {e}"));
}

/// Wait for `child` to exit within [`EXIT_BOUND`]; its exit code, or a panic naming `what`.
async fn exit_code(child: &mut Child, what: &str) -> i32 {
    let deadline = Instant::now() + EXIT_BOUND;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return status
                    .code()
                    .unwrap_or_else(|| panic!("{what}: ended by a signal: {status}"))
            }
            Ok(None) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(None) => {
                let _ = child.kill();
                panic!("{what}: still running {EXIT_BOUND:?} after SIGTERM");
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// `run` with both log pipes to this test, which closes them as `run ... | tee` does when the
/// pane running `tee` is closed.
fn spawn_piped(url: &str) -> Child {
    Command::new(BIN)
        .args(["run", "--nats-url", url, "--http-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"))
}

/// Whether process `pid` holds `path` open.
fn holds_open(pid: u32, path: &std::path::Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(Result::ok)
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == path))
        })
        .unwrap_or(false)
}

/// A SIGTERM that comes while `run` is still starting (here: reading its settings from a pipe
/// nothing has written to yet) is kept, not fatal: the worker finishes starting, drains and exits
/// 0, holding no lease. Process managers send SIGTERM whenever they stop a process, a slow start
/// included; before, such a signal ended the process by its default action.
#[tokio::test]
async fn a_sigterm_while_run_reads_its_settings_stops_it_cleanly() {
    use std::io::Write;
    let nats = TestNats::start().await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temporary directory: {e}"));
    let fifo = dir.path().join("collab.toml");
    let log = dir.path().join("run.log");
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
    // Both ends held here: the worker's open returns at once and its read waits for the text.
    let mut pipe = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fifo)
        .unwrap_or_else(|e| panic!("{}: {e}", fifo.display()));
    let mut child = Command::new(BIN)
        .arg("run")
        .arg("--config")
        .arg(&fifo)
        .args(["--nats-url", &nats.url(), "--http-addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display())))
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"));
    let pid = child.id();
    wait_until(GUARD, "run opens its settings file", || {
        let opened = holds_open(pid, &fifo);
        async move { opened }
    })
    .await;
    sigterm(&child);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let early = child.try_wait();
    assert!(
        matches!(early, Ok(None)),
        "run was ended by a SIGTERM that came while it read its settings: {early:?}"
    );
    pipe.write_all(b"# the defaults\n")
        .unwrap_or_else(|e| panic!("writing the settings: {e}"));
    drop(pipe);
    let code = exit_code(&mut child, "run stopped while it read its settings").await;
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        code, 0,
        "run did not exit cleanly after an early SIGTERM: {said}"
    );
    let js = nats.jetstream().await;
    let left = lease_owners(&js).await;
    assert!(left.is_empty(), "leases still held after exit: {left:?}");
}

async fn closed_pipe_then_sigterm(close_before_startup: bool) {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut child = spawn_piped(&nats.url());
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    if close_before_startup {
        drop((stdout, stderr));
        wait_all_leased(&js).await;
    } else {
        let mut lines = BufReader::new(stdout.unwrap_or_else(|| panic!("no stdout pipe"))).lines();
        let up = lines.any(|l| l.is_ok_and(|l| l.contains("http listening on")));
        assert!(up, "the worker never printed its HTTP address");
        wait_all_leased(&js).await;
        drop((lines, stderr));
    }
    // Log lines written into the closed pipes: the worker must go on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        matches!(child.try_wait(), Ok(None)),
        "the worker exited when its log pipe closed: {:?}",
        child.try_wait()
    );
    sigterm(&child);
    let code = exit_code(&mut child, "the worker with a closed log pipe").await;
    assert_eq!(code, 0, "the worker did not exit cleanly after SIGTERM");
    let left = lease_owners(&js).await;
    assert!(left.is_empty(), "leases still held after exit: {left:?}");
}

#[tokio::test]
async fn a_worker_whose_log_pipe_closed_drains_and_exits_on_sigterm() {
    closed_pipe_then_sigterm(false).await;
}

#[tokio::test]
async fn a_worker_whose_log_pipe_closed_during_startup_runs_and_exits_on_sigterm() {
    closed_pipe_then_sigterm(true).await;
}

fn output(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(envs.iter().copied())
        .env_remove("NATS_URL")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"))
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn a_second_run_on_a_taken_http_port_names_the_flag_in_one_line() {
    let nats = TestNats::start().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let addr = taken
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .to_string();
    let out = output(
        &["run", "--nats-url", &nats.url(), "--http-addr", &addr],
        &[("RUST_BACKTRACE", "1"), ("RUST_LOG", "error")],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(&addr), "{err}");
    assert!(err.contains("--http-addr"), "{err}");
    assert!(err.contains("--no-http"), "{err}");
    assert!(!err.contains("backtrace"), "{err}");
    // Nothing was taken: the address is checked before any partition.
    let js = nats.jetstream().await;
    assert!(lease_owners(&js).await.is_empty());
}

/// An OpenTelemetry endpoint variable that is no URL stops `run` before it connects, in one
/// line naming the variable and not repeating its value (it may hold credentials).
#[tokio::test]
async fn a_bad_otel_endpoint_variable_stops_run_before_it_connects() {
    let nats = TestNats::start().await;
    let out = output(
        &["run", "--nats-url", &nats.url(), "--no-http"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "user:hunter2@collector:4318"),
            ("RUST_LOG", "error"),
        ],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{err}");
    assert!(err.contains("http://"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // Nothing was provisioned: the check comes before the connection.
    let js = nats.jetstream().await;
    let streams = stream_names(&js).await;
    assert!(streams.is_empty(), "{streams:?}");
}

/// Values no run could use are refused before anything runs, in words that say what to give:
/// an out-of-range demo rate (which stopped the demo's publisher with a panic), an unknown
/// dead-letter reason (which replayed nothing and said so as if it had looked), an empty
/// range to audit (which said the audit held), an empty NATS URL (which was retried as an
/// address), and a mistyped token, whose value is never repeated.
#[tokio::test]
async fn values_no_run_could_use_are_refused_saying_what_to_give() {
    let nats = TestNats::start().await;
    let url = nats.url();
    // Arguments, environment, exit status, words the error must hold.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], i32, &'a [&'a str]);
    let cases: [Case; 6] = [
        (&["demo", "--rate", "1001"], &[], 2, &["1..=1000"]),
        (
            &["dlq", "replay", "--reason", "nope"],
            &[],
            2,
            &["bad_key", "too_large"],
        ),
        (
            &["audit", "--nats-url", &url, "--from", "10", "--to", "5"],
            &[],
            1,
            &["--from 10 is after --to 5"],
        ),
        (
            &["audit", "--nats-url", &url, "--from", "100000"],
            &[],
            1,
            &["nothing to audit"],
        ),
        (
            &["provision", "--nats-url", ""],
            &[],
            1,
            &["nats.url is empty"],
        ),
        (
            &["provision", "--nats-url", &url],
            &[("COLLAB_HTTP__TOKENS", r#"[{name="a",token="hunter2"}]"#)],
            1,
            &["http.tokens"],
        ),
    ];
    // The audit of an empty range needs the streams to exist.
    let out = output(&["provision", "--nats-url", &url], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    for (args, envs, code, words) in cases {
        let mut envs = envs.to_vec();
        envs.push(("RUST_LOG", "error"));
        let out = output(args, &envs);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        for w in words {
            assert!(err.contains(w), "{args:?}: {w:?} missing: {err}");
        }
        assert!(!err.contains("hunter2"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        if code == 1 {
            assert_eq!(
                err.trim_end().lines().count(),
                1,
                "{args:?}: one line: {err}"
            );
        }
    }
}

/// `normalize` whose reader stops early (`| head -1`) ends quietly with status 0: what the
/// reader took was written, and a closed pipe is no error of the input's.
#[test]
fn normalize_into_a_reader_that_stops_early_ends_quietly() {
    use std::io::{Read, Write};
    let mut child = Command::new(BIN)
        .arg("normalize")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"));
    let mut stdout = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
    // More lines than the pipe holds, so the writer meets the closed pipe.
    let feeder = std::thread::spawn(move || {
        for _ in 0..200_000 {
            if stdin
                .write_all(b"{\"type\":\"health.ping\",\"agentId\":\"a\"}\n")
                .is_err()
            {
                break;
            }
        }
    });
    let mut first = [0u8; 64];
    let n = stdout.read(&mut first).unwrap_or(0);
    assert!(n > 0, "no output");
    drop(stdout);
    let out = child.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let _ = feeder.join();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "{err}");
}

#[test]
fn commands_refuse_flags_they_would_ignore() {
    let commands: [&[&str]; 4] = [
        &["status", "--once"],
        &["audit"],
        &["provision"],
        &["dlq", "replay"],
    ];
    let flags: [&[&str]; 3] = [
        &["--http-addr", "127.0.0.1:9"],
        &["--turn-timeout", "5s"],
        &["--main-agents", "a,b"],
    ];
    for command in commands {
        for flag in flags {
            let mut args = command.to_vec();
            args.extend_from_slice(flag);
            let out = output(&args, &[]);
            let err = stderr_of(&out);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(
                err.contains(&format!("unexpected argument '{}'", flag[0])),
                "{args:?}: {err}"
            );
        }
    }
}

#[test]
fn a_configuration_error_is_printed_once_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "bogus_section = 1\n").unwrap_or_else(|e| panic!("{e}"));
    let path = file.to_string_lossy().into_owned();
    for command in [&["status", "--once"][..], &["audit"], &["run"]] {
        let mut args = command.to_vec();
        args.extend_from_slice(&["--config", &path]);
        let out = output(&args, &[("RUST_BACKTRACE", "1")]);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.matches("bogus_section").count(), 1, "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("backtrace"), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn logs_in_a_file_are_plain_and_blank_main_agents_still_warn() {
    let nats = TestNats::start().await;
    let mut p = start_projector(&nats.url(), &["--main-agents", ""], &[("RUST_LOG", "info")]).await;
    p.sigterm();
    let code = p.wait_exit(EXIT_BOUND).await.and_then(|s| s.code());
    let log = p.log_text();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("no main agents configured"), "{log}");
    assert!(log.contains("stopped"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file: {log:?}"
    );
}

#[tokio::test]
async fn status_counts_an_api_only_process_apart_from_the_workers() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let _worker = start_projector(&nats.url(), &[], &[]).await;
    let _api = start_projector(&nats.url(), &["--no-workers"], &[]).await;
    wait_all_leased(&js).await;
    let url = nats.url();
    let mut text = String::new();
    wait_until(
        GUARD,
        "status sees the worker and the API-only process",
        || {
            let out = output(&["status", "--once", "--nats-url", &url], &[]);
            text = String::from_utf8_lossy(&out.stdout).into_owned();
            let seen = text.contains("1 worker + 1 API-only answered");
            async move { seen }
        },
    )
    .await;
    assert!(text.contains("TOTAL (1 worker + 1 API-only)"), "{text}");
    assert!(text.contains("api only"), "{text}");
}

#[tokio::test]
async fn run_waits_for_nats_and_one_shot_commands_say_it_is_down() {
    let reserved = ReservedPort::new();
    let url = format!("nats://127.0.0.1:{}", reserved.port());
    // One-shot commands stop at once, naming the server and the fix.
    for command in [&["status", "--once"][..], &["audit"], &["provision"]] {
        let mut args = command.to_vec();
        args.extend_from_slice(&["--nats-url", &url]);
        let out = output(&args, &[]);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("cannot connect to NATS at"), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
    // What waiting cannot fix stops `run` at once.
    let out = output(
        &["run", "--no-http", "--nats-url", "nats://bad host:x"],
        &[],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("invalid server URL"), "{err}");
    // `run` waits, says so, and starts when the server comes.
    let mut p = Projector::spawn(&url, &[], &[("RUST_LOG", "info")]);
    wait_until(GUARD, "run says it waits for NATS", || {
        let said = p.log_text().contains("waiting for NATS");
        async move { said }
    })
    .await;
    let port = reserved.release();
    let mut server = collab_projector::localnats::LocalNats::start(
        collab_projector::localnats::LocalNatsOptions {
            port,
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("nats-server on port {port}: {e}"));
    let js = async_nats::jetstream::new(
        async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    wait_all_leased(&js).await;
    p.sigterm();
    let code = p.wait_exit(EXIT_BOUND).await.and_then(|s| s.code());
    assert_eq!(code, Some(0), "{}", p.log_text());
    // SIGTERM while still waiting is a clean stop too.
    server.stop().await;
    let down = ReservedPort::new();
    let down_url = format!("nats://127.0.0.1:{}", down.port());
    let mut waiting = Projector::spawn(&down_url, &[], &[("RUST_LOG", "info")]);
    wait_until(GUARD, "the second run waits for NATS", || {
        let said = waiting.log_text().contains("waiting for NATS");
        async move { said }
    })
    .await;
    waiting.sigterm();
    let code = waiting.wait_exit(EXIT_BOUND).await.and_then(|s| s.code());
    assert_eq!(code, Some(0), "{}", waiting.log_text());
}

/// The streams a server holds.
async fn stream_names(js: &async_nats::jetstream::Context) -> Vec<String> {
    js.stream_names()
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .filter_map(Result::ok)
        .collect()
}

fn demo(extra: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut args = vec!["demo", "--duration", "5s", "--http-addr", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let out = Command::new(BIN)
        .args(&args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[tokio::test]
async fn the_demo_never_joins_a_server_it_was_not_told_to() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let url = nats.url();
    // A deployment's usual environment points at the running server: the demo ignores it.
    let (code, text) = demo(&[], &[("NATS_URL", &url), ("COLLAB_NATS__URL", &url)]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("started a nats-server of its own"), "{text}");
    assert!(!text.contains(&url), "{text}");
    let streams = stream_names(&js).await;
    assert!(streams.is_empty(), "the demo touched {url}: {streams:?}");
}

#[tokio::test]
async fn a_demo_told_to_join_says_so_and_keeps_to_its_own_prefix() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let url = nats.url();
    let (code, text) = demo(&["--nats-url", &url, "--turn-timeout", "45s"], &[]);
    assert_eq!(code, Some(0), "{text}");
    let first = text.lines().take(3).collect::<Vec<_>>().join("\n");
    assert!(
        first.contains(&format!("JOINING the NATS server at {url}")),
        "{text}"
    );
    assert!(first.contains("DEMO_RAW"), "{text}");
    let streams = stream_names(&js).await;
    assert!(streams.iter().any(|s| s == "DEMO_RAW"), "{streams:?}");
    assert!(
        !streams.iter().any(|s| s.starts_with("COLLAB")),
        "{streams:?}"
    );
    // The periodic summaries keep the viewer's address in sight, and an empty reason list is
    // not printed.
    let summaries: Vec<&str> = text.lines().filter(|l| l.starts_with("--- ")).collect();
    assert!(!summaries.is_empty(), "{text}");
    assert!(
        summaries
            .iter()
            .all(|l| l.contains("viewer: http://127.0.0.1:")),
        "{text}"
    );
    assert!(!text.contains("()"), "{text}");
    // The generated main-main turns ask for the deadline `--turn-timeout` gave.
    let mut raw = js
        .get_stream("DEMO_RAW")
        .await
        .unwrap_or_else(|e| panic!("DEMO_RAW: {e}"));
    let last = raw
        .info()
        .await
        .unwrap_or_else(|e| panic!("DEMO_RAW info: {e}"))
        .state
        .last_sequence;
    let mut deadlines = Vec::new();
    for seq in 1..=last.min(5_000) {
        let Ok(m) = raw.get_raw_message(seq).await else {
            continue;
        };
        let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
        if let Some(ms) = body.pointer("/data/timeoutMs") {
            deadlines.push(ms.clone());
        }
    }
    assert!(
        !deadlines.is_empty(),
        "no generated turn in {last} raw messages"
    );
    assert!(
        deadlines.iter().all(|d| *d == serde_json::json!(45_000)),
        "{deadlines:?}"
    );
}

/// A server whose JetStream storage is smaller than the default limits add up to (6.5 GiB):
/// `provision` and `run` stop with one error line that names the setting the server could not
/// reserve, the deployment's total, and both ways out; smaller limits then fit.
#[tokio::test]
async fn a_server_too_small_for_the_storage_limits_is_named_with_the_fix() {
    let server = collab_projector::localnats::LocalNats::start(
        collab_projector::localnats::LocalNatsOptions {
            max_file_store: Some(4 << 30),
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("nats-server: {e}"));
    let url = server.url();
    let out = output(
        &["provision", "--nats-url", &url],
        &[("RUST_BACKTRACE", "1")],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The raw stream (2 GiB) fits in 4 GiB; the projection stream (3 GiB) does not.
    for part in [
        "stream COLLAB_PROJ",
        "storage.proj_max_bytes (3 GiB)",
        "come to 6.5 GiB",
        "max_file_store",
        "error code 10047",
    ] {
        assert!(err.contains(part), "{part:?} missing: {err}");
    }
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("max_file_store"), "{err}");
    assert!(!err.contains("backtrace"), "{err}");

    // `run` provisions at start and stops the same way.
    let mut p = Projector::spawn(&url, &[], &[("RUST_LOG", "info")]);
    let code = p.wait_exit(EXIT_BOUND).await.and_then(|s| s.code());
    let log = p.log_text();
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("storage.proj_max_bytes (3 GiB)"), "{log}");

    // With limits that fit, the same server is provisioned.
    let out = output(
        &["provision", "--nats-url", &url],
        &[
            ("COLLAB_STORAGE__RAW_MAX_BYTES", "1073741824"),
            ("COLLAB_STORAGE__PROJ_MAX_BYTES", "1073741824"),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
}
