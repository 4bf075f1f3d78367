//! The open turns of one partition, ordered by store-time deadline so the one timer of the
//! partition sleeps until the earliest and a watermark advance finds every expired turn in
//! order; and the partition's event-time watermark.

use super::TurnRecord;
use lru::LruCache;
use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The open turns of one partition, compact enough to hold a million of them.
///
/// Per open turn it keeps the key (once, shared by the map and the deadline order), the
/// deadline and the revision of the record in KV. The full record is kept for at most `keep`
/// open turns, the ones opened (or updated) last; a turn that closes gives its place up at once,
/// so with answered turns closing within moments the places go to the turns still waiting,
/// which are the ones a deadline decides. Deciding a turn whose record is not kept costs one KV
/// read. It also keeps a hash of every record key the partition has (open or
/// decided), so an event of a turn it has never seen needs no KV read to say so. Records expire
/// from KV after `turns.retention`; with [`OpenTurns::forgetting_after`] the hashes of keys not
/// noted for that long are let go too (in two generations), so a partition that runs for months
/// holds the keys of its last one or two retention periods, not of every turn it ever saw.
#[derive(Debug, Clone)]
pub struct OpenTurns<R> {
    slots: HashMap<Arc<str>, Slot<R>>,
    by_time: BTreeSet<(i64, Arc<str>)>,
    /// The open turns whose record is kept, least recently opened first; at most `keep`.
    /// Unbounded to the cache itself, so a large `keep` allocates only as turns come.
    kept: LruCache<Arc<str>, ()>,
    keep: usize,
    /// Hashes of the keys noted in the current generation, and in the one before it.
    known: HashSet<u64>,
    known_before: HashSet<u64>,
    /// How long a generation lasts, and when the current one ends (`None`: keys are never
    /// forgotten).
    generation: Option<Duration>,
    generation_ends: Option<Instant>,
    hasher: RandomState,
}

#[derive(Debug, Clone)]
struct Slot<R> {
    deadline: Option<i64>,
    rev: R,
    record: Option<Box<TurnRecord>>,
}

impl<R: Clone> OpenTurns<R> {
    /// Keep the full record of at most `keep` open turns, the ones opened last.
    pub fn new(keep: usize) -> Self {
        OpenTurns {
            slots: HashMap::new(),
            by_time: BTreeSet::new(),
            kept: LruCache::unbounded(),
            keep,
            known: HashSet::new(),
            known_before: HashSet::new(),
            generation: None,
            generation_ends: None,
            hasher: RandomState::new(),
        }
    }

    /// Let go of the hash of a key noted neither in the last `after` nor in the generation
    /// before (so a key is remembered for at least `after` after it was last noted). `after`
    /// must be at least as long as a record lives in KV; `None` remembers every key.
    pub fn forgetting_after(mut self, after: Option<Duration>) -> Self {
        self.generation = after;
        self
    }

    /// Open (or update) a turn; `record` is kept if given, among the last `keep`.
    pub fn open(&mut self, key: &str, deadline: Option<i64>, rev: R, record: Option<TurnRecord>) {
        self.note(key);
        let shared: Arc<str> = match self.slots.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        let keeping = record.is_some() && self.keep > 0;
        let slot = Slot {
            deadline,
            rev,
            record: record.filter(|_| keeping).map(Box::new),
        };
        if let Some(old) = self.slots.insert(shared.clone(), slot) {
            if let Some(d) = old.deadline {
                self.by_time.remove(&(d, shared.clone()));
            }
        }
        if let Some(d) = deadline {
            self.by_time.insert((d, shared.clone()));
        }
        if !keeping {
            self.kept.pop(&shared);
            return;
        }
        self.kept.push(shared, ());
        while self.kept.len() > self.keep {
            let Some((gone, ())) = self.kept.pop_lru() else {
                break;
            };
            if let Some(slot) = self.slots.get_mut(&gone) {
                slot.record = None;
            }
        }
    }

    /// The turn, if open: its full record when kept, its revision and its deadline.
    pub fn get(&self, key: &str) -> Option<(Option<&TurnRecord>, &R, Option<i64>)> {
        self.slots
            .get(key)
            .map(|s| (s.record.as_deref(), &s.rev, s.deadline))
    }

    /// Set an open turn's revision, keeping the rest of it.
    pub fn set_rev(&mut self, key: &str, rev: R) {
        if let Some(slot) = self.slots.get_mut(key) {
            slot.rev = rev;
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.slots.contains_key(key)
    }

    /// The turn is no longer open. Returns whether it was.
    pub fn close(&mut self, key: &str) -> bool {
        match self.slots.remove_entry(key) {
            Some((k, slot)) => {
                self.kept.pop(&k);
                if let Some(d) = slot.deadline {
                    self.by_time.remove(&(d, k));
                }
                true
            }
            None => false,
        }
    }

    /// The earliest armed deadline.
    pub fn next_deadline(&self) -> Option<i64> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Disarm and return, earliest first, the turns whose deadline is strictly before the
    /// watermark (a reply stored exactly at the deadline is on time). They stay open until
    /// closed.
    pub fn expire(&mut self, watermark_ms: i64) -> Vec<(i64, String)> {
        let mut out = Vec::new();
        while let Some((t, _)) = self.by_time.first() {
            if *t >= watermark_ms {
                break;
            }
            if let Some((t, key)) = self.by_time.pop_first() {
                if let Some(slot) = self.slots.get_mut(&key) {
                    slot.deadline = None;
                }
                out.push((t, key.to_string()));
            }
        }
        out
    }

    /// Open turns.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Remember that the partition has a record under `key`.
    pub fn note(&mut self, key: &str) {
        self.note_at(key, Instant::now());
    }

    /// [`Self::note`] at `now`: a generation that has ended becomes the one before, and the one
    /// before that is let go.
    fn note_at(&mut self, key: &str, now: Instant) {
        if let Some(length) = self.generation {
            match self.generation_ends {
                Some(end) if now < end => {}
                Some(_) => {
                    self.known_before = std::mem::take(&mut self.known);
                    self.generation_ends = now.checked_add(length);
                }
                None => self.generation_ends = now.checked_add(length),
            }
        }
        self.known.insert(self.hasher.hash_one(key));
    }

    /// Whether the partition may have a record under `key` (false: it certainly has none).
    pub fn maybe_known(&self, key: &str) -> bool {
        let h = self.hasher.hash_one(key);
        self.known.contains(&h) || self.known_before.contains(&h)
    }

    /// Key hashes held (both generations).
    #[cfg(test)]
    fn known_len(&self) -> usize {
        self.known.len() + self.known_before.len()
    }
}

/// Event-time progress of one partition: "every raw message stored before `value` has been
/// processed".
///
/// A partition processes its messages in stream order (a new owner first re-reads what the
/// previous owner left in flight), so a processed message's store time is a watermark; an idle
/// partition with nothing left to process moves it to the clock.
///
/// That holds while the partition's inputs are stored in one stream. Once a newer set of raw
/// streams exists (`collab-projector reshard`), its inputs may be stored in either set until every
/// server maps raw subjects to the new one, so a store time read in the old stream says nothing
/// about the new one: the watermark is then held at a cap (see [`Watermark::cap_at`]) until the
/// partition reads the new stream.
#[derive(Debug, Clone, Default)]
pub struct Watermark {
    value: Option<i64>,
    cap: Option<i64>,
}

impl Watermark {
    fn raise(&mut self, to: i64) -> Option<i64> {
        let to = self.cap.map_or(to, |cap| to.min(cap));
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

    /// From now on the watermark moves no further than `at_ms` (the lowest of the caps given),
    /// however late the messages that follow were stored.
    pub fn cap_at(&mut self, at_ms: i64) {
        self.cap = Some(self.cap.map_or(at_ms, |c| c.min(at_ms)));
    }

    /// The cap given, if any.
    pub fn cap(&self) -> Option<i64> {
        self.cap
    }

    /// Move with the store times again: what set the caps no longer holds.
    pub fn lift_cap(&mut self) {
        self.cap = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turns::ExchangeKind;

    #[test]
    fn watermark_follows_store_times_and_never_goes_back() {
        let mut w = Watermark::default();
        assert_eq!(w.observe(100), Some(100));
        assert_eq!(w.observe(90), None);
        assert_eq!(w.observe(150), Some(150));
    }

    #[test]
    fn a_capped_watermark_stops_at_its_lowest_cap() {
        let mut w = Watermark::default();
        assert_eq!(w.observe(100), Some(100));
        w.cap_at(180);
        w.cap_at(160);
        w.cap_at(170);
        assert_eq!(w.cap(), Some(160));
        assert_eq!(w.observe(150), Some(150));
        assert_eq!(w.observe(500), Some(160));
        assert_eq!(w.observe(900), None);
        w.lift_cap();
        assert_eq!(w.cap(), None);
        assert_eq!(w.observe(900), Some(900));
    }

    fn record(turn: &str) -> TurnRecord {
        TurnRecord {
            exchange: ExchangeKind::Turn,
            conversation_id: "c".into(),
            key: "c".into(),
            turn: turn.into(),
            state: super::super::TurnState::Open,
            send: None,
            deadline_ms: Some(100),
            winner: None,
            sender: None,
            target: None,
            writer: None,
            early: None,
        }
    }

    #[test]
    fn record_keys_are_remembered_for_a_generation_at_least_then_let_go() {
        let day = Duration::from_secs(86_400);
        let t0 = Instant::now();
        let mut o: OpenTurns<u64> = OpenTurns::new(0).forgetting_after(Some(day));
        o.note_at("a", t0);
        o.note_at("b", t0 + day / 2);
        // The first generation ends: a and b are in the one before, still known.
        o.note_at("c", t0 + day);
        assert!(o.maybe_known("a") && o.maybe_known("b") && o.maybe_known("c"));
        // Noted again, b moves into the current generation.
        o.note_at("b", t0 + day + day / 2);
        // The second generation ends: a (last noted two generations ago) is let go.
        o.note_at("d", t0 + 2 * day);
        assert!(
            !o.maybe_known("a"),
            "a key not noted for two generations is let go"
        );
        assert!(o.maybe_known("b") && o.maybe_known("c") && o.maybe_known("d"));
        assert_eq!(o.known_len(), 3);
        // Without a generation nothing is let go.
        let mut all: OpenTurns<u64> = OpenTurns::new(0);
        all.note_at("a", t0);
        all.note_at("b", t0 + 100 * day);
        assert!(all.maybe_known("a") && all.maybe_known("b"));
    }

    #[test]
    fn open_turns_keep_only_the_last_records_and_expire_in_deadline_order() {
        let mut o: OpenTurns<u64> = OpenTurns::new(2);
        o.open("a", Some(300), 1, Some(record("a")));
        o.open("b", Some(100), 2, Some(record("b")));
        o.open("c", Some(200), 3, Some(record("c")));
        o.open("d", None, 4, None);
        assert_eq!(o.len(), 4);
        assert!(o.get("a").is_some_and(|(r, _, _)| r.is_none()), "evicted");
        assert!(o
            .get("c")
            .is_some_and(|(r, rev, d)| r.is_some() && *rev == 3 && d == Some(200)));
        assert_eq!(o.next_deadline(), Some(100));
        assert_eq!(
            o.expire(201),
            vec![(100, "b".to_string()), (200, "c".to_string())]
        );
        assert!(o.contains("b"), "expired turns stay open until closed");
        assert_eq!(o.get("b").map(|(_, _, d)| d), Some(None));
        assert_eq!(o.next_deadline(), Some(300));
        assert!(o.close("a"));
        assert!(!o.close("a"));
        assert_eq!(o.next_deadline(), None, "an expired turn stays disarmed");
        assert!(o.maybe_known("a") && o.maybe_known("d"));
        assert!(!o.maybe_known("zz"));
    }

    #[test]
    fn a_closed_turn_gives_its_place_up_to_the_turns_still_open() {
        let mut o: OpenTurns<u64> = OpenTurns::new(2);
        // One turn left waiting, then many opened and answered at once after it.
        o.open("waiting", Some(10_000), 1, Some(record("waiting")));
        for i in 0..100 {
            let key = format!("answered-{i}");
            o.open(&key, Some(100), 2, Some(record(&key)));
            assert!(o.close(&key));
        }
        o.open("last", Some(200), 3, Some(record("last")));
        assert!(
            o.get("waiting").is_some_and(|(r, _, _)| r.is_some()),
            "the turn still open keeps its record: the answered ones gave their places up"
        );
        assert!(o.get("last").is_some_and(|(r, _, _)| r.is_some()));
        // A third open turn takes the place of the one opened longest ago.
        o.open("third", Some(300), 4, Some(record("third")));
        assert!(o.get("waiting").is_some_and(|(r, _, _)| r.is_none()));
        assert!(o.get("third").is_some_and(|(r, _, _)| r.is_some()));
        // A turn updated without its record is no longer kept, and its place is free.
        o.open("last", Some(200), 5, None);
        o.open("fourth", Some(400), 6, Some(record("fourth")));
        assert!(o.get("third").is_some_and(|(r, _, _)| r.is_some()));
        assert!(o.get("fourth").is_some_and(|(r, _, _)| r.is_some()));
        // Keeping none keeps none.
        let mut none: OpenTurns<u64> = OpenTurns::new(0);
        none.open("a", Some(1), 1, Some(record("a")));
        assert!(none.get("a").is_some_and(|(r, _, _)| r.is_none()));
    }

    #[test]
    fn reopening_a_kept_turn_keeps_its_record() {
        let mut o: OpenTurns<u64> = OpenTurns::new(2);
        o.open("a", Some(1), 1, Some(record("a")));
        o.open("a", Some(2), 2, Some(record("a")));
        o.open("b", Some(3), 3, Some(record("b")));
        assert!(o
            .get("a")
            .is_some_and(|(r, rev, _)| r.is_some() && *rev == 2));
        assert_eq!(o.expire(10).len(), 2, "one deadline per turn");
    }
}
