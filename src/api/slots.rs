//! Caps on the event streams open at once: all callers together (`http.sse_max_streams`) and per
//! bearer token (`http.sse_max_streams_per_token`). A stream takes a [`Slot`] before it opens
//! anything and gives it back when its response body is dropped (the client went, or the stream
//! ended), so a closed stream frees its place at once.

use super::error::ApiError;
use axum::http::StatusCode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The open streams, counted.
#[derive(Debug)]
pub struct StreamSlots {
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
    slots: Arc<StreamSlots>,
    token: Option<String>,
}

impl StreamSlots {
    pub fn new(max_total: usize, max_per_token: usize) -> StreamSlots {
        StreamSlots {
            max_total,
            max_per_token,
            open: Mutex::new(Open::default()),
        }
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        self.open.lock().map(|o| o.total).unwrap_or(0)
    }

    /// A place for one more stream of the grant `token` (`None`: access control is off, and only
    /// the global cap applies). A token at its cap gets 429, a full server 503, each naming the
    /// setting.
    pub fn acquire(self: &Arc<Self>, token: Option<&str>) -> Result<Slot, ApiError> {
        let mut open = self
            .open
            .lock()
            .map_err(|_| ApiError::unavailable("stream slots", "lock poisoned"))?;
        if let Some(t) = token {
            let mine = open.per_token.get(t).copied().unwrap_or(0);
            if mine >= self.max_per_token {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too_many_streams",
                    format!(
                        "this token already has {mine} event streams open, its limit (http.sse_max_streams_per_token = {}); close one before opening another",
                        self.max_per_token
                    ),
                ));
            }
        }
        if open.total >= self.max_total {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_streams",
                format!(
                    "the server has {} event streams open, its limit (http.sse_max_streams = {}); retry later",
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
        tracing::debug!(open = open.total, "event stream closed");
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
        let slots = Arc::new(StreamSlots::new(3, 2));
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
        let slots = Arc::new(StreamSlots::new(2, 1));
        let _x = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        let _y = slots.acquire(None).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(slots.acquire(None).is_err());
    }
}
