//! Large fields: moved out of the projected envelope into the object store `<prefix>_blobs`, and
//! replaced by a reference (docs/contract.md section 5).
//!
//! Pure: [`offload`] rewrites an envelope's payload and returns the blobs to store; the worker
//! stores them before it publishes the projection that refers to them, and the API serves them
//! (`GET /api/blobs/{id}`) to a caller whose grant covers the role recorded with the blob.
//!
//! The reference that takes a field's place:
//!
//! ```json
//! {"$ref": "blob:<id>", "bytes": 180000, "sha256": "<hex>", "contentType": "text/plain; charset=utf-8", "preview": "first characters..."}
//! ```
//!
//! A string is stored as its UTF-8 text; an object or array as its JSON. The id is the SHA-256 of
//! the event's role and the content, so the same field projected again (a redelivery, a replay)
//! lands on the same object, and the same content under two roles makes two objects, each readable
//! by its own role only. Redaction has already run on the input: a blob never holds a secret the
//! projection would not.

use crate::model::Role;
use bytes::Bytes;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Object metadata key holding the role whose grant may read the blob.
pub const META_ROLE: &str = "role";
/// Object metadata key holding the content's SHA-256 (hex).
pub const META_SHA256: &str = "sha256";
/// Object metadata key holding the content type.
pub const META_CONTENT_TYPE: &str = "content-type";

/// Content type of an offloaded string.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// Content type of an offloaded object or array.
pub const JSON: &str = "application/json";

/// Characters of the content kept in the reference.
pub const PREVIEW_CHARS: usize = 120;

/// One field moved out of an envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// Object name in the store: 64 lowercase hex characters.
    pub id: String,
    /// The role of the event it came from: only a grant covering it may read the blob.
    pub role: Role,
    /// SHA-256 of `data`, hex.
    pub sha256: String,
    pub content_type: &'static str,
    pub data: Bytes,
}

/// Whether `id` can name a blob (so that nothing else reaches the object store's API).
pub fn is_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Replace every field of `payload` whose size is over `max_inline` bytes by a reference, and
/// return the blobs to store, innermost first. A string's size is its UTF-8 length; an object's
/// or array's is the length of its JSON once its own large fields are references, so a field
/// holding many medium values is offloaded whole. The payload itself stays: its top-level
/// fields are what a UI reads first. `max_inline == 0` offloads nothing.
pub fn offload(payload: &mut Value, max_inline: usize, role: Role) -> Vec<Blob> {
    let mut blobs = Vec::new();
    if max_inline == 0 {
        return blobs;
    }
    let fields: Vec<&mut Value> = match payload {
        Value::Object(map) => map.values_mut().collect(),
        Value::Array(items) => items.iter_mut().collect(),
        other => vec![other],
    };
    for field in fields {
        shrink(field, max_inline, role, &mut blobs);
    }
    blobs
}

/// Offload what is too large below and at `v`; the JSON length of what remains.
// Recursion depth is the input's nesting, which `limits.max_depth` (at most 128) bounds before
// any envelope is built.
fn shrink(v: &mut Value, max_inline: usize, role: Role, blobs: &mut Vec<Blob>) -> usize {
    let (size, over) = match v {
        Value::String(s) => (s.len() + 2, s.len() > max_inline),
        Value::Array(items) => {
            let inner: usize = items
                .iter_mut()
                .map(|i| shrink(i, max_inline, role, blobs))
                .sum();
            let size = 2 + inner + items.len().saturating_sub(1);
            (size, size > max_inline)
        }
        Value::Object(map) => {
            let inner: usize = map
                .iter_mut()
                .map(|(k, i)| k.len() + 3 + shrink(i, max_inline, role, blobs))
                .sum();
            let size = 2 + inner + map.len().saturating_sub(1);
            (size, size > max_inline)
        }
        Value::Null => (4, false),
        Value::Bool(b) => (if *b { 4 } else { 5 }, false),
        Value::Number(n) => (n.to_string().len(), false),
    };
    if !over {
        return size;
    }
    let blob = make(v, role);
    *v = reference(&blob, v);
    blobs.push(blob);
    serde_json::to_vec(v).map_or(0, |r| r.len())
}

/// Replace the whole of `payload` by one reference (its top-level fields included): for a
/// payload whose many small fields together make the projection too large to publish.
pub fn offload_all(payload: &mut Value, role: Role) -> Blob {
    let blob = make(payload, role);
    *payload = reference(&blob, payload);
    blob
}

/// Smallest `limits.max_inline_bytes` other than 0: a reference is a few hundred bytes, so a
/// lower limit would make fields larger by offloading them.
pub const MIN_INLINE_BYTES: usize = 1024;

fn make(v: &Value, role: Role) -> Blob {
    let (data, content_type) = match v {
        Value::String(s) => (Bytes::copy_from_slice(s.as_bytes()), TEXT),
        other => (
            Bytes::from(serde_json::to_vec(other).unwrap_or_default()),
            JSON,
        ),
    };
    let sha256 = hex::encode(Sha256::digest(&data));
    let mut id = Sha256::new();
    id.update(role.as_str().as_bytes());
    id.update([0u8]);
    id.update(&data);
    Blob {
        id: hex::encode(id.finalize()),
        role,
        sha256,
        content_type,
        data,
    }
}

fn reference(blob: &Blob, original: &Value) -> Value {
    let preview: String = match original {
        Value::String(s) => s.chars().take(PREVIEW_CHARS).collect(),
        _ => String::from_utf8_lossy(&blob.data)
            .chars()
            .take(PREVIEW_CHARS)
            .collect(),
    };
    let mut r = Map::new();
    r.insert("$ref".into(), Value::String(format!("blob:{}", blob.id)));
    r.insert("bytes".into(), Value::from(blob.data.len()));
    r.insert("sha256".into(), Value::String(blob.sha256.clone()));
    r.insert(
        "contentType".into(),
        Value::String(blob.content_type.to_string()),
    );
    r.insert("preview".into(), Value::String(preview));
    Value::Object(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sha(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    #[test]
    fn a_whole_payload_can_become_one_reference() {
        let mut p = json!({"a": 1, "b": "two"});
        let text = serde_json::to_vec(&p).unwrap_or_default();
        let blob = offload_all(&mut p, Role::OrchestrationTask);
        assert_eq!(blob.data, Bytes::from(text));
        assert_eq!(blob.content_type, JSON);
        assert_eq!(p["$ref"], json!(format!("blob:{}", blob.id)));
    }

    #[test]
    fn small_payloads_are_left_alone() {
        let mut p = json!({"text": "hello", "n": 3, "list": [1, 2, {"a": null}]});
        let before = p.clone();
        assert!(offload(&mut p, 64, Role::ConversationMain).is_empty());
        assert_eq!(p, before);
        // 0 turns offloading off, whatever the size.
        let mut big = json!({"text": "x".repeat(100_000)});
        assert!(offload(&mut big, 0, Role::ConversationMain).is_empty());
    }

    #[test]
    fn a_long_string_becomes_a_reference_with_size_digest_and_preview() {
        let text = format!("résumé {}", "y".repeat(3000));
        let mut p = json!({"tool": "search", "output": text});
        let blobs = offload(&mut p, 1024, Role::DelegationSubagent);
        assert_eq!(blobs.len(), 1);
        let b = &blobs[0];
        assert_eq!(b.data, Bytes::from(text.clone()));
        assert_eq!(b.sha256, sha(text.as_bytes()));
        assert_eq!(b.content_type, TEXT);
        assert_eq!(b.role, Role::DelegationSubagent);
        assert!(is_id(&b.id), "{}", b.id);
        let r = &p["output"];
        assert_eq!(r["$ref"], json!(format!("blob:{}", b.id)));
        assert_eq!(r["bytes"], json!(text.len()));
        assert_eq!(r["sha256"], json!(b.sha256));
        assert_eq!(r["contentType"], json!(TEXT));
        let preview = r["preview"].as_str().unwrap_or_default();
        assert_eq!(preview.chars().count(), PREVIEW_CHARS);
        assert!(text.starts_with(preview));
        // The rest of the payload is untouched.
        assert_eq!(p["tool"], "search");
    }

    #[test]
    fn a_string_at_the_limit_stays_inline() {
        let mut p = json!({"s": "z".repeat(1024)});
        assert!(offload(&mut p, 1024, Role::ConversationMain).is_empty());
        let mut p = json!({"s": "z".repeat(1025)});
        assert_eq!(offload(&mut p, 1024, Role::ConversationMain).len(), 1);
    }

    #[test]
    fn the_payload_itself_stays_even_when_its_fields_add_up_past_the_limit() {
        let mut p = json!({});
        for i in 0..100 {
            p[format!("field{i}")] = json!("0123456789012345678901234567890123456789");
        }
        let before = p.clone();
        assert!(offload(&mut p, 1024, Role::ConversationMain).is_empty());
        assert_eq!(p, before);
    }

    #[test]
    fn nested_fields_and_array_items_are_offloaded_where_they_are() {
        let long = "q".repeat(5000);
        let mut p =
            json!({"result": {"pages": ["short", long.clone()], "meta": {"deep": long.clone()}}});
        let blobs = offload(&mut p, 1024, Role::OrchestrationTask);
        assert_eq!(blobs.len(), 2);
        assert_eq!(p["result"]["pages"][0], "short");
        assert!(p["result"]["pages"][1]["$ref"].is_string());
        assert!(p["result"]["meta"]["deep"]["$ref"].is_string());
        // Same content, same role: the same object.
        assert_eq!(blobs[0].id, blobs[1].id);
    }

    #[test]
    fn a_container_of_many_medium_fields_is_offloaded_whole_as_json() {
        let items: Vec<Value> = (0..200).map(|i| json!(format!("item {i:04}"))).collect();
        let mut p = json!({"list": items.clone(), "keep": 1});
        let blobs = offload(&mut p, 1024, Role::SystemObservability);
        assert_eq!(blobs.len(), 1);
        assert_eq!(blobs[0].content_type, JSON);
        let back: Value = serde_json::from_slice(&blobs[0].data).unwrap_or_default();
        assert_eq!(back, Value::Array(items));
        assert_eq!(p["keep"], 1);
        assert!(p["list"]["preview"]
            .as_str()
            .unwrap_or_default()
            .starts_with("[\"item 0000\""));
    }

    #[test]
    fn the_id_depends_on_the_role_and_the_content_only() {
        let text = "w".repeat(3000);
        let one = |role| {
            let mut p = json!({"a": text.clone()});
            offload(&mut p, 1024, role).remove(0)
        };
        let a = one(Role::ConversationMain);
        assert_eq!(a, one(Role::ConversationMain));
        let b = one(Role::SystemObservability);
        assert_ne!(a.id, b.id);
        assert_eq!(a.sha256, b.sha256);
    }

    #[test]
    fn ids_are_recognised_strictly() {
        assert!(is_id(&"a".repeat(64)));
        assert!(!is_id(&"A".repeat(64)));
        assert!(!is_id(&"a".repeat(63)));
        assert!(!is_id("../../etc/passwd"));
        assert!(!is_id(""));
    }
}
