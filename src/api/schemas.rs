//! JSON Schemas (2020-12) of what the projector publishes and the API returns, derived from the
//! Rust types that produce it.
//!
//! - `GET /api/schemas`: the index (name, URL, what each describes);
//! - `GET /api/schemas/{name}`: one schema, as checked in under `schemas/` in the repository.
//!
//! The same schemas are the OpenAPI document's `components.schemas` ([`components`]), with their
//! references pointing inside that document.

use super::error::{ApiError, ErrorBody};
use super::events::EventPage;
use super::me::Me;
use super::query::{NoQuery, PathParam};
use super::search::SearchPage;
use super::sessions::{WorkSessionList, WorkSessionResponse};
use super::store::EventItem;
use super::stream::StreamError;
use super::threads::ThreadResponse;
use super::tree::TreeResponse;
use super::waiting::WaitingList;
use crate::model::Envelope;
use crate::turns::payload::{BlockedPayload, RunFailedPayload, SuppressedPayload};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::generate::SchemaSettings;
use schemars::transform::{transform_subschemas, Transform};
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::Serialize;
use serde_json::{Map, Value};
use std::sync::OnceLock;

/// Where the schemas are served; a schema's `$id` is this followed by its file name.
pub const BASE_URL: &str = "/api/schemas/";

/// The JSON Schema dialect of every schema.
pub const DIALECT: &str = "https://json-schema.org/draft/2020-12/schema";

/// One schema: its file name, what it describes, and the type it is derived from.
struct Entry {
    file: &'static str,
    about: &'static str,
    root: fn() -> Schema,
    component: fn(&mut SchemaGenerator) -> Schema,
}

fn settings() -> SchemaSettings {
    SchemaSettings::draft2020_12()
        .for_serialize()
        .with_transform(NoNullWhenOmitted)
}

/// A property that is left out when it has no value (not `required`) is never `null`: drop the
/// `null` schemars allows for an `Option`, so a `null` in the output is drift.
#[derive(Debug, Clone)]
struct NoNullWhenOmitted;

impl Transform for NoNullWhenOmitted {
    fn transform(&mut self, schema: &mut Schema) {
        transform_subschemas(self, schema);
        let required: Vec<String> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        if let Some(Value::Object(properties)) = schema.get_mut("properties") {
            for (name, property) in properties.iter_mut() {
                if !required.contains(name) {
                    strip_null(property);
                }
            }
        }
    }
}

fn strip_null(property: &mut Value) {
    let Value::Object(p) = property else {
        return;
    };
    if let Some(Value::Array(types)) = p.get_mut("type") {
        types.retain(|t| t != "null");
        if let [only] = types.as_slice() {
            let only = only.clone();
            p.insert("type".into(), only);
        }
    }
    let null = serde_json::json!({"type": "null"});
    let inner = match p.get("anyOf") {
        Some(Value::Array(options)) if options.len() == 2 && options.contains(&null) => {
            options.iter().find(|o| **o != null).cloned()
        }
        _ => None,
    };
    if let Some(Value::Object(inner)) = inner {
        p.remove("anyOf");
        for (k, v) in inner {
            p.entry(k).or_insert(v);
        }
    }
}

fn root<T: JsonSchema>() -> Schema {
    settings().into_generator().into_root_schema_for::<T>()
}

fn component<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    generator.subschema_for::<T>()
}

fn entry<T: JsonSchema>(file: &'static str, about: &'static str) -> Entry {
    Entry {
        file,
        about,
        root: root::<T>,
        component: component::<T>,
    }
}

fn entries() -> Vec<Entry> {
    vec![
        entry::<Envelope>(
            "envelope.schema.json",
            "A projected event (a message on collab.proj.<role>.<key>.<type>), and the `event` of an API event item.",
        ),
        entry::<BlockedPayload>(
            "blocked-payload.schema.json",
            "The payload of a blocked a2a.response (timeout, error or not_found), with the handoff sections goal, outcome, evidence, next_action.",
        ),
        entry::<SuppressedPayload>(
            "suppressed-payload.schema.json",
            "The payload of a2a.response.suppressed and run.terminal.suppressed: a further response or run terminal, with a reference to what won.",
        ),
        entry::<RunFailedPayload>(
            "run-failed-payload.schema.json",
            "The payload of the run.failed the processor writes for an AG-UI run that stored no terminal by its deadline.",
        ),
        entry::<EventItem>(
            "event-item.schema.json",
            "One event of GET /api/events, and the data of each event of GET /api/events/stream.",
        ),
        entry::<EventPage>(
            "event-page.schema.json",
            "The body of GET /api/events.",
        ),
        entry::<StreamError>(
            "stream-error.schema.json",
            "The data of the final `event: error` of GET /api/events/stream.",
        ),
        entry::<WorkSessionList>(
            "work-session-list.schema.json",
            "The body of GET /api/work-sessions.",
        ),
        entry::<WorkSessionResponse>(
            "work-session.schema.json",
            "The body of GET /api/work-sessions/{id} (format=json).",
        ),
        entry::<ThreadResponse>(
            "thread.schema.json",
            "The body of GET /api/threads/{key}: runs with assembled messages, tool calls and steps, and turns with their replies in place.",
        ),
        entry::<SearchPage>(
            "search-page.schema.json",
            "The body of GET /api/search: events matching an agent, outcome, time range and text, newest first.",
        ),
        entry::<TreeResponse>(
            "tree.schema.json",
            "The body of GET /api/tree/{key}: the delegation tree below a thread, run or turn, across keys, with start, duration, outcome and usage rolled up at each node.",
        ),
        entry::<WaitingList>(
            "waiting.schema.json",
            "The body of GET /api/waiting: the turns and runs waiting now, who waits on whom, for what and since when.",
        ),
        entry::<Me>("me.schema.json", "The body of GET /api/me."),
        entry::<ErrorBody>(
            "error.schema.json",
            "The body of every API error response (400, 401, 403, 404, 410, 503).",
        ),
        entry::<SchemaIndex>(
            "schema-index.schema.json",
            "The body of GET /api/schemas.",
        ),
    ]
}

/// A schema's URL.
pub fn url(file: &str) -> String {
    format!("{BASE_URL}{file}")
}

/// A root schema with `$schema`, `$id`, `title` and `description` first.
fn file_schema(e: &Entry) -> Value {
    let mut out = Map::new();
    out.insert("$schema".into(), Value::from(DIALECT));
    out.insert("$id".into(), Value::from(url(e.file)));
    if let Value::Object(mut fields) = (e.root)().to_value() {
        for first in ["title", "description"] {
            if let Some(v) = fields.shift_remove(first) {
                out.insert(first.into(), v);
            }
        }
        out.extend(fields);
    }
    Value::Object(out)
}

/// Every schema, by file name, in a fixed order.
pub fn all() -> Vec<(&'static str, Value)> {
    entries().iter().map(|e| (e.file, file_schema(e))).collect()
}

/// A schema as its file holds it: pretty-printed, with a final newline.
pub fn file_text(schema: &Value) -> String {
    let mut text = serde_json::to_string_pretty(schema).unwrap_or_default();
    text.push('\n');
    text
}

struct Served {
    index: SchemaIndex,
    texts: Vec<(&'static str, String)>,
}

fn served() -> &'static Served {
    static SERVED: OnceLock<Served> = OnceLock::new();
    SERVED.get_or_init(|| Served {
        index: SchemaIndex {
            schemas: entries()
                .iter()
                .map(|e| SchemaLink {
                    name: e.file.to_string(),
                    url: url(e.file),
                    description: e.about.to_string(),
                })
                .collect(),
        },
        texts: all()
            .into_iter()
            .map(|(file, v)| (file, file_text(&v)))
            .collect(),
    })
}

/// The schemas the API serves.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SchemaIndex {
    pub schemas: Vec<SchemaLink>,
}

/// One schema the API serves.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SchemaLink {
    /// Its file name (`envelope.schema.json`).
    #[schemars(regex(pattern = r"^[a-z-]+\.schema\.json$"))]
    pub name: String,
    /// Where it is served (`/api/schemas/<name>`), also its `$id`.
    pub url: String,
    /// What it describes.
    pub description: String,
}

/// `GET /api/schemas`.
pub async fn index(_: NoQuery) -> Json<SchemaIndex> {
    Json(served().index.clone())
}

/// `GET /api/schemas/{name}`.
pub async fn one(PathParam(name): PathParam, _: NoQuery) -> Result<Response, ApiError> {
    let text = served()
        .texts
        .iter()
        .find(|(file, _)| *file == name)
        .map(|(_, text)| text.clone())
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no schema `{name}`; the schemas are listed at /api/schemas"
            ))
            .with_valid(served().texts.iter().map(|(file, _)| *file))
        })?;
    Ok(([(header::CONTENT_TYPE, "application/schema+json")], text).into_response())
}

/// The schemas as OpenAPI components: every type under `#/components/schemas/<Name>`, with the
/// references between them rewritten to point there, and each served schema's URL in its
/// description and `externalDocs`.
pub fn components() -> Map<String, Value> {
    let mut generator = settings()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    let mut served_as = Vec::new();
    for e in entries() {
        let reference = (e.component)(&mut generator);
        if let Some(name) = reference
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix("#/components/schemas/"))
        {
            served_as.push((name.to_string(), e.file));
        }
    }
    let mut defs = generator.take_definitions(true);
    for (name, file) in served_as {
        if let Some(Value::Object(schema)) = defs.get_mut(&name) {
            let about = schema
                .get("description")
                .and_then(Value::as_str)
                .map(|d| format!("{d}\n\n"))
                .unwrap_or_default();
            schema.insert(
                "description".into(),
                Value::from(format!("{about}JSON Schema: {}", url(file))),
            );
            schema.insert(
                "externalDocs".into(),
                serde_json::json!({"description": "The JSON Schema (2020-12) of this type", "url": url(file)}),
            );
        }
    }
    let mut names: Vec<String> = defs.keys().cloned().collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|n| defs.remove(&n).map(|v| (n, v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeSet;

    fn dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas")
    }

    #[test]
    fn checked_in_schemas_are_the_generated_ones() {
        let failures: Vec<String> = all()
            .iter()
            .filter_map(|(file, schema)| {
                crate::golden::check(&dir().join(file), &file_text(schema))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "schemas/ differs from the types (regenerate with UPDATE_GOLDEN=1 cargo test --lib api::schemas):\n{}",
            failures.join("\n")
        );
        let generated: BTreeSet<String> = all().iter().map(|(f, _)| f.to_string()).collect();
        let on_disk: BTreeSet<String> = std::fs::read_dir(dir())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".schema.json"))
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(
            on_disk, generated,
            "schema files without a type, or missing"
        );
        let readme = std::fs::read_to_string(dir().join("README.md")).unwrap_or_default();
        for file in &generated {
            assert!(
                readme.contains(file.as_str()),
                "schemas/README.md does not describe {file}"
            );
        }
    }

    #[test]
    fn every_schema_compiles_and_names_itself() {
        for (file, schema) in all() {
            assert_eq!(schema["$id"], json!(url(file)), "{file}");
            assert_eq!(schema["$schema"], json!(DIALECT), "{file}");
            assert!(
                jsonschema::draft202012::new(&schema).is_ok(),
                "{file} does not compile"
            );
        }
    }

    fn validator(file: &str) -> jsonschema::Validator {
        let schema = all()
            .into_iter()
            .find(|(f, _)| *f == file)
            .map(|(_, s)| s)
            .unwrap_or(Value::Null);
        match jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
        {
            Ok(v) => v,
            Err(e) => panic!("{file}: {e}"),
        }
    }

    #[test]
    fn the_schemas_are_strict_where_the_types_are_closed() {
        let envelope = validator("envelope.schema.json");
        let good = json!({"type": "a2a.send", "eventRole": "conversation.main", "payload": {"any": 1},
            "rawEventRef": {"stream": "COLLAB_RAW", "seq": 3, "subject": "collab.raw.c.a2a.send", "storedAt": "2026-01-01T00:00:00.000Z"}});
        assert!(envelope.is_valid(&good));
        let mut unknown_field = good.clone();
        unknown_field["surprise"] = json!(1);
        assert!(!envelope.is_valid(&unknown_field));
        let mut bad_role = good.clone();
        bad_role["eventRole"] = json!("conversation.mian");
        assert!(!envelope.is_valid(&bad_role));
        let mut bad_time = good;
        bad_time["rawEventRef"]["storedAt"] = json!("yesterday");
        assert!(!envelope.is_valid(&bad_time));

        let suppressed = validator("suppressed-payload.schema.json");
        let turn = json!({"reason": "duplicate", "winner": {"msgId": "turn:c:0", "rawSeq": 2, "outcome": "response", "reason": null, "conversationId": "c", "turn": "0"}, "response": {}});
        assert!(suppressed.is_valid(&turn));
        let mut bad_reason = turn.clone();
        bad_reason["reason"] = json!("again");
        assert!(!suppressed.is_valid(&bad_reason));
        let mut half_run = turn;
        half_run["winner"]["runId"] = json!("r1");
        assert!(!suppressed.is_valid(&half_run));

        let me = validator("me.schema.json");
        assert!(me.is_valid(
            &json!({"accessControl": false, "grant": null, "roles": ["system.observability"]})
        ));
        assert!(!me.is_valid(&json!({"accessControl": false, "roles": []})));
    }

    #[test]
    fn the_error_body_is_what_errors_send() {
        let e = ApiError::bad_request("invalid_role", "unknown role").with_valid(["a", "b"]);
        let body = serde_json::to_value(e.body()).unwrap_or_default();
        assert_eq!(
            body,
            json!({"error": {"code": "invalid_role", "message": "unknown role", "valid": ["a", "b"]}})
        );
        assert!(validator("error.schema.json").is_valid(&body));
        assert!(!validator("error.schema.json")
            .is_valid(&json!({"error": {"code": "x", "message": "m", "extra": 1}})));
    }

    /// Every `$ref` of the OpenAPI document points at a component it holds.
    #[test]
    fn openapi_components_resolve_inside_the_document() {
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    for (k, x) in m {
                        match (k.as_str(), x) {
                            ("$ref", Value::String(r)) => out.push(r.clone()),
                            _ => refs(x, out),
                        }
                    }
                }
                Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
                _ => {}
            }
        }
        let doc = super::super::openapi::document();
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(found.len() > 10);
        for r in found {
            let pointer = r.strip_prefix('#').unwrap_or("not local");
            assert!(doc.pointer(pointer).is_some(), "unresolved {r}");
        }
        let text = doc.to_string();
        assert!(
            !text.contains("$defs"),
            "a reference left outside components"
        );
        for (file, _) in all() {
            assert!(text.contains(&url(file)), "{file} is not referenced");
        }
    }
}
