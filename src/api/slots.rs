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

/// What a set of slots caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capped {
    /// `/api/events/stream`.
    EventStreams,
    /// `/api/work-sessions`, which reads the whole work-session bucket.
    SessionLists,
}

impl Capped {
    /// The settings of the total cap and of the per-token cap.
    fn settings(self) -> (&'static str, &'static str) {
        match self {
            Capped::EventStreams => ("http.sse_max_streams", "http.sse_max_streams_per_token"),
            Capped::SessionLists => ("http.session_lists", "http.session_lists_per_token"),
        }
    }

    fn code(self) -> &'static str {
        match self {
            Capped::EventStreams => "too_many_streams",
            Capped::SessionLists => "too_many_lists",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Capped::EventStreams => "event streams open",
            Capped::SessionLists => "work-session lists being read",
        }
    }

    fn advice(self) -> &'static str {
        match self {
            Capped::EventStreams => "close one before opening another",
            Capped::SessionLists => "wait for one to finish",
        }
    }
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
        let (total_setting, token_setting) = self.capped.settings();
        let what = self.capped.what();
        if let Some(t) = token {
            let mine = open.per_token.get(t).copied().unwrap_or(0);
            if mine >= self.max_per_token {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    self.capped.code(),
                    format!(
                        "this token already has {mine} {what}, its limit ({token_setting} = {}); {}",
                        self.max_per_token,
                        self.capped.advice()
                    ),
                ));
            }
        }
        if open.total >= self.max_total {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                self.capped.code(),
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
        match self.slots.capped {
            Capped::EventStreams => tracing::debug!(open = open.total, "event stream closed"),
            Capped::SessionLists => tracing::debug!(open = open.total, "work-session list done"),
        }
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
        let slots = Arc::new(Slots::new(Capped::EventStreams, 3, 2));
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
        let slots = Arc::new(Slots::new(Capped::EventStreams, 2, 1));
        let _x = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        let _y = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(slots.acquire(None).is_err());
    }

    #[test]
    fn session_lists_name_their_own_settings() {
        let slots = Arc::new(Slots::new(Capped::SessionLists, 2, 1));
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
