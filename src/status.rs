//! `collab-projector status`: a terminal view of a running fleet.
//!
//! [`collect`] sends one request to `$SRV.STATS.collab-projector` with a reply inbox of its own
//! and gathers every worker's answer for a short window (a plain request returns the first reply
//! only); each answer carries the worker's [`WorkerStatus`]. The rest is pure: [`render`] turns a
//! collection (and the one before it, for rates) into one row per worker, the fleet's totals, the
//! partitions no worker owns and warnings; [`watch`] refreshes that in place every interval.

use crate::telemetry::WorkerStatus;
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Every worker answers a request here with its service stats, its [`WorkerStatus`] as the
/// endpoints' `data`.
pub const STATS_SUBJECT: &str = "$SRV.STATS.collab-projector";

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("subscribing to a reply inbox: {0}")]
    Subscribe(String),
    #[error("sending the request to {STATS_SUBJECT}: {0}")]
    Request(String),
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
    #[error("encoding the reports as JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Read one `$SRV.STATS` reply: the first endpoint's `data` as a [`WorkerStatus`] (missing
/// fields take their defaults). A report without a worker id or a version takes the service
/// instance's id and version. `None` when the reply carries no such data.
pub fn parse_stats_reply(payload: &[u8]) -> Option<WorkerStatus> {
    let reply: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let data = reply
        .get("endpoints")?
        .as_array()?
        .iter()
        .find_map(|e| e.get("data").filter(|d| d.is_object()))?;
    let mut status: WorkerStatus = serde_json::from_value(data.clone()).ok()?;
    let field = |name: &str| {
        reply
            .get(name)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    if status.worker_id.is_empty() {
        status.worker_id = field("id");
    }
    if status.version.is_empty() {
        status.version = field("version");
    }
    Some(status)
}

/// Ask every worker for its status and gather the replies that arrive within `wait`, sorted by
/// worker id. Replies that carry no status are left out.
pub async fn collect(
    client: &async_nats::Client,
    wait: Duration,
) -> Result<Vec<WorkerStatus>, StatusError> {
    let inbox = client.new_inbox();
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| StatusError::Subscribe(e.to_string()))?;
    client
        .publish_with_reply(STATS_SUBJECT, inbox, bytes::Bytes::new())
        .await
        .map_err(|e| StatusError::Request(e.to_string()))?;
    client
        .flush()
        .await
        .map_err(|e| StatusError::Request(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut workers = Vec::new();
    while let Ok(Some(reply)) = tokio::time::timeout_at(deadline, replies.next()).await {
        match parse_stats_reply(&reply.payload) {
            Some(status) => workers.push(status),
            None => tracing::debug!(
                bytes = reply.payload.len(),
                "a reply to {STATS_SUBJECT} carried no worker status"
            ),
        }
    }
    let _ = replies.unsubscribe().await;
    workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
    Ok(workers)
}

/// One collection, stamped on a monotonic clock (milliseconds from any fixed origin), so two of
/// them give rates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub at_ms: u64,
    pub workers: Vec<WorkerStatus>,
}

/// A worker's counters' growth per second between two snapshots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub inputs: f64,
    pub projected: f64,
}

/// Rates per worker id between `prev` and `cur`: only for workers in both, once each (an id two
/// processes answer with is left out), whose counters did not go back (a restart resets them).
pub fn rates(prev: &Snapshot, cur: &Snapshot) -> BTreeMap<String, Rates> {
    let mut out = BTreeMap::new();
    let Some(elapsed_ms) = cur.at_ms.checked_sub(prev.at_ms).filter(|ms| *ms > 0) else {
        return out;
    };
    let secs = elapsed_ms as f64 / 1000.0;
    let before = unique_by_id(&prev.workers);
    for (id, now) in unique_by_id(&cur.workers) {
        let Some(then) = before.get(id) else { continue };
        if now.uptime_ms < then.uptime_ms
            || now.inputs < then.inputs
            || now.projected < then.projected
        {
            continue;
        }
        out.insert(
            id.to_string(),
            Rates {
                inputs: (now.inputs - then.inputs) as f64 / secs,
                projected: (now.projected - then.projected) as f64 / secs,
            },
        );
    }
    out
}

/// Workers by id, leaving out ids that more than one report carries.
fn unique_by_id(workers: &[WorkerStatus]) -> BTreeMap<&str, &WorkerStatus> {
    let mut seen: BTreeMap<&str, Option<&WorkerStatus>> = BTreeMap::new();
    for w in workers {
        seen.entry(w.worker_id.as_str())
            .and_modify(|slot| *slot = None)
            .or_insert(Some(w));
    }
    seen.into_iter()
        .filter_map(|(id, w)| w.map(|w| (id, w)))
        .collect()
}

/// Partition numbers as a short list: runs of three or more as ranges (`0-3,8`, `5,6`).
pub fn compact_partitions(partitions: impl IntoIterator<Item = u16>) -> String {
    let sorted: BTreeSet<u16> = partitions.into_iter().collect();
    let mut runs: Vec<(u16, u16)> = Vec::new();
    for p in sorted {
        match runs.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(p) => *end = p,
            _ => runs.push((p, p)),
        }
    }
    let mut parts = Vec::new();
    for (start, end) in runs {
        match end - start {
            0 => parts.push(start.to_string()),
            1 => {
                parts.push(start.to_string());
                parts.push(end.to_string());
            }
            _ => parts.push(format!("{start}-{end}")),
        }
    }
    parts.join(",")
}

/// The partitions `0..partitions` that no worker reports owning.
pub fn unowned(workers: &[WorkerStatus], partitions: u16) -> Vec<u16> {
    let owned: BTreeSet<u16> = workers
        .iter()
        .flat_map(|w| w.partitions.iter().map(|p| p.partition))
        .collect();
    (0..partitions).filter(|p| !owned.contains(p)).collect()
}

/// What the view needs besides the reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ViewOptions {
    /// `nats.partitions`: the raw stream's partition count.
    pub partitions: u16,
    /// A partition whose oldest pending message is older than this is a warning; so is a worker
    /// with pending messages that processed nothing for this long.
    pub pending_age_warn: Duration,
}

impl Default for ViewOptions {
    fn default() -> Self {
        ViewOptions {
            partitions: 16,
            pending_age_warn: Duration::from_secs(30),
        }
    }
}

/// The warnings a snapshot calls for, in a stable order: workers, then partitions.
pub fn warnings(workers: &[WorkerStatus], opts: &ViewOptions) -> Vec<String> {
    let mut out = Vec::new();
    if workers.is_empty() {
        out.push(format!(
            "no worker answered on {STATS_SUBJECT}: none is running, or this connection may not publish there"
        ));
        return out;
    }
    if !workers.iter().any(|w| w.workers) {
        out.push(
            "only API-only processes (run --no-workers) answered: no worker is running, nothing is projected"
                .to_string(),
        );
    }
    let limit_ms = opts.pending_age_warn.as_millis();
    let mut ids: BTreeMap<&str, usize> = BTreeMap::new();
    for w in workers {
        *ids.entry(w.worker_id.as_str()).or_default() += 1;
    }
    for (id, n) in &ids {
        if *n > 1 {
            out.push(format!(
                "{n} processes answer as worker {id}: give each its own workers.id"
            ));
        }
    }
    for w in workers {
        if !w.ready {
            let why = if !w.nats_connected {
                "not connected to NATS".to_string()
            } else if w.partitions_running < w.partitions_owned {
                format!(
                    "runs {} of the {} partitions it owns",
                    w.partitions_running, w.partitions_owned
                )
            } else {
                "not ready".to_string()
            };
            out.push(format!("worker {} is not ready: {why}", w.worker_id));
        }
        let pending = pending_total(w);
        if let Some(age) = w.last_processed_age_ms {
            if pending > 0 && u128::from(age) > limit_ms {
                out.push(format!(
                    "worker {} holds {pending} pending messages but processed nothing for {}",
                    w.worker_id,
                    age_text(age)
                ));
            }
        }
    }
    let mut owners: BTreeMap<u16, Vec<&str>> = BTreeMap::new();
    for w in workers {
        for p in &w.partitions {
            owners
                .entry(p.partition)
                .or_default()
                .push(w.worker_id.as_str());
            if p.partition >= opts.partitions {
                out.push(format!(
                    "worker {} reports partition {}, beyond nats.partitions = {} (is this the fleet's configuration?)",
                    w.worker_id, p.partition, opts.partitions
                ));
            }
        }
    }
    for (partition, who) in &owners {
        if who.len() > 1 {
            out.push(format!(
                "partition {partition} is reported by {} workers ({}): a handover in progress, or a stalled former owner",
                who.len(),
                who.join(", ")
            ));
        }
    }
    for w in workers {
        let mut parts: Vec<_> = w.partitions.iter().collect();
        parts.sort_by_key(|p| p.partition);
        for p in parts {
            if let Some(age) = p.oldest_pending_age_ms {
                if u128::from(age) > limit_ms {
                    out.push(format!(
                        "partition {} ({}): oldest pending message is {} old ({} pending)",
                        p.partition,
                        w.worker_id,
                        age_text(age),
                        p.pending
                    ));
                }
            }
        }
    }
    for w in workers {
        if let Some(f) = w.session_fold.filter(|f| f.behind > FOLD_BEHIND_WARN) {
            out.push(format!(
                "the work-session fold ({}) is {} projections behind: work sessions lag the projections (which never wait for it) and catch up when the load drops; give this worker a core to spare (docs/operations.md, \"Capacity planning\")",
                w.worker_id, f.behind
            ));
        }
    }
    out.extend(storage_warnings(workers));
    out
}

/// Projections the work-session fold may have left to read before `status` warns (the
/// threshold of `CollabProjectorSessionsBehind` in config/prometheus/collab-projector.rules.yml;
/// a unit test keeps the two equal).
pub const FOLD_BEHIND_WARN: u64 = 100_000;

/// A `work sessions:` line for each worker that reports the fold: one, or two while partition 0
/// changes hands.
fn fold_lines(workers: &[WorkerStatus]) -> Vec<String> {
    workers
        .iter()
        .filter_map(|w| {
            let f = w.session_fold?;
            Some(format!(
                "work sessions: folded by {} to projection {}, {} behind\n",
                w.worker_id, f.position, f.behind
            ))
        })
        .collect()
}

/// A stream holding this share of its limit is warned of (as `CollabProjectorStorageFilling`).
pub const STORAGE_WARN_AT: f64 = 0.85;

/// A warning per stream holding [`STORAGE_WARN_AT`] of its limit or more, by the fullest any
/// worker sampled it, in stream order; then one per stream any worker found a count limit on.
fn storage_warnings(workers: &[WorkerStatus]) -> Vec<String> {
    let mut fullest: BTreeMap<&str, &crate::telemetry::StreamFill> = BTreeMap::new();
    for fill in workers.iter().flat_map(|w| &w.storage) {
        let slot = fullest.entry(fill.stream.as_str()).or_insert(fill);
        if fill.ratio() > slot.ratio() {
            *slot = fill;
        }
    }
    let size = |b: u64| crate::bus::provision::Size(b).to_string();
    // A count limit as any worker sampled it (the fullest sample may predate it).
    let mut limited: BTreeMap<&str, &crate::telemetry::StreamFill> = BTreeMap::new();
    for fill in workers.iter().flat_map(|w| &w.storage) {
        if !fill.count_limits.is_empty() {
            limited.entry(fill.stream.as_str()).or_insert(fill);
        }
    }
    let counted = limited
        .into_values()
        .map(|f| {
            format!(
                "stream {} has a count limit no setting names ({}; it holds {} messages): once reached, max_msgs refuses writes before the size limit and max_msgs_per_subject drops a subject's oldest messages; run `provision` to take it away",
                f.stream,
                f.count_limits_text(),
                f.messages,
            )
        })
        .collect::<Vec<_>>();
    let full = fullest
        .into_values()
        .filter_map(|f| {
            let ratio = f.ratio().filter(|r| *r >= STORAGE_WARN_AT)?;
            let raw = f.stream.ends_with("_RAW") || f.stream.contains("_RAW_");
            let when_full = if raw {
                "when full, producers' publishes are refused"
            } else if f.stream.ends_with("_work_sessions") {
                "when full, the work-session fold stops and work sessions lag (projections go on)"
            } else {
                "when full, the partitions writing to it stop until there is room"
            };
            Some(format!(
                "stream {} holds {:.0} % of its limit ({} of {}): {when_full}; raise its storage.*_max_bytes setting and run `provision`, or make room",
                f.stream,
                (ratio * 100.0).floor(),
                size(f.bytes),
                size(f.limit.unwrap_or(0)),
            ))
        })
        .collect::<Vec<_>>();
    full.into_iter().chain(counted).collect()
}

fn pending_total(w: &WorkerStatus) -> u64 {
    w.partitions.iter().map(|p| p.pending).sum()
}

fn oldest_pending(w: &WorkerStatus) -> Option<u64> {
    w.partitions
        .iter()
        .filter_map(|p| p.oldest_pending_age_ms)
        .max()
}

/// A duration for people: `850ms`, `12.5s`, `4m05s`, `2h03m`, `3d04h`.
pub fn age_text(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{}.{}s", s, (ms % 1000) / 100),
        60_000..3_600_000 => format!("{}m{:02}s", s / 60, s % 60),
        3_600_000..86_400_000 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// A rate per second: one decimal below 10, none above.
pub fn rate_text(per_second: f64) -> String {
    if per_second < 10.0 {
        format!("{per_second:.1}")
    } else {
        format!("{per_second:.0}")
    }
}

const HEADERS: [&str; 11] = [
    "WORKER",
    "VERSION",
    "READY",
    "PARTITIONS",
    "PENDING",
    "OLDEST",
    "IN/S",
    "PROJ/S",
    "DEAD",
    "OPEN TURNS",
    "LAST",
];
/// Columns aligned right (numbers and ages).
const RIGHT: [bool; 11] = [
    false, false, false, false, true, true, true, true, true, true, true,
];

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

fn worker_row(w: &WorkerStatus, rate: Option<&Rates>) -> [String; 11] {
    let listed: Vec<u16> = w.partitions.iter().map(|p| p.partition).collect();
    let partitions = if !listed.is_empty() {
        compact_partitions(listed)
    } else if w.partitions_owned > 0 {
        format!("{} (unlisted)", w.partitions_owned)
    } else if !w.workers {
        "api only".to_string()
    } else {
        "-".to_string()
    };
    let dash = || "-".to_string();
    [
        w.worker_id.clone(),
        w.version.clone(),
        yes_no(w.ready).to_string(),
        partitions,
        pending_total(w).to_string(),
        oldest_pending(w).map_or_else(dash, age_text),
        rate.map_or_else(dash, |r| rate_text(r.inputs)),
        rate.map_or_else(dash, |r| rate_text(r.projected)),
        w.dead_lettered.to_string(),
        w.open_turns.to_string(),
        w.last_processed_age_ms.map_or_else(dash, age_text),
    ]
}

/// "2 workers", or "2 workers + 1 API-only" when processes without workers (`run
/// --no-workers`) answered too: those serve HTTP and are not counted as workers.
pub fn process_count(processes: &[WorkerStatus]) -> String {
    let workers = processes.iter().filter(|w| w.workers).count();
    let api_only = processes.len() - workers;
    let mut text = format!("{workers} worker{}", if workers == 1 { "" } else { "s" });
    if api_only > 0 {
        text.push_str(&format!(" + {api_only} API-only"));
    }
    text
}

fn totals_row(
    workers: &[WorkerStatus],
    rates: &BTreeMap<String, Rates>,
    partitions: u16,
) -> [String; 11] {
    let versions: BTreeSet<&str> = workers.iter().map(|w| w.version.as_str()).collect();
    let version = match versions.len() {
        0 => "-".to_string(),
        1 => versions
            .iter()
            .next()
            .copied()
            .unwrap_or_default()
            .to_string(),
        n => format!("{n} versions"),
    };
    let owned = usize::from(partitions) - unowned(workers, partitions).len();
    let dash = || "-".to_string();
    let running: Vec<&WorkerStatus> = workers.iter().filter(|w| w.workers).collect();
    let rate_sum = |f: fn(&Rates) -> f64| {
        if rates.is_empty() {
            dash()
        } else {
            rate_text(rates.values().map(f).sum())
        }
    };
    [
        format!("TOTAL ({})", process_count(workers)),
        version,
        format!(
            "{}/{}",
            running.iter().filter(|w| w.ready).count(),
            running.len()
        ),
        format!("{owned}/{partitions} owned"),
        workers.iter().map(pending_total).sum::<u64>().to_string(),
        workers
            .iter()
            .filter_map(oldest_pending)
            .max()
            .map_or_else(dash, age_text),
        rate_sum(|r| r.inputs),
        rate_sum(|r| r.projected),
        workers
            .iter()
            .map(|w| w.dead_lettered)
            .sum::<u64>()
            .to_string(),
        workers
            .iter()
            .map(|w| w.open_turns)
            .sum::<i64>()
            .to_string(),
        workers
            .iter()
            .filter_map(|w| w.last_processed_age_ms)
            .min()
            .map_or_else(dash, age_text),
    ]
}

fn table(rows: &[[String; 11]]) -> String {
    let mut widths = HEADERS.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String; 11]| {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            if RIGHT[i] {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                if i + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad));
                }
            }
        }
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(&HEADERS.map(String::from));
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

/// The view of `cur`: a row per worker (rates against `prev` when given, `-` otherwise), the
/// fleet's totals, `unowned: ...` when some partition has no owner, a `work sessions: ...` line
/// from the worker that runs the work-session fold, then one `warning:` line per warning.
pub fn render(prev: Option<&Snapshot>, cur: &Snapshot, opts: &ViewOptions) -> String {
    let rates = prev.map(|p| rates(p, cur)).unwrap_or_default();
    let mut rows: Vec<[String; 11]> = cur
        .workers
        .iter()
        .map(|w| worker_row(w, rates.get(&w.worker_id)))
        .collect();
    rows.push(totals_row(&cur.workers, &rates, opts.partitions));
    let mut out = table(&rows);
    let free = unowned(&cur.workers, opts.partitions);
    if !free.is_empty() {
        out.push_str(&format!("unowned: {}\n", compact_partitions(free)));
    }
    for line in fold_lines(&cur.workers) {
        out.push_str(&line);
    }
    for w in warnings(&cur.workers, opts) {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}

/// How `status` runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchOptions {
    /// Between the starts of two collections.
    pub interval: Duration,
    /// How long each collection gathers replies.
    pub wait: Duration,
    /// One snapshot, then return.
    pub once: bool,
    /// The collected reports as a JSON array (one line per snapshot) instead of the table.
    pub json: bool,
    pub view: ViewOptions,
}

/// Collect and print until `cancel` (or once). On a terminal each view replaces the previous one
/// in place; elsewhere views follow each other, separated by a blank line.
pub async fn watch(
    client: &async_nats::Client,
    opts: &WatchOptions,
    cancel: CancellationToken,
) -> Result<(), StatusError> {
    let in_place = !opts.once && !opts.json && std::io::stdout().is_terminal();
    let origin = std::time::Instant::now();
    let mut ticks = tokio::time::interval(opts.interval.max(opts.wait));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut prev: Option<Snapshot> = None;
    let mut first = true;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = ticks.tick() => {}
        }
        let at_ms = u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let workers = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            w = collect(client, opts.wait) => w?,
        };
        let cur = Snapshot { at_ms, workers };
        let frame = if opts.json {
            format!("{}\n", serde_json::to_string(&cur.workers)?)
        } else {
            let header = format!(
                "collab-projector status  {}  {} answered within {}{}\n\n",
                chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC"),
                process_count(&cur.workers),
                age_text(u64::try_from(opts.wait.as_millis()).unwrap_or(u64::MAX)),
                if opts.once {
                    String::new()
                } else {
                    format!(
                        ", every {}",
                        age_text(u64::try_from(opts.interval.as_millis()).unwrap_or(u64::MAX))
                    )
                },
            );
            header + &render(prev.as_ref(), &cur, &opts.view)
        };
        let mut out = std::io::stdout().lock();
        if in_place {
            // Home, each line cleared to its end, then everything below the view cleared: the
            // view is redrawn without a blank flash.
            if first {
                out.write_all(b"\x1b[2J")?;
            }
            out.write_all(b"\x1b[H")?;
            for line in frame.lines() {
                out.write_all(line.as_bytes())?;
                out.write_all(b"\x1b[K\n")?;
            }
            out.write_all(b"\x1b[J")?;
        } else {
            if !first && !opts.json {
                out.write_all(b"\n")?;
            }
            out.write_all(frame.as_bytes())?;
        }
        out.flush()?;
        drop(out);
        first = false;
        if opts.once {
            return Ok(());
        }
        prev = Some(cur);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::PartitionStatus;

    fn part(partition: u16, pending: u64, oldest_ms: Option<u64>) -> PartitionStatus {
        PartitionStatus {
            partition,
            pending,
            oldest_pending_age_ms: oldest_ms,
            ..Default::default()
        }
    }

    fn worker(id: &str, partitions: &[u16]) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            version: "0.1.0".into(),
            uptime_ms: 10_000,
            ready: true,
            nats_connected: true,
            workers: true,
            partitions_owned: partitions.len(),
            partitions_running: partitions.len(),
            partitions: partitions.iter().map(|p| part(*p, 0, None)).collect(),
            last_processed_age_ms: Some(200),
            ..Default::default()
        }
    }

    fn opts(partitions: u16) -> ViewOptions {
        ViewOptions {
            partitions,
            pending_age_warn: Duration::from_secs(30),
        }
    }

    #[test]
    fn compact_lists_use_ranges_for_runs_of_three_or_more() {
        assert_eq!(compact_partitions([0, 1, 2, 3, 8]), "0-3,8");
        assert_eq!(compact_partitions([6, 5]), "5,6");
        assert_eq!(compact_partitions([9, 1, 3, 2, 3, 12, 11, 10]), "1-3,9-12");
        assert_eq!(compact_partitions([7]), "7");
        assert_eq!(compact_partitions([]), "");
        assert_eq!(compact_partitions([u16::MAX - 1, u16::MAX]), "65534,65535");
    }

    #[test]
    fn unowned_partitions_are_those_no_worker_lists() {
        let ws = [worker("a", &[0, 1, 2, 3]), worker("b", &[4, 7])];
        assert_eq!(unowned(&ws, 8), vec![5, 6]);
        assert_eq!(unowned(&[], 3), vec![0, 1, 2]);
        assert!(unowned(&ws, 4).is_empty());
    }

    #[test]
    fn rates_are_counter_differences_per_second_and_skip_restarts() {
        let mut a0 = worker("a", &[0]);
        a0.inputs = 1_000;
        a0.projected = 900;
        let mut b0 = worker("b", &[1]);
        b0.inputs = 500;
        let prev = Snapshot {
            at_ms: 10_000,
            workers: vec![a0.clone(), b0.clone()],
        };
        let mut a1 = a0.clone();
        a1.uptime_ms += 2_000;
        a1.inputs = 5_000;
        a1.projected = 2_900;
        // b restarted: its counters start again from zero.
        let mut b1 = worker("b", &[1]);
        b1.uptime_ms = 500;
        b1.inputs = 10;
        let c1 = worker("c", &[2]);
        let cur = Snapshot {
            at_ms: 12_000,
            workers: vec![a1, b1, c1],
        };
        let r = rates(&prev, &cur);
        assert_eq!(
            r.get("a"),
            Some(&Rates {
                inputs: 2_000.0,
                projected: 1_000.0
            })
        );
        assert!(!r.contains_key("b"), "a restarted worker has no rate yet");
        assert!(!r.contains_key("c"), "a new worker has no rate yet");
        // No time between the two: no rate at all.
        assert!(rates(&cur, &cur).is_empty());
    }

    #[test]
    fn rates_skip_an_id_that_two_processes_answer_with() {
        let a = worker("a", &[0]);
        let prev = Snapshot {
            at_ms: 0,
            workers: vec![a.clone(), a.clone()],
        };
        let cur = Snapshot {
            at_ms: 1_000,
            workers: vec![a.clone(), a],
        };
        assert!(rates(&prev, &cur).is_empty());
    }

    #[test]
    fn ages_and_rates_read_well() {
        assert_eq!(age_text(0), "0ms");
        assert_eq!(age_text(850), "850ms");
        assert_eq!(age_text(12_540), "12.5s");
        assert_eq!(age_text(245_000), "4m05s");
        assert_eq!(age_text(7_380_000), "2h03m");
        assert_eq!(age_text(273_600_000), "3d04h");
        assert_eq!(rate_text(0.0), "0.0");
        assert_eq!(rate_text(7.25), "7.2");
        assert_eq!(rate_text(1520.4), "1520");
    }

    #[test]
    fn the_table_has_a_row_per_worker_totals_and_rates_from_the_previous_snapshot() {
        let mut a = worker("worker-a", &[0, 1, 2, 3, 8]);
        a.partitions[1] = part(1, 12, Some(1_500));
        a.inputs = 100;
        a.projected = 90;
        a.dead_lettered = 3;
        a.open_turns = 42;
        let mut b = worker("worker-b", &[4, 5, 6, 7]);
        b.last_processed_age_ms = None;
        b.inputs = 50;
        b.projected = 50;
        b.open_turns = 1;
        let prev = Snapshot {
            at_ms: 0,
            workers: vec![a.clone(), b.clone()],
        };
        a.inputs = 300;
        a.projected = 290;
        a.uptime_ms += 2_000;
        b.uptime_ms += 2_000;
        let cur = Snapshot {
            at_ms: 2_000,
            workers: vec![a, b],
        };
        let first = render(None, &cur, &opts(10));
        let expected_first = "\
WORKER             VERSION  READY  PARTITIONS  PENDING  OLDEST  IN/S  PROJ/S  DEAD  OPEN TURNS   LAST
worker-a           0.1.0    yes    0-3,8            12    1.5s     -       -     3          42  200ms
worker-b           0.1.0    yes    4-7               0       -     -       -     0           1      -
TOTAL (2 workers)  0.1.0    2/2    9/10 owned       12    1.5s     -       -     3          43  200ms
unowned: 9
";
        assert_eq!(first, expected_first, "\n{first}");
        let second = render(Some(&prev), &cur, &opts(9));
        let expected_second = "\
WORKER             VERSION  READY  PARTITIONS  PENDING  OLDEST  IN/S  PROJ/S  DEAD  OPEN TURNS   LAST
worker-a           0.1.0    yes    0-3,8            12    1.5s   100     100     3          42  200ms
worker-b           0.1.0    yes    4-7               0       -   0.0     0.0     0           1      -
TOTAL (2 workers)  0.1.0    2/2    9/9 owned        12    1.5s   100     100     3          43  200ms
";
        assert_eq!(second, expected_second, "\n{second}");
    }

    #[test]
    fn a_stream_near_its_limit_is_warned_of_once_by_its_fullest_sample() {
        let fill = |stream: &str, bytes: u64, limit: Option<u64>| crate::telemetry::StreamFill {
            stream: stream.into(),
            bytes,
            limit,
            ..Default::default()
        };
        let gib = 1u64 << 30;
        let mut a = worker("a", &[0]);
        a.storage = vec![
            fill("COLLAB_RAW", gib * 7 / 4, Some(2 * gib)),
            fill("COLLAB_PROJ", gib, Some(3 * gib)),
            fill("COLLAB_DLQ", 5 * gib, None),
        ];
        let mut b = worker("b", &[1]);
        // A later sample of the raw stream, and the session bucket nearly full.
        b.storage = vec![
            fill("COLLAB_RAW", gib * 15 / 8, Some(2 * gib)),
            fill("KV_collab_work_sessions", 250 << 20, Some(256 << 20)),
        ];
        let w = warnings(&[a.clone(), b], &opts(2));
        assert_eq!(
            w,
            [
                "stream COLLAB_RAW holds 93 % of its limit (1.9 GiB of 2 GiB): when full, producers' publishes are refused; raise its storage.*_max_bytes setting and run `provision`, or make room",
                "stream KV_collab_work_sessions holds 97 % of its limit (250 MiB of 256 MiB): when full, the work-session fold stops and work sessions lag (projections go on); raise its storage.*_max_bytes setting and run `provision`, or make room",
            ]
        );
        // Below 85 % nothing is said.
        a.storage = vec![fill("COLLAB_RAW", gib * 3 / 2, Some(2 * gib))];
        assert!(warnings(&[a.clone()], &opts(1)).is_empty());
        // A count limit set by hand is named however empty the stream is.
        a.storage.push(crate::telemetry::StreamFill {
            messages: 12,
            count_limits: vec![
                ("max_msgs".into(), 1000),
                ("max_msgs_per_subject".into(), 5),
            ],
            ..fill("COLLAB_PROJ", 4096, Some(gib))
        });
        assert_eq!(
            warnings(&[a], &opts(1)),
            ["stream COLLAB_PROJ has a count limit no setting names (max_msgs 1000, max_msgs_per_subject 5; it holds 12 messages): once reached, max_msgs refuses writes before the size limit and max_msgs_per_subject drops a subject's oldest messages; run `provision` to take it away"]
        );
    }

    /// `status` warns of the fold at the threshold the shipped alert rule uses: changing one
    /// without the other fails here.
    #[test]
    fn the_fold_warning_and_its_alert_rule_share_their_threshold() {
        let rules = include_str!("../config/prometheus/collab-projector.rules.yml");
        let rule = format!("max(collab_session_fold_behind) > {FOLD_BEHIND_WARN}\n");
        assert!(
            rules.contains(&rule),
            "the rules file has no `{}`",
            rule.trim_end()
        );
    }

    #[test]
    fn the_work_session_fold_is_shown_and_warned_of_past_its_threshold() {
        let mut a = worker("a", &[0]);
        let b = worker("b", &[1]);
        let view = |a: &WorkerStatus| {
            let cur = Snapshot {
                at_ms: 0,
                workers: vec![a.clone(), b.clone()],
            };
            render(None, &cur, &opts(2))
        };
        // No worker reports the fold (older versions, or partition 0 between owners): no line.
        assert!(!view(&a).contains("work sessions"), "{}", view(&a));
        a.session_fold = Some(crate::telemetry::FoldStatus {
            position: 1_200,
            behind: FOLD_BEHIND_WARN,
        });
        let shown = view(&a);
        assert!(
            shown.contains("work sessions: folded by a to projection 1200, 100000 behind\n"),
            "{shown}"
        );
        assert!(!shown.contains("warning"), "{shown}");
        a.session_fold = Some(crate::telemetry::FoldStatus {
            position: 1_200,
            behind: FOLD_BEHIND_WARN + 1,
        });
        assert_eq!(
            warnings(&[a.clone(), b.clone()], &opts(2)),
            ["the work-session fold (a) is 100001 projections behind: work sessions lag the projections (which never wait for it) and catch up when the load drops; give this worker a core to spare (docs/operations.md, \"Capacity planning\")"]
        );
        // A worker's reply without the field (an older version) reads as no fold.
        let mut old = serde_json::to_value(&b).expect("serialises");
        if let Some(o) = old.as_object_mut() {
            o.remove("sessionFold");
        }
        let parsed: WorkerStatus = serde_json::from_value(old).expect("parses");
        assert_eq!(parsed.session_fold, None);
        let with = serde_json::to_value(&a).expect("serialises");
        assert_eq!(
            with["sessionFold"],
            serde_json::json!({"position": 1200, "behind": 100001})
        );
    }

    #[test]
    fn warnings_name_unready_workers_stale_partitions_overlaps_and_stalls() {
        let mut a = worker("a", &[0, 1]);
        a.partitions[1] = part(1, 40, Some(45_000));
        a.ready = false;
        a.partitions_running = 1;
        a.last_processed_age_ms = Some(50_000);
        let mut b = worker("b", &[1, 2, 20]);
        b.ready = false;
        b.nats_connected = false;
        let c = worker("c", &[3]);
        let w = warnings(&[a, b, c], &opts(4));
        assert_eq!(
            w,
            vec![
                "worker a is not ready: runs 1 of the 2 partitions it owns".to_string(),
                "worker a holds 40 pending messages but processed nothing for 50.0s".to_string(),
                "worker b is not ready: not connected to NATS".to_string(),
                "worker b reports partition 20, beyond nats.partitions = 4 (is this the fleet's configuration?)".to_string(),
                "partition 1 is reported by 2 workers (a, b): a handover in progress, or a stalled former owner".to_string(),
                "partition 1 (a): oldest pending message is 45.0s old (40 pending)".to_string(),
            ]
        );
    }

    #[test]
    fn a_healthy_fleet_has_no_warning_and_an_empty_one_says_so() {
        let ws = [worker("a", &[0, 1]), worker("b", &[2, 3])];
        assert!(warnings(&ws, &opts(4)).is_empty());
        // Pending messages younger than the limit, recent processing: still fine.
        let mut busy = worker("a", &[0]);
        busy.partitions[0] = part(0, 500, Some(29_000));
        busy.last_processed_age_ms = Some(10);
        assert!(warnings(&[busy], &opts(1)).is_empty());
        let empty = render(
            None,
            &Snapshot {
                at_ms: 0,
                workers: vec![],
            },
            &opts(4),
        );
        assert!(empty.contains("TOTAL (0 workers)"), "{empty}");
        assert!(empty.contains("unowned: 0-3\n"), "{empty}");
        assert!(
            empty.contains("warning: no worker answered on $SRV.STATS.collab-projector"),
            "{empty}"
        );
    }

    #[test]
    fn an_api_only_process_is_not_counted_as_a_worker() {
        let mut api = worker("api", &[]);
        api.workers = false;
        let ws = vec![worker("a", &[0, 1]), api.clone()];
        assert_eq!(process_count(&ws), "1 worker + 1 API-only");
        let text = render(
            None,
            &Snapshot {
                at_ms: 0,
                workers: ws,
            },
            &opts(2),
        );
        assert!(text.contains("TOTAL (1 worker + 1 API-only)"), "{text}");
        assert!(text.contains(" 1/1 "), "{text}");
        let alone = warnings(&[api], &opts(2));
        assert!(
            alone.iter().any(|w| w.contains("no worker is running")),
            "{alone:?}"
        );
    }

    #[test]
    fn two_processes_with_one_id_are_a_warning() {
        let w = warnings(&[worker("a", &[0]), worker("a", &[1])], &opts(2));
        assert_eq!(
            w,
            vec!["2 processes answer as worker a: give each its own workers.id".to_string()]
        );
    }

    #[test]
    fn mixed_versions_and_api_only_instances_show_in_the_table() {
        let mut api = WorkerStatus {
            worker_id: "api-1".into(),
            version: "0.2.0".into(),
            ready: true,
            nats_connected: true,
            ..Default::default()
        };
        api.workers = false;
        let text = render(
            None,
            &Snapshot {
                at_ms: 0,
                workers: vec![api, worker("a", &[0])],
            },
            &opts(1),
        );
        assert!(text.contains("api only"), "{text}");
        assert!(text.contains("2 versions"), "{text}");
    }

    #[test]
    fn stats_replies_parse_in_the_full_and_the_older_shape() {
        let full = serde_json::json!({
            "type": "io.nats.micro.v1.stats_response",
            "name": "collab-projector",
            "id": "SVC1",
            "version": "0.1.0",
            "started": "2026-01-01T00:00:00Z",
            "endpoints": [{
                "name": "collab-projector.status",
                "subject": "collab-projector.status",
                "num_requests": 0, "num_errors": 0,
                "processing_time": 0, "average_processing_time": 0,
                "last_error": "", "queue_group": "q",
                "data": {
                    "workerId": "worker-a", "version": "0.1.0", "ready": true,
                    "natsConnected": true, "workers": true,
                    "partitionsOwned": 2, "partitionsRunning": 2,
                    "partitions": [
                        {"partition": 0, "pending": 3, "oldestPendingAgeMs": 1200},
                        {"partition": 1, "pending": 0}
                    ],
                    "inputs": 10, "projected": 9, "deadLettered": 1, "openTurns": 4,
                    "lastProcessedAgeMs": 80,
                    "storage": [
                        {"stream": "COLLAB_RAW", "bytes": 900, "limit": 1000},
                        {"stream": "COLLAB_DLQ", "bytes": 5}
                    ]
                }
            }]
        });
        let s = parse_stats_reply(full.to_string().as_bytes()).expect("parses");
        assert_eq!(s.worker_id, "worker-a");
        assert_eq!(s.partitions.len(), 2);
        assert_eq!(s.partitions[0].oldest_pending_age_ms, Some(1200));
        assert_eq!(s.partitions[1].oldest_pending_age_ms, None);
        assert_eq!(s.last_processed_age_ms, Some(80));
        assert_eq!(s.storage.len(), 2);
        assert_eq!(s.storage[0].ratio(), Some(0.9));
        assert_eq!(s.storage[1].limit, None);

        // The older, smaller report: the service instance names the worker.
        let older = serde_json::json!({
            "name": "collab-projector", "id": "SVC2", "version": "0.0.9",
            "endpoints": [{"name": "collab-projector.status", "data": {
                "partitionsOwned": 16, "partitionsRunning": 16, "inputs": 5,
                "projected": 5, "deadLettered": 0, "publishRetries": 0, "openTurns": 0
            }}]
        });
        let s = parse_stats_reply(older.to_string().as_bytes()).expect("parses");
        assert_eq!(s.worker_id, "SVC2");
        assert_eq!(s.version, "0.0.9");
        assert_eq!(s.partitions_owned, 16);
        assert!(s.partitions.is_empty());
        assert!(s.storage.is_empty());

        assert_eq!(parse_stats_reply(b"not json"), None);
        assert_eq!(parse_stats_reply(br#"{"endpoints": []}"#), None);
        assert_eq!(
            parse_stats_reply(br#"{"endpoints": [{"name": "x"}]}"#),
            None
        );
    }
}
