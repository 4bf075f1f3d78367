//! `GET /api/openapi.json`: the OpenAPI 3.1 description of the API. The paths are written by
//! hand next to the handlers they describe (a test checks that every route is in it); the
//! component schemas are derived from the response types ([`super::schemas`]).

use axum::Json;
use serde_json::{json, Value};

pub async fn handler(
    axum::extract::State(state): axum::extract::State<super::ApiState>,
    _: super::query::NoQuery,
) -> Json<Value> {
    Json(document_for(state.served().tag))
}

/// ASCII whitespace, which list parameters ignore around each value.
const WS: &str = "[ \\t\\n\\f\\r]*";

/// One character of an event type token: anything but `.`, `,` (the list separator), `*`, `>`,
/// control characters and whitespace.
const TYPE_CHAR: &str =
    "[^.,*>\\x00-\\x20\\x7f-\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]";

/// A cursor: unpadded base64url of `v1:` and 1 to 19 decimal digits (every group of three
/// digits encodes to four characters of a known shape), or empty for none.
/// The digits behind a cursor's 3-byte prefix (which base64 encodes to 4 characters of its own).
const CURSOR_DIGITS: &str = concat!(
    "(?:(?:(?:[MN][DTjz]|O[DT])[AEIMQUYcgk][w-z0-5]){1,6}",
    "|(?:(?:[MN][DTjz]|O[DT])[AEIMQUYcgk][w-z0-5]){0,6}(?:[MN][AQgw]|O[AQ])",
    "|(?:(?:[MN][DTjz]|O[DT])[AEIMQUYcgk][w-z0-5]){0,5}(?:(?:[MN][DTjz]|O[DT])[AEIMQUYcgk]))"
);

/// The cursors of the version whose cursor tag is `tag`: its prefix, then the digits.
fn cursor_pattern(tag: u16) -> String {
    use base64::Engine;
    let prefix =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(super::query::cursor_prefix(tag));
    format!("^(?:{prefix}{CURSOR_DIGITS})?$")
}

/// The pattern of one occurrence of a list parameter: `item`s separated by commas, each
/// optional (empty entries are ignored) and padded by ASCII whitespace.
fn csv_pattern(item: &str) -> String {
    format!("^{WS}(?:{item})?{WS}(?:,{WS}(?:{item})?{WS})*$")
}

/// [`csv_pattern`] with at most `max` entries (empty ones count).
fn csv_pattern_max(item: &str, max: usize) -> String {
    format!(
        "^{WS}(?:{item})?{WS}(?:,{WS}(?:{item})?{WS}){{0,{}}}$",
        max.saturating_sub(1)
    )
}

/// `param` with at most `max` occurrences.
fn at_most(mut param: Value, max: usize) -> Value {
    if let Some(schema) = param.get_mut("schema").and_then(Value::as_object_mut) {
        schema.insert("maxItems".into(), json!(max));
    }
    param
}

/// `word` matched without regard to ASCII case.
fn any_case(word: &str) -> String {
    word.chars()
        .map(|c| {
            if c.is_ascii_alphabetic() {
                format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A list parameter, comma-separated or repeated; `item` is the schema of one occurrence.
fn list_param(name: &str, description: &str, item: Value) -> Value {
    json!({
        "name": name, "in": "query", "required": false,
        "description": description,
        "style": "form", "explode": true,
        "schema": {"type": "array", "items": item}
    })
}

fn param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

fn error_response(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}})
}

/// 401, with the challenge every 401 carries.
fn unauthorized_response() -> Value {
    let mut r = error_response("No or an invalid bearer token (when access control is on).");
    if let Some(m) = r.as_object_mut() {
        m.insert(
            "headers".into(),
            json!({"WWW-Authenticate": {"required": true, "description": "`Bearer realm=\"collab-projector\"`", "schema": {"type": "string"}}}),
        );
    }
    r
}

/// The query parameters and schemas several paths share.
struct Shared {
    /// Every role's name.
    roles: Value,
    /// One occurrence of a role list.
    role_item: Value,
    role: Value,
    typ: Value,
    key: Value,
    view: Value,
    limit_schema: Value,
    cursor_schema: Value,
}

impl Shared {
    fn new(tag: u16) -> Self {
        let roles: Value = crate::model::Role::ALL
            .iter()
            .map(|r| Value::from(r.as_str()))
            .collect();
        let role_names: Vec<String> = crate::model::Role::ALL
            .iter()
            .map(|r| r.as_str().replace('.', "\\."))
            .collect();
        let role_item = json!({
            "type": "string",
            "pattern": csv_pattern(&format!("(?:{})", role_names.join("|"))),
            "examples": roles,
            "description": "One or more of the roles (see Role), comma-separated; whitespace around each and empty entries are ignored."
        });
        let role = list_param("role", "Event roles, comma-separated or repeated. Default: every role the token may read. Naming a role outside the token's grant is a 403.", role_item.clone());
        let type_item = json!({
            "type": "string",
            "maxLength": super::query::MAX_TYPE_VALUE,
            "pattern": csv_pattern_max(&format!("{TYPE_CHAR}+(?:\\.{TYPE_CHAR}+)*"), super::query::MAX_TYPES_PER_PARAM),
            "description": "One to four types, comma-separated: each dot-separated tokens without whitespace, control characters, `*` or `>`. Whitespace around each and empty entries are ignored; at most 256 characters per value."
        });
        let typ = at_most(
            list_param(
                "type",
                "Event types, comma-separated or repeated (dot-separated tokens, no spaces, `*` or `>`): at most 4 parameters of at most 4 types each (400 too_many_types).",
                type_item,
            ),
            super::query::MAX_TYPE_PARAMS,
        );
        let key = list_param("key", "Ordering key (conversation id for a2a.*), repeated for several (a key may contain commas, so values are not split). Any string: a subject token (letters, digits, `_`, `-`, at most 128) is used as it is, any other id is encoded by the id rule. Whitespace around a value is ignored, and so is an empty value (with no key given, every key of the roles is selected). At most 16 keys (400 too_many_keys).",
            json!({"type": "string"}));
        let key = at_most(key, super::query::MAX_KEYS);
        let view = param("view", "Preset: `conversations` (role=conversation.main, type=a2a.response) or `debug` (type=a2a.send,a2a.response,a2a.complete); empty for none. Explicit role/type replace the preset's. One value (repeating it needs the same value).", json!({"type": "string", "enum": ["conversations", "debug", ""]}));
        let limit_schema =
            json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 100});
        let cursor_schema = json!({"type": "string", "pattern": cursor_pattern(tag), "description": "A cursor from a response (`next`, `prev`, `oldest`, an event's `cursor`); empty for none."});
        Shared {
            roles,
            role_item,
            role,
            typ,
            key,
            view,
            limit_schema,
            cursor_schema,
        }
    }
}

/// The errors every query answers with, and `extra` ones.
fn common_errors(extra: &[(&str, &str)]) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("400".into(), error_response("A parameter is invalid (unknown role, malformed type, bad cursor, a one-value parameter repeated with different values, unknown parameter, too many types or keys); the error says what to fix and, for a value, lists the valid ones in `valid`."));
    m.insert("401".into(), unauthorized_response());
    m.insert(
        "403".into(),
        error_response(
            "A named role is outside the token's grant (the error lists the grant in `granted`).",
        ),
    );
    m.insert(
        "503".into(),
        error_response("The event store (NATS) is unavailable (code unavailable; Retry-After says when to try again)."),
    );
    for (code, d) in extra {
        m.insert((*code).into(), error_response(d));
    }
    Value::Object(m)
}

/// [`common_errors`] of a route that scans the projection stream, capped and stopped by
/// `http.scans`, `http.scans_per_token` and `http.scan_timeout`.
fn scan_errors(extra: &[(&str, &str)]) -> Value {
    let mut all = extra.to_vec();
    all.push(("429", "The token already has as many scans running as http.scans_per_token allows (code too_many_scans; Retry-After says when to try again)."));
    all.push(("503", "The event store (NATS) is unavailable (code unavailable), the server has as many scans running as http.scans allows (code too_many_scans; both with Retry-After), or the scan ran past http.scan_timeout and was stopped (code scan_timeout): narrow it with role, key, type or since."));
    common_errors(&all)
}

/// `errors` with `ok` as the 200 response.
fn with_ok(mut errors: Value, ok: Value) -> Value {
    if let Some(m) = errors.as_object_mut() {
        m.insert("200".into(), ok);
    }
    errors
}

/// The document.
pub fn document() -> Value {
    document_for(0)
}

/// The document of the API serving the version whose cursor tag is `tag` (its cursors' pattern).
pub fn document_for(tag: u16) -> Value {
    let shared = Shared::new(tag);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "collab-projector projection API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Role-partitioned projections of multi-agent collaboration events, read from NATS JetStream (stream COLLAB_PROJ) and the work-session bucket. Cursors are opaque strings wrapping the projection stream's sequence."
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Tokens from http.tokens, each granted a set of roles. Without configured tokens access control is off (loopback only)."}},
            "schemas": super::schemas::components()
        },
        "security": [{"bearer": []}, {}],
        "paths": paths(&shared)
    })
}

/// Every path, in the order the document lists them.
fn paths(p: &Shared) -> Value {
    let mut paths = serde_json::Map::new();
    for (path, item) in [
        ("/api/events", events(p)),
        ("/api/events/stream", events_stream(p)),
        ("/api/work-sessions", work_sessions(p)),
        ("/api/work-sessions/{id}", work_session(p)),
        ("/api/threads/{key}", thread(p)),
        ("/api/search", search(p)),
        ("/api/tree/{key}", tree(p)),
        ("/api/waiting", waiting(p)),
        ("/api/blobs/{id}", blob(&p.roles)),
        ("/api/me", me()),
        ("/api/schemas", schema_index()),
        ("/api/schemas/{name}", schema()),
        ("/api/openapi.json", openapi()),
    ] {
        paths.insert(path.into(), item);
    }
    Value::Object(paths)
}

/// `GET /api/events`: a page of filtered events.
fn events(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "listEvents",
        "summary": "Filtered projections: the newest `limit` by default, oldest first, with cursors.",
        "parameters": [p.role.clone(), p.typ.clone(), p.key.clone(), p.view.clone(),
            param("limit", "Events per page (default 100). One value.", p.limit_schema.clone()),
            param("after", "Cursor: the oldest `limit` events after it (with `before`: between the two). One value.", p.cursor_schema.clone()),
            param("before", "Cursor: the newest `limit` events before it (with `after`: the oldest `limit` between the two). One value.", p.cursor_schema.clone())],
        "responses": with_ok(scan_errors(&[("410", "The cursor is older than the stream's retention (code cursor_expired; the error carries oldestCursor), past its newest event (code cursor_ahead: the stream was made again since the cursor was issued; start again), or a position in a projection version this API no longer serves (code version_switched: start again without a cursor).")]),
            json!({"description": "A page of events.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventPage"}}}}))
    }})
}

/// `GET /api/events/stream`: the filtered events as Server-Sent Events.
fn events_stream(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "streamEvents",
        "summary": "The same filters as Server-Sent Events. Each event's id is its cursor; resume with Last-Event-ID (or after) without loss or repeats. A client whose buffer fills gets a final `event: error` (code slow_consumer, resumeFrom) and the stream closes; so does every stream after http.sse_max_stream_lifetime (code lifetime_reached: reconnect at once with Last-Event-ID set to resumeFrom), and every stream when the API is switched to another projection version (code version_switched: reconnect without Last-Event-ID).",
        "parameters": [p.role.clone(), p.typ.clone(), p.key.clone(), p.view.clone(),
            param("after", "Cursor to start after (Last-Event-ID wins). Default: the next event stored. One value.", p.cursor_schema.clone()),
            {"name": "Last-Event-ID", "in": "header", "required": false, "description": "The `id` of the last event received (a cursor); empty for none.", "schema": p.cursor_schema.clone()}],
        "responses": with_ok(common_errors(&[("410", "The cursor is older than the stream's retention (code cursor_expired), past its newest event (code cursor_ahead: the stream was made again since the cursor was issued; reconnect without Last-Event-ID), or a position in a projection version this API no longer serves (code version_switched: reconnect without Last-Event-ID)."), ("429", "The token already has as many event streams open as http.sse_max_streams_per_token allows (code too_many_streams); close one first."), ("503", "The event store (NATS) is unavailable (code unavailable), or the server has as many event streams open as http.sse_max_streams allows (code too_many_streams); retry later.")]),
            json!({"description": "An event stream; each `data` is an EventItem (#/components/schemas/EventItem, /api/schemas/event-item.schema.json); a final `event: error` carries a StreamError (#/components/schemas/StreamError, /api/schemas/stream-error.schema.json).", "content": {"text/event-stream": {"schema": {
                "type": "object", "required": ["data"],
                "properties": {
                    "event": {"type": "string", "enum": ["message", "error"]},
                    "id": {"type": "string", "description": "The event's cursor."},
                    "data": {"type": "string", "contentMediaType": "application/json"}
                }}}}}))
    }})
}

/// `GET /api/work-sessions`: the work sessions.
fn work_sessions(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "listWorkSessions",
        "summary": "Work sessions holding events of the given roles and types, most recently updated first.",
        "parameters": [p.role.clone(), p.typ.clone(),
            list_param("status", "ACTIVE, QUIET or ARCHIVED (any case), comma-separated or repeated.",
                json!({"type": "string", "pattern": csv_pattern(&format!("(?:{}|{}|{})", any_case("ACTIVE"), any_case("QUIET"), any_case("ARCHIVED")))})),
            param("limit", "Sessions returned (default 100). One value.", p.limit_schema.clone())],
        "responses": with_ok(common_errors(&[("429", "The token already has as many work-session lists being read as http.session_lists_per_token allows (code too_many_lists); wait for one to finish."), ("503", "The event store (NATS) is unavailable (code unavailable), or the server has as many work-session lists being read as http.session_lists allows (code too_many_lists); retry later.")]), json!({"description": "Sessions.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WorkSessionList"}}}}))
    }})
}

/// `GET /api/work-sessions/{id}`: one work session.
fn work_session(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "getWorkSession",
        "summary": "One work session; `format=mplp` returns an MPLP Collab object (schemas/v2/mplp-collab.schema.json).",
        "parameters": [
            {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}, "description": "The work session id (or the conversation id of a session without one)."},
            list_param("role", "Roles to see the session through (default: the token's grant), comma-separated or repeated. Naming a role outside the token's grant is a 403.", p.role_item.clone()),
            param("format", "json (default; also when empty) or mplp. One value.", json!({"type": "string", "enum": ["json", "mplp", ""]}))],
        "responses": with_ok(common_errors(&[("404", "No such work session (or none visible to this token).")]),
            json!({"description": "The session (`{session, role}`), or the MPLP Collab object.", "content": {"application/json": {"schema": {"anyOf": [{"$ref": "#/components/schemas/WorkSessionResponse"}, {"type": "object", "description": "format=mplp: an MPLP Collab object."}]}}}}))
    }})
}

/// `GET /api/search`: events by agent, outcome, time and text.
fn search(p: &Shared) -> Value {
    // An empty value is no bound.
    let time = json!({"type": "string", "anyOf": [{"format": "date-time"}, {"maxLength": 0}]});
    let limit = json!({"type": "integer", "minimum": 1, "maximum": 500, "default": 50});
    json!({"get": {
        "operationId": "searchEvents",
        "summary": "Events matching every criterion given, newest first: an agent the event names (agentId, fromAgent, toAgent or its publisher), an outcome (blocked; waiting: an answer asking for input or credentials, a run ended on an interrupt; error: a blocked turn, run.failed, tool.failed, a2a.error), a time range on the event time, and text (case-insensitive, in the event's JSON). The stream is scanned backwards, at most 50,000 events per request; `prev` continues further back.",
        "parameters": [p.role.clone(), p.typ.clone(),
            param("q", "Text the event must contain (case-insensitive). One value.", json!({"type": "string"})),
            param("agent", "An agent the event names (case-insensitive). One value.", json!({"type": "string"})),
            param("outcome", "blocked, waiting or error. One value.", json!({"type": "string", "enum": ["blocked", "waiting", "error", ""]})),
            param("since", "Events at or after this time (RFC 3339). One value.", time.clone()),
            param("until", "Events before this time (RFC 3339). One value.", time),
            param("limit", "Events per page (default 50, at most 500). One value.", limit),
            param("before", "Cursor (`prev` of a previous page): scan older events than it. One value.", p.cursor_schema.clone())],
        "responses": with_ok(scan_errors(&[("410", "The cursor is a position in a projection version this API no longer serves (code version_switched): start again without a cursor.")]),
            json!({"description": "Matching events.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SearchPage"}}}}))
    }})
}

/// `GET /api/threads/{key}`: one thread, assembled.
fn thread(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "getThread",
        "summary": "One conversation, AG-UI thread or session as people read it: its runs (messages assembled from their deltas, tool calls with arguments and results, steps, duration, outcome: running, finished, waiting, failed, timed_out) and its turns (request and reply in place; awaiting_reply, answered, waiting, blocked). The newest 5000 events of the key in the token's roles are read; `truncated` says when older ones exist.",
        "parameters": [
            {"name": "key", "in": "path", "required": true, "schema": {"type": "string", "pattern": "\\S"}, "description": "The ordering key: a conversation id, AG-UI thread id or session id (as events' `key`). Whitespace around it is ignored; a key of only whitespace is refused (400 invalid_key)."},
            list_param("role", "Roles to read the thread's events from (default: the token's grant), comma-separated or repeated. Naming a role outside the token's grant is a 403.", p.role_item.clone())],
        "responses": with_ok(scan_errors(&[("404", "No events of the key in the roles read.")]),
            json!({"description": "The thread (`{thread, role}`).", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ThreadResponse"}}}}))
    }})
}

/// `GET /api/tree/{key}`: the delegation tree below a thread, run or turn.
fn tree(p: &Shared) -> Value {
    json!({"get": {
        "operationId": "getTree",
        "summary": "The delegation tree below a conversation, AG-UI thread or session, or below one of its runs or turns: the conversations it delegated to (parentConversationId, parentSessionId, parentThreadId, parentRunId, A2A referenceTaskIds, a2a.spawn targets), the tasks its turns and runs carry (taskId), runs nested by parentRunId and their tool calls. Each node has its kind, label, start, duration, outcome, its own usage and the total rolled up from below, costed by the projector's price table. The newest 2000 events of the key are read, the 50,000 projections stored from shortly before its first event (the item's) on are scanned for links, then the newest 2000 events of each linked key, at most 64 keys; `truncated` and `scanComplete` say when a bound cut something off.",
        "parameters": [
            {"name": "key", "in": "path", "required": true, "schema": {"type": "string", "pattern": "\\S"}, "description": "The ordering key: a conversation id, AG-UI thread id or session id (as events' `key`). Whitespace around it is ignored; a key of only whitespace is refused (400 invalid_key)."},
            param("item", "Root the tree at one run or turn of the key: `run:<run id>` or `turn:<turn id>` (empty: the whole key). One value.", json!({"type": "string", "pattern": "^(?:(?:run|turn):[\\s\\S]+)?$"})),
            list_param("role", "Roles to read (default: the token's grant), comma-separated or repeated. Naming a role outside the token's grant is a 403.", p.role_item.clone())],
        "responses": with_ok(scan_errors(&[("404", "No events of the key in the roles read, or no such run or turn among its newest events.")]),
            json!({"description": "The tree (`{tree, keys, events, truncated, scanned, scanComplete, role}`).", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TreeResponse"}}}}))
    }})
}

/// `GET /api/waiting`: the turns and runs waiting now.
fn waiting(p: &Shared) -> Value {
    let limit = json!({"type": "integer", "minimum": 1, "maximum": 500, "default": 100});
    json!({"get": {
        "operationId": "listWaiting",
        "summary": "Every turn and run waiting now, longest waiting first: answers asking for input or credentials (A2A input-required, auth-required), runs ended on an interrupt (AG-UI), and turns still awaiting their reply. Each says who waits, on whom, for what, since when, and the thread (`key`) and `item` to open. A wait ends when a later send resumes the turn's conversation or a later run starts in the run's thread. The newest 10,000 turn and run events (a2a.send, a2a.response, run.started, run.finished, run.failed) are read.",
        "parameters": [p.role.clone(),
            param("limit", "Waits returned (default 100, at most 500). One value.", limit)],
        "responses": with_ok(scan_errors(&[]),
            json!({"description": "The waits.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WaitingList"}}}}))
    }})
}

/// `GET /api/blobs/{id}`: a field moved to the blob store.
fn blob(roles: &Value) -> Value {
    json!({"get": {
        "operationId": "getBlob",
        "summary": "A field moved out of a projection because it was over limits.max_inline_bytes. The projection holds `{\"$ref\": \"blob:<id>\", \"bytes\", \"sha256\", \"contentType\", \"preview\"}` in its place; this returns the content (UTF-8 text for a string, JSON for an object or array), already redacted. Kept as long as projections are (projection.max_age).",
        "parameters": [
            {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}, "description": "The id after `blob:` in a reference."}],
        "responses": {
            "200": {"description": "The content. `ETag` is its SHA-256; `Collab-Event-Role` the role it belongs to.", "headers": {
                "Collab-Event-Role": {"required": true, "description": "The role of the event the field came from.", "schema": {"type": "string", "enum": roles}},
                "ETag": {"description": "The content's SHA-256, quoted.", "schema": {"type": "string"}},
                "Cache-Control": {"required": true, "schema": {"type": "string"}},
                "X-Content-Type-Options": {"required": true, "schema": {"type": "string", "const": "nosniff"}}}, "content": {
                "text/plain": {"schema": {"type": "string"}},
                "application/json": {"schema": {}},
                "application/octet-stream": {"schema": {"type": "string", "contentEncoding": "binary"}}}},
            "400": error_response("A query parameter was given: this endpoint takes none (code unknown_parameter)."),
            "401": unauthorized_response(),
            "404": error_response("No such blob for this token: never stored, expired with its projections, or of a role outside the token's grant (the same answer, so a token cannot learn that another role holds a given content)."),
            "503": error_response("The event store (NATS) is unavailable.")
        }
    }})
}

/// `GET /api/me`: the caller.
fn me() -> Value {
    json!({"get": {
        "operationId": "getMe",
        "summary": "The caller: whether access control is on, the token's grant, and the roles it may read (a UI shows only those).",
        "responses": {
            "200": {"description": "The caller.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Me"}}}},
            "400": error_response("A query parameter was given: this endpoint takes none (code unknown_parameter)."),
            "401": error_response("No or an invalid bearer token (when access control is on)."),
            "503": error_response("The event store (NATS) is unavailable.")
        }
    }})
}

/// `GET /api/schemas`: the index of the JSON Schemas.
fn schema_index() -> Value {
    json!({"get": {
        "operationId": "listSchemas",
        "summary": "The JSON Schemas (2020-12) of the envelope, the payloads the processor writes and every API body; the same types are this document's components.",
        "security": [],
        "responses": {"200": {"description": "The index.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SchemaIndex"}}}},
            "400": error_response("A query parameter was given: this endpoint takes none (code unknown_parameter).")}
    }})
}

/// `GET /api/schemas/{name}`: one JSON Schema.
fn schema() -> Value {
    json!({"get": {
        "operationId": "getSchema",
        "summary": "One JSON Schema, by file name (its `$id` is its URL).",
        "security": [],
        "parameters": [
            {"name": "name", "in": "path", "required": true, "schema": {"type": "string"}, "description": "The schema's file name, as listed by /api/schemas (`envelope.schema.json`, ...)."}],
        "responses": {
            "200": {"description": "The schema.", "content": {"application/schema+json": {"schema": {"type": "object"}}}},
            "400": error_response("A query parameter was given: this endpoint takes none (code unknown_parameter)."),
            "404": error_response("No such schema.")
        }
    }})
}

/// `GET /api/openapi.json`: this document.
fn openapi() -> Value {
    json!({"get": {
        "operationId": "openapi",
        "summary": "This document.",
        "security": [],
        "responses": {"200": {"description": "OpenAPI 3.1 document.", "content": {"application/json": {"schema": {"type": "object"}}}},
            "400": error_response("A query parameter was given: this endpoint takes none (code unknown_parameter).")}
    }})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_described() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        for path in [
            "/api/events",
            "/api/events/stream",
            "/api/work-sessions",
            "/api/work-sessions/{id}",
            "/api/blobs/{id}",
            "/api/me",
            "/api/openapi.json",
            "/api/schemas",
            "/api/schemas/{name}",
        ] {
            assert!(doc["paths"][path]["get"].is_object(), "{path}");
        }
        let names: Vec<&str> = doc["paths"]["/api/events"]["get"]["parameters"]
            .as_array()
            .map(|a| a.iter().filter_map(|p| p["name"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(
            names,
            ["role", "type", "key", "view", "limit", "after", "before"]
        );
    }

    fn item_pattern(doc: &Value, path: &str, name: &str) -> regex::Regex {
        let params = doc["paths"][path]["get"]["parameters"].as_array();
        let p = params
            .and_then(|ps| ps.iter().find(|p| p["name"] == name))
            .map(|p| {
                let s = &p["schema"];
                s["items"]["pattern"]
                    .as_str()
                    .or(s["pattern"].as_str())
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default();
        regex::Regex::new(&p).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// The patterns accept exactly what the server's parsers accept, on samples of each side.
    #[test]
    fn patterns_agree_with_the_parsers() {
        use crate::api::query::{self, decode_cursor, encode_cursor};
        let doc = document();
        let cursor = item_pattern(&doc, "/api/events", "after");
        for seq in [0, 1, 9, 10, 99, 100, 123_456, 9_999_999_999_999_999_999] {
            let c = encode_cursor(0, seq);
            assert!(cursor.is_match(&c), "{seq}");
            assert_eq!(decode_cursor(0, &c).ok(), Some(seq), "{seq}");
        }
        // A version's document gives its own cursors' pattern, and no other version's.
        let tag = crate::served::cursor_tag("v2");
        let doc2 = document_for(tag);
        let cursor2 = item_pattern(&doc2, "/api/events", "after");
        for seq in [0, 1, 123_456, 9_999_999_999_999_999_999] {
            assert!(cursor2.is_match(&encode_cursor(tag, seq)), "{seq}");
            assert!(!cursor2.is_match(&encode_cursor(0, seq)), "{seq}");
            assert!(!cursor.is_match(&encode_cursor(tag, seq)), "{seq}");
        }
        assert!(cursor.is_match(""));
        for junk in ["djE6", "djE6MQ=", " djE6MQ", "djE6MR", "djI6MQ", "x"] {
            assert!(decode_cursor(0, junk).is_err(), "{junk}");
            assert!(!cursor.is_match(junk), "{junk}");
        }
        let params = |name: &str, v: &str| {
            query::Params::new(vec![(name.to_string(), v.to_string())], &[name]).ok()
        };
        let role = item_pattern(&doc, "/api/events", "role");
        for (v, ok) in [
            ("conversation.main", true),
            (" conversation.main ,, system.observability", true),
            ("", true),
            ("conversation.mian", false),
            ("\u{a0}conversation.main", false),
        ] {
            assert_eq!(role.is_match(v), ok, "{v:?}");
            let parsed = params("role", v).map(|p| query::roles(&p).is_ok());
            assert_eq!(parsed, Some(ok), "{v:?}");
        }
        let typ = item_pattern(&doc, "/api/events", "type");
        for (v, ok) in [
            ("a2a.send", true),
            ("a2a.send, task.updated ,", true),
            ("caf\u{e9}.\u{1f600}", true),
            ("a b", false),
            ("a..b", false),
            ("a.*", false),
            ("a\u{85}", false),
            ("a\u{3000}b", false),
        ] {
            assert_eq!(typ.is_match(v), ok, "{v:?}");
            let parsed = params("type", v).map(|p| query::types(&p).is_ok());
            assert_eq!(parsed, Some(ok), "{v:?}");
        }
    }
}
