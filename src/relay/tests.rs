use super::wire::*;
use super::*;

fn frames(parser: &mut SseParser, chunks: &[&[u8]]) -> Vec<Frame> {
    let mut out = Vec::new();
    for c in chunks {
        parser.push(c, &mut out);
    }
    out
}

fn data(s: &str) -> Frame {
    Frame::Data(Bytes::copy_from_slice(s.as_bytes()))
}

#[test]
fn sse_frames_come_out_when_their_blank_line_arrives() {
    let mut p = SseParser::new(1024);
    let mut out = Vec::new();
    p.push(b"data: {\"a\":1}\n", &mut out);
    assert!(out.is_empty(), "no blank line yet");
    p.push(b"\ndata: {\"b\"", &mut out);
    assert_eq!(out, vec![data("{\"a\":1}")]);
    p.push(b":2}\n\n", &mut out);
    assert_eq!(out, vec![data("{\"a\":1}"), data("{\"b\":2}")]);
}

#[test]
fn sse_line_endings_comments_and_fields() {
    let mut p = SseParser::new(1024);
    // CRLF split between chunks, a lone CR, comments, event/id/retry fields, no space after colon.
    let got = frames(
        &mut p,
        &[
            b"\xEF\xBB\xBF: keep-alive\r",
            b"\nevent: message\r\nid: 7\r\nretry: 10\r\ndata:{\"x\":1}\r",
            b"\n\r",
            b"data: {\"y\":2}\r\rdata\n\n",
        ],
    );
    assert_eq!(got, vec![data("{\"x\":1}"), data("{\"y\":2}"), data("")]);
}

#[test]
fn sse_multi_line_data_is_joined_with_line_feeds() {
    let mut p = SseParser::new(1024);
    let got = frames(&mut p, &[b"data: {\n data:  \"a\": 1\ndata: }\n\n"]);
    // " data:" (leading space) is a field named " data", ignored; one space after the colon
    // is removed, the second kept.
    assert_eq!(got, vec![data("{\n}")]);
    let got = frames(&mut p, &[b"data: {\ndata:  \"a\": 1\ndata: }\n\n"]);
    assert_eq!(got, vec![data("{\n \"a\": 1\n}")]);
}

#[test]
fn sse_events_without_data_and_unfinished_events_give_nothing() {
    let mut p = SseParser::new(1024);
    let got = frames(
        &mut p,
        &[b"event: ping\n\n: comment\n\ndata: {\"late\":true}"],
    );
    assert!(got.is_empty());
    assert!(p.pending() > 0, "the unfinished event is still pending");
}

#[test]
fn sse_oversized_events_are_reported_without_their_bytes() {
    let mut p = SseParser::new(8);
    let got = frames(
        &mut p,
        &[
            b"data: 0123456789abcdef\n",
            b"data: more\n\n",
            b"data: ok\n\n",
        ],
    );
    assert!(matches!(got[0], Frame::TooLarge(n) if n > 8), "{got:?}");
    assert_eq!(got[1], data("ok"));
    // A line with no end holds at most a bounded prefix.
    let mut p = SseParser::new(8);
    let long = vec![b'x'; 10_000];
    let mut out = Vec::new();
    p.push(b"data: ", &mut out);
    p.push(&long, &mut out);
    assert!(p.pending() < 64, "{}", p.pending());
    p.push(b"\n\n", &mut out);
    assert!(matches!(out[..], [Frame::TooLarge(_)]), "{out:?}");
}

#[test]
fn json_rpc_keys_come_from_the_message_or_the_params() {
    let send = br#"{"jsonrpc":"2.0","id":1,"method":"message/send","params":{"message":{"role":"user","parts":[],"messageId":"m","contextId":"ctx-1"}}}"#;
    let call = a2a_call("POST", "/", send);
    assert!(call.recognised && call.publish_request);
    assert_eq!(call.context_id.as_deref(), Some("ctx-1"));
    assert_eq!(call.rest_method, Some("message/send"));

    let list = br#"{"jsonrpc":"2.0","id":"x","method":"ListTasks","params":{"contextId":"ctx-2"}}"#;
    assert_eq!(
        a2a_call("POST", "/a2a", list).context_id.as_deref(),
        Some("ctx-2")
    );

    let no_context = br#"{"jsonrpc":"2.0","id":2,"method":"SendMessage","params":{"message":{"role":"ROLE_USER","parts":[{"text":"hi"}],"messageId":"m","contextId":""}}}"#;
    let call = a2a_call("POST", "/", no_context);
    assert!(call.recognised);
    assert_eq!(call.context_id, None, "an empty contextId is none");
}

#[test]
fn http_json_methods_come_from_the_route() {
    let cases = [
        ("POST", "/message:send", Some("SendMessage")),
        ("POST", "/v1/message:send", Some("SendMessage")),
        (
            "POST",
            "/a2a/rest/message:stream",
            Some("SendStreamingMessage"),
        ),
        (
            "POST",
            "/tenant-a/message:stream",
            Some("SendStreamingMessage"),
        ),
        ("GET", "/tasks/t-1", Some("GetTask")),
        ("GET", "/v1/tasks/t-1?historyLength=3", Some("GetTask")),
        ("POST", "/tasks/t-1:cancel", Some("CancelTask")),
        ("GET", "/tasks", Some("ListTasks")),
        ("GET", "/v1/tasks/", Some("ListTasks")),
        ("GET", "/tasks/t-1:subscribe", Some("SubscribeToTask")),
        ("POST", "/v1/tasks/t-1:subscribe", Some("SubscribeToTask")),
        (
            "POST",
            "/tasks/t-1/pushNotificationConfigs",
            Some("CreateTaskPushNotificationConfig"),
        ),
        (
            "GET",
            "/tasks/t-1/pushNotificationConfigs",
            Some("ListTaskPushNotificationConfigs"),
        ),
        (
            "GET",
            "/tasks/t-1/pushNotificationConfigs/p-1",
            Some("GetTaskPushNotificationConfig"),
        ),
        (
            "DELETE",
            "/tasks/t-1/pushNotificationConfigs/p-1",
            Some("DeleteTaskPushNotificationConfig"),
        ),
        ("GET", "/extendedAgentCard", Some("GetExtendedAgentCard")),
        ("GET", "/v1/card", Some("GetExtendedAgentCard")),
        ("GET", "/.well-known/agent-card.json", Some("GetAgentCard")),
        (
            "GET",
            "/agents/x/.well-known/agent.json",
            Some("GetAgentCard"),
        ),
        ("GET", "/message:send", None),
        ("POST", "/tasks/t-1", None),
        ("GET", "/healthz", None),
        ("GET", "/", None),
        ("POST", "/.well-known/agent-card.json", None),
    ];
    for (method, path, want) in cases {
        assert_eq!(rest_method(method, path), want, "{method} {path}");
    }
}

#[test]
fn http_json_keys_come_from_the_message() {
    let body = br#"{"message":{"role":"ROLE_USER","parts":[{"text":"hi"}],"messageId":"m","contextId":"agent:eden main"}}"#;
    let call = a2a_call("POST", "/v1/message:send", body);
    assert!(call.recognised && call.publish_request);
    assert_eq!(call.rest_method, Some("SendMessage"));
    assert_eq!(call.context_id.as_deref(), Some("agent:eden main"));
    let p = plan(
        Protocol::A2a,
        "POST",
        "/v1/message:send",
        RequestBytes::Whole(body),
    );
    assert_eq!(p.request, Some(Kind::A2aRequest));
    assert!(p.publish_answers);
}

#[test]
fn plans_for_calls_that_are_not_published_whole() {
    // A GET on an A2A route: the answer is published, the empty request is not.
    let p = plan(Protocol::A2a, "GET", "/tasks/t-1", RequestBytes::Whole(b""));
    assert_eq!(p.request, None);
    assert!(p.publish_answers);
    assert_eq!(p.rest_method, Some("GetTask"));
    assert!(p.note.is_some());
    // Not A2A at all: forwarded only.
    let p = plan(Protocol::A2a, "GET", "/healthz", RequestBytes::Whole(b""));
    assert_eq!((p.request, p.publish_answers), (None, false));
    let p = plan(
        Protocol::A2a,
        "POST",
        "/rpc",
        RequestBytes::Whole(b"{\"not\":\"json-rpc\"}"),
    );
    assert_eq!((p.request, p.publish_answers), (None, false));
    // Too large to read whole, but recognisably JSON-RPC: the answers are published and the
    // request is accounted for.
    let head = br#"{"jsonrpc":"2.0","id":1,"method":"message/send","params":{"message":{"parts":[{"kind":"file","file":{"bytes":"AAAA"#;
    let p = plan(Protocol::A2a, "POST", "/", RequestBytes::Head(head));
    assert_eq!(p.request, Some(Kind::A2aRequest));
    assert!(p.publish_answers);
    assert_eq!(p.context_id, None);
}

#[test]
fn agui_runs_are_keyed_by_thread_then_run() {
    let p = plan(
        Protocol::Agui,
        "POST",
        "/",
        RequestBytes::Whole(br#"{"threadId":"t-1","runId":"r-1","messages":[]}"#),
    );
    assert_eq!(p.context_id.as_deref(), Some("t-1"));
    assert_eq!(p.run_id.as_deref(), Some("r-1"));
    assert_eq!(p.request, None, "the run input is not an event");
    assert!(p.publish_answers);
    let p = plan(
        Protocol::Agui,
        "POST",
        "/",
        RequestBytes::Whole(br#"{"runId":"r-2","messages":[]}"#),
    );
    assert_eq!(p.context_id.as_deref(), Some("r-2"));
    let p = plan(
        Protocol::Agui,
        "POST",
        "/",
        RequestBytes::Whole(b"not json"),
    );
    assert_eq!((p.context_id, p.run_id), (None, None));
}

#[test]
fn subjects_and_json_objects() {
    assert_eq!(
        subject("collab", "ctx-1", Kind::A2aRequest),
        "collab.raw.ctx-1.a2a.wire.request"
    );
    assert_eq!(
        subject("p", "k", Kind::A2aStream),
        "p.raw.k.a2a.wire.stream"
    );
    assert_eq!(subject("collab", "t", Kind::Agui), "collab.raw.t.agui");
    assert!(is_json_object(b" {\"a\": [1]} \n"));
    assert!(!is_json_object(b"[1]"));
    assert!(!is_json_object(b"{\"a\":"));
    assert!(!is_json_object(b""));
    assert!(!is_json_object(b"\x1f\x8b\x08"));
}

#[test]
fn hop_by_hop_headers_and_event_streams() {
    for h in [
        "Connection",
        "keep-alive",
        "Transfer-Encoding",
        "TE",
        "Upgrade",
        "host",
    ] {
        assert!(is_hop_by_hop(h), "{h}");
    }
    for h in ["content-type", "authorization", "a2a-version", "x-caller"] {
        assert!(!is_hop_by_hop(h), "{h}");
    }
    let mut headers = HeaderMap::new();
    headers.insert("connection", HeaderValue::from_static("close, X-Hop"));
    headers.insert("x-hop", HeaderValue::from_static("1"));
    headers.insert("x-keep", HeaderValue::from_static("2"));
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let kept: Vec<&str> = forwarded_headers(&headers)
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(kept, vec!["x-keep", "content-type"]);
    assert!(is_event_stream("text/event-stream; charset=utf-8"));
    assert!(is_event_stream("Text/Event-Stream"));
    assert!(!is_event_stream("application/json"));
}

#[test]
fn upstream_urls_keep_the_base_path_and_the_query() {
    let base = reqwest::Url::parse("http://agent:9000/complete/").unwrap();
    assert_eq!(
        upstream_url(&base, "/a2a/jsonrpc?x=1").as_str(),
        "http://agent:9000/complete/a2a/jsonrpc?x=1"
    );
    let base = reqwest::Url::parse("http://agent:9000").unwrap();
    assert_eq!(
        upstream_url(&base, "/tasks/t-1:cancel").as_str(),
        "http://agent:9000/tasks/t-1:cancel"
    );
    assert_eq!(upstream_url(&base, "/").as_str(), "http://agent:9000/");
    let secret = reqwest::Url::parse("https://user:pw@agent/x").unwrap();
    assert_eq!(shown_url(&secret), "https://agent/x");
}

#[test]
fn compressed_answers_are_decoded_for_publishing_within_the_limit() {
    use std::io::Write;
    let body = br#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(body).unwrap();
    let gz = gz.finish().unwrap();
    assert_eq!(decode(ContentEncoding::Gzip, &gz, 1024).unwrap(), &body[..]);
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(body).unwrap();
    let z = z.finish().unwrap();
    assert_eq!(
        decode(ContentEncoding::Deflate, &z, 1024).unwrap(),
        &body[..]
    );
    // A bomb: small compressed, large inflated.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&vec![b' '; 1 << 20]).unwrap();
    let bomb = gz.finish().unwrap();
    assert_eq!(
        decode(ContentEncoding::Gzip, &bomb, 1024),
        Err(DropReason::TooLarge)
    );
    assert_eq!(
        decode(ContentEncoding::parse(Some("br")), body, 1024),
        Err(DropReason::Encoded)
    );
    assert_eq!(
        ContentEncoding::parse(Some(" GZIP ")),
        ContentEncoding::Gzip
    );
    assert_eq!(ContentEncoding::parse(None), ContentEncoding::Identity);
}

#[test]
fn the_queue_is_bounded_in_messages_and_in_bytes() {
    let msg = |n: usize| Outgoing {
        subject: "collab.raw.k.agui".into(),
        headers: async_nats::HeaderMap::new(),
        payload: Bytes::from(vec![b'x'; n]),
        kind: Kind::Agui,
    };
    let (queue, mut rx) = Queue::new(3, 100);
    queue.offer(msg(40));
    queue.offer(msg(40));
    queue.offer(msg(40)); // 120 bytes: over the byte bound
    queue.offer(msg(10));
    queue.offer(msg(1)); // a fourth message: over the count bound
    let mut sizes = Vec::new();
    while let Ok(m) = rx.try_recv() {
        sizes.push(m.payload.len());
    }
    assert_eq!(sizes, vec![40, 40, 10]);
}
