//! What an SRE sees of a running worker, against a real nats-server and the real binary:
//! `/metrics` (every family with HELP and TYPE, moving with traffic), `/healthz`, `/readyz`, the
//! NATS service API's stats, and a crashed worker's partitions taken over before its leases
//! expire.

use std::collections::BTreeMap;

use collab_projector::telemetry::{self, WorkerStatus};
use serde_json::{json, Value};

use crate::pipeline::{
    count, publish, start_projector, task_update, wait_settled, GUARD, MAIN_AGENTS, PROJ,
};
use crate::support::{fill_bucket, purge_filled, wait_until, TestNats};

async fn get(addr: &str, path: &str) -> (u16, String) {
    let resp = reqwest::get(format!("http://{addr}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

/// Samples of the Prometheus text: `name{labels}` -> value.
pub fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of every series of `name` whose labels contain all of `labels` (`k="v"` pairs).
pub fn sum(samples: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    samples
        .iter()
        .filter(|(series, _)| {
            let (n, rest) = series.split_once('{').unwrap_or((series.as_str(), ""));
            n == name && labels.iter().all(|l| rest.contains(l))
        })
        .map(|(_, v)| v)
        .sum()
}

fn collab(t: &str, from: &str, to: &str, conv: &str, extra: Value) -> (String, Vec<u8>) {
    let mut data = json!({"fromAgent": from, "toAgent": to, "conversationId": conv});
    if let (Some(d), Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    let body = json!({"type": t, "agentId": from, "data": data});
    (
        format!("collab.raw.{conv}.{t}"),
        body.to_string().into_bytes(),
    )
}

#[tokio::test]
async fn metrics_health_and_service_stats_describe_a_running_worker() {
    let nats = TestNats::start().await;
    let projector = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let addr = projector.http_addr();
    let js = nats.jetstream().await;

    // An answered turn, a turn that times out, a task event and a message that is not JSON.
    let inputs = [
        collab(
            "a2a.send",
            "ruda",
            "eden",
            "c-ok",
            json!({"message": "ping"}),
        ),
        collab(
            "a2a.response",
            "eden",
            "ruda",
            "c-ok",
            json!({"message": "pong"}),
        ),
        collab(
            "a2a.send",
            "ruda",
            "eden",
            "c-late",
            json!({"message": "anyone?", "timeoutMs": 500}),
        ),
        (
            "collab.raw.t-1.task.updated".to_string(),
            json!({"type": "task.updated", "taskId": "t-1", "status": "running"})
                .to_string()
                .into_bytes(),
        ),
        (
            "collab.raw.x.task.updated".to_string(),
            b"{not json".to_vec(),
        ),
    ];
    for (subject, body) in &inputs {
        publish(&js, subject, body.clone()).await;
    }
    // Two sends, the reply, the synthesised timeout, the task event; one dead letter.
    wait_settled(&js, 5, 1).await;

    // Renewals and lag samples arrive on their own schedules: wait for them, not for a time.
    wait_until(
        GUARD,
        "a lease renewal and a lag sample in /metrics",
        || {
            let addr = addr.clone();
            async move {
                let text = get(&addr, "/metrics").await.1;
                let s = samples(&text);
                sum(&s, telemetry::LEASE_RENEWALS, &[]) > 0.0
                    && text.contains(&format!("{}{{partition=", telemetry::PARTITION_PENDING))
            }
        },
    )
    .await;
    // Each stream's size is sampled every 15 s: the raw and dead-letter streams' gauges come to
    // read what the streams hold now (nothing more arrives in either).
    let held = |name: &'static str| {
        let js = js.clone();
        async move {
            let mut st = js
                .get_stream(name)
                .await
                .unwrap_or_else(|e| panic!("stream {name}: {e}"));
            let info = st.info().await.unwrap_or_else(|e| panic!("{name}: {e}"));
            (info.state.bytes as f64, info.config.max_bytes as f64)
        }
    };
    let (raw_bytes, raw_limit) = held("COLLAB_RAW").await;
    let (dlq_bytes, dlq_limit) = held("COLLAB_DLQ").await;
    assert!(raw_bytes > 0.0 && dlq_bytes > 0.0);
    wait_until(GUARD, "the storage gauges sampled after the inputs", || {
        let addr = addr.clone();
        async move {
            let s = samples(&get(&addr, "/metrics").await.1);
            sum(&s, telemetry::STORAGE_BYTES, &["stream=\"COLLAB_RAW\""]) == raw_bytes
                && sum(&s, telemetry::STORAGE_BYTES, &["stream=\"COLLAB_DLQ\""]) == dlq_bytes
        }
    })
    .await;
    let s = samples(&get(&addr, "/metrics").await.1);
    let of = |name: &str, stream: &str| sum(&s, name, &[&format!("stream=\"{stream}\"")]);
    assert_eq!(of(telemetry::STORAGE_LIMIT, "COLLAB_RAW"), raw_limit);
    assert_eq!(of(telemetry::STORAGE_LIMIT, "COLLAB_DLQ"), dlq_limit);
    for stream in [
        "COLLAB_PROJ",
        "KV_collab_turns",
        "KV_collab_work_sessions",
        "KV_collab_leases",
        "OBJ_collab_blobs",
    ] {
        assert!(
            of(telemetry::STORAGE_LIMIT, stream) >= 1048576.0,
            "{stream}"
        );
    }
    assert!(of(telemetry::STORAGE_BYTES, "COLLAB_PROJ") > 0.0);

    let text = get(&addr, "/metrics").await.1;
    // The relay's families belong to `relay` processes (tests/it/relay.rs checks them there).
    let worker_families = telemetry::FAMILIES
        .iter()
        .filter(|(name, _, _)| !name.starts_with(telemetry::RELAY_FAMILY_PREFIX));
    for &(name, family, help) in worker_families {
        let kind = family.kind();
        assert!(
            text.contains(&format!("# HELP {name} {help}\n")),
            "{name} has no HELP line:\n{text}"
        );
        assert!(
            text.contains(&format!("# TYPE {name} {kind}\n")),
            "{name} has no TYPE {kind} line:\n{text}"
        );
    }
    let s = samples(&text);
    let partitions = 16.0;
    assert_eq!(
        sum(
            &s,
            telemetry::INPUTS,
            &[
                "outcome=\"projected\"",
                "role=\"conversation.main\"",
                "class=\"a2a\""
            ]
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        sum(
            &s,
            telemetry::INPUTS,
            &["outcome=\"projected\"", "class=\"task\""]
        ),
        1.0
    );
    assert_eq!(
        sum(&s, telemetry::DEAD_LETTERS, &["reason=\"bad_json\""]),
        1.0
    );
    assert_eq!(
        sum(&s, telemetry::DEAD_LETTERS, &["reason=\"too_large\""]),
        0.0
    );
    assert_eq!(
        sum(
            &s,
            telemetry::TURN_OUTCOMES,
            &["outcome=\"blocked\"", "reason=\"timeout\""]
        ),
        1.0
    );
    assert_eq!(
        sum(
            &s,
            telemetry::PROJECTED,
            &["role=\"conversation.main\"", "class=\"a2a\""]
        ),
        4.0
    );
    for histogram in [
        telemetry::END_TO_END,
        telemetry::PUBLISH_ACK,
        telemetry::BATCH_SIZE,
        telemetry::STATE_WRITE,
        telemetry::TIMEOUT_LATENESS,
    ] {
        assert!(
            sum(&s, &format!("{histogram}_count"), &[]) >= 1.0,
            "{histogram} recorded nothing:\n{text}"
        );
    }
    assert_eq!(sum(&s, telemetry::PARTITIONS_OWNED, &[]), partitions);
    assert_eq!(
        sum(&s, telemetry::TAKEOVERS, &["cause=\"free\""]),
        partitions
    );
    assert_eq!(sum(&s, telemetry::LEASE_LOSSES, &[]), 0.0);
    assert_eq!(sum(&s, telemetry::READY, &[]), 1.0);

    let (code, health) = get(&addr, "/healthz").await;
    assert_eq!(code, 200, "{health}");
    assert_eq!(
        serde_json::from_str::<Value>(&health).unwrap_or_default()["healthy"],
        true
    );
    let (code, ready) = get(&addr, "/readyz").await;
    assert_eq!(code, 200, "{ready}");

    // The service API carries the same figures: every worker answers $SRV.STATS. Lag is
    // sampled: wait for a sample taken after the drain.
    let client = nats.client().await;
    let stats = || async {
        let reply = client
            .request("$SRV.STATS.collab-projector", "".into())
            .await
            .expect("a $SRV.STATS reply");
        let stats: Value = serde_json::from_slice(&reply.payload).expect("JSON stats");
        serde_json::from_value::<WorkerStatus>(stats["endpoints"][0]["data"].clone())
            .expect("a WorkerStatus")
    };
    wait_until(GUARD, "a lag sample with nothing pending", || async {
        let status = stats().await;
        status.partitions.len() == 16 && status.partitions.iter().all(|p| p.pending == 0)
    })
    .await;
    let status = stats().await;
    assert!(status.ready && status.nats_connected && status.workers);
    assert_eq!(status.partitions_owned, 16);
    assert!(status
        .partitions
        .iter()
        .all(|p| p.oldest_pending_age_ms.is_none() && p.watermark_age_ms == Some(0)));
    assert_eq!(status.inputs, 5);
    assert_eq!(status.dead_lettered, 1);
    assert_eq!(status.takeovers, 16);
    assert!(status.last_processed_age_ms.is_some());
    assert!(!status.worker_id.is_empty());
}

/// A worker killed with SIGKILL loses its partitions once its connection is gone and its leases
/// have gone quiet for a third of the TTL (plus a pull's expiry), not when they expire: the
/// takeovers are counted as `owner_gone`, which only the presence probe gives.
#[tokio::test]
async fn a_crashed_workers_partitions_are_taken_before_its_leases_expire() {
    let nats = TestNats::start().await;
    let long_ttl = [("COLLAB_WORKERS__LEASE_TTL", "30s")];
    let mut first = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[long_ttl[0], ("COLLAB_WORKERS__ID", "first")],
    )
    .await;
    let first_addr = first.http_addr();
    wait_until(GUARD, "the first worker owns every partition", || {
        let addr = first_addr.clone();
        async move {
            let (_, body) = get(&addr, "/readyz").await;
            serde_json::from_str::<Value>(&body).unwrap_or_default()["partitionsOwned"] == 16
        }
    })
    .await;
    let second = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[long_ttl[0], ("COLLAB_WORKERS__ID", "second")],
    )
    .await;
    let second_addr = second.http_addr();
    let js = nats.jetstream().await;
    let (subject, body) = collab(
        "a2a.send",
        "ruda",
        "eden",
        "c-before",
        json!({"message": "1"}),
    );
    publish(&js, &subject, body).await;
    wait_settled(&js, 1, 0).await;

    first.kill9();
    wait_until(
        GUARD,
        "the second worker takes every partition from the dead one",
        || {
            let addr = second_addr.clone();
            async move {
                let s = samples(&get(&addr, "/metrics").await.1);
                sum(&s, telemetry::PARTITIONS_OWNED, &[]) == 16.0
            }
        },
    )
    .await;
    let s = samples(&get(&second_addr, "/metrics").await.1);
    assert_eq!(
        sum(&s, telemetry::TAKEOVERS, &["cause=\"owner_gone\""]),
        16.0,
        "{}",
        second.log_text()
    );
    assert!(
        second.log_text().contains("connection closed"),
        "{}",
        second.log_text()
    );

    // And it projects: input published after the crash, in every partition's reach.
    for i in 0..32 {
        let (subject, body) = collab(
            "a2a.send",
            "ruda",
            "eden",
            &format!("c-after-{i}"),
            json!({"message": "2"}),
        );
        publish(&js, &subject, body).await;
    }
    wait_settled(&js, 33, 0).await;
    assert_eq!(
        crate::support::outputs_in(&js, "COLLAB_PROJ").await,
        33,
        "each input projected once"
    );
}

/// The work-session fold reports what it has not folded yet: everything stored while it cannot
/// write a session (its bucket full), nothing once it has caught up. A first round that fails
/// and is read again from the checkpoint folds every projection: the fold's start is written
/// before its first round, so its own writes never make it look like an older version's bucket.
#[tokio::test]
async fn the_folds_backlog_is_reported_while_sessions_cannot_be_written_and_until_caught_up() {
    let nats = TestNats::start().await;
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[("COLLAB_STORAGE__SESSIONS_MAX_BYTES", "1048576")],
    )
    .await;
    let addr = projector.http_addr();
    let js = nats.jetstream().await;
    let bucket = js
        .get_key_value(
            collab_projector::config::Settings::default()
                .names()
                .sessions_bucket,
        )
        .await
        .unwrap_or_else(|e| panic!("the work-session bucket: {e}"));
    wait_until(GUARD, "the fold has written where it starts", || {
        let bucket = bucket.clone();
        async move {
            let key = collab_projector::bus::sessions::FOLD_KEY;
            matches!(bucket.get(key).await, Ok(Some(_)))
        }
    })
    .await;
    // No session can be written.
    let junk = fill_bucket(&bucket).await;

    let behind_and_position = || {
        let addr = addr.clone();
        async move {
            let s = samples(&get(&addr, "/metrics").await.1);
            (
                sum(&s, telemetry::SESSION_FOLD_BEHIND, &[]),
                sum(&s, telemetry::SESSION_FOLD_POSITION, &[]),
            )
        }
    };
    let last_projection = || {
        let js = js.clone();
        async move {
            let mut proj = js.get_stream("COLLAB_PROJ").await.expect("COLLAB_PROJ");
            proj.info().await.expect("its info").state.last_sequence as f64
        }
    };
    for i in 0..3 {
        let (subject, body) = collab(
            "a2a.send",
            "ruda",
            "eden",
            &format!("c-fold-{i}"),
            json!({"message": "hello", "workSessionId": format!("ws-{i}")}),
        );
        publish(&js, &subject, body).await;
    }
    wait_settled(&js, 3, 0).await;
    let stored = last_projection().await;
    assert!(stored >= 3.0);
    wait_until(
        GUARD,
        "the fold reports every stored projection as not folded",
        || async { behind_and_position().await == (stored, 0.0) },
    )
    .await;
    // The metrics say the same before the fold's first write is refused (a fold running late
    // on a busy machine); the refusal itself is what this part waits for.
    projector.wait_logged("maximum bytes exceeded", GUARD).await;
    assert_eq!(behind_and_position().await, (stored, 0.0));
    // The round gives up and the fold starts again from its checkpoint, still reporting it all.
    projector
        .wait_logged(
            "work-session fold failed; restarting from its checkpoint",
            GUARD,
        )
        .await;
    assert_eq!(behind_and_position().await, (stored, 0.0));

    // Room again: the fold writes the sessions and reports nothing left.
    purge_filled(&bucket, &junk).await;
    wait_until(GUARD, "the fold catches up", || async {
        behind_and_position().await == (0.0, last_projection().await)
    })
    .await;
    for i in 0..3 {
        let session = bucket
            .get(format!("ws-{i}"))
            .await
            .unwrap_or_else(|e| panic!("reading session ws-{i}: {e}"));
        assert!(session.is_some(), "session ws-{i} is written");
    }
}

/// A worker whose lease renewals come back later than the lease's validity allows (a slow
/// server or a loaded worker) pauses its partitions over each gap and goes on where it was once
/// the answer comes: no partition starts over (a restart reads its in-flight range again, and on
/// a server slow enough, each attempt could be cut short by the next late renewal), and every
/// input is projected once. TTL 3 s: validity 1 s from each renewal's request, a renewal every
/// 0.5 s; the hook takes each answer 0.6 s late, so a round ends 0.6 s after its request, the
/// next is asked a quarter of a second later (half the renewal period after a round that
/// overran it) and answered some 1.45 s after the first request: each validity runs out about
/// 0.45 s before the next answer, against the partition's wait of up to 1 s.
#[tokio::test]
async fn partitions_whose_lease_renewals_come_back_late_pause_and_go_on() {
    let nats = TestNats::start().await;
    let worker = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("COLLAB_WORKERS__LEASE_TTL", "3s"),
            ("COLLAB_TEST_LEASE_RENEWAL_ANSWER_LATE_MS", "600"),
        ],
    )
    .await;
    let js = nats.jetstream().await;
    let addr = worker.http_addr();
    let waited = || async {
        sum(
            &samples(&get(&addr, "/metrics").await.1),
            telemetry::LEASE_LAPSES_WAITED,
            &[],
        )
    };
    // Waves of inputs over every partition until partitions have paused mid-work a few times.
    let mut n = 0;
    let deadline = tokio::time::Instant::now() + GUARD;
    for wave in 0.. {
        for i in 0..48 {
            let (subject, body) = task_update(&format!("lapse-{}", i % 24), n);
            publish(&js, &subject, body).await;
            n += 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        if wave >= 12 && waited().await >= 5.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no partition paused for a late renewal within {GUARD:?}: {}",
            worker.log_text()
        );
    }
    let n = u64::try_from(n).unwrap_or(u64::MAX);
    wait_settled(&js, n, 0).await;
    assert_eq!(count(&js, PROJ).await, n, "one projection per input");
    let log = worker.log_text();
    assert!(
        !log.contains("the lease may have lapsed"),
        "a partition started over for a late renewal: {log}"
    );
    let s = samples(&get(&addr, "/metrics").await.1);
    assert_eq!(sum(&s, telemetry::LEASE_LOSSES, &[]), 0.0, "{log}");
    assert_eq!(sum(&s, telemetry::PARTITIONS_OWNED, &[]), 16.0, "{log}");
}

/// A lease renewal the server stored but whose answer never came (a timeout on a slow link) is
/// read back, not taken as lost: the worker keeps its partitions instead of stopping them and
/// leaving them unowned until the lease TTL passes. The test hook takes every third stored
/// renewal's answer as lost.
#[tokio::test]
async fn a_lease_renewal_stored_with_its_answer_lost_keeps_the_partition() {
    let nats = TestNats::start().await;
    let worker = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("COLLAB_WORKERS__LEASE_TTL", "3s"),
            ("COLLAB_TEST_LOSE_LEASE_RENEWAL_ANSWER_EVERY", "3"),
        ],
    )
    .await;
    let addr = worker.http_addr();
    // Six rounds of sixteen renewals: thirty-two of them stored with their answer lost.
    wait_until(GUARD, "six rounds of lease renewals", || {
        let addr = addr.clone();
        async move {
            let s = samples(&get(&addr, "/metrics").await.1);
            sum(&s, telemetry::LEASE_RENEWALS, &[]) >= 96.0
        }
    })
    .await;
    let s = samples(&get(&addr, "/metrics").await.1);
    assert_eq!(
        sum(&s, telemetry::LEASE_LOSSES, &[]),
        0.0,
        "{}",
        worker.log_text()
    );
    assert_eq!(sum(&s, telemetry::TAKEOVERS, &[]), 16.0);
    assert_eq!(sum(&s, telemetry::PARTITIONS_OWNED, &[]), 16.0);
    assert!(
        worker
            .log_text()
            .contains("a lease renewal whose answer was lost was stored"),
        "{}",
        worker.log_text()
    );
    // And the partitions work.
    let js = nats.jetstream().await;
    let (subject, body) = collab("a2a.send", "ruda", "eden", "c-1", json!({"message": "1"}));
    publish(&js, &subject, body).await;
    wait_settled(&js, 1, 0).await;
}

/// A worker whose renewals were stored with their answers lost, and not read back (the lease
/// bucket's leader did not answer), still hands its leases back at shutdown: the delete at the
/// revision it knows fails, so it reads each lease back and deletes the revision its own
/// renewal stored. None of its leases is left to the TTL (30 s here) for the next worker.
#[tokio::test]
async fn leases_renewed_with_their_answers_lost_are_still_handed_back_at_shutdown() {
    let nats = TestNats::start().await;
    let mut worker = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("COLLAB_WORKERS__LEASE_TTL", "30s"),
            ("COLLAB_WORKERS__ID", "lossy"),
            ("COLLAB_TEST_LOSE_LEASE_RENEWAL_ANSWER_EVERY", "1"),
            ("COLLAB_TEST_LEASE_READ_BACK_FAILS", "1"),
        ],
    )
    .await;
    wait_until(
        GUARD,
        "a round of renewals stored but not confirmed",
        || {
            let n = worker
                .log_text()
                .matches("lease renewal not confirmed")
                .count();
            async move { n >= 16 }
        },
    )
    .await;
    worker.stop_cleanly(GUARD).await;
    let js = nats.jetstream().await;
    let leases = js
        .get_key_value("collab_leases")
        .await
        .expect("the lease bucket");
    let mut held = Vec::new();
    for p in 0..16u16 {
        if let Ok(Some(v)) = leases.get(format!("l.{p}")).await {
            held.push((p, String::from_utf8_lossy(&v).into_owned()));
        }
    }
    assert!(
        held.is_empty(),
        "leases left to expire: {held:?}\n{}",
        worker.log_text()
    );
}

/// A lease bucket whose age is cut below the renewal period on the live server (`nats kv edit
/// --ttl`, `nats stream edit --max-age`) would drop every lease between two renewals, so the
/// partitions would change hands without a fault. The worker reads the bucket's age and renews
/// within it; a starting worker refuses the cut bucket, and the `provision` command gives the
/// bucket its age back (and refuses, run with another TTL than the worker's). TTL 12 s: a renewal every 2 s,
/// against an age cut to 1.5 s.
#[tokio::test]
async fn a_lease_bucket_whose_age_is_cut_on_the_server_is_renewed_within_it() {
    let nats = TestNats::start().await;
    let worker = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("COLLAB_WORKERS__LEASE_TTL", "12s"),
            ("COLLAB_WORKERS__ID", "aged"),
        ],
    )
    .await;
    let addr = worker.http_addr();
    let metric = |name: &'static str| {
        let addr = addr.clone();
        async move { sum(&samples(&get(&addr, "/metrics").await.1), name, &[]) }
    };
    wait_until(GUARD, "every partition owned", || async {
        metric(telemetry::PARTITIONS_OWNED).await == 16.0
    })
    .await;
    let js = nats.jetstream().await;
    let age = |js: async_nats::jetstream::Context| async move {
        let mut st = js
            .get_stream("KV_collab_leases")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        st.info()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .config
            .clone()
    };
    let mut config = age(js.clone()).await;
    assert_eq!(config.max_age, std::time::Duration::from_secs(12));
    config.max_age = std::time::Duration::from_millis(1500);
    config.duplicate_window = config.max_age;
    js.update_stream(&config)
        .await
        .unwrap_or_else(|e| panic!("the bucket's age is cut: {e}"));

    // Twelve renewal rounds of all sixteen leases in a row, none lost.
    let from = std::cell::Cell::new((
        metric(telemetry::LEASE_RENEWALS).await,
        metric(telemetry::LEASE_LOSSES).await,
    ));
    wait_until(
        GUARD,
        "twelve renewal rounds without a lease lost",
        || async {
            let renewals = metric(telemetry::LEASE_RENEWALS).await;
            let losses = metric(telemetry::LEASE_LOSSES).await;
            if losses > from.get().1 {
                from.set((renewals, losses));
            }
            renewals - from.get().0 >= 16.0 * 12.0
        },
    )
    .await;
    let log = worker.log_text();
    assert!(
        log.contains("the lease bucket keeps entries for less than workers.lease_ttl"),
        "{log}"
    );
    assert_eq!(metric(telemetry::PARTITIONS_OWNED).await, 16.0, "{log}");
    // And the partitions work.
    let (subject, body) = task_update("age-cut", 1);
    publish(&js, &subject, body).await;
    wait_settled(&js, 1, 0).await;
    assert_eq!(count(&js, PROJ).await, 1);

    // `provision` gives the bucket its age back, and the worker goes back to the TTL.
    let mut settings = collab_projector::config::Settings::default();
    settings.nats.url = nats.url();
    settings.workers.lease_ttl = std::time::Duration::from_secs(12);
    // A worker starting with the cut bucket refuses to change it (another TTL may be the
    // running workers'), and says how to give it back.
    let refused = collab_projector::bus::provision::provision(&js, &settings)
        .await
        .err()
        .unwrap_or_else(|| panic!("a starting worker must not change the lease bucket's age"));
    assert!(
        refused
            .to_string()
            .contains("`collab-projector provision` sets it"),
        "{refused}"
    );
    let restore = collab_projector::bus::provision::LeaseAge::Restore;
    // `provision` with another TTL than the running worker's refuses, naming the worker: workers
    // of two TTLs would wait out each other's leases by their own.
    let mut other = settings.clone();
    other.workers.lease_ttl = std::time::Duration::from_secs(20);
    let refused = collab_projector::bus::provision::provision_with(&js, &other, restore)
        .await
        .err()
        .unwrap_or_else(|| panic!("provision must not give running workers another lease TTL"));
    let refused = refused.to_string();
    assert!(
        refused.contains("worker aged runs with 12s")
            && refused.contains("this configuration's 20s"),
        "{refused}"
    );
    assert_eq!(
        age(js.clone()).await.max_age,
        std::time::Duration::from_millis(1500),
        "the refused provision left the bucket's age alone"
    );
    let report = collab_projector::bus::provision::provision_with(&js, &settings, restore)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    assert!(
        report
            .updated
            .iter()
            .any(|u| u.contains("bucket collab_leases") && u.contains("max_age")),
        "{:?}",
        report.updated
    );
    let config = age(js.clone()).await;
    assert_eq!(config.max_age, std::time::Duration::from_secs(12));
    wait_until(GUARD, "the worker goes back to the lease TTL", || async {
        worker
            .log_text()
            .contains("the lease bucket keeps entries for workers.lease_ttl again")
    })
    .await;
}

/// A count limit set by hand on a live stream (`nats stream edit --max-msgs`), which no setting
/// names, would make it refuse writes before its size limit with nothing to say why: the
/// workers name it in the log and in `collab_storage_count_limit`, and `provision` takes it away
/// (a bucket's history, its per-key limit, is left as it is).
#[tokio::test]
async fn a_count_limit_set_on_a_live_stream_is_reported_and_taken_away_by_provision() {
    let nats = TestNats::start().await;
    let worker = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let addr = worker.http_addr();
    let js = nats.jetstream().await;
    let config_of = |name: &'static str| {
        let js = js.clone();
        async move {
            let mut st = js.get_stream(name).await.unwrap_or_else(|e| panic!("{e}"));
            st.info()
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .config
                .clone()
        }
    };
    let mut proj = config_of("COLLAB_PROJ").await;
    proj.max_messages = 5000;
    proj.max_messages_per_subject = 2000;
    proj.discard_new_per_subject = true;
    js.update_stream(&proj)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut turns = config_of("KV_collab_turns").await;
    turns.max_messages = 100_000;
    js.update_stream(&turns)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let limit = |labels: &'static [&'static str]| {
        let addr = addr.clone();
        async move {
            let s = samples(&get(&addr, "/metrics").await.1);
            sum(&s, telemetry::STORAGE_COUNT_LIMIT, labels)
        }
    };
    let proj_msgs: &[&str] = &["stream=\"COLLAB_PROJ\"", "kind=\"max_msgs\""];
    let proj_subject: &[&str] = &["stream=\"COLLAB_PROJ\"", "kind=\"max_msgs_per_subject\""];
    let turns_msgs: &[&str] = &["stream=\"KV_collab_turns\"", "kind=\"max_msgs\""];
    let turns_subject: &[&str] = &[
        "stream=\"KV_collab_turns\"",
        "kind=\"max_msgs_per_subject\"",
    ];
    wait_until(GUARD, "the count limits sampled", || async {
        limit(proj_msgs).await == 5000.0 && limit(turns_msgs).await == 100_000.0
    })
    .await;
    assert_eq!(limit(proj_subject).await, 2000.0);
    // A bucket's per-key limit is its history, not a count limit.
    assert_eq!(limit(turns_subject).await, 0.0);
    let log = worker.log_text();
    for stream in ["stream=COLLAB_PROJ", "stream=KV_collab_turns"] {
        assert!(
            log.lines()
                .any(|l| l.contains("a count limit no setting names") && l.contains(stream)),
            "{stream}: {log}"
        );
    }

    let mut settings = collab_projector::config::Settings::default();
    settings.nats.url = nats.url();
    let report = collab_projector::bus::provision::provision(&js, &settings)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    let updated = report.updated.join("\n");
    assert!(
        updated.contains(
            "stream COLLAB_PROJ: max_msgs 5000 (wanted -1); max_msgs_per_subject 2000 (wanted -1); discard_new_per_subject true (wanted false)"
        ),
        "{updated}"
    );
    assert!(
        updated.contains("bucket collab_turns: max_msgs 100000 (wanted -1)"),
        "{updated}"
    );
    let proj = config_of("COLLAB_PROJ").await;
    assert_eq!(
        (
            proj.max_messages,
            proj.max_messages_per_subject,
            proj.discard_new_per_subject
        ),
        (-1, -1, false)
    );
    let turns = config_of("KV_collab_turns").await;
    assert_eq!(
        (turns.max_messages, turns.max_messages_per_subject),
        (-1, 1)
    );
    wait_until(GUARD, "no count limit sampled any more", || async {
        limit(proj_msgs).await == 0.0 && limit(turns_msgs).await == 0.0
    })
    .await;
    // Provisioning again changes nothing.
    let again = collab_projector::bus::provision::provision(&js, &settings)
        .await
        .unwrap_or_else(|e| panic!("provision again: {e}"));
    assert!(again.updated.is_empty(), "{:?}", again.updated);
}
