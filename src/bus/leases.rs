//! Partition ownership for N identical workers: one lease per partition in the KV bucket
//! `<prefix>_leases` (entries expire after `workers.lease_ttl` unless renewed), worker
//! heartbeats in the same bucket, and a balanced target of ceil(P / N) partitions per worker.
//!
//! A worker renews what it holds every third of the TTL, stops a partition at once when its
//! renewal fails (another owner took it), releases its excess gracefully (drain, then delete the
//! lease) when workers join, and takes free partitions up to its share. On shutdown it drains
//! every partition and deletes its leases so the others take over without waiting for the TTL.
//! Two owners may briefly overlap after a pause longer than the TTL; the KV fence of the turn
//! contract and the Msg-Ids keep the output exactly-once then.

use super::worker::{self, WorkerContext};
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

struct Held {
    revision: u64,
    /// Until when (ms since the epoch) the lease is known to hold: the start of its last
    /// successful renewal plus two thirds of the TTL.
    valid_until: Arc<AtomicI64>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

/// The target number of partitions for each of `workers` live workers.
pub fn share(partitions: u16, workers: usize) -> usize {
    let n = workers.max(1);
    usize::from(partitions).div_ceil(n)
}

/// The order in which a worker tries free partitions: starting at a point derived from its id, so
/// workers that start together do not all race for partition 0.
pub fn probe_order(worker_id: &str, partitions: u16) -> Vec<u16> {
    let start = worker_id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
        % u32::from(partitions.max(1));
    (0..partitions)
        .map(|i| ((u32::from(i) + start) % u32::from(partitions)) as u16)
        .collect()
}

fn lease_key(p: u16) -> String {
    format!("l.{p}")
}

fn spawn_partition(
    shared: Arc<WorkerContext>,
    p: u16,
    cancel: CancellationToken,
    valid_until: Arc<AtomicI64>,
) -> JoinHandle<()> {
    let rt = shared.partitions_rt.clone();
    rt.spawn(async move {
        // The owner of partition 0 also folds the projections into the work sessions.
        let fold = (p == 0).then(|| {
            shared.sessions_rt.handle.spawn(super::sessions::run_fold(
                shared.sessions.clone(),
                shared.sessions_js.clone(),
                shared.names.proj_stream.clone(),
                cancel.clone(),
                valid_until.clone(),
            ))
        });
        let mut retry = super::Retry::new(Duration::from_millis(200), Duration::from_secs(5));
        while !cancel.is_cancelled() {
            match worker::run_partition(shared.clone(), p, cancel.clone(), valid_until.clone())
                .await
            {
                Ok(()) => break,
                Err(e @ worker::WorkerError::Interrupted { .. }) => {
                    info!(error = %e, "restarting the partition");
                    continue;
                }
                Err(e) => {
                    error!(error = %e, "partition failed; restarting");
                    if !retry.wait(&cancel).await {
                        break;
                    }
                }
            }
        }
        if let Some(fold) = fold {
            let _ = fold.await;
        }
    })
}

async fn live_workers(store: &kv::Store) -> usize {
    let Ok(mut keys) = store.keys().await else {
        return 1;
    };
    let mut n = 0;
    while let Some(k) = keys.next().await {
        if k.is_ok_and(|k| k.starts_with("w.")) {
            n += 1;
        }
    }
    n.max(1)
}

/// Own a fair share of the partitions until `cancel`; then drain them and give them back.
pub async fn run(
    shared: Arc<WorkerContext>,
    store: kv::Store,
    worker_id: String,
    cancel: CancellationToken,
) {
    let partitions = shared.settings.nats.partitions;
    let ttl = shared.settings.workers.lease_ttl;
    let every = ttl / 3;
    let mut held: BTreeMap<u16, Held> = BTreeMap::new();
    let order = probe_order(&worker_id, partitions);
    let heartbeat = format!("w.{worker_id}");
    let validity_ms = i64::try_from((ttl * 2 / 3).as_millis()).unwrap_or(i64::MAX);
    let mut workers = 1;
    loop {
        if cancel.is_cancelled() {
            break;
        }
        if let Err(e) = store.put(&heartbeat, worker_id.clone().into()).await {
            warn!(error = %e, "worker heartbeat failed");
        }
        // Renew, all at once (one round trip, however many partitions are held); a failed
        // renewal means someone else owns it now: stop at once.
        let mut lost = Vec::new();
        if !cancel.is_cancelled() {
            let renewals = held.iter().map(|(p, h)| {
                let (p, revision, store, id) = (*p, h.revision, &store, worker_id.clone());
                async move {
                    let asked_at = super::now_ms();
                    (
                        p,
                        asked_at,
                        store.update(lease_key(p), id.into(), revision).await,
                    )
                }
            });
            for (p, asked_at, result) in futures::future::join_all(renewals).await {
                let Some(h) = held.get_mut(&p) else { continue };
                match result {
                    Ok(rev) => {
                        h.revision = rev;
                        h.valid_until
                            .store(asked_at + validity_ms, Ordering::Relaxed);
                    }
                    Err(e) => {
                        warn!(partition = p, error = %e, "lease lost; stopping the partition");
                        lost.push(p);
                    }
                }
            }
        }
        let lost: Vec<Held> = lost.into_iter().filter_map(|p| held.remove(&p)).collect();
        for h in &lost {
            h.cancel.cancel();
        }
        for h in lost {
            let _ = h.task.await;
        }
        // Listing the heartbeats is a JetStream API request, which a busy server may answer late:
        // never let it push the next renewal past the TTL; the last count serves meanwhile.
        if let Ok(n) = tokio::time::timeout(every / 2, live_workers(&store)).await {
            workers = n;
        }
        let target = share(partitions, workers);
        // Release the excess gracefully: drain first, then free the lease.
        // All at once, so the kept leases are renewed again within the drain time of one.
        let mut excess = Vec::new();
        while held.len() > target {
            let Some((p, h)) = held.pop_last() else { break };
            h.cancel.cancel();
            excess.push((p, h));
        }
        for (p, h) in excess {
            let _ = h.task.await;
            let _ = store
                .delete_expect_revision(lease_key(p), Some(h.revision))
                .await;
            info!(partition = p, "partition released for balance");
        }
        // Take free partitions up to the share.
        if held.len() < target {
            for p in &order {
                if held.len() >= target || cancel.is_cancelled() {
                    break;
                }
                if held.contains_key(p) {
                    continue;
                }
                let asked_at = super::now_ms();
                if let Ok(rev) = store.create(lease_key(*p), worker_id.clone().into()).await {
                    let c = cancel.child_token();
                    let valid_until = Arc::new(AtomicI64::new(asked_at + validity_ms));
                    let task = spawn_partition(shared.clone(), *p, c.clone(), valid_until.clone());
                    held.insert(
                        *p,
                        Held {
                            revision: rev,
                            valid_until,
                            cancel: c,
                            task,
                        },
                    );
                }
            }
        }
        shared
            .state
            .partitions_owned
            .store(held.len(), Ordering::Relaxed);
        metrics::gauge!(crate::telemetry::PARTITIONS_OWNED).set(held.len() as f64);
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = cancel.cancelled() => {}
        }
    }
    // Shutdown: drain every partition, then hand the leases back at once (bounded: with the
    // server unreachable they lapse by themselves after the TTL).
    for h in held.values() {
        h.cancel.cancel();
    }
    let mut revisions = Vec::new();
    for (p, h) in std::mem::take(&mut held) {
        let _ = h.task.await;
        revisions.push((p, h.revision));
    }
    shared.state.partitions_owned.store(0, Ordering::Relaxed);
    let release = async {
        for (p, rev) in revisions {
            let _ = store.delete_expect_revision(lease_key(p), Some(rev)).await;
        }
        let _ = store.delete(&heartbeat).await;
    };
    if tokio::time::timeout(ttl, release).await.is_err() {
        warn!("could not hand the leases back in time; they lapse after the lease TTL");
        return;
    }
    info!("leases released");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_partition() {
        assert_eq!(share(64, 1), 64);
        assert_eq!(share(64, 2), 32);
        assert_eq!(share(64, 3), 22);
        assert_eq!(share(64, 4), 16);
        assert_eq!(share(64, 0), 64);
        for n in 1..10 {
            assert!(share(64, n) * n >= 64);
        }
    }

    #[test]
    fn probe_order_is_a_permutation() {
        let mut o = probe_order("worker-a", 64);
        assert_eq!(o.len(), 64);
        o.sort_unstable();
        assert_eq!(o, (0..64).collect::<Vec<u16>>());
    }
}
