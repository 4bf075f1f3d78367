//! Redaction of streamed text: a secret split over several deltas (AG-UI's
//! `TEXT_MESSAGE_CONTENT`, `TOOL_CALL_ARGS`, `REASONING_MESSAGE_CONTENT`) is found in the
//! assembled message, not delta by delta.
//!
//! Each delta is published as soon as it is processed, so a secret's first half cannot be taken
//! back once the second half arrives. The stream redactor therefore holds back the end of what it
//! has seen and publishes it with a later delta: the last word always (it may be the start of a
//! token), everything from the first rule keyword within the last [`StreamLimits::hold`] bytes
//! (a match that spans words, `Bearer x`, `password = x`, a PEM block, holds a keyword before its
//! first space), and every match that reaches the end of the text (it may still grow). Cuts are
//! made after whitespace or punctuation no key or token holds, never inside a match. The
//! concatenation of what it publishes equals the redacted whole message for every match that
//! fits in the window, wherever the deltas were cut.
//!
//! A match still growing past [`StreamLimits::max_hold`] (a PEM key whose END line has not come,
//! a token longer than the window) is replaced by its marker at once, and what follows that still
//! belongs to it (the rule's `continues` characters, or up to a PEM END line) is dropped as it
//! arrives; so memory stays bounded and the secret's tail never appears either.
//!
//! Pure: no clock, no I/O. One stream redactor serves one partition of the worker, whose events
//! arrive in order; streams are told apart by the raw subject key, the kind and the AG-UI id.

use super::rules::{apply, Redactor};
use std::sync::Arc;

/// What a stream carries (AG-UI ids of different kinds may coincide).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// `TEXT_MESSAGE_CONTENT` / `TEXT_MESSAGE_CHUNK` deltas, by `messageId`.
    Text,
    /// `TOOL_CALL_ARGS` / `TOOL_CALL_CHUNK` deltas, by `toolCallId`.
    ToolArgs,
    /// `REASONING_MESSAGE_CONTENT` / `REASONING_MESSAGE_CHUNK` deltas, by `messageId`.
    Reasoning,
}

/// One open stream: a message or a tool call of one partition key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamId {
    /// The raw subject's key (the AG-UI thread).
    pub key: String,
    pub kind: StreamKind,
    /// The `messageId` or `toolCallId`.
    pub id: String,
}

/// Bounds on what a stream redactor keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Bytes kept back behind the newest byte of each open stream: the longest secret that is
    /// caught whole across deltas.
    pub hold: usize,
    /// Bytes a stream may keep while a match or a run without whitespace is still growing; past
    /// it the match is replaced and the text cut.
    pub max_hold: usize,
    /// Open streams kept; opening one more publishes the oldest one's held text and forgets it.
    pub max_open: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            hold: 512,
            max_hold: 4096,
            max_open: 256,
        }
    }
}

/// The text to publish for one delta.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pushed {
    /// Redacted; possibly shorter or longer than the delta (text is held back and released).
    pub text: String,
    /// Matches replaced in it.
    pub redactions: u64,
    /// A stream closed to make room (over [`StreamLimits::max_open`]): its held text is to be
    /// published now.
    pub evicted: Option<Flushed>,
}

/// The held text of a stream that ended: published as one more delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flushed {
    pub id: StreamId,
    pub text: String,
    pub redactions: u64,
}

#[derive(Clone)]
struct Open {
    id: StreamId,
    /// Text seen and not published yet (raw: redacted when published).
    pending: String,
    /// Inside a secret cut at the window's edge: the index of its rule.
    swallow: Option<usize>,
    /// The sequence of the last delta pushed, with what it gave (a redelivered delta gets the
    /// same answer).
    last: Option<(u64, String, u64)>,
}

/// The per-partition state of streamed-text redaction. See the module documentation.
///
/// Its `Debug` shows sizes only: the text it holds is raw, possibly a secret's first half.
#[derive(Clone)]
pub struct StreamRedactor {
    redactor: Arc<Redactor>,
    limits: StreamLimits,
    /// Oldest first.
    open: Vec<Open>,
    /// The last `finish` or `finish_key` call, by the sequence that made it, for a redelivery.
    last_finish: Option<(u64, Vec<Flushed>)>,
}

impl std::fmt::Debug for StreamRedactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRedactor")
            .field("limits", &self.limits)
            .field("open_streams", &self.open.len())
            .field("held_bytes", &self.held_bytes())
            .finish_non_exhaustive()
    }
}

impl StreamRedactor {
    pub fn new(redactor: Arc<Redactor>, limits: StreamLimits) -> StreamRedactor {
        let hold = limits.hold.max(1);
        StreamRedactor {
            redactor,
            limits: StreamLimits {
                hold,
                max_hold: limits.max_hold.max(hold * 2),
                max_open: limits.max_open.max(1),
            },
            open: Vec::new(),
            last_finish: None,
        }
    }

    /// The rules it applies.
    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.open.len()
    }

    /// Bytes held now, over all streams (at most `max_open * max_hold`).
    pub fn held_bytes(&self) -> usize {
        self.open.iter().map(|o| o.pending.len()).sum()
    }

    /// The next delta of stream `id`, from the raw message at `seq` (its stream sequence; `None`
    /// offline): the text to publish in its place. The same `seq` pushed again (a redelivery)
    /// gets the same answer; an older one gets nothing (what it carried was published with the
    /// deltas after it).
    pub fn push(&mut self, id: &StreamId, seq: Option<u64>, delta: &str) -> Pushed {
        let mut evicted = None;
        let at = match self.open.iter().position(|o| o.id == *id) {
            Some(at) => at,
            None => {
                if self.open.len() >= self.limits.max_open {
                    let oldest = self.open.remove(0);
                    evicted = Some(self.close(oldest));
                }
                self.open.push(Open {
                    id: id.clone(),
                    pending: String::new(),
                    swallow: None,
                    last: None,
                });
                self.open.len() - 1
            }
        };
        let Some(mut open) = self.open.get(at).cloned() else {
            return Pushed::default();
        };
        match (&open.last, seq) {
            (Some((last, text, n)), Some(seq)) if *last == seq => {
                return Pushed {
                    text: text.clone(),
                    redactions: *n,
                    evicted,
                }
            }
            (Some((last, _, _)), Some(seq)) if *last > seq => {
                return Pushed {
                    evicted,
                    ..Pushed::default()
                }
            }
            _ => {}
        }
        open.pending.push_str(delta);
        let (text, redactions) = self.drain(&mut open, false);
        open.last = seq.map(|seq| (seq, text.clone(), redactions));
        if let Some(slot) = self.open.get_mut(at) {
            *slot = open;
        }
        Pushed {
            text,
            redactions,
            evicted,
        }
    }

    /// Stream `id` ended (`*_END`), at the raw message `seq`: its held text, redacted, to
    /// publish as one last delta (`None` when nothing is held).
    pub fn finish(&mut self, id: &StreamId, seq: Option<u64>) -> Option<Flushed> {
        if let Some(done) = self.replayed_finish(seq) {
            return done.into_iter().next();
        }
        let at = self.open.iter().position(|o| o.id == *id)?;
        let open = self.open.remove(at);
        let flushed = Some(self.close(open)).filter(|f| !f.text.is_empty());
        self.last_finish = seq.map(|seq| (seq, flushed.clone().into_iter().collect()));
        flushed
    }

    /// Every stream of `key` ended (`RUN_FINISHED`, `RUN_ERROR`) at the raw message `seq`: their
    /// held texts, oldest stream first (empty ones left out).
    pub fn finish_key(&mut self, key: &str, seq: Option<u64>) -> Vec<Flushed> {
        if let Some(done) = self.replayed_finish(seq) {
            return done;
        }
        let (ended, kept): (Vec<Open>, Vec<Open>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|o| o.id.key == key);
        self.open = kept;
        let flushed: Vec<Flushed> = ended
            .into_iter()
            .map(|o| self.close(o))
            .filter(|f| !f.text.is_empty())
            .collect();
        if let (false, Some(seq)) = (flushed.is_empty(), seq) {
            self.last_finish = Some((seq, flushed.clone()));
        }
        flushed
    }

    fn replayed_finish(&self, seq: Option<u64>) -> Option<Vec<Flushed>> {
        match (&self.last_finish, seq) {
            (Some((s, done)), Some(seq)) if *s == seq => Some(done.clone()),
            _ => None,
        }
    }

    fn close(&self, mut open: Open) -> Flushed {
        let (text, redactions) = self.drain(&mut open, true);
        Flushed {
            id: open.id,
            text,
            redactions,
        }
    }

    /// Publish what of `open.pending` can be published: everything at the end of the stream,
    /// else up to a safe cut point.
    fn drain(&self, open: &mut Open, at_end: bool) -> (String, u64) {
        let StreamLimits { hold, max_hold, .. } = self.limits;
        let mut out = String::new();
        let mut count = 0u64;
        // Each turn of the loop shortens `pending` or returns.
        loop {
            if let Some(rule) = open.swallow {
                if !self.swallow(open, rule, at_end) {
                    return (out, count);
                }
                continue;
            }
            let pending = &open.pending;
            let len = pending.len();
            let spans = self.redactor.spans(pending);
            if at_end {
                count += spans.iter().filter(|s| s.redacts(pending)).count() as u64;
                out.push_str(&apply(pending, &spans));
                open.pending.clear();
                return (out, count);
            }
            let floor = floor_boundary(pending, len.saturating_sub(max_hold));
            // The window: the last `hold` bytes wait, from after a separator (else from the
            // window's edge itself).
            let base = if len > hold {
                let limit = floor_boundary(pending, len - hold);
                last_separator_end(pending, floor, limit).unwrap_or(limit)
            } else {
                0
            };
            // Inside the window, text waits only from the word holding the first keyword on:
            // every built-in match that crosses a separator has a keyword before it (`Bearer`,
            // `-----BEGIN`, a key name), and a match without one is a single word, which waits
            // anyway. Configured patterns promise neither, so with them the whole window waits.
            let until = match self.redactor.first_keyword(pending, base) {
                _ if self.redactor.has_configured_patterns() => base,
                Some(k) => k,
                None => len,
            };
            let mut cut = last_separator_end(pending, base, until)
                .unwrap_or(base)
                .max(base);
            // A match reaching the end may still grow: it waits whole.
            let inside = spans
                .iter()
                .position(|s| s.start < cut && (cut < s.end || s.end == len));
            if let Some(i) = inside {
                cut = spans.get(i).map_or(cut, |s| s.start);
            }
            match inside.and_then(|i| spans.get(i).map(|s| (i, s))) {
                // A match still growing past the window: replace it now and drop the rest of
                // it as it comes.
                Some((i, s)) if cut < floor => {
                    let through = spans.get(..=i).unwrap_or_default();
                    count += through.iter().filter(|s| s.redacts(pending)).count() as u64;
                    out.push_str(&apply(pending.get(..s.end).unwrap_or_default(), through));
                    if s.end == len {
                        open.swallow = Some(s.rule);
                    }
                    open.pending.drain(..s.end);
                }
                _ => {
                    let before: Vec<_> = spans.into_iter().filter(|s| s.end <= cut).collect();
                    let head = pending.get(..cut).unwrap_or_default();
                    count += before.iter().filter(|s| s.redacts(head)).count() as u64;
                    out.push_str(&apply(head, &before));
                    open.pending.drain(..cut);
                    return (out, count);
                }
            }
        }
    }

    /// Drop the part of `pending` that still belongs to a secret cut at the window's edge;
    /// `true` when the secret ended (the rest of `pending` is ordinary text again).
    fn swallow(&self, open: &mut Open, rule: usize, at_end: bool) -> bool {
        let Some(rule) = self.redactor.rule(rule) else {
            open.swallow = None;
            return true;
        };
        let end = match &rule.until {
            Some(until) => until.find(&open.pending).map(|m| m.end()),
            None => rule
                .continues
                .find(&open.pending)
                .map(|m| m.end())
                .filter(|end| *end < open.pending.len()),
        };
        match end {
            Some(end) => {
                open.pending.drain(..end);
                open.swallow = None;
                true
            }
            None if at_end || rule.until.is_none() => {
                open.pending.clear();
                false
            }
            None => {
                // The end marker may be split over deltas: keep what could be its beginning.
                let keep = floor_boundary(
                    &open.pending,
                    open.pending.len().saturating_sub(self.limits.hold),
                );
                open.pending.drain(..keep);
                false
            }
        }
    }
}

/// The position after the last separator in `s[from..to]`.
fn last_separator_end(s: &str, from: usize, to: usize) -> Option<usize> {
    s.get(from..to)?
        .char_indices()
        .rev()
        .find(|(_, c)| separates(*c))
        .map(|(i, c)| from + i + c.len_utf8())
}

/// A character no secret or key name holds: text is cut after one.
fn separates(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            ';' | ',' | '&' | '"' | '\'' | '(' | ')' | '[' | ']' | '{' | '}' | '<' | '>' | '|'
        )
}

/// The largest char boundary of `s` at or before `at`.
fn floor_boundary(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The built-in rules, compiled once for every test here (the property tests below would
    /// otherwise spend nearly all their time compiling them).
    fn redactor() -> Arc<Redactor> {
        static RULES: std::sync::LazyLock<Arc<Redactor>> = std::sync::LazyLock::new(|| {
            Arc::new(Redactor::new(&[], &[]).unwrap_or_else(|e| panic!("rules compile: {e}")))
        });
        Arc::clone(&RULES)
    }

    fn id(n: &str) -> StreamId {
        StreamId {
            key: "thread-1".into(),
            kind: StreamKind::Text,
            id: n.into(),
        }
    }

    /// Push `deltas` as one stream and finish it: the published deltas.
    fn stream(r: &mut StreamRedactor, deltas: &[&str]) -> Vec<String> {
        let m = id("m1");
        let mut out: Vec<String> = deltas
            .iter()
            .enumerate()
            .map(|(i, d)| r.push(&m, Some(i as u64 + 1), d).text)
            .collect();
        out.extend(r.finish(&m, Some(1000)).map(|f| f.text));
        out
    }

    fn whole(r: &Redactor, text: &str) -> String {
        r.patterns(text)
            .map_or_else(|| text.to_string(), |(s, _)| s)
    }

    const GITHUB: &str = "ghp_R2d2C3poBb8Yoda4Luke5Leia6Han7Solo9x";
    const PEM_BODY: &str = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7";

    #[test]
    fn a_token_split_over_two_deltas_is_redacted_in_the_assembled_message() {
        let mut r = StreamRedactor::new(redactor(), StreamLimits::default());
        let out = stream(
            &mut r,
            &[
                "Use ghp_R2d2C3poBb8Yoda4",
                "Luke5Leia6Han7Solo9x, keep it safe.",
            ],
        );
        let joined = out.concat();
        assert_eq!(joined, "Use [redacted:github], keep it safe.");
        assert!(!joined.contains("R2d2C3po"), "{out:?}");
        assert_eq!(r.open_streams(), 0);
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn text_waits_only_from_the_last_word_or_the_first_keyword_in_the_window() {
        let limits = StreamLimits {
            hold: 16,
            max_hold: 64,
            max_open: 4,
        };
        let mut r = StreamRedactor::new(redactor(), limits);
        let m = id("m1");
        // No keyword: all but the last word (which may be the start of a token) goes out.
        let first = r.push(
            &m,
            Some(1),
            "one two three four five six seven eight nine ten",
        );
        assert_eq!(first.text, "one two three four five six seven eight nine ");
        // A keyword: from its word on, the text waits (a value may follow), up to the window.
        let second = r.push(&m, Some(2), " and then Authorization: Bearer abc");
        assert_eq!(second.text, "ten and then ");
        let third = r.push(&m, Some(3), "def123 ok, more words follow here");
        assert_eq!(
            third.text,
            "Authorization: Bearer [redacted:bearer] ok, more words follow "
        );
        let rest = r.finish(&m, Some(4)).map(|f| f.text).unwrap_or_default();
        assert_eq!(rest, "here");
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn configured_patterns_make_the_whole_window_wait() {
        let red = Redactor::new(
            &[],
            &[crate::redact::ExtraPattern {
                name: "ticket".into(),
                pattern: r"TKT 0000 [0-9]{4}".into(),
            }],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let limits = StreamLimits {
            hold: 16,
            max_hold: 64,
            max_open: 4,
        };
        let mut r = StreamRedactor::new(Arc::new(red), limits);
        let m = id("m1");
        let first = r.push(&m, Some(1), "see TKT 0000 ");
        assert_eq!(first.text, "");
        let second = r.push(&m, Some(2), "1234 now");
        let rest = r.finish(&m, Some(3)).map(|f| f.text).unwrap_or_default();
        assert_eq!(
            format!("{}{rest}", second.text),
            "see [redacted:ticket] now"
        );
    }

    #[test]
    fn tool_arguments_streamed_as_json_are_redacted_over_the_whole_call() {
        let mut r = StreamRedactor::new(redactor(), StreamLimits::default());
        let out = stream(
            &mut r,
            &[
                "{\"url\":\"https://api\",\"api_key\":\"sk-proj-Zz9",
                "Yy8Xx7Ww6Vv5Uu4Tt3Ss2Rr1\"}",
            ],
        );
        let joined = out.concat();
        assert!(
            !joined.contains("Zz9") && !joined.contains("Rr1"),
            "{joined}"
        );
        assert!(
            joined.starts_with("{\"url\":\"https://api\",\"api_key\":\""),
            "{joined}"
        );
    }

    #[test]
    fn a_pem_key_longer_than_the_window_is_dropped_to_its_end_line() {
        let limits = StreamLimits {
            hold: 32,
            max_hold: 96,
            max_open: 4,
        };
        let mut r = StreamRedactor::new(redactor(), limits);
        let body: Vec<String> = (0..12).map(|_| format!("{PEM_BODY}\n")).collect();
        let mut deltas = vec!["key follows\n-----BEGIN PRIVATE KEY-----\n".to_string()];
        deltas.extend(body);
        deltas.push("-----END PRIV".into());
        deltas.push("ATE KEY-----\nthat was the key".into());
        let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
        let joined = stream(&mut r, &refs).concat();
        assert_eq!(
            joined,
            "key follows\n[redacted:private_key]\nthat was the key"
        );
        assert!(r.held_bytes() == 0);
    }

    #[test]
    fn a_pem_key_cut_before_its_end_line_is_dropped_to_the_end_of_the_message() {
        let mut r = StreamRedactor::new(redactor(), StreamLimits::default());
        let joined = stream(
            &mut r,
            &[
                "-----BEGIN RSA PRIV",
                "ATE KEY-----\n",
                PEM_BODY,
                "\n",
                PEM_BODY,
            ],
        )
        .concat();
        assert_eq!(joined, "[redacted:private_key]");
    }

    #[test]
    fn streams_are_bounded_and_evicted_oldest_first() {
        let limits = StreamLimits {
            hold: 8,
            max_hold: 16,
            max_open: 2,
        };
        let mut r = StreamRedactor::new(redactor(), limits);
        // The last word waits (it may be the start of a secret).
        assert_eq!(r.push(&id("a"), Some(1), "held a").text, "held ");
        assert_eq!(r.push(&id("b"), Some(2), "held b").text, "held ");
        let c = r.push(&id("c"), Some(3), "held c");
        assert_eq!(
            c.evicted,
            Some(Flushed {
                id: id("a"),
                text: "a".into(),
                redactions: 0
            })
        );
        assert_eq!(r.open_streams(), 2);
        for n in 4..200 {
            r.push(&id("b"), Some(n), "x y z w ");
            assert!(r.held_bytes() <= 2 * 16, "{}", r.held_bytes());
        }
        // A run's end closes every stream of its key, not other keys'.
        let other = StreamId {
            key: "thread-2".into(),
            ..id("d")
        };
        r.push(&other, Some(300), "other");
        let ended = r.finish_key("thread-1", Some(301));
        assert_eq!(ended.len(), 1, "{ended:?}");
        assert_eq!(r.open_streams(), 1);
    }

    #[test]
    fn debug_output_never_shows_held_text() {
        let mut r = StreamRedactor::new(redactor(), StreamLimits::default());
        r.push(&id("m"), Some(1), "Use ghp_R2d2C3poBb8Yoda4");
        let shown = format!("{r:?}");
        assert!(
            !shown.contains("R2d2") && shown.contains("held_bytes"),
            "{shown}"
        );
    }

    #[test]
    fn a_redelivered_delta_gets_the_same_answer() {
        let mut r = StreamRedactor::new(
            redactor(),
            StreamLimits {
                hold: 4,
                max_hold: 8,
                max_open: 4,
            },
        );
        let m = id("m");
        let once = r.push(&m, Some(7), "alpha beta gamma ");
        let again = r.push(&m, Some(7), "alpha beta gamma ");
        assert_eq!(once, again);
        assert_eq!(r.push(&m, Some(6), "older").text, "");
        let end = r.finish(&m, Some(9));
        assert_eq!(r.finish(&m, Some(9)), end);
        assert_eq!(
            format!("{}{}", once.text, end.map(|f| f.text).unwrap_or_default()),
            "alpha beta gamma "
        );
    }

    /// Secrets of every family, as the assembled message would carry them.
    fn secrets() -> Vec<String> {
        vec![
            GITHUB.to_string(),
            "sk_live_4eC39HqLyjWDarjtT1zdp7dcTYooMQauvdEDq54NiTphI7jx".into(),
            "hf_FakeTokenForTestsOnly0123456789abcdef".into(),
            "DefaultEndpointsProtocol=https;AccountName=demo;AccountKey=Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4==;EndpointSuffix=core.windows.net".into(),
            format!("-----BEGIN PRIVATE KEY-----\n{PEM_BODY}\n-----END PRIVATE KEY-----"),
            "'aws_secret_access_key': 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKEKEY0000'".into(),
            "password=Tr0ub4dor&3".into(),
            "glpat-AbCdEfGhIjKlMnOpQrSt".into(),
            "xoxb-123456789012-abcdefghijklmnop".into(),
            "sk-ant-api03-FakeFakeFakeFakeFakeFake0123".into(),
        ]
    }

    /// Prose words, sometimes a keyword, a key name or punctuation a rule looks at.
    fn word() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[a-z]{1,9}",
            1 => proptest::sample::select(vec![
                "key", "token:", "pass", "Bearer", "secret=", "'", "\"", "{", "}", "sk-", "ghp_",
                "-----BEGIN", "api_key:", "password", "=", "AKIA", "://", "sig=", "\n", "12345678",
            ])
            .prop_map(String::from),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// However the message is cut into deltas, the published deltas put together equal the
        /// redacted whole message and hold no secret.
        #[test]
        fn any_split_publishes_the_redacted_whole(
            which in 0usize..10,
            before in proptest::collection::vec(word(), 0..80),
            after in proptest::collection::vec(word(), 0..80),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
            hold in prop_oneof![Just(256usize), Just(512)],
        ) {
            let secret = secrets().swap_remove(which);
            let text = format!("{} {secret} {}", before.join(" "), after.join(" "));
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(text.len() + 1)).collect();
            points.push(0);
            points.push(text.len());
            points.sort_unstable();
            points.dedup();
            let deltas: Vec<&str> = points
                .windows(2)
                .filter_map(|w| text.get(w[0]..w[1]))
                .collect();
            let red = redactor();
            let mut r = StreamRedactor::new(red.clone(), StreamLimits { hold, max_hold: 4096, max_open: 4 });
            let joined = stream(&mut r, &deltas).concat();
            prop_assert_eq!(&joined, &whole(&red, &text));
            let core = if secret.contains("AccountKey") { "Zm9vYmFy" } else if secret.contains("PRIVATE") { PEM_BODY } else if let Some((_, v)) = secret.split_once('=') { v } else if let Some((_, v)) = secret.split_once(": ") { v } else { secret.as_str() };
            prop_assert!(!joined.contains(core), "{} in {}", core, joined);
            prop_assert_eq!(r.held_bytes(), 0);
        }

        /// With a window smaller than some secrets, a secret is still never published.
        #[test]
        fn a_small_window_never_publishes_a_secret(
            which in 0usize..10,
            before in proptest::collection::vec(word(), 0..40),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        ) {
            let secret = secrets().swap_remove(which);
            let text = format!("{} {secret} tail", before.join(" "));
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(text.len() + 1)).collect();
            points.push(0);
            points.push(text.len());
            points.sort_unstable();
            points.dedup();
            let deltas: Vec<&str> = points.windows(2).filter_map(|w| text.get(w[0]..w[1])).collect();
            let mut r = StreamRedactor::new(redactor(), StreamLimits { hold: 64, max_hold: 128, max_open: 4 });
            let joined = stream(&mut r, &deltas).concat();
            let core = if secret.contains("AccountKey") { "Zm9vYmFy" } else if secret.contains("PRIVATE") { "MIIEvQ" } else if let Some((_, v)) = secret.split_once('=') { v } else if let Some((_, v)) = secret.split_once(": ") { v } else { secret.as_str() };
            prop_assert!(!joined.contains(core), "{} in {:?} from {:?}", core, joined, deltas);
        }
    }
}
