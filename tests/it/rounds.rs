//! The reader the work-session fold and the OpenTelemetry export follow the projection stream
//! with (`bus::rounds::Rounds`): in order from its start, a round at a time, what was stored
//! while the round gathered taken in bursts; a lost consumer is an error, never a skipped range.

use crate::support::local_nats;
use async_nats::jetstream::{self, stream};
use collab_projector::bus::rounds::Rounds;
use collab_projector::bus::LeaseValidity;
use collab_projector::localnats::LocalNats;
use futures::TryStreamExt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const GATHER: Duration = Duration::from_millis(300);

/// A server, and a stream on it holding messages `1..=count`.
async fn stream_with(count: u64) -> (LocalNats, jetstream::Context, stream::Stream) {
    let nats = local_nats().await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let s = js
        .create_stream(stream::Config {
            name: "ROUNDS".into(),
            subjects: vec!["rounds.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    publish(&js, 1, count).await;
    (nats, js, s)
}

/// Publish messages `from..=to`, each with its number as its body.
async fn publish(js: &jetstream::Context, from: u64, to: u64) {
    let mut acks = Vec::new();
    for i in from..=to {
        acks.push(
            js.publish(format!("rounds.{}", i % 7), i.to_string().into())
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// The next round of `rounds`, gathering for `GATHER`, never cancelled.
async fn next_round(rounds: &mut Rounds, max: usize) -> Vec<jetstream::Message> {
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    rounds
        .next(&cancel, &lease, GATHER, max)
        .await
        .unwrap()
        .unwrap()
}

/// A gathering time no test run reaches.
const NEVER: Duration = Duration::from_secs(600);

/// The next round of `rounds` (at most `max`), asked with a gathering time no test run reaches:
/// it comes only if the round does not gather.
async fn round_without_gathering(rounds: &mut Rounds, max: usize) -> Vec<jetstream::Message> {
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    tokio::time::timeout(
        Duration::from_secs(60),
        rounds.next(&cancel, &lease, NEVER, max),
    )
    .await
    .expect("a round whose messages are all stored must not wait the gathering time")
    .unwrap()
    .unwrap()
}

/// Whether `rounds.next` gives no round when cancelled `after` into its wait.
async fn cancelled_while_waiting(
    rounds: &mut Rounds,
    gather: Duration,
    max: usize,
    after: Duration,
) -> bool {
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    let stop = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        stop.cancel();
    });
    rounds
        .next(&cancel, &lease, gather, max)
        .await
        .unwrap()
        .is_none()
}

fn bodies(round: &[jetstream::Message]) -> Vec<u64> {
    round
        .iter()
        .map(|m| std::str::from_utf8(&m.payload).unwrap().parse().unwrap())
        .collect()
}

fn stream_seqs(round: &[jetstream::Message]) -> Vec<u64> {
    round
        .iter()
        .map(|m| m.info().unwrap().stream_sequence)
        .collect()
}

#[tokio::test]
async fn rounds_take_every_message_once_in_order_in_bursts_of_at_most_max() {
    let (_nats, js, s) = stream_with(5).await;
    let mut rounds = Rounds::new(&s, 1).await.unwrap();

    let first = next_round(&mut rounds, 100).await;
    assert_eq!(bodies(&first), (1..=5).collect::<Vec<_>>());

    // More than one request's worth, and more than one round's: the rounds split them in order.
    publish(&js, 6, 4505).await;
    let mut taken = Vec::new();
    let mut sizes = Vec::new();
    while taken.len() < 4500 {
        let round = next_round(&mut rounds, 3000).await;
        sizes.push(round.len());
        taken.extend(bodies(&round));
    }
    assert_eq!(taken, (6..=4505).collect::<Vec<_>>());
    assert_eq!(
        sizes,
        vec![3000, 1500],
        "rounds of at most max, the rest in the next"
    );
}

#[tokio::test]
async fn rounds_are_bounded_by_bytes_and_still_take_every_message_once_in_order() {
    let (_nats, js, s) = stream_with(0).await;
    // 300 messages of about 1 KiB, with one of 40 KiB among them: larger than a round's bound.
    let mut acks = Vec::new();
    for i in 1..=300u64 {
        let pad = if i == 150 { 40 * 1024 } else { 1000 };
        let body = format!("{i} {}", "x".repeat(pad));
        acks.push(
            js.publish(format!("rounds.{}", i % 7), body.into())
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
    let bound = 16 * 1024;
    let mut rounds = Rounds::new(&s, 1).await.unwrap().max_bytes(bound);
    let mut taken = Vec::new();
    let mut sizes = Vec::new();
    while taken.len() < 300 {
        // A reader a round's bytes behind does not gather.
        let round = round_without_gathering(&mut rounds, 1000).await;
        let bytes: usize = round.iter().map(|m| m.message.length).sum();
        // Past the bound only by a round's first message, taken whatever its size.
        assert!(
            bytes <= bound || round.len() == 1,
            "a round of {} messages holds {bytes} bytes, over {bound}",
            round.len()
        );
        sizes.push(round.len());
        taken.extend(round.iter().map(|m| {
            let text = std::str::from_utf8(&m.payload).unwrap();
            text.split(' ').next().unwrap().parse::<u64>().unwrap()
        }));
    }
    assert_eq!(
        taken,
        (1..=300).collect::<Vec<_>>(),
        "every message once, in order"
    );
    assert!(
        sizes.contains(&1),
        "the large message makes a round of its own: {sizes:?}"
    );
    assert!(
        sizes.iter().all(|&n| n <= 16) && sizes.iter().filter(|&&n| n >= 10).count() > 10,
        "rounds end at the byte bound, not the count: {sizes:?}"
    );
}

#[tokio::test]
async fn a_small_round_fetched_in_paced_chunks_and_a_larger_one_both_come_whole() {
    let (_nats, js, s) = stream_with(1).await;
    let mut rounds = Rounds::new(&s, 1).await.unwrap();
    // 451 stored: fewer than the pacing threshold, so the round is fetched a hundred at a time
    // with pauses between, and still ends only where the stored messages do.
    publish(&js, 2, 451).await;
    let round = next_round(&mut rounds, 1000).await;
    assert_eq!(bodies(&round), (1..=451).collect::<Vec<_>>());
    // 2,600 stored: more than the threshold is left after the first chunk, so the rest comes
    // without pauses, in the same round.
    publish(&js, 452, 3051).await;
    let round = next_round(&mut rounds, 5000).await;
    assert_eq!(bodies(&round), (452..=3051).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_reader_a_whole_round_behind_takes_its_round_without_gathering() {
    let (_nats, js, s) = stream_with(1).await;
    let mut rounds = Rounds::new(&s, 1).await.unwrap();
    publish(&js, 2, 2500).await;
    // Two rounds with a whole round still stored behind their first message.
    for from in [1u64, 1001] {
        let round = round_without_gathering(&mut rounds, 1000).await;
        assert_eq!(bodies(&round), (from..from + 1000).collect::<Vec<_>>());
    }
    // Less than a round left: that one gathers (cancelled here while it does).
    assert!(cancelled_while_waiting(&mut rounds, NEVER, 1000, Duration::from_millis(500)).await);
}

#[tokio::test]
async fn a_round_waits_for_its_first_message_and_gathers_what_follows() {
    let (_nats, js, s) = stream_with(3).await;
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    // From a start past the first messages: those before it are not read.
    let mut rounds = Rounds::new(&s, 3).await.unwrap();
    assert_eq!(stream_seqs(&next_round(&mut rounds, 100).await), vec![3]);

    let later = {
        let js = js.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            publish(&js, 4, 4).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            publish(&js, 5, 6).await;
        })
    };
    let round = rounds
        .next(&cancel, &lease, Duration::from_millis(1000), 100)
        .await
        .unwrap()
        .unwrap();
    later.await.unwrap();
    assert_eq!(
        bodies(&round),
        vec![4, 5, 6],
        "the first message is waited for, what is stored within the gathering time comes with it"
    );

    // Cancelled while it waits: no round.
    assert!(cancelled_while_waiting(&mut rounds, GATHER, 100, Duration::from_millis(200)).await);
}

#[tokio::test]
async fn a_lost_consumer_is_an_error_that_names_the_stream() {
    let (_nats, js, s) = stream_with(2).await;
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    let mut rounds = Rounds::new(&s, 1).await.unwrap();
    assert_eq!(next_round(&mut rounds, 100).await.len(), 2);
    let names: Vec<String> = s.consumer_names().try_collect().await.unwrap();
    assert_eq!(names.len(), 1, "one consumer reads the stream: {names:?}");
    s.delete_consumer(&names[0]).await.unwrap();
    publish(&js, 3, 3).await;
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        rounds.next(&cancel, &lease, GATHER, 100),
    )
    .await
    .expect("a lost consumer is reported, not waited on")
    .expect_err("nothing is read past a lost consumer");
    assert!(err.contains("ROUNDS"), "{err}");
}

/// A reader of the test stream through a proxy, and the gathering time to give its round. The
/// tests hold what the reader sends once the round's first message is in: the request for the
/// rest of the round never reaches the server, as one sent just before a connection drops never
/// does.
async fn reader_behind_a_held_proxy(
    nats: &LocalNats,
) -> (crate::support::proxy::Proxy, Rounds, Duration) {
    let proxy = crate::support::proxy::Proxy::start(nats.port()).await;
    let via = jetstream::new(async_nats::connect(proxy.url()).await.unwrap());
    let s = via.get_stream("ROUNDS").await.unwrap();
    let rounds = Rounds::new(&s, 1).await.unwrap();
    // Long enough that the hold, set a second in, lands while the round gathers on any machine.
    (proxy, rounds, Duration::from_secs(5))
}

#[tokio::test]
async fn a_request_the_server_never_answers_is_an_error_not_a_wait() {
    // The round must fail (its reader then starts again from its checkpoint) rather than wait
    // for an answer that cannot come, which would also keep a stopping worker from ever
    // finishing its drain.
    let (nats, js, _) = stream_with(3).await;
    let (proxy, mut rounds, gather) = reader_behind_a_held_proxy(&nats).await;
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    let held = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.hold_up(true);
        proxy
    });
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        rounds.next(&cancel, &lease, gather, 100),
    )
    .await
    .expect("an unanswered request ends the round within its silence limit")
    .expect_err("a round whose rest never came is not handed over as complete");
    assert!(
        err.contains("ROUNDS") && err.contains("sent nothing"),
        "the request for the round's rest timed out: {err}"
    );
    held.await.unwrap().hold_up(false);
    // A reader that starts again from the same place reads every message, in order.
    let s = js.get_stream("ROUNDS").await.unwrap();
    let mut again = Rounds::new(&s, 1).await.unwrap();
    let round = next_round(&mut again, 100).await;
    assert_eq!(bodies(&round), vec![1, 2, 3]);
}

#[tokio::test]
async fn a_reader_waiting_on_an_unanswered_request_stops_when_cancelled() {
    let (nats, _js, _) = stream_with(3).await;
    let (proxy, mut rounds, gather) = reader_behind_a_held_proxy(&nats).await;
    let (cancel, lease) = (CancellationToken::new(), LeaseValidity::default());
    let stop = cancel.clone();
    let held = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.hold_up(true);
        // Past the gathering time: the request for the rest is out, and unanswered.
        tokio::time::sleep(Duration::from_secs(6)).await;
        stop.cancel();
        proxy
    });
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        rounds.next(&cancel, &lease, gather, 100),
    )
    .await
    .expect("a cancelled reader returns");
    // Cancelled 7 s in, before the request's 10 s of silence could end the round (15 s in, an
    // error): what it returns says which came first.
    match got {
        Ok(None) => {}
        other => panic!("the cancellation ends the wait, with no round: {other:?}"),
    }
    held.await.unwrap().hold_up(false);
}
