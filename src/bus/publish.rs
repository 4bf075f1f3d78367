//! How a partition's outputs reach JetStream: sized before they are sent, fenced by the
//! partition's ownership term, and, when a publish fails, classified by what can heal it.
//!
//! - **Fits.** [`wire_size`] is what the server counts against `max_payload` (headers included).
//!   A dead letter that would not fit keeps a bounded excerpt of the input plus its digest, size
//!   and raw sequence ([`fit_dead_letter`]); the input itself stays in the raw stream.
//! - **Fenced.** Each owner of a partition claims it by publishing a fence message on the
//!   partition's fence subject in the projection and dead-letter streams ([`Fence::claim`]), and
//!   every output it publishes expects that fence to still be the last message there
//!   (`Nats-Expected-Last-Subject-Sequence` with `-Subject`). A deposed owner's publishes, however
//!   late the network delivers them, fail on the server once the next owner has claimed: the
//!   duplicate window is a second line, not the proof.
//! - **Classified.** [`classify`] sorts a failed publish into what waiting heals (retried in
//!   place), what the output's size causes (dead-lettered `too_large`), a lost fence (the
//!   partition stops), and what only an operator can fix (the partition stops loudly).

use crate::config::Names;
use crate::pipeline::{OutKind, Outgoing};
use async_nats::jetstream::{self, context::PublishErrorKind, ErrorCode};
use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Marks a fence message (its value: the claiming worker's id). Never an output.
pub const H_FENCE: &str = "Collab-Fence";
/// On a dead letter whose body is an excerpt: the input's size in bytes.
pub const H_DLQ_TRUNCATED: &str = "Collab-Dlq-Truncated";
/// On a dead letter: the SHA-256 (hex) of the whole input.
pub const H_SOURCE_SHA256: &str = "Collab-Source-Sha256";
/// On a dead letter: the stream that keeps the input.
pub const H_SOURCE_STREAM: &str = "Collab-Source-Stream";

const H_EXPECTED_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";
const H_EXPECTED_SUBJECT: &str = "Nats-Expected-Last-Subject-Sequence-Subject";
const H_MSG_ID: &str = "Nats-Msg-Id";

/// Room kept for the fence headers and the Msg-Id, which are added when an output is sent.
const SEND_HEADROOM: usize = 512;

/// The fence subjects of partition `p` (in the projection and the dead-letter stream).
pub fn fence_subjects(names: &Names, p: u16) -> (String, String) {
    (
        format!("{}.proj._fence.{p}", names.prefix),
        format!("{}.dlq._fence.{p}", names.prefix),
    )
}

/// Whether a stored subject is a partition fence (readers of whole streams skip them).
pub fn is_fence_subject(subject: &str) -> bool {
    subject.split('.').nth(2) == Some("_fence")
}

/// The messages `stream` holds less the fence claims among them (0 if it cannot be read): its
/// outputs, for a projection or dead-letter stream.
pub async fn outputs_in(js: &jetstream::Context, stream: &str) -> u64 {
    use futures::TryStreamExt;
    let Ok(mut s) = js.get_stream(stream).await else {
        return 0;
    };
    let Ok(total) = s.info().await.map(|i| i.state.messages) else {
        return 0;
    };
    let mut fences = 0u64;
    if let Ok(mut subjects) = s.info_with_subjects("*.*._fence.*").await {
        while let Ok(Some((_, n))) = subjects.try_next().await {
            fences += n as u64;
        }
    }
    total.saturating_sub(fences)
}

/// The last message on `subject` (a wildcard is allowed) in `stream`, answered by its leader
/// (`STREAM.MSG.GET`, never a direct get, which a lagging replica may answer); `None` when there
/// is none.
pub async fn last_from_leader(
    stream: &jetstream::stream::Stream,
    subject: &str,
) -> Result<Option<jetstream::message::StreamMessage>, jetstream::stream::LastRawMessageError> {
    use jetstream::stream::LastRawMessageErrorKind;
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A partition owner's claim: the sequence of its fence message in each output stream.
#[derive(Debug, Clone)]
pub struct Fence {
    proj: (String, u64),
    dlq: (String, u64),
}

impl Fence {
    /// Claim partition `p` for `owner`: from now on, outputs fenced by an earlier claim fail.
    /// `fold_reads`: a work-session fold reads the projection stream, so earlier claims there
    /// are left to it (see below).
    pub async fn claim(
        js: &jetstream::Context,
        names: &Names,
        p: u16,
        owner: &str,
        fold_reads: bool,
    ) -> Result<Fence, jetstream::context::PublishError> {
        let (proj, dlq) = fence_subjects(names, p);
        let mut seqs = [0u64; 2];
        for (i, subject) in [&proj, &dlq].into_iter().enumerate() {
            let mut headers = HeaderMap::new();
            headers.insert(H_FENCE, owner);
            let ack = js
                .publish_with_headers(subject.clone(), headers, Bytes::new())
                .await?
                .await?;
            seqs[i] = ack.sequence;
        }
        // Only the last claim on a fence subject counts: the earlier ones are removed, so a
        // partition that starts over and over does not fill the streams with claims. Removing
        // only what came before this claim leaves it, and any later owner's, in place.
        //
        // In the projection stream the work-session fold removes them once it has read them
        // (`bus::sessions`): a message removed ahead of the fold is, to it, a projection gone
        // unread (reported as lost from the work sessions, `collab_session_fold_skipped_total`),
        // and a fold that is behind or starting over from its checkpoint would report every
        // claim removed meanwhile.
        let mut purges = vec![(&names.dlq_stream, &dlq, seqs[1])];
        if !fold_reads {
            purges.push((&names.proj_stream, &proj, seqs[0]));
        }
        for (stream, subject, before) in purges {
            match js.get_stream_no_info(stream).await {
                Ok(s) => remove_claims_before(&s, subject, before).await,
                Err(e) => {
                    tracing::debug!(subject = %subject, error = %e, "earlier fence claims not removed")
                }
            }
        }
        Ok(Fence {
            proj: (proj, seqs[0]),
            dlq: (dlq, seqs[1]),
        })
    }

    /// The fence subject and sequence an output of `kind` expects.
    fn of(&self, kind: OutKind) -> (&str, u64) {
        match kind {
            OutKind::Projection(_) => (&self.proj.0, self.proj.1),
            OutKind::DeadLetter(_) => (&self.dlq.0, self.dlq.1),
        }
    }

    /// The headers of `out` as sent: its own, then the fence expectation.
    pub fn headers(&self, out: &Outgoing) -> HeaderMap {
        let mut headers = output_headers(out);
        let (subject, seq) = self.of(out.kind);
        headers.insert(HeaderName::from_static(H_EXPECTED_SEQ), seq.to_string());
        headers.insert(HeaderName::from_static(H_EXPECTED_SUBJECT), subject);
        headers
    }
}

/// Remove the fence claims on `subject` stored before sequence `before` in `stream`. Best
/// effort, bounded to 5 s: a claim left behind costs a few bytes, never correctness, and goes
/// with the next removal.
pub async fn remove_claims_before<I>(
    stream: &jetstream::stream::Stream<I>,
    subject: &str,
    before: u64,
) {
    let purge = stream.purge().filter(subject).sequence(before);
    let failed = match tokio::time::timeout(std::time::Duration::from_secs(5), purge).await {
        Ok(Ok(_)) => return,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".to_string(),
    };
    tracing::debug!(subject = %subject, error = %failed, "earlier fence claims not removed");
}

/// An output's own headers, without the fence's.
pub fn output_headers(out: &Outgoing) -> HeaderMap {
    // Names from static strings are not copied (a `&str` name is, on every publish).
    let mut headers = HeaderMap::new();
    for (k, v) in &out.headers {
        headers.insert(HeaderName::from_static(k), v.as_str());
    }
    headers
}

/// The bytes the server counts against `max_payload` for `out` once sent (payload plus header
/// block), with room for the fence headers and the Msg-Id.
pub fn wire_size(out: &Outgoing) -> usize {
    // "NATS/1.0\r\n" + "Key: value\r\n" per header + "\r\n".
    let headers: usize = out
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.len() + 4)
        .sum::<usize>()
        + H_MSG_ID.len()
        + out.msg_id.len()
        + 4
        + 12;
    out.payload.len() + headers + SEND_HEADROOM
}

/// A dead letter that fits in `max_bytes`: as it is when it does; otherwise its body becomes the
/// longest prefix of the input that fits (cut at a UTF-8 boundary), with the input's size,
/// SHA-256 and stream in headers (its sequence is there already). `dlq replay` reads the whole
/// input back from the raw stream.
pub fn fit_dead_letter(mut out: Outgoing, raw_stream: &str, max_bytes: usize) -> Outgoing {
    if !matches!(out.kind, OutKind::DeadLetter(_)) {
        return out;
    }
    out.headers.push((H_SOURCE_STREAM, raw_stream.to_string()));
    out.headers
        .push((H_SOURCE_SHA256, hex::encode(Sha256::digest(&out.payload))));
    if wire_size(&out) <= max_bytes {
        return out;
    }
    let size = out.payload.len();
    out.headers.push((H_DLQ_TRUNCATED, size.to_string()));
    // Header values are single lines the pipeline already bounded; only the body shrinks.
    let room = max_bytes.saturating_sub(wire_size(&Outgoing {
        payload: Bytes::new(),
        ..out.clone()
    }));
    let mut cut = room.min(EXCERPT_MAX).min(size);
    // Text ends on a character boundary (a character cut in two at the end is dropped);
    // anything else keeps its prefix as it is.
    if let Err(e) = std::str::from_utf8(&out.payload[..cut]) {
        if e.error_len().is_none() {
            cut = e.valid_up_to();
        }
    }
    out.payload = out.payload.slice(..cut);
    out
}

/// The longest excerpt a shortened dead letter keeps: enough to recognise the input, far
/// below any server's `max_payload`.
pub const EXCERPT_MAX: usize = 64 * 1024;

/// What a failed publish means for the partition.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// Waiting can heal it (no answer in time, a connection or leader change, a full stream
    /// whose oldest messages will age out): retry in place.
    #[error("publish to {subject} failed, retrying: {source}")]
    Transient {
        subject: String,
        #[source]
        source: jetstream::context::PublishError,
    },
    /// The output cannot be stored as it is (over `max_payload` or the stream's largest
    /// message, lowered since the worker read them): the partition stops, reads the limits
    /// again as it restarts, and its outputs are then offloaded (or the input dead-lettered
    /// `too_large`) to fit.
    #[error("publish to {subject} refused, too large: {source}")]
    TooLarge {
        subject: String,
        #[source]
        source: jetstream::context::PublishError,
    },
    /// Another owner claimed the partition since this one did: publish nothing more.
    #[error("publish to {subject} refused: the partition has a newer owner ({source})")]
    Deposed {
        subject: String,
        #[source]
        source: jetstream::context::PublishError,
    },
    /// Nothing stores it until an operator acts (the stream is gone, the user may not publish
    /// there): stop the partition and say so.
    #[error("publish to {subject} cannot succeed until an operator acts: {source}")]
    Fatal {
        subject: String,
        #[source]
        source: jetstream::context::PublishError,
    },
}

impl Failure {
    /// Whether the stream leader refused the publish only because an earlier message with an
    /// expectation on the same subject is still being proposed (`10164` on a replicated stream:
    /// the partition's previous output, on the same fence subject). It clears within one
    /// proposal: routine, and retried like any transient failure.
    pub fn is_busy(&self) -> bool {
        match self {
            Failure::Transient { source, .. } => {
                error_code(source) == Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT)
            }
            _ => false,
        }
    }

    /// The bounded label of the failure's class, for metrics.
    pub fn class(&self) -> &'static str {
        match self {
            Failure::Transient { .. } => "transient",
            Failure::TooLarge { .. } => "too_large",
            Failure::Deposed { .. } => "deposed",
            Failure::Fatal { .. } => "fatal",
        }
    }
}

/// The JetStream error code the server answered a publish with, if it answered with one.
fn error_code(source: &jetstream::context::PublishError) -> Option<ErrorCode> {
    std::error::Error::source(source)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(jetstream::Error::error_code)
}

/// Classify a failed publish to `subject`.
pub fn classify(subject: &str, source: jetstream::context::PublishError) -> Failure {
    let subject = subject.to_string();
    let code = error_code(&source);
    match source.kind() {
        PublishErrorKind::MaxPayloadExceeded => Failure::TooLarge { subject, source },
        PublishErrorKind::WrongLastSequence => Failure::Deposed { subject, source },
        // No responders: no stream listens on the subject (deleted, or never provisioned).
        PublishErrorKind::StreamNotFound => Failure::Fatal { subject, source },
        PublishErrorKind::TimedOut if super::denied::recently(&subject) => {
            Failure::Fatal { subject, source }
        }
        PublishErrorKind::Other => match code {
            Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                Failure::TooLarge { subject, source }
            }
            Some(ErrorCode::STREAM_NOT_FOUND) => Failure::Fatal { subject, source },
            Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE) => Failure::Deposed { subject, source },
            // `10164`, the constant form: a clustered stream leader refuses an expectation on
            // a subject while an earlier message with an expectation on it is still being
            // proposed (the partition's previous output, on the same fence subject). It says
            // nothing of the fence; the retry gets the answer.
            _ => Failure::Transient { subject, source },
        },
        _ => Failure::Transient { subject, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DlqReason;

    fn dead_letter(body: Vec<u8>) -> Outgoing {
        Outgoing {
            subject: "collab.dlq.bad_json".into(),
            payload: Bytes::from(body),
            msg_id: "COLLAB_RAW:9:dlq".into(),
            headers: vec![
                ("Collab-Dlq-Reason", "bad_json".into()),
                ("Collab-Dlq-Detail", "expected value at line 1".into()),
                ("Collab-Source-Subject", "collab.raw.k.x".into()),
                (crate::pipeline::H_SOURCE_SEQ, "9".into()),
            ],
            kind: OutKind::DeadLetter(DlqReason::BadJson),
        }
    }

    #[test]
    fn a_dead_letter_that_fits_keeps_the_whole_input_and_names_its_digest() {
        let out = fit_dead_letter(dead_letter(b"{broken".to_vec()), "COLLAB_RAW", 1 << 20);
        assert_eq!(out.payload.as_ref(), b"{broken");
        assert!(!out.headers.iter().any(|(k, _)| *k == H_DLQ_TRUNCATED));
        let digest = hex::encode(Sha256::digest(b"{broken"));
        assert!(out.headers.contains(&(H_SOURCE_SHA256, digest)));
        assert!(out
            .headers
            .contains(&(H_SOURCE_STREAM, "COLLAB_RAW".to_string())));
    }

    #[test]
    fn an_oversize_dead_letter_keeps_a_bounded_excerpt_that_fits() {
        let max = 1024 * 1024;
        let body = vec![b'x'; 1_048_450];
        let out = fit_dead_letter(dead_letter(body.clone()), "COLLAB_RAW", max);
        assert!(wire_size(&out) <= max, "{}", wire_size(&out));
        assert!(out.payload.len() <= EXCERPT_MAX);
        assert!(body.starts_with(&out.payload));
        assert!(out
            .headers
            .contains(&(H_DLQ_TRUNCATED, "1048450".to_string())));
        let digest = hex::encode(Sha256::digest(&body));
        assert!(out.headers.contains(&(H_SOURCE_SHA256, digest)));
        // A small server limit still gets a dead letter that fits.
        let small = fit_dead_letter(dead_letter(body), "COLLAB_RAW", 4096);
        assert!(wire_size(&small) <= 4096);
    }

    #[test]
    fn an_excerpt_of_text_ends_on_a_character_boundary() {
        let body = "é".repeat(600_000).into_bytes();
        let out = fit_dead_letter(dead_letter(body), "COLLAB_RAW", 1 << 20);
        assert!(std::str::from_utf8(&out.payload).is_ok());
        assert!(!out.payload.is_empty());
    }

    #[test]
    fn the_wire_size_counts_headers() {
        let mut out = dead_letter(vec![b'a'; 100]);
        let small = wire_size(&out);
        out.headers.push(("X-Long", "v".repeat(1000)));
        assert!(wire_size(&out) >= small + 1000);
        assert!(small > 100);
    }

    #[test]
    fn fence_subjects_are_recognised_and_never_role_subjects() {
        let names = Names::new("collab");
        let (proj, dlq) = fence_subjects(&names, 7);
        assert!(is_fence_subject(&proj) && is_fence_subject(&dlq));
        assert!(!is_fence_subject(
            "collab.proj.conversation.main.k.a2a.send"
        ));
        assert!(!is_fence_subject("collab.dlq.bad_json"));
    }

    #[test]
    fn failures_are_classified_by_what_heals_them() {
        use jetstream::context::PublishError;
        let c = |k| classify("s", PublishError::new(k)).class();
        assert_eq!(c(PublishErrorKind::MaxPayloadExceeded), "too_large");
        assert_eq!(c(PublishErrorKind::WrongLastSequence), "deposed");
        assert_eq!(c(PublishErrorKind::StreamNotFound), "fatal");
        assert_eq!(c(PublishErrorKind::TimedOut), "transient");
        assert_eq!(c(PublishErrorKind::BrokenPipe), "transient");
        // The sequence a fence check found (10071) is a newer claim; the constant form (10164)
        // is an earlier expectation on the fence subject still in flight: wait and retry.
        for (code, class) in [(10071, "deposed"), (10164, "transient")] {
            let body =
                format!(r#"{{"code":400,"err_code":{code},"description":"wrong last sequence"}}"#);
            let Ok(err) = serde_json::from_str::<jetstream::Error>(&body) else {
                panic!("not a JetStream error: {body}");
            };
            let failure = classify("s", PublishError::with_source(PublishErrorKind::Other, err));
            assert_eq!(failure.class(), class, "error code {code}");
            // Only the constant form is a busy leader, retried after a moment.
            assert_eq!(failure.is_busy(), code == 10164, "error code {code}");
        }
        let timed_out = classify("s", PublishError::new(PublishErrorKind::TimedOut));
        assert!(!timed_out.is_busy());
    }
}
