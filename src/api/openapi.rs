//! `GET /api/openapi.json`: the OpenAPI 3.1 description of the API. The paths are written by
//! hand next to the handlers they describe (a test checks that every route is in it); the
//! component schemas are derived from the response types ([`super::schemas`]).

use axum::Json;
use serde_json::{json, Value};

pub async fn handler() -> Json<Value> {
    Json(document())
}

fn list_param(name: &str, description: &str) -> Value {
    json!({
        "name": name, "in": "query", "required": false,
        "description": description,
        "style": "form", "explode": true,
        "schema": {"type": "array", "items": {"type": "string"}}
    })
}

fn param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

fn error_response(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}})
}

/// The document.
pub fn document() -> Value {
    let role = list_param("role", "Event roles, comma-separated or repeated. Default: every role the token may read. Naming a role outside the token's grant is a 403.");
    let typ = list_param(
        "type",
        "Event types, comma-separated or repeated (dot-separated tokens, no spaces, `*` or `>`).",
    );
    let key = list_param("key", "Ordering key (conversation id for a2a.*). An id that is not a subject token is encoded by the id rule.");
    let view = param("view", "Preset: `conversations` (role=conversation.main, type=a2a.response) or `debug` (type=a2a.send,a2a.response,a2a.complete). Explicit role/type replace the preset's.", json!({"type": "string", "enum": ["conversations", "debug"]}));
    let cursor_schema = json!({"type": "string"});
    let common_errors = |extra: &[(&str, &str)]| {
        let mut m = serde_json::Map::new();
        m.insert("400".into(), error_response("A parameter is invalid (unknown role, malformed type, bad cursor, unknown parameter); the error lists the valid values."));
        m.insert(
            "401".into(),
            error_response("No or an invalid bearer token (when access control is on)."),
        );
        m.insert(
            "403".into(),
            error_response("A named role is outside the token's grant."),
        );
        m.insert(
            "503".into(),
            error_response("The event store (NATS) is unavailable."),
        );
        for (code, d) in extra {
            m.insert((*code).into(), error_response(d));
        }
        Value::Object(m)
    };
    let with_ok = |mut errors: Value, ok: Value| {
        if let Some(m) = errors.as_object_mut() {
            m.insert("200".into(), ok);
        }
        errors
    };
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
        "paths": {
            "/api/events": {"get": {
                "operationId": "listEvents",
                "summary": "Filtered projections: the newest `limit` by default, oldest first, with cursors.",
                "parameters": [role.clone(), typ.clone(), key.clone(), view.clone(),
                    param("limit", "Events per page (default 100).", json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 100})),
                    param("after", "Cursor: the oldest `limit` events after it.", cursor_schema.clone()),
                    param("before", "Cursor: the newest `limit` events before it.", cursor_schema.clone())],
                "responses": with_ok(common_errors(&[("410", "The cursor is older than the stream's retention; the error carries oldestCursor.")]),
                    json!({"description": "A page of events.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventPage"}}}}))
            }},
            "/api/events/stream": {"get": {
                "operationId": "streamEvents",
                "summary": "The same filters as Server-Sent Events. Each event's id is its cursor; resume with Last-Event-ID (or after) without loss or repeats. A client whose buffer fills gets a final `event: error` (code slow_consumer, resumeFrom) and the stream closes.",
                "parameters": [role.clone(), typ.clone(), key.clone(), view.clone(),
                    param("after", "Cursor to start after (Last-Event-ID wins). Default: the next event stored.", cursor_schema.clone()),
                    {"name": "Last-Event-ID", "in": "header", "required": false, "schema": {"type": "string"}}],
                "responses": with_ok(common_errors(&[("410", "The cursor is older than the stream's retention.")]),
                    json!({"description": "An event stream; each `data` is an EventItem (#/components/schemas/EventItem, /api/schemas/event-item.schema.json); a final `event: error` carries a StreamError (/api/schemas/stream-error.schema.json).", "content": {"text/event-stream": {"schema": {"type": "string"}}}}))
            }},
            "/api/work-sessions": {"get": {
                "operationId": "listWorkSessions",
                "summary": "Work sessions holding events of the given roles and types, most recently updated first.",
                "parameters": [role.clone(), typ.clone(),
                    list_param("status", "ACTIVE, QUIET or ARCHIVED, comma-separated or repeated."),
                    param("limit", "Sessions returned (default 100).", json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}))],
                "responses": with_ok(common_errors(&[]), json!({"description": "Sessions.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WorkSessionList"}}}}))
            }},
            "/api/work-sessions/{id}": {"get": {
                "operationId": "getWorkSession",
                "summary": "One work session; `format=mplp` returns an MPLP Collab object (schemas/v2/mplp-collab.schema.json).",
                "parameters": [
                    {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}, "description": "The work session id (or the conversation id of a session without one)."},
                    list_param("role", "Roles to see the session through (default: the token's grant)."),
                    param("format", "json (default) or mplp.", json!({"type": "string", "enum": ["json", "mplp"]}))],
                "responses": with_ok(common_errors(&[("404", "No such work session (or none visible to this token).")]),
                    json!({"description": "The session (`{session, role}`), or the MPLP Collab object.", "content": {"application/json": {"schema": {"anyOf": [{"$ref": "#/components/schemas/WorkSessionResponse"}, {"type": "object", "description": "format=mplp: an MPLP Collab object."}]}}}}))
            }},
            "/api/blobs/{id}": {"get": {
                "operationId": "getBlob",
                "summary": "A field moved out of a projection because it was over limits.max_inline_bytes. The projection holds `{\"$ref\": \"blob:<id>\", \"bytes\", \"sha256\", \"contentType\", \"preview\"}` in its place; this returns the content (UTF-8 text for a string, JSON for an object or array), already redacted. Kept as long as projections are (projection.max_age).",
                "parameters": [
                    {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}, "description": "The id after `blob:` in a reference."}],
                "responses": {
                    "200": {"description": "The content. `ETag` is its SHA-256; `Collab-Event-Role` the role it belongs to.", "content": {
                        "text/plain": {"schema": {"type": "string"}},
                        "application/json": {"schema": {}}}},
                    "401": error_response("No or an invalid bearer token (when access control is on)."),
                    "403": error_response("The blob belongs to a role outside the token's grant."),
                    "404": error_response("No such blob (never stored, or expired with its projections)."),
                    "503": error_response("The event store (NATS) is unavailable.")
                }
            }},
            "/api/me": {"get": {
                "operationId": "getMe",
                "summary": "The caller: whether access control is on, the token's grant, and the roles it may read (a UI shows only those).",
                "responses": {
                    "200": {"description": "The caller.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Me"}}}},
                    "401": error_response("No or an invalid bearer token (when access control is on)."),
                    "503": error_response("The event store (NATS) is unavailable.")
                }
            }},
            "/api/schemas": {"get": {
                "operationId": "listSchemas",
                "summary": "The JSON Schemas (2020-12) of the envelope, the payloads the processor writes and every API body; the same types are this document's components.",
                "security": [],
                "responses": {"200": {"description": "The index.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SchemaIndex"}}}}}
            }},
            "/api/schemas/{name}": {"get": {
                "operationId": "getSchema",
                "summary": "One JSON Schema, by file name (its `$id` is its URL).",
                "security": [],
                "parameters": [
                    {"name": "name", "in": "path", "required": true, "schema": {"type": "string"}, "description": "The schema's file name, as listed by /api/schemas (`envelope.schema.json`, ...)."}],
                "responses": {
                    "200": {"description": "The schema.", "content": {"application/schema+json": {"schema": {"type": "object"}}}},
                    "404": error_response("No such schema.")
                }
            }},
            "/api/openapi.json": {"get": {
                "operationId": "openapi",
                "summary": "This document.",
                "security": [],
                "responses": {"200": {"description": "OpenAPI 3.1 document.", "content": {"application/json": {"schema": {"type": "object"}}}}}
            }}
        }
    })
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
}
