//! The deadline set of one partition: open turns ordered by store-time deadline, so the one
//! timer of the partition sleeps until the earliest and a watermark advance finds every expired
//! turn in order.

use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Default, Clone)]
pub struct DeadlineBook {
    by_time: BTreeSet<(i64, String)>,
    by_key: HashMap<String, i64>,
}

impl DeadlineBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// Arm (or re-arm) the deadline of a turn.
    pub fn arm(&mut self, key: &str, deadline_ms: i64) {
        if let Some(old) = self.by_key.insert(key.to_string(), deadline_ms) {
            self.by_time.remove(&(old, key.to_string()));
        }
        self.by_time.insert((deadline_ms, key.to_string()));
    }

    /// Forget a turn (it was decided).
    pub fn disarm(&mut self, key: &str) {
        if let Some(old) = self.by_key.remove(key) {
            self.by_time.remove(&(old, key.to_string()));
        }
    }

    /// The earliest deadline.
    pub fn next_deadline(&self) -> Option<i64> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Remove and return, earliest first, the turns whose deadline is strictly before the
    /// watermark (a reply stored exactly at the deadline is on time).
    pub fn expire(&mut self, watermark_ms: i64) -> Vec<(i64, String)> {
        let mut out = Vec::new();
        while let Some((t, _)) = self.by_time.first() {
            if *t >= watermark_ms {
                break;
            }
            if let Some((t, key)) = self.by_time.pop_first() {
                self.by_key.remove(&key);
                out.push((t, key));
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// Event-time progress of one partition: "every raw message stored before `value` has been
/// processed".
///
/// A partition processes its messages in stream order (a new owner first re-reads what the
/// previous owner left in flight), so a processed message's store time is a watermark; an idle
/// partition with nothing left to process moves it to the clock.
#[derive(Debug, Clone, Default)]
pub struct Watermark {
    value: Option<i64>,
}

impl Watermark {
    pub fn value(&self) -> Option<i64> {
        self.value
    }

    fn raise(&mut self, to: i64) -> Option<i64> {
        if self.value.is_some_and(|v| v >= to) {
            return None;
        }
        self.value = Some(to);
        Some(to)
    }

    /// A message stored at `stored_ms` is about to be processed. Returns the new watermark when it
    /// moved.
    pub fn observe(&mut self, stored_ms: i64) -> Option<i64> {
        self.raise(stored_ms)
    }

    /// Nothing is pending and everything delivered was processed: the watermark is `now_ms`.
    pub fn idle(&mut self, now_ms: i64) -> Option<i64> {
        self.raise(now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_follows_store_times_and_never_goes_back() {
        let mut w = Watermark::default();
        assert_eq!(w.observe(100), Some(100));
        assert_eq!(w.observe(90), None);
        assert_eq!(w.idle(80), None);
        assert_eq!(w.idle(150), Some(150));
    }

    #[test]
    fn expires_in_deadline_order_and_only_strictly_before_the_watermark() {
        let mut b = DeadlineBook::new();
        b.arm("c", 300);
        b.arm("a", 100);
        b.arm("b", 200);
        assert_eq!(b.next_deadline(), Some(100));
        assert_eq!(b.expire(100), vec![]);
        assert_eq!(
            b.expire(201),
            vec![(100, "a".to_string()), (200, "b".to_string())]
        );
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn rearm_and_disarm() {
        let mut b = DeadlineBook::new();
        b.arm("a", 100);
        b.arm("a", 500);
        assert_eq!(b.expire(200), vec![]);
        b.disarm("a");
        assert!(b.is_empty());
        assert_eq!(b.expire(1000), vec![]);
    }
}
