//! Caps on what runs at once, all callers together and per bearer token: the event streams open
//! (`http.sse_max_streams`, `http.sse_max_streams_per_token`) and the work-session lists being
//! read (`http.session_lists`, `http.session_lists_per_token`; each reads the whole bucket). A
//! request takes a [`Slot`] before it reads anything and gives it back when it is dropped (a
//! stream when its response body is dropped, a list when its handler returns), so a place is
//! freed at once.

use super::error::ApiError;
use axum::http::StatusCode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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
