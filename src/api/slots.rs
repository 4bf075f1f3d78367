//! Caps on what runs at once, all callers together and per bearer token: the event streams open
//! (`http.sse_max_streams`, `http.sse_max_streams_per_token`) and the work-session lists being
//! read (`http.session_lists`, `http.session_lists_per_token`; each reads the whole bucket) and
//! the scans of the projection stream (`http.scans`, `http.scans_per_token`; [`guarded`] also
//! stops one at `http.scan_timeout`). A request takes a [`Slot`] before it reads anything and
//! gives it back when it is dropped (a stream when its response body is dropped, a list when its
//! handler returns), so a place is freed at once.

use super::error::ApiError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a set of slots caps: the settings that bound it, and how a refusal and a freed place
/// are worded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capped {
    total_setting: &'static str,
    token_setting: &'static str,
    code: &'static str,
    what: &'static str,
    advice: &'static str,
    freed: &'static str,
}

impl Capped {
    /// `/api/events/stream`.
    pub const EVENT_STREAMS: Capped = Capped {
        total_setting: "http.sse_max_streams",
        token_setting: "http.sse_max_streams_per_token",
        code: "too_many_streams",
        what: "event streams open",
        advice: "close one before opening another",
        freed: "event stream closed",
    };
    /// `/api/work-sessions`, which reads the whole work-session bucket.
    pub const SESSION_LISTS: Capped = Capped {
        total_setting: "http.session_lists",
        token_setting: "http.session_lists_per_token",
        code: "too_many_lists",
        what: "work-session lists being read",
        advice: "wait for one to finish",
        freed: "work-session list done",
    };
    /// `/api/events` pages, `/api/search`, `/api/tree`, `/api/waiting`, `/api/threads`: each
    /// scans the projection stream.
    pub const SCANS: Capped = Capped {
        total_setting: "http.scans",
        token_setting: "http.scans_per_token",
        code: "too_many_scans",
        what: "scans running",
        advice: "wait for one to finish",
        freed: "scan done",
    };
}

/// The requests of one kind running now, counted.
#[derive(Debug)]
pub struct Slots {
    capped: Capped,
    max_total: usize,
    max_per_token: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_token: HashMap<String, usize>,
}

/// One open stream's place; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    token: Option<String>,
}

impl Slots {
    pub fn new(capped: Capped, max_total: usize, max_per_token: usize) -> Slots {
        Slots {
            capped,
            max_total,
            max_per_token,
            open: Mutex::new(Open::default()),
        }
    }

    /// Requests holding a place now.
    pub fn open(&self) -> usize {
        self.open.lock().map(|o| o.total).unwrap_or(0)
    }

    /// A place for one more request of the grant `token` (`None`: access control is off, and
    /// only the global cap applies). A token at its cap gets 429, a full server 503, each naming
    /// the setting.
    pub fn acquire(self: &Arc<Self>, token: Option<&str>) -> Result<Slot, ApiError> {
        let mut open = self
            .open
            .lock()
            .map_err(|_| ApiError::unavailable("request slots", "lock poisoned"))?;
        let Capped {
            total_setting,
            token_setting,
            code,
            what,
            advice,
            ..
        } = self.capped;
        if let Some(t) = token {
            let mine = open.per_token.get(t).copied().unwrap_or(0);
            if mine >= self.max_per_token {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    code,
                    format!(
                        "this token already has {mine} {what}, its limit ({token_setting} = {}); {advice}",
                        self.max_per_token,
                    ),
                ));
            }
        }
        if open.total >= self.max_total {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                format!(
                    "the server has {} {what}, its limit ({total_setting} = {}); retry later",
                    open.total, self.max_total
                ),
            ));
        }
        open.total += 1;
        if let Some(t) = token {
            *open.per_token.entry(t.to_string()).or_insert(0) += 1;
        }
        Ok(Slot {
            slots: self.clone(),
            token: token.map(str::to_string),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Ok(mut open) = self.slots.open.lock() else {
            return;
        };
        open.total = open.total.saturating_sub(1);
        tracing::debug!(open = open.total, "{}", self.slots.capped.freed);
        if let Some(t) = &self.token {
            if let Some(n) = open.per_token.get_mut(t) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    open.per_token.remove(t);
                }
            }
        }
    }
}

/// `scan` run with a place among `slots` for `token`, and stopped after `limit`.
pub async fn guarded(
    slots: &Arc<Slots>,
    limit: Duration,
    token: Option<&str>,
    route: &str,
    scan: impl Future<Output = Response>,
) -> Response {
    let _slot = match slots.acquire(token) {
        Ok(slot) => slot,
        Err(e) => return e.into_response(),
    };
    match tokio::time::timeout(limit, scan).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(
                route,
                caller = token.unwrap_or("-"),
                limit = %humantime::format_duration(limit),
                "API scan stopped at http.scan_timeout"
            );
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "scan_timeout",
                format!(
                    "the read was stopped after {} (http.scan_timeout): narrow it with role, key, type or since, or ask an operator to raise the setting",
                    humantime::format_duration(limit)
                ),
            )
            .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_token_and_in_total_and_frees_on_drop() {
        let slots = Arc::new(Slots::new(Capped::EVENT_STREAMS, 3, 2));
        let a1 = slots.acquire(Some("a")).unwrap_or_else(|e| panic!("{e:?}"));
        let _a2 = slots.acquire(Some("a")).unwrap_or_else(|e| panic!("{e:?}"));
        let e = slots
            .acquire(Some("a"))
            .err()
            .unwrap_or_else(|| panic!("a third for a"));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(
            e.message.contains("http.sse_max_streams_per_token = 2"),
            "{}",
            e.message
        );
        let _b1 = slots.acquire(Some("b")).unwrap_or_else(|e| panic!("{e:?}"));
        let e = slots
            .acquire(Some("b"))
            .err()
            .unwrap_or_else(|| panic!("a fourth in all"));
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            e.message.contains("http.sse_max_streams = 3"),
            "{}",
            e.message
        );
        drop(a1);
        assert_eq!(slots.open(), 2);
        let _a3 = slots.acquire(Some("a")).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(slots.open(), 3);
    }

    #[test]
    fn without_tokens_only_the_global_cap_applies() {
        let slots = Arc::new(Slots::new(Capped::EVENT_STREAMS, 2, 1));
        let _x = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        let _y = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(slots.acquire(None).is_err());
    }

    #[tokio::test]
    async fn a_scan_is_capped_per_token_and_stopped_at_its_time_limit() {
        let slots = Arc::new(Slots::new(Capped::SCANS, 8, 1));
        let limit = Duration::from_millis(50);
        // A scan holding the token's one place: a second one is refused at once.
        let held = slots.acquire(Some("a")).unwrap_or_else(|e| panic!("{e:?}"));
        let refused = guarded(&slots, limit, Some("a"), "/api/search", async {
            panic!("a refused scan ran")
        })
        .await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            refused.headers().get(axum::http::header::RETRY_AFTER),
            Some(&axum::http::HeaderValue::from_static("1"))
        );
        drop(held);
        // A scan that never ends is stopped and answered 503 scan_timeout, without Retry-After,
        // and its place is free again.
        let stopped = guarded(
            &slots,
            limit,
            Some("a"),
            "/api/search",
            std::future::pending::<Response>(),
        )
        .await;
        assert_eq!(stopped.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(stopped
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .is_none());
        let body = axum::body::to_bytes(stopped.into_body(), 1 << 16)
            .await
            .unwrap_or_default();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(body["error"]["code"], "scan_timeout", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("http.scan_timeout")),
            "{body}"
        );
        assert_eq!(slots.open(), 0);
        // One that finishes in time is answered as it is.
        let done = guarded(&slots, limit, Some("a"), "/api/search", async {
            StatusCode::OK.into_response()
        })
        .await;
        assert_eq!(done.status(), StatusCode::OK);
    }

    #[test]
    fn session_lists_name_their_own_settings() {
        let slots = Arc::new(Slots::new(Capped::SESSION_LISTS, 2, 1));
        let _a = slots.acquire(Some("a")).unwrap_or_else(|e| panic!("{e:?}"));
        let e = slots
            .acquire(Some("a"))
            .err()
            .unwrap_or_else(|| panic!("a second list for a"));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.code, "too_many_lists");
        assert!(
            e.message.contains("http.session_lists_per_token = 1"),
            "{}",
            e.message
        );
        let _b = slots.acquire(Some("b")).unwrap_or_else(|e| panic!("{e:?}"));
        let e = slots
            .acquire(None)
            .err()
            .unwrap_or_else(|| panic!("a third in all"));
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            e.message.contains("http.session_lists = 2"),
            "{}",
            e.message
        );
    }
}
