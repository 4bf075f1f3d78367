//! The OpenTelemetry export job: reads the projection stream in order from its checkpoint,
//! assembles turns, runs and tool calls into spans ([`crate::spans`]) and sends them through
//! the OTLP exporter ([`crate::otel`]).
//!
//! Run by the owner of partition 0 on the work-session thread, only when an endpoint is
//! configured. It is off the projection path: nothing a partition does waits for it. An export
//! that fails or takes longer than `otel.timeout` drops its spans (counted) and the job moves on,
//! so a collector that is down costs spans, never progress. Projections are redacted before they
//! are stored, so nothing exported holds a secret the projections do not.

use super::reconnects::Reconnects;
use crate::otel::Export;
use crate::spans::{Assembler, Limits};
use crate::telemetry::OTEL_SPANS;
use crate::usage::Prices;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use opentelemetry_sdk::trace::SpanExporter as _;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The export's checkpoint in the work-session bucket: the last projection-stream sequence
/// whose spans were handed to the exporter. Two tokens, so it is never taken for a session.
pub const EXPORT_KEY: &str = "otel.position";
/// Most projections in one round.
const ROUND_MAX: usize = 5_000;
/// How long a round gathers projections after its first one.
const ROUND_GATHER: Duration = Duration::from_millis(500);

/// What the job needs beyond the worker's context.
pub struct ExportJob {
    pub export: Export,
    pub prices: Prices,
    pub js: jetstream::Context,
    pub kv: kv::Store,
    pub proj_stream: String,
}

/// Export until `cancel`, restarting from the checkpoint after a failure of the stream or the
/// bucket (never of the collector, whose failures only drop spans).
pub async fn run_export(
    job: ExportJob,
    cancel: CancellationToken,
    lease_valid_until: Arc<super::LeaseValidity>,
) {
    let mut exporter = match crate::otel::exporter(&job.export) {
        Ok(e) => e,
        Err(e) => {
            warn!(error = %e, "OpenTelemetry export disabled: the exporter could not be built");
            return;
        }
    };
    let mut retry = super::Retry::new(Duration::from_millis(200), Duration::from_secs(5));
    while !cancel.is_cancelled() {
        match export(&job, &mut exporter, &cancel, &lease_valid_until).await {
            Ok(()) => break,
            Err(e) => {
                warn!(error = %e, "OpenTelemetry export failed; restarting from its checkpoint");
                if !retry.wait(&cancel).await {
                    break;
                }
            }
        }
    }
    let _ = exporter.shutdown();
}

/// Where the job starts: after its checkpoint, or (first start) at the end of the projection
/// stream: turning the export on sends what is projected from then on, not the stream's past.
/// That end is saved as the checkpoint before anything is exported, so a job that restarts
/// before its first round is saved starts there again, not at a later end past what was
/// projected in between.
async fn start(job: &ExportJob, reconnects: &Reconnects) -> Result<u64, String> {
    use super::sessions::Stored;
    match super::sessions::read_stored(&job.kv, reconnects, EXPORT_KEY).await? {
        Stored::At { last, .. } => return Ok(last + 1),
        Stored::Deleted => warn!(
            "the OpenTelemetry export's checkpoint was deleted from the work-session bucket: \
             exporting from the projection stream's end; what was projected since its last \
             saved round is not exported"
        ),
        Stored::Never => {}
    }
    let mut proj = job
        .js
        .get_stream(&job.proj_stream)
        .await
        .map_err(|e| format!("stream {}: {e}", job.proj_stream))?;
    let last = proj
        .info()
        .await
        .map(|i| i.state.last_sequence)
        .map_err(|e| e.to_string())?;
    job.kv
        .put(EXPORT_KEY, Bytes::from(last.to_string()))
        .await
        .map_err(|e| format!("checkpoint {EXPORT_KEY}: {e}"))?;
    Ok(last + 1)
}

async fn export(
    job: &ExportJob,
    exporter: &mut opentelemetry_otlp::SpanExporter,
    cancel: &CancellationToken,
    lease_valid_until: &super::LeaseValidity,
) -> Result<(), String> {
    let reconnects = std::sync::Arc::new(Reconnects::new(&job.js.client()));
    let from = start(job, &reconnects).await?;
    let proj = job
        .js
        .get_stream(&job.proj_stream)
        .await
        .map_err(|e| format!("stream {}: {e}", job.proj_stream))?;
    let mut rounds = super::rounds::Rounds::new(&proj, from)
        .await?
        .watching(reconnects);
    // Logged once the starting position is fixed: everything projected from here on is exported.
    info!(protocol = ?job.export.protocol, endpoint = job.export.endpoint.as_deref().unwrap_or("from OTEL_EXPORTER_OTLP_*"),
        from, "exporting turns, runs and tool calls as OpenTelemetry spans");
    let mut assembler = Assembler::new(
        Limits {
            max_open: job.export.max_open,
            ..Limits::default()
        },
        job.prices.clone(),
    );
    loop {
        let Some(round) = rounds
            .next(cancel, lease_valid_until, ROUND_GATHER, ROUND_MAX)
            .await?
        else {
            return Ok(());
        };
        let mut last = 0;
        let mut spans = Vec::new();
        for m in &round {
            let Ok(info) = m.info() else { continue };
            last = info.stream_sequence;
            // A projection that is not an envelope (none is) is skipped, not fatal.
            let Ok(env) = serde_json::from_slice::<crate::model::Envelope>(&m.payload) else {
                continue;
            };
            let stored_ms = info.published.timestamp_millis();
            let observed = assembler.observe(&env, stored_ms);
            if observed.evicted > 0 {
                metrics::counter!(OTEL_SPANS, "outcome" => "evicted").increment(observed.evicted);
            }
            spans.extend(observed.spans);
        }
        send(exporter, spans, job.export.timeout).await;
        if last > 0 {
            job.kv
                .put(EXPORT_KEY, Bytes::from(last.to_string()))
                .await
                .map_err(|e| format!("checkpoint {EXPORT_KEY}: {e}"))?;
        }
    }
}

/// Hand `spans` to the exporter, bounded by `timeout`; counted as exported or dropped.
async fn send(
    exporter: &opentelemetry_otlp::SpanExporter,
    spans: Vec<crate::spans::Span>,
    timeout: Duration,
) {
    if spans.is_empty() {
        return;
    }
    let n = spans.len() as u64;
    let batch = spans.into_iter().map(crate::otel::span_data).collect();
    // The exporter's own timeout bounds the request; this bounds everything around it too.
    match tokio::time::timeout(timeout + Duration::from_secs(1), exporter.export(batch)).await {
        Ok(Ok(())) => {
            metrics::counter!(OTEL_SPANS, "outcome" => "exported").increment(n);
        }
        Ok(Err(e)) => {
            metrics::counter!(OTEL_SPANS, "outcome" => "export_failed").increment(n);
            warn!(error = %e, spans = n, "OpenTelemetry export failed; these spans are dropped");
        }
        Err(_) => {
            metrics::counter!(OTEL_SPANS, "outcome" => "export_failed").increment(n);
            warn!(spans = n, after = ?timeout, "OpenTelemetry export took too long; these spans are dropped");
        }
    }
}
