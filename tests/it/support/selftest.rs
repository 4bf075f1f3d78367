//! Tests of the harness itself: if these fail, every other integration test is suspect.

use std::time::Duration;

use async_nats::jetstream::stream::Config as StreamConfig;

use super::{
    cluster3, cluster_client, cluster_url, local_nats, local_nats_with, wait_until, Projector,
    TestNats,
};

async fn create_stream(js: &async_nats::jetstream::Context, name: &str, replicas: usize) {
    js.create_stream(StreamConfig {
        name: name.to_owned(),
        subjects: vec![format!("{}.>", name.to_lowercase())],
        num_replicas: replicas,
        ..StreamConfig::default()
    })
    .await
    .unwrap_or_else(|err| panic!("could not create stream {name}: {err}"));
}

async fn publish(js: &async_nats::jetstream::Context, subject: &str, payload: &'static str) -> u64 {
    js.publish(subject.to_owned(), payload.into())
        .await
        .expect("publish was not sent")
        .await
        .expect("publish was not acknowledged")
        .sequence
}

/// The messages `stream` holds, read over a new connection to `server` (started again).
async fn stored_after_restart(
    server: &collab_projector::localnats::LocalNats,
    stream: &str,
) -> u64 {
    let js = async_nats::jetstream::new(
        async_nats::connect(server.url())
            .await
            .expect("reconnect to the local server"),
    );
    let mut stream = js.get_stream(stream).await.expect("stream recovered");
    let info = stream.info().await.expect("stream info");
    info.state.messages
}

#[tokio::test]
async fn restart_keeps_port_and_stored_messages() {
    let mut nats = TestNats::start().await;
    let url_before = nats.url();
    let js = nats.jetstream().await;
    create_stream(&js, "SELFTEST", 1).await;
    let seq = publish(&js, "selftest.a", "kept across restarts").await;
    drop(js);

    nats.restart().await;

    assert_eq!(nats.url(), url_before, "restart must keep the port");
    let js = nats.jetstream().await;
    let stream = js
        .get_stream("SELFTEST")
        .await
        .expect("the stream survives a restart");
    let message = stream
        .get_raw_message(seq)
        .await
        .expect("the message survives a restart");
    assert_eq!(message.subject.as_str(), "selftest.a");
    assert_eq!(&message.payload[..], b"kept across restarts");
}

#[tokio::test]
async fn parallel_servers_get_distinct_ports() {
    let (a, b) = tokio::join!(TestNats::start(), TestNats::start());
    assert_ne!(a.port(), b.port());
    // Both answer, each as itself.
    a.client()
        .await
        .flush()
        .await
        .expect("first server answers");
    b.client()
        .await
        .flush()
        .await
        .expect("second server answers");
}

#[tokio::test]
async fn drop_kills_the_server_and_removes_its_temporary_store() {
    let server = local_nats().await;
    let store = server.store_dir().to_path_buf();
    let port = server.port();
    assert!(store.join("nats-server.conf").is_file());
    drop(server);
    assert!(!store.exists(), "{} should be gone", store.display());
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "nothing should listen on {port} any more"
    );
}

#[tokio::test]
async fn kill_now_then_restart_recovers_the_store() {
    let mut server = local_nats().await;
    let js = async_nats::jetstream::new(
        async_nats::connect(server.url())
            .await
            .expect("connect to the local server"),
    );
    create_stream(&js, "CRASHY", 1).await;
    publish(&js, "crashy.a", "acked before the crash").await;
    drop(js);
    let old_pid = server.pid();

    server.kill_now();
    assert!(!server.is_running());
    server.restart().await.expect("restart after SIGKILL");

    assert_ne!(server.pid(), old_pid);
    assert_eq!(stored_after_restart(&server, "CRASHY").await, 1);
}

/// The chaos suite's rolling-upgrade step: a server put in lame duck mode tells its clients,
/// closes them after its grace period, exits, and starts again with its store.
#[tokio::test]
async fn lame_duck_tells_the_clients_and_exits_then_restart_recovers_the_store() {
    let mut server = local_nats_with(
        "lame_duck_duration: \"30s\"\nlame_duck_grace_period: \"1s\"\n".to_string(),
    )
    .await;
    let (told, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let client = async_nats::ConnectOptions::new()
        .event_callback(move |event| {
            let told = told.clone();
            async move {
                if matches!(event, async_nats::Event::LameDuckMode) {
                    let _ = told.send(());
                }
            }
        })
        .connect(server.url())
        .await
        .expect("connect to the local server");
    let js = async_nats::jetstream::new(client);
    create_stream(&js, "RETIRED", 1).await;
    publish(&js, "retired.a", "stored before lame duck mode").await;

    server
        .lame_duck(Duration::from_secs(30))
        .await
        .expect("the server exits in lame duck mode");
    assert!(!server.is_running());
    tokio::time::timeout(Duration::from_secs(5), heard.recv())
        .await
        .expect("the client is told of lame duck mode")
        .expect("the event channel is open");

    server
        .restart()
        .await
        .expect("restart after lame duck mode");
    assert_eq!(stored_after_restart(&server, "RETIRED").await, 1);
}

#[tokio::test]
async fn cluster3_replicates_a_stream() {
    let nodes = cluster3().await;
    assert_eq!(nodes.len(), 3);
    assert_eq!(cluster_url(&nodes).split(',').count(), 3);
    let js = async_nats::jetstream::new(cluster_client(&nodes).await);
    create_stream(&js, "REPLICATED", 3).await;
    // The node the client is on may learn of a new replicated stream's subjects a moment after
    // the stream is created: until then a publish finds no stream.
    wait_until(
        Duration::from_secs(30),
        "the replicated stream takes a publish",
        || {
            let js = js.clone();
            async move {
                match js.publish("replicated.a", "on three nodes".into()).await {
                    Ok(ack) => ack.await.is_ok(),
                    Err(_) => false,
                }
            }
        },
    )
    .await;
    let mut stream = js.get_stream("REPLICATED").await.expect("stream exists");
    let info = stream.info().await.expect("stream info");
    let cluster = info
        .cluster
        .as_ref()
        .expect("a clustered stream reports its cluster");
    assert_eq!(cluster.replicas.len(), 2, "a leader and two followers");
}

#[tokio::test]
async fn projector_is_spawned_and_killed() {
    // No server needed: whatever the binary does with an unreachable URL, SIGKILL must end it.
    let mut projector = Projector::spawn("nats://127.0.0.1:1", &[], &[("RUST_LOG", "info")]);
    assert_ne!(projector.pid(), 0);
    projector.kill9();
    let status = projector.wait_exit(Duration::from_secs(30)).await;
    assert!(status.is_some(), "the projector did not exit after SIGKILL");
    let _ = projector.log_text();
}

#[tokio::test]
async fn wait_until_returns_once_the_condition_holds() {
    let mut calls = 0;
    wait_until(Duration::from_secs(5), "the third poll", || {
        calls += 1;
        let done = calls >= 3;
        async move { done }
    })
    .await;
    assert_eq!(calls, 3);
}

#[tokio::test]
#[should_panic(expected = "waiting until the impossible happens")]
async fn wait_until_panics_with_what_it_waited_for() {
    wait_until(
        Duration::from_millis(100),
        "the impossible happens",
        || async { false },
    )
    .await;
}
