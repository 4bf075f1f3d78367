//! What the relay reads from the traffic it forwards, as pure functions over bytes: which A2A
//! method an HTTP call is, which key its messages go under, where one SSE frame ends, and which
//! headers belong to one hop only. Nothing here touches a socket or a clock.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// The protocol a relay fronts; it decides what is published and under which type tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// A2A v0.3 / v1.0: JSON-RPC 2.0 and HTTP+JSON bodies, their SSE streams, the agent card.
    A2a,
    /// AG-UI: a `RunAgentInput` POST answered by an SSE stream of events.
    Agui,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::A2a => "a2a",
            Protocol::Agui => "agui",
        }
    }
}

/// What a message published by the relay is, in the exchange it belongs to. The string form is
/// the subject's type tokens and the `kind` label of the published counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    A2aRequest,
    A2aResponse,
    A2aStream,
    Agui,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::A2aRequest,
        Kind::A2aResponse,
        Kind::A2aStream,
        Kind::Agui,
    ];

    /// The subject's type tokens (after `<prefix>.raw.<key>.`).
    pub fn subject_type(self) -> &'static str {
        match self {
            Kind::A2aRequest => "a2a.wire.request",
            Kind::A2aResponse => "a2a.wire.response",
            Kind::A2aStream => "a2a.wire.stream",
            Kind::Agui => "agui",
        }
    }

    /// `Collab-Direction`: whose words the message is.
    pub fn direction(self) -> &'static str {
        match self {
            Kind::A2aRequest => crate::ingest::RelayHeaders::DIRECTION_REQUEST,
            Kind::A2aResponse | Kind::A2aStream | Kind::Agui => {
                crate::ingest::RelayHeaders::DIRECTION_ANSWER
            }
        }
    }

    /// The bounded metric label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::A2aRequest => "a2a_request",
            Kind::A2aResponse => "a2a_response",
            Kind::A2aStream => "a2a_stream",
            Kind::Agui => "agui",
        }
    }
}

/// The subject of a raw message, published as the agent that speaks it:
/// `<prefix>.raw.<key>._as.<speaker>.<type>` (docs/security.md, "Producer identity"). `key` is
/// already a token ([`crate::model::encode_id`]); `None` when `speaker` cannot be an agent token
/// (the relay checks every id it names before it serves).
pub fn subject(prefix: &str, key: &str, speaker: &str, kind: Kind) -> Option<String> {
    crate::identity::subject(prefix, key, speaker, kind.subject_type())
}

/// What the relay publishes of one exchange, decided from the request alone.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// The request body is published as this kind.
    pub request: Option<Kind>,
    /// The answer (its body or its SSE frames) is published.
    pub publish_answers: bool,
    /// The id the exchange's key is made from; `None`: a fresh one per exchange.
    pub context_id: Option<String>,
    /// `Collab-A2A-Method`: the HTTP+JSON route's method, or the JSON-RPC request's.
    pub rest_method: Option<&'static str>,
    /// `Collab-Run-Id`, for AG-UI runs.
    pub run_id: Option<String>,
    /// Why part of the exchange is not published, for a debug line.
    pub note: Option<&'static str>,
}

/// Plan an exchange from its method, path and body: `Whole` when it fits in what is published,
/// else the `Head` read before it passed that size.
pub fn plan(protocol: Protocol, method: &str, path: &str, body: RequestBytes<'_>) -> Plan {
    let whole = match body {
        RequestBytes::Whole(b) => Some(b),
        RequestBytes::Head(_) => None,
    };
    match protocol {
        Protocol::A2a => {
            let call = a2a_call(method, path, whole.unwrap_or_default());
            // A body too large to read whole may still be an A2A call: by its route, or by a
            // JSON-RPC envelope opening it (`jsonrpc` comes before the large parts in practice).
            // Its answers are published; its request is counted as too large.
            let large_call = match body {
                RequestBytes::Head(head) => {
                    rest_method(method, path).is_some() || opens_json_rpc(head)
                }
                RequestBytes::Whole(_) => false,
            };
            let route = whole.is_none().then(|| rest_method(method, path)).flatten();
            let publish_answers = call.recognised || large_call;
            let (request, note) = if call.publish_request || large_call {
                (Some(Kind::A2aRequest), None)
            } else if publish_answers {
                (
                    None,
                    Some("A2A call without a JSON body: its request is not published"),
                )
            } else {
                (
                    None,
                    Some("not an A2A call (no JSON-RPC body, no A2A route): forwarded, not published"),
                )
            };
            Plan {
                request,
                publish_answers,
                context_id: call.context_id,
                rest_method: call.rest_method.or(route),
                run_id: None,
                note,
            }
        }
        Protocol::Agui => {
            let input = agui_input(whole.unwrap_or_default());
            Plan {
                // The run input is not an AG-UI event; the events answering it are.
                request: None,
                publish_answers: true,
                context_id: input.thread_id.or_else(|| input.run_id.clone()),
                rest_method: None,
                run_id: input.run_id,
                note: None,
            }
        }
    }
}

/// A request body as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub enum RequestBytes<'a> {
    Whole(&'a [u8]),
    /// The first bytes of a body too large to publish.
    Head(&'a [u8]),
}

/// How much of a large body [`plan`] looks at.
pub const HEAD_BYTES: usize = 4096;

/// Whether the first [`HEAD_BYTES`] of a body open a JSON object with a `jsonrpc` member.
fn opens_json_rpc(head: &[u8]) -> bool {
    let head = &head[..head.len().min(HEAD_BYTES)];
    head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && head.windows(9).any(|w| w == b"\"jsonrpc\"")
}

/// What the relay learnt about one A2A call from its request line and body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct A2aCall {
    /// A JSON-RPC body or an HTTP+JSON route (agent card included): the exchange is published.
    pub recognised: bool,
    /// The request body is a JSON object worth publishing (JSON-RPC or HTTP+JSON).
    pub publish_request: bool,
    /// The A2A `contextId` the request names, the exchange's key when present.
    pub context_id: Option<String>,
    /// The HTTP+JSON method derived from the route, or the JSON-RPC request's method (its
    /// answers name none).
    pub rest_method: Option<&'static str>,
}

/// Read an A2A call: JSON-RPC when the body is a JSON-RPC object, else HTTP+JSON when the route
/// is one of A2A's.
pub fn a2a_call(method: &str, path: &str, body: &[u8]) -> A2aCall {
    let json = json_object(body);
    if let Some(Value::Object(obj)) = &json {
        if obj.contains_key("jsonrpc") {
            let params = obj.get("params");
            let context_id = params
                .and_then(|p| p.get("message"))
                .and_then(context_id_of)
                .or_else(|| params.and_then(context_id_of));
            // The answers carry no method: naming the request's lets the projector tell the
            // answer of a `tasks/get` from the answer of a send (which is a turn's response).
            let method = obj
                .get("method")
                .and_then(Value::as_str)
                .and_then(crate::ingest::a2a_wire::known_method);
            return A2aCall {
                recognised: true,
                publish_request: true,
                context_id,
                rest_method: method,
            };
        }
    }
    let Some(rest_method) = rest_method(method, path) else {
        return A2aCall::default();
    };
    let context_id = json
        .as_ref()
        .and_then(|v| v.get("message"))
        .and_then(context_id_of)
        .or_else(|| json.as_ref().and_then(context_id_of));
    A2aCall {
        recognised: true,
        publish_request: json.is_some(),
        context_id,
        rest_method: Some(rest_method),
    }
}

/// `contextId` (or the proto field name `context_id`, which protobuf JSON parsers also accept)
/// as a non-empty string.
fn context_id_of(v: &Value) -> Option<String> {
    ["contextId", "context_id"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// The A2A method of an HTTP+JSON call, from its method and path. The route is matched at the
/// end of the path, so a mount point (`/a2a/rest`), a tenant segment or v0.3's `/v1` may stand
/// before it.
pub fn rest_method(method: &str, path: &str) -> Option<&'static str> {
    let path = path
        .split('?')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/');
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = method.eq_ignore_ascii_case("GET");
    let post = method.eq_ignore_ascii_case("POST");
    let delete = method.eq_ignore_ascii_case("DELETE");
    if get
        && (path.ends_with("/.well-known/agent-card.json")
            || path.ends_with("/.well-known/agent.json"))
    {
        return Some("GetAgentCard");
    }
    let last = *segments.last()?;
    if post && last == "message:send" {
        return Some("SendMessage");
    }
    if post && last == "message:stream" {
        return Some("SendStreamingMessage");
    }
    if get && (last == "extendedAgentCard" || last == "card" && segments.len() >= 2) {
        return Some("GetExtendedAgentCard");
    }
    // The rest are under `tasks`: find the last `tasks` segment and read what follows it.
    let at = segments.iter().rposition(|s| *s == "tasks")?;
    match &segments[at + 1..] {
        [] if get => Some("ListTasks"),
        [id] => match id.rsplit_once(':') {
            Some((_, "cancel")) if post => Some("CancelTask"),
            Some((_, "subscribe")) if get || post => Some("SubscribeToTask"),
            None if get => Some("GetTask"),
            _ => None,
        },
        [_, "pushNotificationConfigs"] if post => Some("CreateTaskPushNotificationConfig"),
        [_, "pushNotificationConfigs"] if get => Some("ListTaskPushNotificationConfigs"),
        [_, "pushNotificationConfigs", _] if get => Some("GetTaskPushNotificationConfig"),
        [_, "pushNotificationConfigs", _] if delete => Some("DeleteTaskPushNotificationConfig"),
        _ => None,
    }
}

/// The ids of an AG-UI `RunAgentInput`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AguiInput {
    pub thread_id: Option<String>,
    pub run_id: Option<String>,
}

/// Read `threadId` and `runId` from a run input; a body that is not a JSON object has neither.
pub fn agui_input(body: &[u8]) -> AguiInput {
    let Some(json) = json_object(body) else {
        return AguiInput::default();
    };
    let field = |names: [&str; 2]| {
        names
            .iter()
            .find_map(|k| json.get(*k).and_then(Value::as_str))
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    AguiInput {
        thread_id: field(["threadId", "thread_id"]),
        run_id: field(["runId", "run_id"]),
    }
}

/// The body as a JSON object, or `None` when it is anything else (empty, not JSON, an array, a
/// scalar). Only objects are raw messages.
pub fn json_object(body: &[u8]) -> Option<Value> {
    let body = crate::ingest::without_bom(body);
    let first = body.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    serde_json::from_slice::<Value>(body)
        .ok()
        .filter(Value::is_object)
}

/// Whether `body` is one JSON object, without keeping the parsed value.
pub fn is_json_object(body: &[u8]) -> bool {
    let body = crate::ingest::without_bom(body);
    let Some(first) = body.iter().find(|b| !b.is_ascii_whitespace()) else {
        return false;
    };
    *first == b'{' && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
}

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), which a proxy
/// must not pass on. `Host` is rewritten for the upstream; `Expect` is answered by this hop.
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP: &[&str] = &[
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "expect",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// The header names a `Connection` header value lists: those are hop-by-hop for this message.
pub fn connection_tokens(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|t| !t.is_empty())
}

/// Whether a `Content-Type` value is an SSE stream.
pub fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// An incremental reader of `text/event-stream` bytes (the WHATWG event-stream grammar): feed it
/// chunks as they arrive, get each event's data (its `data:` lines joined by `\n`) once the blank
/// line that ends the event has arrived. Comments, `event:`, `id:` and `retry:` fields are
/// skipped. An event whose data grows past `max_data` is reported as [`Frame::TooLarge`] without
/// holding its bytes.
#[derive(Debug)]
pub struct SseParser {
    max_data: usize,
    /// The line being read, up to its end of line (at most `max_data` plus a field name).
    line: BytesMut,
    /// The line being read was longer than `line` holds.
    line_cut: bool,
    /// The previous chunk ended with CR: a LF starting the next one belongs to that line ending.
    after_cr: bool,
    /// The stream's first bytes are still to come (a leading BOM is dropped).
    at_start: bool,
    /// The data of the event being read, while it fits in `max_data`.
    data: BytesMut,
    has_data: bool,
    /// The size of the event's data, counted on once it no longer fits.
    size: usize,
}

/// One event read by [`SseParser`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Data(Bytes),
    /// Its data passed the limit; at least this many bytes.
    TooLarge(usize),
}

impl SseParser {
    pub fn new(max_data: usize) -> SseParser {
        SseParser {
            max_data,
            line: BytesMut::new(),
            line_cut: false,
            after_cr: false,
            at_start: true,
            data: BytesMut::new(),
            has_data: false,
            size: 0,
        }
    }

    /// Read `chunk`; the events it completes are appended to `out` in stream order.
    pub fn push(&mut self, mut chunk: &[u8], out: &mut Vec<Frame>) {
        if self.at_start && !chunk.is_empty() {
            const BOM: &[u8] = b"\xEF\xBB\xBF";
            // A BOM split over chunks is rare enough to read as text; it then fails JSON parsing
            // and that one frame is not published.
            if chunk.starts_with(BOM) {
                chunk = &chunk[BOM.len()..];
            }
            self.at_start = false;
        }
        if self.after_cr && chunk.first() == Some(&b'\n') {
            chunk = &chunk[1..];
        }
        self.after_cr = false;
        while let Some(at) = chunk.iter().position(|b| *b == b'\n' || *b == b'\r') {
            self.extend_line(&chunk[..at]);
            self.end_line(out);
            let was_cr = chunk[at] == b'\r';
            chunk = &chunk[at + 1..];
            if was_cr {
                match chunk.first() {
                    Some(b'\n') => chunk = &chunk[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
        }
        self.extend_line(chunk);
    }

    /// Bytes of an event that never got its closing blank line when the stream ended (a client
    /// discards such an event, and so does the relay).
    pub fn pending(&self) -> usize {
        self.line.len() + self.size
    }

    fn extend_line(&mut self, part: &[u8]) {
        // A stream without line ends must not grow memory without bound: past what any
        // publishable data line needs, the line is only marked as cut.
        let room = (self.max_data + 8).saturating_sub(self.line.len());
        if part.len() > room {
            self.line.extend_from_slice(&part[..room]);
            self.line_cut = true;
        } else {
            self.line.extend_from_slice(part);
        }
    }

    fn end_line(&mut self, out: &mut Vec<Frame>) {
        let line = self.line.split().freeze();
        let cut = std::mem::take(&mut self.line_cut);
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line.first() == Some(&b':') {
            return;
        }
        let (name, value) = match line.iter().position(|b| *b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (&line[..], &b""[..]),
        };
        if name != b"data" {
            return;
        }
        let join = usize::from(self.has_data);
        self.has_data = true;
        self.size = self.size.saturating_add(join + value.len());
        if cut || self.size > self.max_data {
            // Counted from here on, never held.
            self.size = self.size.max(self.max_data + 1);
            self.data.clear();
            return;
        }
        if join == 1 {
            self.data.extend_from_slice(b"\n");
        }
        self.data.extend_from_slice(value);
    }

    fn dispatch(&mut self, out: &mut Vec<Frame>) {
        if self.has_data {
            if self.size > self.max_data {
                out.push(Frame::TooLarge(self.size));
            } else {
                out.push(Frame::Data(self.data.split().freeze()));
            }
        }
        self.data.clear();
        self.has_data = false;
        self.size = 0;
    }
}

/// Why a request path is refused: each would reach, or could be read by the agent as reaching,
/// something outside the upstream's base path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRefusal {
    /// Not an origin-form path (`*`, or no leading `/`).
    NotAPath,
    /// Starts with `//`, which URL resolvers read as a host name.
    HostLike,
    /// A backslash, which some servers read as `/`.
    Backslash,
    /// An encoded `/` or `\` (`%2f`, `%5c`), or a double-encoded one or dot (`%252e`): a server
    /// that decodes once more would see a separator or a dot segment the relay did not.
    EncodedSeparator,
    /// An encoded control character (`%00`, `%0a`).
    Control,
    /// More `..` segments than segments before them: above the base path.
    AboveBase,
    /// A dot segment with path parameters (`..;/`, `.;x=1`): servers that strip parameters
    /// before resolving dot segments (Tomcat, Jetty, Spring) would climb where the relay did not.
    DotParameters,
}

impl PathRefusal {
    /// What the caller is told; it names the rule, never the path.
    pub fn message(self) -> &'static str {
        match self {
            PathRefusal::NotAPath => "the request target must be a path starting with /",
            PathRefusal::HostLike => {
                "the path starts with // (read as a host name); send a single leading /"
            }
            PathRefusal::Backslash => "the path contains a backslash; use / between segments",
            PathRefusal::EncodedSeparator => {
                "the path contains an encoded / or \\ (%2f, %5c) or a double-encoded one (%25...); send separators unencoded"
            }
            PathRefusal::Control => "the path contains an encoded control character",
            PathRefusal::AboveBase => {
                "the path climbs above the agent's base path with .. segments; only paths under the base are forwarded"
            }
            PathRefusal::DotParameters => {
                "the path has a . or .. segment with ;parameters, which some servers resolve as a dot segment; send plain segments"
            }
        }
    }

    /// The bounded `reason` label and log field.
    pub fn as_str(self) -> &'static str {
        match self {
            PathRefusal::NotAPath => "not_a_path",
            PathRefusal::HostLike => "host_like",
            PathRefusal::Backslash => "backslash",
            PathRefusal::EncodedSeparator => "encoded_separator",
            PathRefusal::Control => "control",
            PathRefusal::AboveBase => "above_base",
            PathRefusal::DotParameters => "dot_parameters",
        }
    }
}

/// A request path made safe to append to the upstream's base path: dot segments (`.`, `..`, and
/// their percent-encoded forms such as `%2e%2E`) are resolved (RFC 3986 section 5.2.4) before
/// joining, and anything that could leave the base is refused. Other segments are kept as they
/// came, still percent-encoded, for the agent to decode.
pub fn confine_path(path: &str) -> Result<String, PathRefusal> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(PathRefusal::NotAPath);
    };
    if rest.starts_with('/') {
        return Err(PathRefusal::HostLike);
    }
    if path.contains('\\') {
        return Err(PathRefusal::Backslash);
    }
    let segments: Vec<&str> = rest.split('/').collect();
    let mut out: Vec<&str> = Vec::with_capacity(segments.len());
    for (i, segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        let decoded = percent_decode(segment);
        if decoded.iter().any(|b| *b == b'/' || *b == b'\\') {
            return Err(PathRefusal::EncodedSeparator);
        }
        if decoded.iter().any(|b| b.is_ascii_control()) {
            return Err(PathRefusal::Control);
        }
        if has_encoded_special(&decoded) {
            return Err(PathRefusal::EncodedSeparator);
        }
        if let Some(end) = decoded.iter().position(|b| *b == b';') {
            if matches!(&decoded[..end], b"." | b"..") {
                return Err(PathRefusal::DotParameters);
            }
        }
        match decoded.as_slice() {
            b"." => {}
            b".." => {
                if out.pop().is_none() {
                    return Err(PathRefusal::AboveBase);
                }
            }
            _ => {
                out.push(segment);
                continue;
            }
        }
        // A path ending in a dot segment names a directory: it keeps its trailing slash.
        if last {
            out.push("");
        }
    }
    Ok(format!("/{}", out.join("/")))
}

/// `%XX` escapes decoded; a `%` not followed by two hex digits stays as it is.
fn percent_decode(segment: &str) -> Vec<u8> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'%'));
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// Whether once-decoded bytes still hold an escape of `.`, `/` or `\` (a double encoding).
fn has_encoded_special(decoded: &[u8]) -> bool {
    decoded.windows(3).any(|w| {
        w[0] == b'%'
            && matches!(
                (w[1], w[2].to_ascii_lowercase()),
                (b'2', b'e') | (b'2', b'f') | (b'5', b'c')
            )
    })
}
