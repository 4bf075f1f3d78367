//! The API's one error type: JSON `{ "error": { "code", "message", ... } }` with the right status.
//! Messages are written for the caller; internal causes are logged, never returned.

use crate::model::Role;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use tracing::warn;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Extra fields of the error object (`valid`, `granted`, `oldestCursor`); boxed, so a
    /// `Result` carrying an error stays small.
    pub extra: Box<ErrorExtra>,
}

/// The fields an error adds to its code and message.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorExtra {
    /// With a 400 about a value: the valid values.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub valid: Option<Valid>,
    /// With a 403: the roles the token may read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub granted: Option<Vec<Role>>,
    /// With a 410: the oldest cursor still valid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oldest_cursor: Option<String>,
}

/// The valid values of a parameter: a list, or a pattern with examples.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Valid {
    Values(Vec<String>),
    Pattern(ValidPattern),
}

/// Values matching `pattern`, such as `examples`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ValidPattern {
    /// A regular expression every valid value matches.
    pub pattern: String,
    /// Some valid values.
    pub examples: Vec<String>,
}

/// The body of every error response of the API.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ErrorDetail {
    /// A stable machine-readable code (`invalid_role`, `unauthorized`, `forbidden`, `not_found`,
    /// `cursor_expired`, `unavailable`, ...).
    #[schemars(regex(pattern = r"^[a-z][a-z_]*$"))]
    pub code: String,
    /// What went wrong and what to do, for a person.
    #[schemars(length(min = 1))]
    pub message: String,
    #[serde(flatten)]
    pub extra: ErrorExtra,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            extra: Box::default(),
        }
    }

    /// The valid values of the parameter the error is about.
    pub fn with_valid<S: ToString>(mut self, valid: impl IntoIterator<Item = S>) -> Self {
        self.extra.valid = Some(Valid::Values(
            valid.into_iter().map(|v| v.to_string()).collect(),
        ));
        self
    }

    /// The pattern valid values of the parameter match, with examples.
    pub fn with_valid_pattern<S: ToString>(
        mut self,
        pattern: &str,
        examples: impl IntoIterator<Item = S>,
    ) -> Self {
        self.extra.valid = Some(Valid::Pattern(ValidPattern {
            pattern: pattern.to_string(),
            examples: examples.into_iter().map(|v| v.to_string()).collect(),
        }));
        self
    }

    /// The roles the caller may read.
    pub fn with_granted(mut self, granted: &[Role]) -> Self {
        self.extra.granted = Some(granted.to_vec());
        self
    }

    /// The oldest cursor still valid.
    pub fn with_oldest_cursor(mut self, cursor: String) -> Self {
        self.extra.oldest_cursor = Some(cursor);
        self
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a bearer token is required: send `Authorization: Bearer <token>`",
        )
    }

    /// The store (NATS) failed: log the cause, tell the caller to retry.
    pub fn unavailable(what: &str, cause: impl std::fmt::Display) -> Self {
        warn!(what, error = %cause, "API request failed on the event store");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("the event store could not be read ({what}); retry shortly"),
        )
    }

    /// The response body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message.clone(),
                extra: (*self.extra).clone(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"collab-projector\""),
            );
        }
        // A refusal for now (the store unavailable, a cap reached) says when to try again; a
        // scan stopped at its time limit would only be stopped again.
        let busy = matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        );
        if busy && self.code != "scan_timeout" {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}
