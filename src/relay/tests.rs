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
        subject("collab", "ctx-1", "planner", Kind::A2aRequest).as_deref(),
        Some("collab.raw.ctx-1._as.planner.a2a.wire.request")
    );
    assert_eq!(
        subject("p", "k", "weather", Kind::A2aStream).as_deref(),
        Some("p.raw.k._as.weather.a2a.wire.stream")
    );
    assert_eq!(
        subject("collab", "t", "researcher", Kind::Agui).as_deref(),
        Some("collab.raw.t._as.researcher.agui")
    );
    assert_eq!(subject("collab", "t", "a.b", Kind::Agui), None);
    assert!(is_json_object(b" {\"a\": [1]} \n"));
    assert!(!is_json_object(b"[1]"));
    assert!(!is_json_object(b"{\"a\":"));
    assert!(!is_json_object(b""));
    assert!(!is_json_object(b"\x1f\x8b\x08"));
    // A UTF-8 byte order mark before the object, which agents' JSON parsers skip.
    assert!(is_json_object(b"\xEF\xBB\xBF{\"a\": 1}"));
    assert!(json_object(b"\xEF\xBB\xBF {\"jsonrpc\": \"2.0\"}").is_some());
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
        upstream_url(&base, "/a2a/jsonrpc", Some("x=1")).as_str(),
        "http://agent:9000/complete/a2a/jsonrpc?x=1"
    );
    let base = reqwest::Url::parse("http://agent:9000").unwrap();
    assert_eq!(
        upstream_url(&base, "/tasks/t-1:cancel", None).as_str(),
        "http://agent:9000/tasks/t-1:cancel"
    );
    assert_eq!(
        upstream_url(&base, "/", None).as_str(),
        "http://agent:9000/"
    );
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

#[test]
fn the_queue_counts_headers_as_they_go_on_the_wire() {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Collab-Run-Id", "x".repeat(60).as_str());
    // "NATS/1.0\r\n" + "Collab-Run-Id: " + 60 + "\r\n" + "\r\n"
    assert_eq!(
        super::publisher::headers_wire_len(&headers),
        10 + 13 + 2 + 60 + 2 + 2
    );
    assert_eq!(
        super::publisher::headers_wire_len(&async_nats::HeaderMap::new()),
        0
    );
    let msg = |headers: async_nats::HeaderMap| Outgoing {
        subject: "collab.raw.k.agui".into(),
        headers,
        payload: Bytes::from_static(b"{}"),
        kind: Kind::Agui,
    };
    let (queue, mut rx) = Queue::new(10, 100);
    queue.offer(msg(headers.clone())); // 89 + 2 bytes
    queue.offer(msg(headers)); // over the 100-byte bound by its headers alone
    queue.offer(msg(async_nats::HeaderMap::new()));
    let mut kept = Vec::new();
    while let Ok(m) = rx.try_recv() {
        kept.push(m.wire_len());
    }
    assert_eq!(kept, vec![91, 2]);
}

#[test]
fn a_long_run_id_is_not_copied_into_every_message() {
    let plan_of = |run: &str| {
        plan(
            Protocol::Agui,
            "POST",
            "/",
            RequestBytes::Whole(
                format!(r#"{{"threadId":"t1","runId":"{run}","messages":[]}}"#).as_bytes(),
            ),
        )
    };
    let short = super::shared_headers("ex-1", "ui", "planner", &plan_of("r-1"));
    assert_eq!(
        short.get("Collab-Run-Id").map(|v| v.to_string()),
        Some("r-1".to_string())
    );
    let edge = "r".repeat(super::MAX_RUN_ID_HEADER);
    let at_limit = super::shared_headers("ex-1", "ui", "planner", &plan_of(&edge));
    assert!(at_limit.get("Collab-Run-Id").is_some());
    let long = "r".repeat(600_000);
    let over = super::shared_headers("ex-1", "ui", "planner", &plan_of(&long));
    assert!(over.get("Collab-Run-Id").is_none());
    assert!(super::publisher::headers_wire_len(&over) < 200);
}

/// Every escape attempt is refused for the rule it breaks; legitimate paths, dot segments
/// included, stay under the base and reach the agent resolved.
#[test]
fn paths_are_confined_to_the_base() {
    use wire::{confine_path, PathRefusal::*};
    let refused = [
        ("/../b/x", AboveBase),
        ("/%2E%2e/%2e%2E/admin", AboveBase),
        ("/x/../../b/secret", AboveBase),
        ("/%2e%2e/b", AboveBase),
        ("/..%2fb", EncodedSeparator),
        ("/.%2e/b", AboveBase),
        ("/x/..%2F..%2Fb", EncodedSeparator),
        ("//evil.example/x", HostLike),
        ("/\\..\\b", Backslash),
        ("/x/%5c..%5cb", EncodedSeparator),
        ("/x/%252e%252e/b", EncodedSeparator),
        ("/x/%00", Control),
        ("/..", AboveBase),
        ("*", NotAPath),
        ("/..;/admin", DotParameters),
        ("/x/..;jsessionid=1/y", DotParameters),
        ("/x/.;/y", DotParameters),
        ("/%2e%2e;/admin", DotParameters),
    ];
    for (path, why) in refused {
        assert_eq!(confine_path(path), Err(why), "{path}");
    }
    let kept = [
        ("/", "/"),
        ("/v1/message:send", "/v1/message:send"),
        ("/x/a;v=1/y", "/x/a;v=1/y"),
        ("/x/..a;b/y", "/x/..a;b/y"),
        ("/x/./y", "/x/y"),
        ("/x/../y", "/y"),
        ("/x/%2e%2E/y", "/y"),
        ("/x/..", "/"),
        ("/x/y/.", "/x/y/"),
        ("/a2a/", "/a2a/"),
        ("/tasks/t%201:cancel", "/tasks/t%201:cancel"),
        (
            "/.well-known/agent-card.json",
            "/.well-known/agent-card.json",
        ),
        ("/x/...", "/x/..."),
    ];
    for (path, confined) in kept {
        assert_eq!(confine_path(path).as_deref(), Ok(confined), "{path}");
    }
    // Joined under a base with a path, a confined path cannot leave it.
    let base = reqwest::Url::parse("http://host/agents/a/").unwrap();
    for (path, _) in kept {
        let url = upstream_url(&base, &confine_path(path).unwrap(), None);
        assert!(url.path().starts_with("/agents/a/"), "{path} -> {url}");
    }
}

#[test]
fn caller_token_files_name_each_caller_and_refuse_what_is_unclear() {
    use axum::http::{HeaderMap, HeaderValue};
    let tokens = trust::CallerTokens::parse(
        "# planner rotates its token\nplanner 0123456789abcdef0123\nplanner fedcba9876543210fedc\n\n  scheduler   s3cret-s3cret-s3cret  \n",
    )
    .unwrap();
    assert_eq!(tokens.len(), 3);
    let with = |value: &str| {
        let mut h = HeaderMap::new();
        h.insert("proxy-authorization", HeaderValue::from_str(value).unwrap());
        h
    };
    assert_eq!(
        tokens
            .caller(&with("Bearer fedcba9876543210fedc"))
            .as_deref(),
        Some("planner")
    );
    assert_eq!(
        tokens
            .caller(&with("bearer s3cret-s3cret-s3cret"))
            .as_deref(),
        Some("scheduler")
    );
    assert_eq!(tokens.caller(&with("Bearer s3cret-s3cret-s3cre")), None);
    assert_eq!(tokens.caller(&with("Basic s3cret-s3cret-s3cret")), None);
    assert_eq!(tokens.caller(&HeaderMap::new()), None);
    // The agent's own Authorization header is not the relay's token.
    let mut agent_auth = HeaderMap::new();
    agent_auth.insert(
        "authorization",
        HeaderValue::from_static("Bearer s3cret-s3cret-s3cret"),
    );
    assert_eq!(tokens.caller(&agent_auth), None);
    // Debug output names agents, never tokens.
    let shown = format!("{tokens:?}");
    assert!(
        shown.contains("scheduler") && !shown.contains("s3cret"),
        "{shown}"
    );

    for (text, says) in [
        ("planner\n", "line 1: expected `AGENT_ID TOKEN`"),
        ("planner a b\n", "line 1: expected"),
        ("planner short\n", "shorter than 16"),
        (
            "a 0123456789abcdef0123\nb 0123456789abcdef0123\n",
            "line 2: this token is already a's",
        ),
        ("# nobody\n", "no caller in the file"),
    ] {
        let err = trust::CallerTokens::parse(text).unwrap_err();
        assert!(err.contains(says), "{text:?}: {err}");
        assert!(
            !err.contains("0123456789abcdef"),
            "no token in the error: {err}"
        );
    }
}

#[test]
fn header_mode_believes_only_trusted_peers() {
    use axum::http::{HeaderMap, HeaderName, HeaderValue};
    let callers = trust::Callers::Header {
        name: HeaderName::from_static("x-agent-id"),
        trusted: vec![
            trust::parse_net("10.1.0.0/16").unwrap(),
            trust::parse_net("fd00::1").unwrap(),
        ],
        default: "gateway".into(),
    };
    let mut h = HeaderMap::new();
    h.insert("x-agent-id", HeaderValue::from_static("planner"));
    let ip = |s: &str| Some(s.parse().unwrap());
    assert_eq!(callers.identify(&h, ip("10.1.2.3")), Ok("planner".into()));
    // An IPv4 peer seen on a dual-stack socket is still the same peer.
    assert_eq!(
        callers.identify(&h, ip("::ffff:10.1.2.3")),
        Ok("planner".into())
    );
    assert_eq!(callers.identify(&h, ip("fd00::1")), Ok("planner".into()));
    assert_eq!(
        callers.identify(&HeaderMap::new(), ip("10.1.2.3")),
        Ok("gateway".into())
    );
    for untrusted in [ip("10.2.0.1"), ip("127.0.0.1"), ip("fd00::2"), None] {
        assert_eq!(
            callers.identify(&h, untrusted),
            Err(trust::Refusal::UntrustedPeer),
            "{untrusted:?}"
        );
        assert_eq!(
            callers.identify(&HeaderMap::new(), untrusted),
            Err(trust::Refusal::UntrustedPeer)
        );
    }
    // A proxy that appended its header to the caller's: which is which cannot be told.
    let mut twice = h.clone();
    twice.append("x-agent-id", HeaderValue::from_static("boss"));
    assert_eq!(
        callers.identify(&twice, ip("10.1.2.3")),
        Err(trust::Refusal::AmbiguousHeader)
    );
    // A value that cannot name an identity subject is refused, never read as the default.
    let mut dotted = HeaderMap::new();
    dotted.insert("x-agent-id", HeaderValue::from_static("team.lead"));
    assert_eq!(
        callers.identify(&dotted, ip("10.1.2.3")),
        Err(trust::Refusal::BadCaller)
    );
    assert_eq!(trust::Refusal::BadCaller.status().as_u16(), 400);
    assert!(trust::parse_net("10.0.0.0/33").is_err());
    assert!(trust::parse_net("proxy.internal")
        .unwrap_err()
        .contains("CIDR"));
}

#[test]
fn a_caller_over_its_rate_waits_and_others_do_not() {
    let hourly = trust::parse_rate("1/h").unwrap();
    let limiter = trust::Limiter::new(hourly, 2).unwrap();
    assert!(limiter.check("a").is_ok());
    assert!(limiter.check("a").is_ok());
    let wait = limiter.check("a").unwrap_err();
    assert!(wait > std::time::Duration::ZERO && wait <= std::time::Duration::from_secs(3600));
    assert!(limiter.check("b").is_ok(), "buckets are per caller");
    assert!(trust::Limiter::new(None, 10).is_none(), "no rate: no limit");

    let rate = |s: &str| trust::parse_rate(s).map(|r| r.map(|r| (r.count.get(), r.per.as_secs())));
    assert_eq!(rate("20/s"), Ok(Some((20, 1))));
    assert_eq!(rate(" 600/min "), Ok(Some((600, 60))));
    assert_eq!(rate("1000/h"), Ok(Some((1000, 3600))));
    assert_eq!(rate("off"), Ok(None));
    assert_eq!(rate("0"), Ok(None));
    assert_eq!(rate("0/s"), Ok(None));
    for bad in ["20", "20/day", "x/s", "-1/s"] {
        assert!(rate(bad).unwrap_err().contains("20/s, 600/min"), "{bad}");
    }
}

#[test]
fn each_kind_says_whose_words_it_is() {
    assert_eq!(Kind::A2aRequest.direction(), "request");
    for k in [Kind::A2aResponse, Kind::A2aStream, Kind::Agui] {
        assert_eq!(k.direction(), "answer");
    }
}

proptest::proptest! {
    /// Whatever the mix of dot segments (plain or encoded), empty segments and ordinary ones: a
    /// confined path has no dot segment left, joined under a base it stays under it (as the URL
    /// library resolves it too), and it is refused as above the base exactly when a `..` finds
    /// nothing left to remove.
    #[test]
    fn confined_paths_never_leave_the_base(
        segments in proptest::collection::vec(
            proptest::sample::select(vec!["a", "b%20c", ".", "..", "%2e", "%2E%2e", ".%2e", "%2e.", "", "x..y", "..."]),
            0..8,
        )
    ) {
        let path = format!("/{}", segments.join("/"));
        let is_dot = |s: &str| matches!(s.to_ascii_lowercase().replace("%2e", ".").as_str(), "." | "..");
        let climbs = |s: &str| s.to_ascii_lowercase().replace("%2e", ".") == "..";
        // The reference: count the depth, segment by segment.
        let mut depth: i64 = 0;
        let mut above = false;
        for (i, s) in segments.iter().enumerate() {
            if climbs(s) {
                depth -= 1;
                above |= depth < 0;
            } else if !(is_dot(s) || s.is_empty() && i + 1 == segments.len()) {
                depth += 1;
            }
        }
        // A leading empty segment makes `//`, refused for its own reason.
        if segments.first() == Some(&"") && segments.len() > 1 {
            proptest::prop_assert_eq!(wire::confine_path(&path), Err(wire::PathRefusal::HostLike));
            return Ok(());
        }
        match wire::confine_path(&path) {
            Ok(confined) => {
                proptest::prop_assert!(!above, "{} kept as {}", path, confined);
                proptest::prop_assert!(confined.starts_with('/'));
                proptest::prop_assert!(!confined[1..].split('/').any(is_dot), "{}", confined);
                let base = reqwest::Url::parse("http://host/agents/a/").unwrap();
                let url = upstream_url(&base, &confined, None);
                proptest::prop_assert!(url.path().starts_with("/agents/a/"), "{} -> {}", path, url);
            }
            Err(why) => {
                proptest::prop_assert_eq!(why, wire::PathRefusal::AboveBase, "{}", path);
                proptest::prop_assert!(above, "{} refused though it stays under the base", path);
            }
        }
    }
}

fn options() -> RelayOptions {
    RelayOptions {
        protocol: Protocol::A2a,
        listen: "127.0.0.1:0".into(),
        upstream: reqwest::Url::parse("http://127.0.0.1:9/").unwrap(),
        from_agent: None,
        to_agent: "weather".into(),
        from_agent_header: None,
        trust_header_from: Vec::new(),
        caller_tokens: None,
        rate_limit: None,
        rate_burst: 1,
        rate_limit_bytes: 1024,
        rate_limit_bytes_burst: 4096,
        queue_size: 1,
        queue_bytes: 1,
        max_message_bytes: 4096,
        http_addr: None,
        connect_timeout: std::time::Duration::from_secs(1),
        drain_timeout: std::time::Duration::from_secs(1),
    }
}

fn refused(opts: &RelayOptions) -> String {
    match checked(opts) {
        Ok(callers) => panic!("{opts:?} accepted as {callers:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_flag_combination_that_lets_a_caller_name_itself_is_refused() {
    let header = Some(axum::http::HeaderName::from_static("x-agent-id"));
    let proxy = vec![trust::parse_net("10.0.0.0/8").unwrap()];
    let tokens = Some(std::path::PathBuf::from("/nonexistent/callers"));

    // No mode at all.
    assert!(refused(&options()).contains("name the caller: --from-agent ID"));
    // Tokens with --from-agent, with a header, with --trust-header-from.
    let e = refused(&RelayOptions {
        caller_tokens: tokens.clone(),
        from_agent: Some("planner".into()),
        ..options()
    });
    assert!(e.contains("drop --from-agent"), "{e}");
    let e = refused(&RelayOptions {
        caller_tokens: tokens.clone(),
        from_agent_header: header.clone(),
        trust_header_from: proxy.clone(),
        ..options()
    });
    assert!(e.contains("two ways to name the caller"), "{e}");
    let e = refused(&RelayOptions {
        caller_tokens: tokens.clone(),
        trust_header_from: proxy.clone(),
        ..options()
    });
    assert!(e.contains("drop it with --caller-tokens"), "{e}");
    // A header without a trusted proxy, with or without a default caller.
    for from_agent in [None, Some("gateway".to_string())] {
        let e = refused(&RelayOptions {
            from_agent_header: header.clone(),
            from_agent,
            ..options()
        });
        assert!(e.contains("add --trust-header-from"), "{e}");
    }
    // A header with a trusted proxy but no caller for requests without it.
    let e = refused(&RelayOptions {
        from_agent_header: header.clone(),
        trust_header_from: proxy.clone(),
        ..options()
    });
    assert!(e.contains("needs --from-agent too"), "{e}");
    // A trusted proxy without the header it would set.
    let e = refused(&RelayOptions {
        from_agent: Some("planner".into()),
        trust_header_from: proxy.clone(),
        ..options()
    });
    assert!(e.contains("only applies to --from-agent-header"), "{e}");
    // A token file that cannot be read stops the relay, naming the flag.
    let e = refused(&RelayOptions {
        caller_tokens: tokens,
        ..options()
    });
    assert!(e.contains("--caller-tokens: cannot read"), "{e}");

    // The two modes that need no file are accepted.
    let fixed = checked(&RelayOptions {
        from_agent: Some("planner".into()),
        ..options()
    });
    assert_eq!(fixed.map(|c| c.mode()).ok(), Some("fixed"));
    let behind_proxy = checked(&RelayOptions {
        from_agent_header: header,
        trust_header_from: proxy,
        from_agent: Some("gateway".into()),
        ..options()
    });
    assert_eq!(behind_proxy.map(|c| c.mode()).ok(), Some("header"));
}

#[test]
fn agent_ids_must_name_identity_subjects_and_the_byte_burst_must_fit_a_request() {
    for (from, to) in [
        ("a.b", "weather"),
        ("planner", "we ather"),
        ("_as", "weather"),
    ] {
        let e = refused(&RelayOptions {
            from_agent: Some(from.into()),
            to_agent: to.into(),
            ..options()
        });
        assert!(e.contains("cannot be an agent id"), "{e}");
    }
    let e = refused(&RelayOptions {
        from_agent: Some("planner".into()),
        rate_limit_bytes_burst: 1000,
        ..options()
    });
    assert!(e.contains("--rate-limit-bytes-burst 1000 is below"), "{e}");
    // No byte budget: the burst does not matter.
    assert!(checked(&RelayOptions {
        from_agent: Some("planner".into()),
        rate_limit_bytes: 0,
        rate_limit_bytes_burst: 1,
        ..options()
    })
    .is_ok());
    let e = trust::CallerTokens::parse("team.lead 0123456789abcdef0123\n").unwrap_err();
    assert!(e.contains("line 1: the agent id"), "{e}");
}

#[test]
fn a_caller_over_its_byte_budget_waits_and_others_do_not() {
    let budget = trust::ByteBudget::new(1000, 4000).unwrap();
    assert!(budget.take("a", 3000).is_ok());
    assert!(budget.take("a", 1000).is_ok());
    let wait = budget.take("a", 2000).unwrap_err();
    assert!(
        wait > std::time::Duration::ZERO && wait <= std::time::Duration::from_secs(2),
        "{wait:?}"
    );
    assert!(budget.take("b", 4000).is_ok(), "budgets are per caller");
    // A request larger than the burst costs the burst: refused while the bucket is not full,
    // never forever.
    assert!(budget.take("c", 1 << 30).is_ok());
    assert!(trust::ByteBudget::new(0, 10).is_none(), "0: no budget");
}
