//! Operator commands against a real server: `audit`, `dlq replay`, discovery through the NATS
//! service API and `status`; and the operator's files (alert rules, dashboard, operations guide)
//! checked against the metric families.

use crate::pipeline::{count, default_partitions, publish, run_bin, start_projector, wait_settled};
use crate::support::{wait_until, TestNats};
use collab_projector::config::Settings;
use collab_projector::status;
use collab_projector::telemetry::{Family, WorkerStatus, FAMILIES};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const GUARD: Duration = Duration::from_secs(60);

#[tokio::test]
async fn audit_holds_after_a_mixed_run_and_replay_reprojects_fixed_dead_letters() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = start_projector(&nats.url(), &["--main-agents", "ruda,eden"], &[]).await;

    // Two good events, one bad_key (conversation c1 published under key "wrong").
    publish(
        &js,
        "collab.raw.t1.task.created",
        r#"{"type":"task.created","taskId":"t1"}"#,
    )
    .await;
    publish(
        &js,
        "collab.raw.ruda.health.ping",
        r#"{"type":"health.ping"}"#,
    )
    .await;
    let misrouted = r#"{"type":"task.updated","eventRole":"orchestration.tsak","taskId":"t1"}"#;
    publish(&js, "collab.raw.t1.task.updated", misrouted).await;
    wait_settled(&js, 2, 1).await;

    let url = nats.url();
    let (ok, out, err) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(ok, "audit should hold: {out}\n{err}");
    assert!(
        out.contains("3 messages, 2 projected, 1 dead-lettered, 0 both, 0 neither"),
        "{out}"
    );
    assert!(out.contains("dead letters invalid_role: 1"), "{out}");

    // A dry run publishes nothing; a real replay republishes to the producer's subject, where the
    // (unchanged) message is dead-lettered again: replay is a no-loss loop, not a silent drop.
    let (ok, out, _) = run_bin(
        &["dlq", "replay", "--nats-url", &url, "--dry-run"],
        &[],
        b"",
    )
    .await;
    assert!(ok && out.contains("would replay 1 dead letters"), "{out}");
    let raw_before = count(&js, "COLLAB_RAW").await;
    assert_eq!(raw_before, 3);
    let (ok, out, err) = run_bin(
        &[
            "dlq",
            "replay",
            "--nats-url",
            &url,
            "--reason",
            "invalid_role",
        ],
        &[],
        b"",
    )
    .await;
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("replayed 1 dead letters"), "{out}");
    assert_eq!(
        count(&js, "COLLAB_RAW").await,
        4,
        "the dead letter went back to the raw stream"
    );
    wait_until(GUARD, "the replayed message is dead-lettered again", || {
        let js = js.clone();
        async move { count(&js, "COLLAB_DLQ").await == 2 }
    })
    .await;
    let (ok, out, err) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("4 messages, 2 projected, 2 dead-lettered, 0 both, 0 neither"),
        "{out}"
    );
    // Replaying again within the duplicate window publishes nothing new.
    let (ok, _, _) = run_bin(
        &[
            "dlq",
            "replay",
            "--nats-url",
            &url,
            "--reason",
            "invalid_role",
        ],
        &[],
        b"",
    )
    .await;
    assert!(ok);
    assert_eq!(
        count(&js, "COLLAB_RAW").await,
        5,
        "the second dead letter is new, the first collapses"
    );
    drop(projector);
}

#[tokio::test]
async fn audit_fails_when_a_raw_message_was_never_processed() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let url = nats.url();
    // Provision only: nothing consumes, so the message is neither projected nor dead-lettered.
    let (ok, _, err) = run_bin(&["provision", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{err}");
    publish(
        &js,
        "collab.raw.t1.task.created",
        r#"{"type":"task.created"}"#,
    )
    .await;
    let (ok, out, _) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(!ok, "audit must fail: {out}");
    assert!(
        out.contains("neither (lost, or not processed yet): 1"),
        "{out}"
    );
}

#[tokio::test]
async fn workers_answer_the_nats_service_api() {
    let nats = TestNats::start().await;
    let client = nats.client().await;
    let projector = start_projector(&nats.url(), &[], &[]).await;
    let reply = client
        .request("$SRV.PING.collab-projector", "".into())
        .await
        .expect("a worker answers $SRV.PING");
    let ping: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(ping["name"], "collab-projector");
    assert_eq!(ping["version"], env!("CARGO_PKG_VERSION"));
    let partitions = default_partitions();
    wait_until(GUARD, "the worker owns every partition", || {
        let client = client.clone();
        async move {
            match client.request("collab-projector.status", "".into()).await {
                Ok(m) => serde_json::from_slice::<serde_json::Value>(&m.payload)
                    .map(|v| {
                        v["partitionsOwned"] == partitions && v["partitionsRunning"] == partitions
                    })
                    .unwrap_or(false),
                Err(_) => false,
            }
        }
    })
    .await;
    drop(projector);
}

// ---------------------------------------------------------------------------------------------
// `status`, and the operator's files: alert rules, dashboard, docs/operations.md
// ---------------------------------------------------------------------------------------------

/// A worker in this process, named `id`, without HTTP.
async fn start_named_worker(
    url: &str,
    id: &str,
) -> (collab_projector::app::Running, CancellationToken) {
    let mut s = Settings::default();
    s.nats.url = url.to_string();
    s.http.enabled = false;
    s.workers.id = Some(id.to_string());
    crate::api::start_worker(&s).await
}

/// Every partition listed by exactly one worker, each worker ready and within its share.
fn settled(workers: &[WorkerStatus], ids: &[&str], partitions: u16) -> bool {
    let found: BTreeSet<&str> = workers.iter().map(|w| w.worker_id.as_str()).collect();
    let listed: usize = workers.iter().map(|w| w.partitions.len()).sum();
    let share = usize::from(partitions).div_ceil(ids.len());
    found == ids.iter().copied().collect()
        && workers.len() == ids.len()
        && status::unowned(workers, partitions).is_empty()
        && listed == usize::from(partitions)
        && workers
            .iter()
            .all(|w| w.ready && w.partitions.len() <= share)
}

#[tokio::test]
async fn status_finds_every_worker_and_their_partitions_cover_the_stream() {
    let nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let client = nats.client().await;
    let partitions = Settings::default().nats.partitions;

    // Before any worker runs, every partition is unowned and the view says so.
    let (ok, out, err) = run_bin(&["status", "--once", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("0 workers answered"), "{out}");
    assert!(
        out.contains(&format!("unowned: 0-{}", partitions - 1)),
        "{out}"
    );
    assert!(out.contains("warning: no worker answered"), "{out}");

    let (a, cancel_a) = start_named_worker(&url, "status-a").await;
    let (b, cancel_b) = start_named_worker(&url, "status-b").await;
    for n in 0..3 {
        publish(
            &js,
            &format!("collab.raw.t{n}.task.created"),
            format!(r#"{{"type":"task.created","taskId":"t{n}"}}"#),
        )
        .await;
    }

    // The collection: one reply per worker, the two together own every partition once, and
    // their counters account for the three inputs.
    let ids = ["status-a", "status-b"];
    wait_until(
        GUARD,
        "status sees both workers own every partition once",
        || {
            let client = client.clone();
            async move {
                let workers = status::collect(&client, Duration::from_millis(500))
                    .await
                    .expect("collecting");
                settled(&workers, &ids, partitions)
                    && workers.iter().map(|w| w.inputs).sum::<u64>() == 3
                    && workers.iter().all(|w| w.storage.len() == 7)
                    && workers.iter().any(|w| {
                        w.session_fold
                            .is_some_and(|f| f.behind == 0 && f.position >= 3)
                    })
            }
        },
    )
    .await;
    let workers = status::collect(&client, Duration::from_millis(500))
        .await
        .expect("collecting");
    // The work-session fold is reported by the owner of partition 0, and by no other worker.
    let folding: Vec<String> = workers
        .iter()
        .filter(|w| w.session_fold.is_some())
        .map(|w| w.worker_id.clone())
        .collect();
    let owner_of_0: Vec<String> = workers
        .iter()
        .filter(|w| w.partitions.iter().any(|p| p.partition == 0))
        .map(|w| w.worker_id.clone())
        .collect();
    assert_eq!(folding, owner_of_0, "{workers:?}");
    // Each worker reports every stream of the deployment with the limit the server holds.
    let limits = Settings::default().storage;
    for w in &workers {
        let limit_of = |stream: &str| {
            w.storage
                .iter()
                .find(|f| f.stream == stream)
                .and_then(|f| f.limit)
        };
        assert_eq!(limit_of("COLLAB_RAW"), Some(limits.raw_max_bytes as u64));
        assert_eq!(limit_of("COLLAB_PROJ"), Some(limits.proj_max_bytes as u64));
        assert_eq!(
            limit_of("KV_collab_turns"),
            Some(limits.turns_max_bytes as u64)
        );
        assert_eq!(
            limit_of("OBJ_collab_blobs"),
            Some(limits.blobs_max_bytes as u64)
        );
    }
    let view = status::render(
        None,
        &status::Snapshot { at_ms: 0, workers },
        &status::ViewOptions {
            partitions,
            ..Default::default()
        },
    );
    assert!(
        view.contains("status-a") && view.contains("status-b"),
        "{view}"
    );
    assert!(
        view.contains(&format!("{partitions}/{partitions} owned")),
        "{view}"
    );
    assert!(!view.contains("unowned"), "{view}");

    // The command, as a script runs it: one snapshot naming both workers.
    let (ok, out, err) = run_bin(&["status", "--once", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("2 workers answered"), "{out}");
    for id in ids {
        assert!(
            out.lines().any(|l| l.starts_with(id)),
            "a row for {id}: {out}"
        );
    }
    assert!(out.contains("TOTAL (2 workers)"), "{out}");
    assert!(!out.contains("unowned"), "{out}");
    assert!(
        out.contains(&format!(
            "work sessions: folded by {} to projection ",
            owner_of_0[0]
        )),
        "{out}"
    );
    let (ok, out, err) = run_bin(
        &["status", "--once", "--json", "--nats-url", &url],
        &[],
        b"",
    )
    .await;
    assert!(ok, "{out}\n{err}");
    let reports: Vec<WorkerStatus> = serde_json::from_str(out.trim()).expect("a JSON array");
    let found: BTreeSet<&str> = reports.iter().map(|w| w.worker_id.as_str()).collect();
    assert_eq!(found, ids.iter().copied().collect());

    cancel_a.cancel();
    cancel_b.cancel();
    a.wait().await;
    b.wait().await;
}

fn repo_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

/// The metric names an expression mentions.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let name = regex::Regex::new(r"\bcollab_[a-z0-9_]*[a-z0-9]\b").expect("a valid pattern");
    name.find_iter(expr)
        .map(|m| m.as_str().to_string())
        .collect()
}

/// A name is a family, or a histogram family's `_bucket`, `_sum` or `_count` series.
fn is_family_series(name: &str) -> bool {
    FAMILIES.iter().any(|&(family, kind, _)| {
        name == family
            || (matches!(kind, Family::Histogram(_))
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(family)))
    })
}

fn family_of(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s).filter(|base| is_family_series(base)))
        .unwrap_or(name)
}

const RULES: &str = "config/prometheus/collab-projector.rules.yml";
const DASHBOARD: &str = "config/grafana/collab-projector.json";
const OPERATIONS: &str = "docs/operations.md";

/// How to get promtool, for the failure that says it is missing.
const PROMTOOL_HINT: &str = "promtool is not on PATH: these tests check the alert rules and the \
     dashboard's queries with it. Install it with `apt-get install prometheus` (Debian/Ubuntu; \
     .ci/run does this), or take `promtool` from a release archive at \
     https://github.com/prometheus/prometheus/releases and put it on PATH";

/// promtool from PATH; the test fails, saying how to install it, when there is none: a check
/// that silently did not run would pass green.
fn promtool() -> std::path::PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("promtool"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| panic!("{PROMTOOL_HINT}"))
}

fn run_promtool(args: &[&str], dir: &std::path::Path) -> (bool, String) {
    let tool = promtool();
    let out = std::process::Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[derive(serde::Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(serde::Deserialize)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    for_: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

fn alert_rules() -> Vec<Rule> {
    let file: RuleFile = serde_norway::from_str(&repo_file(RULES)).expect("the rules are YAML");
    assert!(!file.groups.is_empty());
    file.groups
        .into_iter()
        .inspect(|g| assert!(!g.name.is_empty()))
        .flat_map(|g| g.rules)
        .collect()
}

/// Every expression of every panel (rows' nested panels included), with the panel's title.
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(panels: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push((title.clone(), expr.to_string()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

#[test]
fn alert_rules_are_well_formed_and_name_only_metric_families() {
    let rules = alert_rules();
    let mut names = BTreeSet::new();
    for r in &rules {
        assert!(names.insert(r.alert.as_str()), "{} listed twice", r.alert);
        assert!(
            r.alert.starts_with("CollabProjector"),
            "{}: alerts are named CollabProjector*",
            r.alert
        );
        assert!(
            matches!(
                r.labels.get("severity").map(String::as_str),
                Some("warning" | "critical")
            ),
            "{}: severity warning or critical",
            r.alert
        );
        for key in ["summary", "description"] {
            assert!(
                r.annotations.get(key).is_some_and(|v| !v.trim().is_empty()),
                "{}: annotation {key}",
                r.alert
            );
        }
        if let Some(f) = &r.for_ {
            humantime::parse_duration(f).unwrap_or_else(|e| panic!("{}: for {f}: {e}", r.alert));
        }
        let used = metric_names(&r.expr);
        assert!(!used.is_empty(), "{}: uses no collab_ metric", r.alert);
        for m in used {
            assert!(
                is_family_series(&m),
                "{}: {m} is not a metric family in telemetry::FAMILIES",
                r.alert
            );
        }
    }
    // The partition count is written into one rule: it must be the default, stated in its label.
    let default = Settings::default().nats.partitions.to_string();
    let unowned = rules
        .iter()
        .find(|r| r.alert == "CollabProjectorPartitionsUnowned")
        .expect("the unowned-partitions alert");
    assert_eq!(unowned.labels.get("partitions"), Some(&default));
    assert!(
        unowned.expr.contains(&format!("< {default}")),
        "{}",
        unowned.expr
    );
    // What the issue asks the rules to watch.
    for family in [
        "collab_partition_pending_messages",
        "collab_partition_oldest_pending_age_seconds",
        "collab_dead_letters_total",
        "collab_turn_outcomes_total",
        "collab_partitions_owned",
        "collab_ready",
        "collab_last_processed_age_seconds",
        "collab_lease_losses_total",
    ] {
        assert!(
            rules.iter().any(|r| metric_names(&r.expr).contains(family)),
            "no rule watches {family}"
        );
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (ok, out) = run_promtool(&["check", "rules", RULES], dir);
    assert!(ok, "promtool check rules: {out}");
}

/// What the alerts do, on synthetic series (promtool's rule unit tests; annotations are left out
/// of the comparison). Needs promtool (Debian package `prometheus`).
#[test]
fn alert_rules_fire_on_the_conditions_they_describe() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut rules: serde_norway::Value =
        serde_norway::from_str(&repo_file(RULES)).expect("the rules are YAML");
    for group in rules["groups"].as_sequence_mut().expect("groups") {
        for rule in group["rules"].as_sequence_mut().expect("rules") {
            if let Some(map) = rule.as_mapping_mut() {
                map.remove("annotations");
            }
        }
    }
    std::fs::write(
        dir.path().join("rules.yml"),
        serde_norway::to_string(&rules).expect("YAML"),
    )
    .expect("writing the rules");
    std::fs::write(dir.path().join("tests.yml"), ALERT_TESTS).expect("writing the tests");
    let (ok, out) = run_promtool(&["test", "rules", "tests.yml"], dir.path());
    assert!(ok, "promtool test rules:\n{out}");
}

const ALERT_TESTS: &str = r#"
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  # Projections gone from the stream before the work-session fold read them.
  - interval: 1m
    input_series:
      - series: 'collab_session_fold_skipped_total{instance="a"}'
        values: '0x5 40x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: CollabProjectorSessionsSkipped
        exp_alerts: []
      - eval_time: 8m
        alertname: CollabProjectorSessionsSkipped
        exp_alerts:
          - exp_labels: {severity: warning}
  # Projections the work-session fold could not read.
  - interval: 1m
    input_series:
      - series: 'collab_session_fold_unreadable_total{instance="a"}'
        values: '0x5 3x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: CollabProjectorSessionsUnreadable
        exp_alerts: []
      - eval_time: 8m
        alertname: CollabProjectorSessionsUnreadable
        exp_alerts:
          - exp_labels: {severity: warning}
  # Two workers with 8 partitions each; one stops owning any after 3 minutes.
  - interval: 1m
    input_series:
      - series: 'collab_partitions_owned{instance="a"}'
        values: '8x20'
      - series: 'collab_partitions_owned{instance="b"}'
        values: '8 8 8 0x17'
    alert_rule_test:
      - eval_time: 2m
        alertname: CollabProjectorPartitionsUnowned
        exp_alerts: []
      - eval_time: 10m
        alertname: CollabProjectorPartitionsUnowned
        exp_alerts:
          - exp_labels: {severity: critical, partitions: "16"}
  # No worker reports at all: every partition is unowned.
  - interval: 1m
    input_series:
      - series: 'up{job="collab-projector"}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 5m
        alertname: CollabProjectorPartitionsUnowned
        exp_alerts:
          - exp_labels: {severity: critical, partitions: "16"}
  # Readiness lost for longer than two minutes.
  - interval: 1m
    input_series:
      - series: 'collab_ready{instance="a"}'
        values: '1 1 0x10'
      - series: 'collab_ready{instance="b"}'
        values: '1x12'
    alert_rule_test:
      - eval_time: 3m
        alertname: CollabProjectorNotReady
        exp_alerts: []
      - eval_time: 6m
        alertname: CollabProjectorNotReady
        exp_alerts:
          - exp_labels: {severity: warning, instance: a}
  # Half the turns time out (6 a minute): spiking. Half of few turns (one every two minutes): not.
  - interval: 1m
    input_series:
      - series: 'collab_turn_outcomes_total{outcome="blocked",reason="timeout",instance="a"}'
        values: '0+6x40'
      - series: 'collab_turn_outcomes_total{outcome="response",instance="a"}'
        values: '0+6x40'
    alert_rule_test:
      - eval_time: 30m
        alertname: CollabProjectorTimeoutsSpiking
        exp_alerts:
          - exp_labels: {severity: warning}
  - interval: 1m
    input_series:
      - series: 'collab_turn_outcomes_total{outcome="blocked",reason="timeout",instance="a"}'
        values: '0+0.5x40'
      - series: 'collab_turn_outcomes_total{outcome="response",instance="a"}'
        values: '0+0.5x40'
    alert_rule_test:
      - eval_time: 30m
        alertname: CollabProjectorTimeoutsSpiking
        exp_alerts: []
  # Worker a has pending messages and stopped processing; b is merely idle.
  - interval: 1m
    input_series:
      - series: 'collab_last_processed_age_seconds{instance="a"}'
        values: '0+60x10'
      - series: 'collab_partition_pending_messages{instance="a",partition="3"}'
        values: '5x10'
      - series: 'collab_last_processed_age_seconds{instance="b"}'
        values: '0+60x10'
      - series: 'collab_partition_pending_messages{instance="b",partition="4"}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 6m
        alertname: CollabProjectorNoProgress
        exp_alerts:
          - exp_labels: {severity: critical, instance: a}
  # Partition 1's backlog grows; partition 2's is large but shrinking.
  - interval: 1m
    input_series:
      - series: 'collab_partition_pending_messages{instance="a",partition="1"}'
        values: '0+200x30'
      - series: 'collab_partition_pending_messages{instance="a",partition="2"}'
        values: '9000-100x30'
    alert_rule_test:
      - eval_time: 25m
        alertname: CollabProjectorLagGrowing
        exp_alerts:
          - exp_labels: {severity: warning, partition: "1"}
  # A partition's oldest message stays over 30 s.
  - interval: 1m
    input_series:
      - series: 'collab_partition_oldest_pending_age_seconds{instance="a",partition="5"}'
        values: '0 45x10'
      - series: 'collab_partition_oldest_pending_age_seconds{instance="a",partition="6"}'
        values: '2x11'
    alert_rule_test:
      - eval_time: 8m
        alertname: CollabProjectorOldestPendingAgeHigh
        exp_alerts:
          - exp_labels: {severity: warning, partition: "5"}
  # One input in ten is dead-lettered; then a max_deliver dead letter.
  - interval: 1m
    input_series:
      - series: 'collab_inputs_total{outcome="projected",instance="a"}'
        values: '0+90x30'
      - series: 'collab_inputs_total{outcome="dead_lettered",instance="a"}'
        values: '0+10x30'
      - series: 'collab_dead_letters_total{reason="bad_json",instance="a"}'
        values: '0+10x30'
      - series: 'collab_dead_letters_total{reason="max_deliver",instance="a"}'
        values: '0x20 1x10'
    alert_rule_test:
      - eval_time: 25m
        alertname: CollabProjectorDeadLettersRising
        exp_alerts:
          - exp_labels: {severity: warning}
      - eval_time: 15m
        alertname: CollabProjectorPoisonMessages
        exp_alerts: []
      - eval_time: 22m
        alertname: CollabProjectorPoisonMessages
        exp_alerts:
          - exp_labels: {severity: warning}
  # Three lease losses in 15 minutes are normal churn; six are not.
  - interval: 1m
    input_series:
      - series: 'collab_lease_losses_total{instance="a"}'
        values: '0 0 0 2 2 2 6x10'
      - series: 'collab_lease_losses_total{instance="b"}'
        values: '0 1 1 1 2 2 2x10'
    alert_rule_test:
      - eval_time: 10m
        alertname: CollabProjectorLeaseLossesFrequent
        exp_alerts:
          - exp_labels: {severity: warning, instance: a}
  # The fold stops moving after 2 minutes with 50 projections left; a worker that does not fold
  # reports 0. The alert needs 10 minutes without a move, then 10 more.
  - interval: 1m
    input_series:
      - series: 'collab_session_fold_behind{instance="a"}'
        values: '0 0 50x40'
      - series: 'collab_session_fold_position{instance="a"}'
        values: '900 950 1000x40'
      - series: 'collab_session_fold_behind{instance="b"}'
        values: '0x42'
    alert_rule_test:
      - eval_time: 15m
        alertname: CollabProjectorSessionsBehind
        exp_alerts: []
      - eval_time: 25m
        alertname: CollabProjectorSessionsBehind
        exp_alerts:
          - exp_labels: {severity: warning}
  # Far behind though moving: it does not keep up. Behind by rounds and moving: it does.
  - interval: 1m
    input_series:
      - series: 'collab_session_fold_behind{instance="a"}'
        values: '200000x30'
      - series: 'collab_session_fold_position{instance="a"}'
        values: '0+5000x30'
    alert_rule_test:
      - eval_time: 5m
        alertname: CollabProjectorSessionsBehind
        exp_alerts: []
      - eval_time: 15m
        alertname: CollabProjectorSessionsBehind
        exp_alerts:
          - exp_labels: {severity: warning}
  - interval: 1m
    input_series:
      - series: 'collab_session_fold_behind{instance="a"}'
        values: '30000x30'
      - series: 'collab_session_fold_position{instance="a"}'
        values: '0+5000x30'
    alert_rule_test:
      - eval_time: 25m
        alertname: CollabProjectorSessionsBehind
        exp_alerts: []
  # The raw stream climbs past 85 % of its limit and stays; the projection stream stays at half.
  # Two workers report the same streams: one alert per stream.
  - interval: 1m
    input_series:
      - series: 'collab_storage_bytes{instance="a",stream="COLLAB_RAW"}'
        values: '800+10x30'
      - series: 'collab_storage_bytes{instance="b",stream="COLLAB_RAW"}'
        values: '800+10x30'
      - series: 'collab_storage_limit_bytes{instance="a",stream="COLLAB_RAW"}'
        values: '1000x30'
      - series: 'collab_storage_limit_bytes{instance="b",stream="COLLAB_RAW"}'
        values: '1000x30'
      - series: 'collab_storage_bytes{instance="a",stream="COLLAB_PROJ"}'
        values: '500x30'
      - series: 'collab_storage_limit_bytes{instance="a",stream="COLLAB_PROJ"}'
        values: '1000x30'
      - series: 'collab_storage_bytes{instance="a",stream="COLLAB_DLQ"}'
        values: '5000x30'
    alert_rule_test:
      - eval_time: 12m
        alertname: CollabProjectorStorageFilling
        exp_alerts: []
      - eval_time: 20m
        alertname: CollabProjectorStorageFilling
        exp_alerts:
          - exp_labels: {severity: warning, stream: COLLAB_RAW}
  # A count limit set on the projection stream by hand: one alert, whichever workers report it;
  # none while every count limit is 0 (unset), and none once it is taken away.
  - interval: 1m
    input_series:
      - series: 'collab_storage_count_limit{instance="a",stream="COLLAB_PROJ",kind="max_msgs"}'
        values: '0 0 5000x10 0x10'
      - series: 'collab_storage_count_limit{instance="b",stream="COLLAB_PROJ",kind="max_msgs"}'
        values: '0 0 5000x10 0x10'
      - series: 'collab_storage_count_limit{instance="a",stream="COLLAB_RAW",kind="max_msgs_per_subject"}'
        values: '0x22'
    alert_rule_test:
      - eval_time: 2m
        alertname: CollabProjectorStreamCountLimit
        exp_alerts: []
      - eval_time: 9m
        alertname: CollabProjectorStreamCountLimit
        exp_alerts:
          - exp_labels: {severity: critical, stream: COLLAB_PROJ, kind: max_msgs}
      - eval_time: 20m
        alertname: CollabProjectorStreamCountLimit
        exp_alerts: []
"#;

#[test]
fn the_dashboard_charts_every_metric_family_and_only_those() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file(DASHBOARD)).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "collab-projector");
    let vars: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("template variables")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        vars.contains(&"datasource") && vars.contains(&"job"),
        "{vars:?}"
    );
    let mut ids = BTreeSet::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        assert!(ids.insert(p["id"].as_u64().expect("a panel id")), "{p}");
        let pos = &p["gridPos"];
        let (x, w) = (pos["x"].as_u64(), pos["w"].as_u64());
        assert!(
            matches!((x, w), (Some(x), Some(w)) if w > 0 && x + w <= 24),
            "panel {} lies within the 24-column grid",
            p["title"]
        );
        if p["type"] != "row" {
            assert!(p["datasource"]["uid"] == "${datasource}", "{}", p["title"]);
            assert!(
                p["targets"].as_array().is_some_and(|t| !t.is_empty()),
                "panel {} has a query",
                p["title"]
            );
        }
    }
    let exprs = dashboard_exprs(&dashboard);
    let mut charted = BTreeSet::new();
    for (title, expr) in &exprs {
        assert!(
            expr.contains("job=~\"$job\""),
            "{title}: every query selects $job: {expr}"
        );
        for m in metric_names(expr) {
            assert!(
                is_family_series(&m),
                "{title}: {m} is not a metric family in telemetry::FAMILIES"
            );
            charted.insert(family_of(&m).to_string());
        }
    }
    for &(family, _, _) in FAMILIES {
        assert!(
            charted.contains(family),
            "the dashboard does not chart {family}"
        );
    }
    // The queries parse: each becomes a recording rule that promtool checks.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut yaml = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let concrete = expr.replace("$__rate_interval", "5m").replace("$job", ".*");
        yaml.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&concrete).expect("a JSON string is a YAML string")
        ));
    }
    std::fs::write(dir.path().join("dashboard.yml"), yaml).expect("writing");
    let (ok, out) = run_promtool(&["check", "rules", "dashboard.yml"], dir.path());
    assert!(ok, "the dashboard's queries: {out}");
}

#[test]
fn the_operations_guide_lists_every_metric_family_and_explains_every_alert() {
    let doc = repo_file(OPERATIONS);
    for &(family, _, _) in FAMILIES {
        assert!(
            doc.contains(&format!("| `{family}`")),
            "docs/operations.md has no table row for {family}"
        );
    }
    // And no metric that does not exist (the buckets and the crate share the prefix).
    // The guide's reprojection section names the resources of an example version `v2`.
    let version = collab_projector::config::Names::versioned("collab", "v2");
    let names = Settings::default().names();
    let buckets = [
        collab_projector::served::control_bucket(&names),
        names.turns_bucket,
        names.sessions_bucket,
        names.leases_bucket,
        names.blobs_store,
        version.turns_bucket,
        version.sessions_bucket,
        version.leases_bucket,
        version.blobs_store,
        version.prefix,
    ];
    for m in metric_names(&doc) {
        assert!(
            is_family_series(&m) || buckets.contains(&m) || m == "collab_projector",
            "docs/operations.md names {m}, which is not a metric family"
        );
    }
    for r in alert_rules() {
        assert!(
            doc.contains(&format!("`{}`", r.alert)),
            "docs/operations.md does not explain {}",
            r.alert
        );
    }
}
