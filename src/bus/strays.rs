//! Strays: raw messages stored in a shard that does not hold their key.
//!
//! Producers publish to `<prefix>.raw.<key>.<type>`, and the server's mapping sends each key to
//! one shard (`<prefix>.shard.<k>.<h % k>.<key>...`). A producer allowed to publish on the
//! shard subjects themselves can name another shard; that shard's raw stream stores the message
//! with its key's partition tokens, and no partition reads those tokens from that stream, so no
//! consumer would ever deliver it. The owner of partition `i < k` (which reads shard `i`) looks
//! for them in shard `i` now and then and dead-letters each one `misrouted`, through the
//! partition's fence and with the Msg-Id of the input's own dead letter: the audit counts it,
//! `dlq replay` republishes it on its key's raw subject, where the mapping puts it in the right
//! shard, and a later owner finds its dead letter stored and leaves it.

use super::context::WorkerContext;
use super::publish::Fence;
use crate::config::{Layout, Names};
use crate::ingest::SubjectInfo;
use crate::model::{DlqReason, Rejection};
use crate::pipeline::{self, RawMessage};
use async_nats::jetstream::stream::RawMessageErrorKind;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How often a shard is searched for strays. Each search is one request per bit of the shard
/// count that finds nothing in the usual case.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The partition tokens `(count, token)` that select, in shard `shard` of `shards` (a power of
/// two), exactly the keys of other shards: a key `h` is a stray there when `h % shards != shard`,
/// that is when some bit of `h` below `shards` differs from `shard`'s. The lowest such bit `b`
/// puts the key's token at count `2^(b+1)` at `shard % 2^(b+1)` with bit `b` flipped, so one
/// filter per bit (log2 of the count, 8 at 256 shards) covers every stray once, where one per
/// other shard would take `shards - 1`.
pub fn stray_tokens(shard: u16, shards: u16) -> Vec<(u16, u16)> {
    std::iter::successors(Some(2u16), |c| c.checked_mul(2))
        .take_while(|c| *c <= shards)
        .map(|count| (count, (shard % count) ^ (count / 2)))
        .collect()
}

/// The subject filters of [`stray_tokens`] in the raw stream's layout, or `None` when the
/// layout lacks one of those counts (then a filter would select every message, strays or not).
pub fn stray_filters(
    layout: &Layout,
    raw_prefix: &str,
    shard: u16,
    shards: u16,
) -> Option<Vec<String>> {
    stray_tokens(shard, shards)
        .into_iter()
        .map(|(count, token)| {
            layout
                .levels
                .contains(&count)
                .then(|| layout.filter(raw_prefix, count, token))
        })
        .collect()
}

/// The raw stream a partition reads, for its stray search.
pub(crate) struct Shard {
    pub p: u16,
    /// The sets of raw streams the partition's stream was chosen from.
    pub raw: Arc<Names>,
    /// The stream's name.
    pub stream: String,
}

/// Search partition `p`'s shard for strays until `cancel`, when `p` is the first partition of a
/// shard of a sharded set of raw streams; return at once otherwise. When `last_round` fires (the
/// stream is sealed and read to its end), search once more and return: nothing can be stored
/// there after that round.
pub(crate) async fn sweep(
    ctx: Arc<WorkerContext>,
    shard: Shard,
    fence: Fence,
    cancel: CancellationToken,
    last_round: CancellationToken,
) {
    let Shard {
        p,
        raw,
        stream: stream_name,
    } = shard;
    let shards = raw.shard_of_stream_name(&stream_name).map_or(1, |(_, k)| k);
    if shards <= 1 || p >= shards {
        return;
    }
    let layout = ctx.settings.layout();
    let Some(filters) = stray_filters(&layout, &raw.raw_prefix, p, shards) else {
        warn!(
            partition = p,
            shards, "the raw stream's partition tokens do not include every power of two up to the shard count; strays are not searched for"
        );
        return;
    };
    // Where each filter's search goes on from: strays found before are not searched again by
    // this run; a new owner searches from the start and finds their dead letters stored.
    let mut from = vec![1u64; filters.len()];
    loop {
        let last = last_round.is_cancelled();
        match ctx.js.get_stream_no_info(&stream_name).await {
            Ok(stream) => {
                for (filter, next) in filters.iter().zip(from.iter_mut()) {
                    if !sweep_filter(
                        &ctx,
                        &raw,
                        (&stream, &stream_name),
                        filter,
                        next,
                        &fence,
                        &cancel,
                    )
                    .await
                    {
                        break;
                    }
                }
            }
            Err(e) => debug!(partition = p, error = %e, "the shard cannot be read for strays now"),
        }
        if last {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = last_round.cancelled() => {}
            _ = cancel.cancelled() => return,
        }
    }
}

/// Dead-letter every stray on `filter` from `*next` on; `false` when the search should stop for
/// this round (cancelled, or a request failed: the next round asks again from the same place).
async fn sweep_filter(
    ctx: &WorkerContext,
    names: &Names,
    (stream, stream_name): (&async_nats::jetstream::stream::Stream<()>, &str),
    filter: &str,
    next: &mut u64,
    fence: &Fence,
    cancel: &CancellationToken,
) -> bool {
    loop {
        if cancel.is_cancelled() {
            return false;
        }
        let found = stream
            .raw_message_builder()
            .sequence(*next)
            .next_by_subject(filter.to_string())
            .send()
            .await;
        let m = match found {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return true,
            Err(e) => {
                debug!(stream = stream_name, error = %e, "searching for strays failed; trying again later");
                return false;
            }
        };
        let seq = m.sequence;
        let raw = RawMessage {
            bytes: &m.payload,
            stream: stream_name,
            seq,
            stored_subject: &m.subject,
            stored_at: m.time,
            delivered: 1,
            headers: Some(&m.headers),
            producer: Default::default(),
        };
        let subject = pipeline::producer_subject(&ctx.names, &m.subject);
        let key = SubjectInfo::parse_raw(&ctx.names.raw_prefix, &subject)
            .map(|s| s.key)
            .unwrap_or_default();
        let rejection = Rejection::new(
            DlqReason::Misrouted,
            format!(
                "published to a shard that does not hold its key (key {key:?} belongs in {}); publish on {}.raw.<key>.<type> and let the server's mapping choose the shard",
                names
                    .raw_streams
                    .get(names.shard_of_key(&key))
                    .map_or("?", String::as_str),
                names.raw_prefix,
            ),
        );
        let out = ctx
            .publisher
            .fit(pipeline::dead_letter(&ctx.names, &raw, &rejection));
        let stored_ms = raw.stored_at.timestamp_millis();
        match ctx.publisher.stored_already(&out, seq, stored_ms).await {
            Ok(true) => {}
            Ok(false) => {
                if ctx
                    .publisher
                    .publish_in_place(&out, fence, &[], cancel)
                    .await
                    .is_err()
                {
                    return false;
                }
                warn!(
                    stream = stream_name,
                    seq,
                    %subject,
                    "a raw message was stored in a shard that does not hold its key; dead-lettered misrouted"
                );
                ctx.state.count_output(&out);
            }
            Err(e) => {
                debug!(stream = stream_name, seq, error = %e, "cannot tell whether a stray's dead letter is stored; trying again later");
                return false;
            }
        }
        *next = seq + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::stray_tokens;

    #[test]
    fn the_stray_tokens_select_exactly_the_keys_of_other_shards() {
        for shards in [2u16, 4, 8, 16, 64, 256] {
            for shard in 0..shards {
                let tokens = stray_tokens(shard, shards);
                assert_eq!(tokens.len() as u32, shards.trailing_zeros());
                for h in 0..u32::from(shards) * 4 {
                    let stray = h % u32::from(shards) != u32::from(shard);
                    let matched: Vec<_> = tokens
                        .iter()
                        .filter(|(count, token)| h % u32::from(*count) == u32::from(*token))
                        .collect();
                    assert_eq!(
                        stray,
                        !matched.is_empty(),
                        "key hash {h} in shard {shard} of {shards}: {tokens:?}"
                    );
                    assert!(matched.len() <= 1, "{h} matched twice: {matched:?}");
                }
            }
        }
    }
}
