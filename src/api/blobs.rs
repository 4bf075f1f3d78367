//! `GET /api/blobs/{id}`: a field the workers moved to the object store (see [`crate::blobs`]),
//! to a caller whose grant covers the role of the event it came from; to any other caller it
//! does not exist.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{NoQuery, PathParam};
use super::state::ApiState;
use crate::blobs::{self, META_CONTENT_TYPE, META_ROLE, META_SHA256};
use crate::model::Role;
use async_nats::jetstream::object_store::InfoErrorKind;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::Extension;
use tokio::io::AsyncReadExt;

/// Response header naming the role the blob belongs to.
pub const H_ROLE: &str = "collab-event-role";

fn missing(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "no blob {id}: it was never stored, or it expired with the projections that referred to it (projection.max_age)"
    ))
}

pub async fn one(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
    _: NoQuery,
) -> Result<Response, ApiError> {
    if !blobs::is_id(&id) {
        return Err(ApiError::not_found(
            "not a blob id: take it from a reference's `$ref` (\"blob:<id>\", 64 hexadecimal characters)",
        ));
    }
    let store = state.blobs_store().await?;
    let info = match store.info(&id).await {
        Ok(info) if !info.deleted => info,
        Ok(_) => return Err(missing(&id)),
        Err(e) if e.kind() == InfoErrorKind::NotFound => return Err(missing(&id)),
        Err(e) => return Err(ApiError::unavailable("object store", e)),
    };
    // A blob without the role it was stored for is not one of ours: never serve it.
    let Some(role) = info
        .metadata
        .get(META_ROLE)
        .and_then(|r| r.parse::<Role>().ok())
    else {
        return Err(missing(&id));
    };
    // Another role's blob is answered as one that does not exist: a blob's id is the digest of
    // its role and content, so a `403` would confirm to anyone who can guess a content that
    // another role holds it.
    if !caller.allowed.contains(&role) {
        return Err(missing(&id));
    }
    let mut object = store
        .get(&id)
        .await
        .map_err(|e| ApiError::unavailable("object store", e))?;
    let mut data = Vec::with_capacity(info.size);
    object
        .read_to_end(&mut data)
        .await
        .map_err(|e| ApiError::unavailable("object store", e))?;
    let content_type = match info.metadata.get(META_CONTENT_TYPE).map(String::as_str) {
        Some(blobs::JSON) => blobs::JSON,
        Some(blobs::TEXT) => blobs::TEXT,
        _ => "application/octet-stream",
    };
    let mut resp = Response::new(Body::from(data));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // The id names the content: it never changes, but only this grant may keep it.
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=86400, immutable"),
    );
    if let Some(etag) = info
        .metadata
        .get(META_SHA256)
        .and_then(|s| HeaderValue::from_str(&format!("\"{s}\"")).ok())
    {
        h.insert(header::ETAG, etag);
    }
    h.insert(H_ROLE, HeaderValue::from_static(role.as_str()));
    Ok(resp)
}
