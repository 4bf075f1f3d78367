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
/// Messages arrive in stream order, so a processed message's store time is a watermark, except
/// right after a partition changes hands: messages a previous owner had in flight are redelivered
/// only after their ack wait, behind newer ones. Until the consumer's ack floor has passed
/// everything delivered before this owner started, the watermark holds still (deadlines wait)
/// while newer store times are remembered.
#[derive(Debug, Clone, Default)]
pub struct Watermark {
    value: Option<i64>,
    seen: Option<i64>,
    recovering_until: Option<u64>,
}

impl Watermark {
    /// A partition whose consumer had `ack_pending` unacknowledged messages, the last delivered
    /// being `delivered_seq`, when this owner took it.
    pub fn starting(ack_pending: usize, delivered_seq: u64) -> Watermark {
        Watermark {
            value: None,
            seen: None,
            recovering_until: (ack_pending > 0).then_some(delivered_seq),
        }
    }

    pub fn value(&self) -> Option<i64> {
        self.value
    }

    pub fn recovering(&self) -> bool {
        self.recovering_until.is_some()
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
        self.seen = Some(self.seen.map_or(stored_ms, |s| s.max(stored_ms)));
        if self.recovering() {
            return None;
        }
        self.raise(stored_ms)
    }

    /// The consumer's ack floor (every sequence up to it acknowledged). Ends recovery once it has
    /// passed what was in flight; returns the new watermark when it moved.
    pub fn ack_floor(&mut self, floor: u64) -> Option<i64> {
        match self.recovering_until {
            Some(until) if floor >= until => {
                self.recovering_until = None;
                self.seen.and_then(|s| self.raise(s))
            }
            _ => None,
        }
    }

    /// Nothing is pending and everything delivered was processed: the watermark is `now_ms`.
    pub fn idle(&mut self, now_ms: i64) -> Option<i64> {
        if self.recovering() {
            return None;
        }
        self.raise(now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_follows_store_times_and_never_goes_back() {
        let mut w = Watermark::starting(0, 0);
        assert_eq!(w.observe(100), Some(100));
        assert_eq!(w.observe(90), None);
        assert_eq!(w.idle(80), None);
        assert_eq!(w.idle(150), Some(150));
    }

    #[test]
    fn watermark_holds_while_a_previous_owner_s_messages_are_outstanding() {
        let mut w = Watermark::starting(3, 40);
        assert_eq!(w.observe(500), None, "newer messages must not move it");
        assert_eq!(w.idle(900), None);
        assert_eq!(w.ack_floor(39), None);
        assert_eq!(w.ack_floor(40), Some(500));
        assert!(!w.recovering());
        assert_eq!(w.observe(600), Some(600));
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
