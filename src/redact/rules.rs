//! The redaction rules and the [`Redactor`] that applies them: the built-in rule file, the
//! configured keys and patterns, and the walk over a parsed value. The stream redactor works on
//! the spans this module finds.

use aho_corasick::AhoCorasick;
use regex::{Regex, RegexSet};
use serde::Deserialize;
use serde_json::{Map, Value};

/// The built-in rule file.
const RULES: &str = include_str!("rules.toml");

/// Strings longer than this that look like JSON are not parsed to look inside: the largest
/// message a NATS server carries (`max_payload` is at most 64 MiB), so every string an input can
/// hold is parsed. Parsing is linear in the string, and JSON nested in strings can only go a few
/// levels deep before its escaping outgrows the message (each level doubles the backslashes).
const MAX_NESTED_JSON: usize = 64 * 1024 * 1024;
/// Nesting beyond which values are left as they are (the normaliser bounds depth before this).
const MAX_DEPTH: usize = 128;
/// Passes of the rules over one string before its redaction is taken as final (two suffice for
/// every combination of the built-in rules: the second finds nothing).
const MAX_PASSES: usize = 4;
/// What a streamed secret longer than the stream window is taken to continue with, for a rule
/// that names nothing else: the characters of tokens and keys.
const DEFAULT_CONTINUES: &str = r"[A-Za-z0-9+/=_.~-]";

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedactError {
    #[error("redaction pattern {name:?} is not a valid regular expression: {detail}")]
    BadPattern { name: String, detail: String },
    #[error("the built-in redaction rules do not load: {0}")]
    BadRules(String),
}

/// A pattern given in configuration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct ExtraPattern {
    /// The kind named in the marker: `[redacted:<name>]`.
    pub name: String,
    /// A regular expression (Rust `regex` syntax); the whole match is replaced.
    pub pattern: String,
}

/// The rule file's shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    keys: KeyNames,
    rules: Vec<RuleSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyNames {
    suffixes: Vec<String>,
    exact: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    id: String,
    #[serde(default)]
    keywords: Vec<String>,
    regex: String,
    replacement: Option<String>,
    secret: Option<String>,
    #[serde(default)]
    min_len: usize,
    #[serde(default)]
    not_numeric: bool,
    #[serde(default)]
    ignore_values: Vec<String>,
    continues: Option<String>,
    until: Option<String>,
}

/// One compiled string rule.
#[derive(Debug, Clone)]
pub(super) struct Rule {
    id: String,
    re: Regex,
    replacement: String,
    /// Capture groups that may hold the secret (the first one that matched is it).
    secret: Vec<String>,
    min_len: usize,
    not_numeric: bool,
    /// Lower-case.
    ignore_values: Vec<String>,
    /// Anchored: the text right after a cut secret that still belongs to it.
    pub(super) continues: Regex,
    /// For a block (a PEM key): where it ends.
    pub(super) until: Option<Regex>,
}

impl Rule {
    fn compile(spec: RuleSpec) -> Result<Rule, RedactError> {
        let bad = |what: &str, e: regex::Error| RedactError::BadPattern {
            name: format!("{}{what}", spec.id),
            detail: e.to_string(),
        };
        let re = Regex::new(&spec.regex).map_err(|e| bad("", e))?;
        let continues = spec.continues.as_deref().unwrap_or(DEFAULT_CONTINUES);
        let continues =
            Regex::new(&format!("^(?:{continues})*")).map_err(|e| bad(".continues", e))?;
        let until = spec
            .until
            .as_deref()
            .map(Regex::new)
            .transpose()
            .map_err(|e| bad(".until", e))?;
        Ok(Rule {
            replacement: spec
                .replacement
                .unwrap_or_else(|| format!("[redacted:{}]", spec.id)),
            secret: spec
                .secret
                .map(|s| s.split('|').map(str::to_string).collect())
                .unwrap_or_default(),
            min_len: spec.min_len,
            not_numeric: spec.not_numeric,
            ignore_values: spec
                .ignore_values
                .iter()
                .map(|v| v.to_lowercase())
                .collect(),
            id: spec.id,
            re,
            continues,
            until,
        })
    }

    /// Whether a match is a secret to replace (its secret group passes the rule's checks).
    fn accepts(&self, caps: &regex::Captures<'_>) -> bool {
        let Some(secret) = self.secret.iter().find_map(|g| caps.name(g)) else {
            return true;
        };
        let s = secret.as_str();
        !(s.starts_with("[redacted:")
            || s.chars().count() < self.min_len
            || (self.not_numeric && s.parse::<f64>().is_ok())
            || self.ignore_values.iter().any(|v| v.eq_ignore_ascii_case(s)))
    }
}

/// A match to replace: `text[start..end]` becomes `replacement`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
    pub end: usize,
    pub replacement: String,
    /// Index into the rules.
    pub rule: usize,
}

impl Span {
    /// A replacement that equals what it matched (a marker matching its own rule) is no
    /// redaction.
    pub(super) fn redacts(&self, text: &str) -> bool {
        text.get(self.start..self.end) != Some(self.replacement.as_str())
    }
}

/// The compiled rules.
#[derive(Debug, Clone)]
pub struct Redactor {
    /// Normalised key names matched as suffixes.
    suffixes: Vec<String>,
    /// Normalised key names matched whole.
    exact: Vec<String>,
    rules: Vec<Rule>,
    /// One pattern per keyword (case-insensitive literal).
    keywords: RegexSet,
    /// The same keywords as one automaton comparing ASCII letters without case, in the same
    /// order: on ASCII text it finds exactly what `keywords` finds (the only characters outside
    /// ASCII that match an ASCII letter without case, `K` (U+212A) and `ſ` (U+017F), cannot
    /// occur in ASCII text), in one pass that allocates nothing when no keyword occurs, which
    /// is most text. `None` when a keyword is not ASCII.
    keyword_scan: Option<AhoCorasick>,
    /// All keywords in one pattern, to find where the first one is.
    any_keyword: Option<Regex>,
    /// Whether configuration added patterns (they have no keywords and may span words).
    configured: bool,
    /// For each keyword, the rules it lets run.
    keyword_rules: Vec<Vec<usize>>,
    /// Rules without keywords: they run on every string.
    always: Vec<usize>,
}

/// The built-in rules compiled: the same for every [`Redactor`], so they are compiled once per
/// process (a worker builds a redactor per pipeline, configuration checks build several, and
/// compiling these patterns is most of what building one costs). A compiled expression's or
/// automaton's clone shares the compiled program.
static BUILTIN: std::sync::LazyLock<Result<Redactor, RedactError>> =
    std::sync::LazyLock::new(Redactor::builtin);

impl Redactor {
    /// The built-in rules plus `extra_keys` (key names, compared normalised) and
    /// `extra_patterns`.
    pub fn new(
        extra_keys: &[String],
        extra_patterns: &[ExtraPattern],
    ) -> Result<Redactor, RedactError> {
        let mut r = BUILTIN.as_ref().map_err(Clone::clone)?.clone();
        r.suffixes
            .extend(extra_keys.iter().map(|k| normalise_key(k)));
        r.suffixes.retain(|k| !k.is_empty());
        // Configured patterns have no keywords: they run on every string.
        for e in extra_patterns {
            r.always.push(r.rules.len());
            r.rules.push(Rule::compile(RuleSpec {
                id: e.name.clone(),
                regex: e.pattern.clone(),
                ..RuleSpec::default()
            })?);
        }
        r.configured = !extra_patterns.is_empty();
        Ok(r)
    }

    /// The built-in rules alone, compiled.
    fn builtin() -> Result<Redactor, RedactError> {
        let file: RuleFile =
            toml::from_str(RULES).map_err(|e| RedactError::BadRules(e.to_string()))?;
        let suffixes = file
            .keys
            .suffixes
            .iter()
            .map(|k| normalise_key(k))
            .collect();
        let exact = file.keys.exact.iter().map(|k| normalise_key(k)).collect();
        let mut rules = Vec::with_capacity(file.rules.len());
        let mut keyword_sources = Vec::new();
        let mut keyword_literals: Vec<String> = Vec::new();
        let mut keyword_rules: Vec<Vec<usize>> = Vec::new();
        let mut always = Vec::new();
        for (i, spec) in file.rules.into_iter().enumerate() {
            if spec.keywords.is_empty() {
                always.push(i);
            }
            for kw in &spec.keywords {
                let source = format!("(?i){}", regex::escape(kw));
                match keyword_sources.iter().position(|s| *s == source) {
                    Some(at) => {
                        if let Some(list) = keyword_rules.get_mut(at) {
                            list.push(i);
                        }
                    }
                    None => {
                        keyword_sources.push(source);
                        keyword_literals.push(kw.clone());
                        keyword_rules.push(vec![i]);
                    }
                }
            }
            rules.push(Rule::compile(spec)?);
        }
        let any_keyword = if keyword_sources.is_empty() {
            None
        } else {
            let alternation = keyword_sources
                .iter()
                .map(|k| format!("(?:{k})"))
                .collect::<Vec<_>>()
                .join("|");
            Some(
                Regex::new(&alternation).map_err(|e| RedactError::BadPattern {
                    name: "(keywords)".into(),
                    detail: e.to_string(),
                })?,
            )
        };
        let keywords = RegexSet::new(&keyword_sources).map_err(|e| RedactError::BadPattern {
            name: "(keywords)".into(),
            detail: e.to_string(),
        })?;
        let keyword_scan = if keyword_literals.iter().all(|k| k.is_ascii()) {
            Some(
                AhoCorasick::builder()
                    .ascii_case_insensitive(true)
                    .build(&keyword_literals)
                    .map_err(|e| RedactError::BadPattern {
                        name: "(keywords)".into(),
                        detail: e.to_string(),
                    })?,
            )
        } else {
            None
        };
        Ok(Redactor {
            suffixes,
            exact,
            rules,
            keywords,
            keyword_scan,
            any_keyword,
            configured: false,
            keyword_rules,
            always,
        })
    }

    /// Redact `value` in place; the number of values and matches replaced.
    pub fn value(&self, value: &mut Value) -> u64 {
        self.walk(value, 0)
    }

    /// Redact one string; `None` when it holds nothing to redact.
    ///
    /// The result is a fixed point: redacting it again finds nothing. One rule's replacement
    /// can expose a match for another (a marker takes the place of a `/` or a space that kept a
    /// URL's password from matching, or of JSON too long to parse), so the rules run again on
    /// what changed until nothing does; the second pass usually finds nothing.
    pub fn text(&self, text: &str) -> Option<(String, u64)> {
        let mut count = 0u64;
        let mut current: Option<String> = None;
        for _ in 0..MAX_PASSES {
            let s = current.as_deref().unwrap_or(text);
            let mut changed: Option<String> = None;
            // JSON carried in a string: redact inside it and write it back.
            let trimmed = s.trim_start();
            if (trimmed.starts_with('{') || trimmed.starts_with('[')) && s.len() <= MAX_NESTED_JSON
            {
                if let Ok(mut inner) = serde_json::from_str::<Value>(s) {
                    let n = self.walk(&mut inner, 1);
                    if n > 0 {
                        count += n;
                        changed = Some(inner.to_string());
                    }
                }
            }
            if let Some((replaced, n)) = self.patterns(changed.as_deref().unwrap_or(s)) {
                count += n;
                changed = Some(replaced);
            }
            match changed {
                Some(next) => current = Some(next),
                None => break,
            }
        }
        current.map(|s| (s, count))
    }

    /// One pass of the string rules; `None` when none replaced anything.
    pub fn patterns(&self, text: &str) -> Option<(String, u64)> {
        let spans = self.spans(text);
        let count = spans.iter().filter(|s| s.redacts(text)).count() as u64;
        (count > 0).then(|| (apply(text, &spans), count))
    }

    /// The matches of every rule in `text`, without overlaps, in order: where two overlap, they
    /// are replaced together by the replacement of the one starting first (then the longer, then
    /// the rule listed first).
    pub(crate) fn spans(&self, text: &str) -> Vec<Span> {
        // The rules a keyword found; the keyword-less rules (`always`, never among them) run
        // on every text, without copying their list for each one.
        let mut candidates: Vec<usize> = Vec::new();
        if !self.keyword_rules.is_empty() {
            match &self.keyword_scan {
                Some(scan) if text.is_ascii() => {
                    if scan.is_match(text) {
                        for m in scan.find_overlapping_iter(text) {
                            let k = m.pattern().as_usize();
                            candidates.extend(self.keyword_rules.get(k).into_iter().flatten());
                        }
                    }
                }
                _ => {
                    for k in self.keywords.matches(text).iter() {
                        candidates.extend(self.keyword_rules.get(k).into_iter().flatten());
                    }
                }
            }
        }
        if candidates.is_empty() && self.always.is_empty() {
            return Vec::new();
        }
        candidates.sort_unstable();
        candidates.dedup();
        let mut found = Vec::new();
        for &i in self.always.iter().chain(&candidates) {
            let Some(rule) = self.rules.get(i) else {
                continue;
            };
            let mut at = 0;
            // Most texts hold no secret: a search without capture groups answers that without
            // allocating them.
            while rule.re.find_at(text, at).is_some() {
                let Some(caps) = rule.re.captures_at(text, at) else {
                    break;
                };
                let Some(m) = caps.get(0) else { break };
                if m.is_empty() || !rule.accepts(&caps) {
                    // A match that is no secret may hide one starting inside it (`api_key:
                    // token: <secret>`, whose first value is too short): look again from its
                    // next character, so the whole text finds what a stream cut there would.
                    at = m.start() + text[m.start()..].chars().next().map_or(1, char::len_utf8);
                    if at > text.len() {
                        break;
                    }
                    continue;
                }
                let mut replacement = String::new();
                caps.expand(&rule.replacement, &mut replacement);
                found.push(Span {
                    start: m.start(),
                    end: m.end(),
                    replacement,
                    rule: i,
                });
                at = m.end();
            }
        }
        found.sort_by(|a, b| {
            a.start
                .cmp(&b.start)
                .then(b.end.cmp(&a.end))
                .then(a.rule.cmp(&b.rule))
        });
        // Overlapping matches become one: the first one's replacement over both, so a match
        // that starts inside another (`token: -----BEGIN PRIVATE KEY-----...`) is never cut
        // short and its rest left in the clear. The rule of a merged span is the one whose match
        // reaches furthest (what a streamed secret continues with).
        let mut spans: Vec<Span> = Vec::with_capacity(found.len());
        for s in found {
            match spans.last_mut() {
                Some(last) if s.start < last.end => {
                    if s.end > last.end {
                        last.end = s.end;
                        last.rule = s.rule;
                    }
                }
                _ => spans.push(s),
            }
        }
        spans
    }

    /// The ids of the string rules, built-in ones first (the kinds markers name).
    pub fn rule_ids(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| r.id.as_str())
    }

    /// Where the first rule keyword at or after byte `at` of `text` starts.
    pub(crate) fn first_keyword(&self, text: &str, at: usize) -> Option<usize> {
        let re = self.any_keyword.as_ref()?;
        (at <= text.len())
            .then(|| re.find_at(text, at).map(|m| m.start()))
            .flatten()
    }

    /// Whether configuration added patterns to the built-in rules.
    pub(crate) fn has_configured_patterns(&self) -> bool {
        self.configured
    }

    /// The rule a span came from.
    pub(super) fn rule(&self, i: usize) -> Option<&Rule> {
        self.rules.get(i)
    }

    /// The marker for a value under `key`, when the key is sensitive.
    fn key_marker(&self, key: &str) -> Option<String> {
        // Most keys are short ASCII: normalise them on the stack (this runs for every key).
        let mut buf = [0u8; 64];
        let mut len = 0;
        let mut slow = None;
        for b in key.bytes() {
            if matches!(b, b'_' | b'-' | b'.' | b' ') {
                continue;
            }
            if len == buf.len() || !b.is_ascii() {
                slow = Some(normalise_key(key));
                break;
            }
            buf[len] = b.to_ascii_lowercase();
            len += 1;
        }
        let k = slow.as_deref().map_or(&buf[..len], str::as_bytes);
        self.suffixes
            .iter()
            .find(|class| k.ends_with(class.as_bytes()))
            .or_else(|| self.exact.iter().find(|name| k == name.as_bytes()))
            .map(|class| format!("[redacted:{class}]"))
    }

    /// For a JSON Patch operation (`op` and `path` strings), the marker its `value` gets when a
    /// segment of its path is a sensitive name (`/config/aws_secret_access_key`,
    /// `/credentials/0/user`).
    fn patch_marker(&self, map: &Map<String, Value>) -> Option<String> {
        let (Some(Value::String(_)), Some(Value::String(path))) = (
            crate::classify::member(map, "op"),
            crate::classify::member(map, "path"),
        ) else {
            return None;
        };
        path.split('/')
            .filter(|seg| !seg.is_empty())
            .find_map(|seg| self.key_marker(&seg.replace("~1", "/").replace("~0", "~")))
    }

    fn walk(&self, value: &mut Value, depth: usize) -> u64 {
        if depth > MAX_DEPTH {
            return 0;
        }
        match value {
            Value::String(s) => match self.text(s) {
                Some((redacted, n)) => {
                    *s = redacted;
                    n
                }
                None => 0,
            },
            Value::Array(items) => items.iter_mut().map(|v| self.walk(v, depth + 1)).sum(),
            Value::Object(map) => {
                let mut n = 0;
                // Keys can carry secrets too (maps keyed by token, header lines as keys).
                let renamed: Vec<(usize, String)> = map
                    .keys()
                    .enumerate()
                    .filter_map(|(i, k)| self.text(k).map(|(key, c)| (i, key, c)))
                    .map(|(i, key, c)| {
                        n += c;
                        (i, key)
                    })
                    .collect();
                let patch = self.patch_marker(map);
                for (k, v) in map.iter_mut() {
                    let sensitive = !matches!(v, Value::Null | Value::Bool(_));
                    let marker = match &patch {
                        Some(m) if k == "value" => Some(m.clone()),
                        _ => self.key_marker(k),
                    };
                    match marker.filter(|_| sensitive) {
                        Some(marker) if v.as_str() != Some(marker.as_str()) => {
                            *v = Value::String(marker);
                            n += 1;
                        }
                        Some(_) => {}
                        None => n += self.walk(v, depth + 1),
                    }
                }
                if !renamed.is_empty() {
                    rename_keys(map, renamed);
                }
                n
            }
            _ => 0,
        }
    }
}

/// `text` with each span replaced (spans in order, without overlaps).
pub(super) fn apply(text: &str, spans: &[Span]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for s in spans {
        out.push_str(text.get(at..s.start).unwrap_or_default());
        out.push_str(&s.replacement);
        at = s.end;
    }
    out.push_str(text.get(at..).unwrap_or_default());
    out
}

/// Give the keys at the listed positions their redacted names, keeping the order. A name that
/// is already taken (two keys that differed only in their secrets) gets ` (2)`, ` (3)`, ...
fn rename_keys(map: &mut Map<String, Value>, renamed: Vec<(usize, String)>) {
    let mut renamed = renamed.into_iter().peekable();
    let old = std::mem::take(map);
    for (i, (key, value)) in old.into_iter().enumerate() {
        let key = match renamed.peek() {
            Some((at, _)) if *at == i => renamed.next().map_or(key, |(_, k)| k),
            _ => key,
        };
        let mut unique = key.clone();
        let mut n = 2;
        while map.contains_key(&unique) {
            unique = format!("{key} ({n})");
            n += 1;
        }
        map.insert(unique, value);
    }
}

/// Lower-case, without `_`, `-`, `.` and spaces.
fn normalise_key(key: &str) -> String {
    key.chars()
        .filter(|c| !matches!(c, '_' | '-' | '.' | ' '))
        .flat_map(char::to_lowercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn redactor() -> Redactor {
        Redactor::new(&[], &[]).unwrap_or_else(|e| panic!("built-in rules compile: {e}"))
    }

    fn redact(mut v: Value) -> (Value, u64) {
        let n = redactor().value(&mut v);
        (v, n)
    }

    #[test]
    fn values_under_sensitive_keys_in_any_spelling_and_depth() {
        let (v, n) = redact(json!({
            "password": "hunter2",
            "api_key": "k1",
            "apiKey": "k2",
            "X-Api-Key": "k3",
            "headers": {"Authorization": "Token abc", "Set-Cookie": "sid=1"},
            "db": [{"PASSWD": "p"}, {"client_secret": "c"}, {"access_token": 7}],
            "credentials": {"user": "u", "pass": "p"},
            "secrets": ["a", "b"],
            "tokens": 1234,
            "private_key": "k",
            "refresh-token": "r",
            "hasPassword": true,
            "token": null,
            "maxTokens": 4096,
            "targetSessionKey": "agent:eden:main",
            "message": "nothing secret here",
        }));
        assert_eq!(v["password"], "[redacted:password]");
        assert_eq!(v["api_key"], "[redacted:apikey]");
        assert_eq!(v["apiKey"], "[redacted:apikey]");
        assert_eq!(v["X-Api-Key"], "[redacted:apikey]");
        assert_eq!(v["headers"]["Authorization"], "[redacted:authorization]");
        assert_eq!(v["headers"]["Set-Cookie"], "[redacted:cookie]");
        assert_eq!(v["db"][0]["PASSWD"], "[redacted:passwd]");
        assert_eq!(v["db"][1]["client_secret"], "[redacted:secret]");
        assert_eq!(v["db"][2]["access_token"], "[redacted:token]");
        assert_eq!(v["credentials"], "[redacted:credentials]");
        assert_eq!(v["secrets"], "[redacted:secrets]");
        assert_eq!(v["tokens"], 1234);
        assert_eq!(v["private_key"], "[redacted:privatekey]");
        assert_eq!(v["refresh-token"], "[redacted:token]");
        // Flags, nulls, usage counts and routing addresses are not secrets.
        assert_eq!(v["hasPassword"], true);
        assert_eq!(v["token"], Value::Null);
        assert_eq!(v["maxTokens"], 4096);
        assert_eq!(v["targetSessionKey"], "agent:eden:main");
        assert_eq!(v["message"], "nothing secret here");
        assert_eq!(n, 13);
    }

    #[test]
    fn a_value_a_rule_turns_down_does_not_hide_a_secret_starting_inside_it() {
        // `api_key: token:` is a key=value match whose value is too short to be a secret; the
        // `token: <secret>` that starts inside it must still be found.
        let (v, _) = redact(json!({"note": "api_key: token: Zq8vN3xK7mP2wR5tY9uB"}));
        let note = v["note"].as_str().unwrap_or_default();
        assert!(!note.contains("Zq8vN3xK7mP2wR5tY9uB"), "{note}");
        assert!(note.contains("[redacted:"), "{note}");
    }

    #[test]
    fn every_string_pattern_family_keeps_the_text_around_it() {
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U";
        let pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7x\nabc\n-----END RSA PRIVATE KEY-----";
        let cases: Vec<(String, &str)> = vec![
            (
                "call with Authorization: Bearer abcdefgh12345678 please".into(),
                "call with Authorization: Bearer [redacted:bearer] please",
            ),
            (
                "Basic dXNlcjpwYXNzd29yZA== was sent".into(),
                "Basic [redacted:basic] was sent",
            ),
            (
                format!("token {jwt} expired"),
                "token [redacted:jwt] expired",
            ),
            (
                format!("key:\n{pem}\nend"),
                "key:\n[redacted:private_key]\nend",
            ),
            (
                "id AKIAIOSFODNN7EXAMPLE in use".into(),
                "id [redacted:aws_access_key] in use",
            ),
            (
                "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
                "aws_secret_access_key = [redacted:aws_secret]",
            ),
            (
                "use ghp_0123456789abcdefghijABCDEFGHIJ012345 now".into(),
                "use [redacted:github] now",
            ),
            (
                "pat github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz".into(),
                "pat [redacted:github]",
            ),
            (
                "glpat-abcdefghij0123456789 ok".into(),
                "[redacted:gitlab] ok",
            ),
            (
                "xoxb-1234567890-abcdefghij ok".into(),
                "[redacted:slack] ok",
            ),
            (
                "post to https://hooks.slack.com/services/T000/B000/XXXX".into(),
                "post to [redacted:slack]",
            ),
            (
                "sk-ant-api03-abcdefghijklmnopqrstuv x".into(),
                "[redacted:anthropic] x",
            ),
            (
                "sk-proj-abcdefghijklmnopqrstuvwx y".into(),
                "[redacted:openai] y",
            ),
            (
                "key AIzaSyA-abcdefghijklmnopqrstuvwxyz01234 z".into(),
                "key [redacted:google_api_key] z",
            ),
            (
                "db at postgres://admin:s3cr3t@db.internal:5432/app".into(),
                "db at postgres://[redacted:url_credentials]@db.internal:5432/app",
            ),
        ];
        let r = redactor();
        for (input, want) in cases {
            let (got, n) = r
                .text(&input)
                .unwrap_or_else(|| panic!("nothing redacted in {input:?}"));
            assert_eq!(got, want, "for {input:?}");
            assert!(n >= 1);
        }
        assert!(r
            .text("plain words, https://example.com/a?b=c, sk-short")
            .is_none());
    }

    #[test]
    fn json_inside_strings_and_arrays_is_redacted_too() {
        let inner =
            json!({"result": {"api_key": "k", "note": "Bearer abcdefgh12345678"}}).to_string();
        let (v, n) = redact(json!({"output": inner, "list": ["ok", "Bearer abcdefgh12345678"]}));
        let back: Value =
            serde_json::from_str(v["output"].as_str().unwrap_or("null")).unwrap_or(Value::Null);
        assert_eq!(back["result"]["api_key"], "[redacted:apikey]");
        assert_eq!(back["result"]["note"], "Bearer [redacted:bearer]");
        assert_eq!(v["list"][1], "Bearer [redacted:bearer]");
        assert_eq!(n, 3);
    }

    #[test]
    fn json_inside_a_string_is_parsed_whatever_its_size() {
        // Larger than any bound but the largest message NATS carries.
        let filler = "lorem ipsum ".repeat(60_000);
        let inner = json!({"filler": filler, "db": [{"PASSWD": "p"}, {"creds": {"pass": "q"}}]})
            .to_string();
        assert!(inner.len() > 512 * 1024);
        let (v, n) = redact(json!({"output": inner}));
        let back: Value =
            serde_json::from_str(v["output"].as_str().unwrap_or("null")).unwrap_or(Value::Null);
        assert_eq!(back["db"][0]["PASSWD"], "[redacted:passwd]");
        assert_eq!(back["db"][1]["creds"]["pass"], "[redacted:pass]");
        assert_eq!(n, 2);
    }

    #[test]
    fn configured_keys_and_patterns_extend_the_rules() {
        let r = Redactor::new(
            &["Session-Pin".into()],
            &[ExtraPattern {
                name: "ticket".into(),
                pattern: r"TKT-[0-9]{6}".into(),
            }],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut v = json!({"session_pin": "1234", "note": "see TKT-123456"});
        assert_eq!(r.value(&mut v), 2);
        assert_eq!(v["session_pin"], "[redacted:sessionpin]");
        assert_eq!(v["note"], "see [redacted:ticket]");
        let bad = Redactor::new(
            &[],
            &[ExtraPattern {
                name: "broken".into(),
                pattern: "(".into(),
            }],
        );
        assert!(matches!(bad, Err(RedactError::BadPattern { name, .. }) if name == "broken"));
    }

    #[test]
    fn secrets_in_keys_are_redacted_and_keys_that_collide_are_kept_apart() {
        let (v, n) = redact(json!({
            "Bearer abcdefgh12345678": 1,
            "plain": 2,
            "Bearer 0a1b2c3d4e5f": 3,
        }));
        let keys: Vec<&str> = v
            .as_object()
            .map(|m| m.keys().map(String::as_str).collect())
            .unwrap_or_default();
        assert_eq!(
            keys,
            [
                "Bearer [redacted:bearer]",
                "plain",
                "Bearer [redacted:bearer] (2)"
            ]
        );
        assert_eq!(v["Bearer [redacted:bearer] (2)"], 3);
        assert_eq!(n, 2);
    }

    #[test]
    fn a_replacement_that_exposes_another_secret_is_followed_by_its_redaction() {
        let r = redactor();
        for (input, want) in [
            (
                "AIza0123456789abcdefghijklmnopqrstuvwxyAKIAABCDEFGHIJKLMNOP",
                "[redacted:google_api_key]",
            ),
            (
                "http://u:https://hooks.slack.com/services/T0/B0@host",
                "http://[redacted:url_credentials]@host",
            ),
        ] {
            let (got, _) = r
                .text(input)
                .unwrap_or_else(|| panic!("nothing redacted in {input:?}"));
            assert_eq!(got, want);
            assert_eq!(r.text(&got), None, "{got:?} is redacted again");
        }
        // The URL rule's marker matches the URL rule: that is no new redaction.
        assert_eq!(r.text("postgres://[redacted:url_credentials]@h/db"), None);
    }

    /// One sample per built-in rule (fakes in each provider's format), the text around kept.
    fn rule_samples() -> Vec<(&'static str, String, String)> {
        let pem_body = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7";
        vec![
            (
                "private_key",
                format!("k:\n-----BEGIN PRIVATE KEY-----\n{pem_body}\n-----END PRIVATE KEY-----\nok"),
                "k:\n[redacted:private_key]\nok".into(),
            ),
            (
                "private_key",
                format!("cut: -----BEGIN OPENSSH PRIVATE KEY-----\n{pem_body}\n{pem_body}"),
                "cut: [redacted:private_key]".into(),
            ),
            (
                "jwt",
                "t eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w x".into(),
                "t [redacted:jwt] x".into(),
            ),
            ("bearer", "Bearer abcdefgh12345678".into(), "Bearer [redacted:bearer]".into()),
            ("basic", "Basic dXNlcjpwYXNzd29yZA==".into(), "Basic [redacted:basic]".into()),
            ("aws_access_key", "AKIAIOSFODNN7EXAMPLE".into(), "[redacted:aws_access_key]".into()),
            (
                "aws_secret",
                "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKEKEY0000".into(),
                "AWS_SECRET_ACCESS_KEY=[redacted:aws_secret]".into(),
            ),
            (
                "google_api_key",
                "AIzaSyFAKE-0123456789abcdefghijklmnopqr".into(),
                "[redacted:google_api_key]".into(),
            ),
            (
                "azure_storage_key",
                "DefaultEndpointsProtocol=https;AccountName=demo;AccountKey=Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFy+/==;EndpointSuffix=core.windows.net".into(),
                "DefaultEndpointsProtocol=https;AccountName=demo;AccountKey=[redacted:azure_storage_key];EndpointSuffix=core.windows.net".into(),
            ),
            (
                "azure_sas",
                "https://demo.blob.core.windows.net/c/b?sv=2022-11-02&sr=b&sig=FAKEa1b2c3d4e5f6g7h8i9j0k%2Bl%3D&se=2030".into(),
                "https://demo.blob.core.windows.net/c/b?sv=2022-11-02&sr=b&sig=[redacted:azure_sas]&se=2030".into(),
            ),
            (
                "github",
                "gho_R2d2C3poBb8Yoda4Luke5Leia6Han7Solo9x".into(),
                "[redacted:github]".into(),
            ),
            (
                "github",
                "github_pat_11FAKE0000_abcdefghijklmnopqrstuvwxyz012345".into(),
                "[redacted:github]".into(),
            ),
            ("gitlab", "glpat-AbCdEfGhIjKlMnOpQrSt".into(), "[redacted:gitlab]".into()),
            (
                "stripe",
                "sk_live_4eC39HqLyjWDarjtT1zdp7dcFAKE and rk_live_51FakeRestrictedKey0123456789".into(),
                "[redacted:stripe] and [redacted:stripe]".into(),
            ),
            (
                "stripe",
                "sk_test_4eC39HqLyjWDarjtT1zdp7dcFAKE".into(),
                "[redacted:stripe]".into(),
            ),
            (
                "slack",
                "xoxp-1234567890-abcdefghij".into(),
                "[redacted:slack]".into(),
            ),
            (
                "discord",
                "https://discord.com/api/webhooks/123456789012345678/FAKE-webhook_token".into(),
                "[redacted:discord]".into(),
            ),
            (
                "discord_bot_token",
                "bot MTAxNTg4NjY2NjY2NjY2NjY2Ng.GFAKE1.abcdefghijklmnopqrstuvwxyz0123 ok".into(),
                "bot [redacted:discord_bot_token] ok".into(),
            ),
            (
                "telegram_bot_token",
                "123456789:AAFakeTelegramBotTokenForTests012345".into(),
                "[redacted:telegram_bot_token]".into(),
            ),
            (
                "anthropic",
                "sk-ant-api03-FakeFakeFakeFakeFakeFake0123".into(),
                "[redacted:anthropic]".into(),
            ),
            (
                "openai",
                "sk-proj-FakeFakeFakeFakeFake0123 and sk-FakeFakeFakeFakeFake0123".into(),
                "[redacted:openai] and [redacted:openai]".into(),
            ),
            (
                "huggingface",
                "hf_FakeTokenForTestsOnly0123456789abcdef".into(),
                "[redacted:huggingface]".into(),
            ),
            (
                "groq",
                "gsk_FakeGroqKeyForTests0123456789abcdefghijklmnopqrstu".into(),
                "[redacted:groq]".into(),
            ),
            (
                "replicate",
                "r8_FakeReplicateTokenForTests0123456789ab".into(),
                "[redacted:replicate]".into(),
            ),
            (
                "url_credentials",
                "redis://default:hunter22@cache:6379".into(),
                "redis://[redacted:url_credentials]@cache:6379".into(),
            ),
            (
                "password",
                "login with pass: Tr0ub4dor&3 then".into(),
                "login with pass: [redacted:password]&3 then".into(),
            ),
            (
                "password",
                "{'user': 'ops', 'pwd': 'correct horse'}".into(),
                "{'user': 'ops', 'pwd': '[redacted:password]'}".into(),
            ),
            (
                "password",
                "DB_PASSWORD=\"s3cr3t value\"".into(),
                "DB_PASSWORD=\"[redacted:password]\"".into(),
            ),
            (
                "secret",
                "creds {'aws_secret_access_key': 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKEKEY0000'}".into(),
                "creds {'aws_secret_access_key': '[redacted:secret]'}".into(),
            ),
            (
                "secret",
                "client_secret=Zx8-fake-client-secret-value&grant_type=client_credentials".into(),
                "client_secret=[redacted:secret]&grant_type=client_credentials".into(),
            ),
            (
                "secret",
                "--accountkey abc and accountkey: FAKEaccountKEY0123456789".into(),
                "--accountkey abc and accountkey: [redacted:secret]".into(),
            ),
            (
                "secret",
                "curl -H 'X-Api-Key: 0123abcd4567ef89' https://api.example.com".into(),
                "curl -H 'X-Api-Key: [redacted:secret]' https://api.example.com".into(),
            ),
            (
                "secret",
                "api-key: 0123456789abcdef0123456789abcdef".into(),
                "api-key: [redacted:secret]".into(),
            ),
            (
                "authorization",
                "Authorization: Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b".into(),
                "Authorization: Token [redacted:authorization]".into(),
            ),
            (
                "authorization",
                "-H \"proxy-authorization: FAKEd1g3stvalue0123\" ok".into(),
                "-H \"proxy-authorization: [redacted:authorization]\" ok".into(),
            ),
            (
                "cookie",
                "Cookie: sessionid=abc123def456; theme=dark\nAccept: */*".into(),
                "Cookie: [redacted:cookie]\nAccept: */*".into(),
            ),
            (
                "cookie",
                "set-cookie: token=FAKE0123456789; Path=/; HttpOnly".into(),
                "set-cookie: [redacted:cookie]".into(),
            ),
        ]
    }

    #[test]
    fn every_built_in_rule_finds_its_sample_and_keeps_the_text_around() {
        let r = redactor();
        let samples = rule_samples();
        for (rule, input, want) in &samples {
            let got = r.text(input).map(|(s, _)| s);
            assert_eq!(
                got.as_deref(),
                Some(want.as_str()),
                "rule {rule}: {input:?}"
            );
            assert_eq!(r.text(want), None, "{want:?} is redacted again");
        }
        for id in r.rule_ids() {
            assert!(
                samples.iter().any(|(rule, _, _)| rule == &id),
                "rule {id} has no sample"
            );
        }
    }

    #[test]
    fn prose_ids_digests_and_usage_counts_are_left_alone() {
        let r = redactor();
        for text in [
            "The password policy requires twelve characters.",
            "Enter your password below and press pass to skip.",
            "tests pass: 12, fail: 0",
            "secret: yes",
            "max_token = 4096, tokens: 1234, token_count=87",
            "request 3f2b9c1e-8d4a-4f6b-9e2d-1a7c5b8e0f43 done",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "commit 9fceb02d0ae598e95dc970b74767f19372d61af8 on main",
            "the task-runner skipped sk-short and hf_x and r8_tiny",
            "Order ORD-2024-ABCDEFGHIJKLMNOP shipped",
            "https://example.com/path?q=1&page=2",
            "base64 of hello is aGVsbG8=",
            "Monday.Tuesday.Wednesday went by",
            "api_key: null, password: \"\", secret_key: true",
            "the key is in the vault; the passphrase is required",
            "Authorization: required for admins",
            "the api-key header is missing",
            "cookie: chocolate chip",
        ] {
            assert_eq!(r.text(text), None, "{text:?}");
        }
        let (v, n) = redact(json!({
            "id": "3f2b9c1e-8d4a-4f6b-9e2d-1a7c5b8e0f43",
            "digest": "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "usage": {"tokens": 1234, "inputTokens": 10, "outputTokens": 2},
            "bypass": "cache", "compass": "north", "passes": 3, "signal": "go",
            "keyId": "k-1", "accessKeyId": "AKIA-is-not-here", "passage": "text",
        }));
        assert_eq!(n, 0, "{v}");
    }

    #[test]
    fn sensitive_keys_include_short_exact_names_and_cloud_key_names() {
        let (v, n) = redact(json!({
            "kind": "data",
            "data": {
                "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKEKEY0000",
                "pass": "hunter2",
                "pwd": "hunter3",
                "AccountKey": "Zm9v",
                "client_secret": "c",
                "sig": "s",
                "signing_key": "k",
                "user": "ops",
            }
        }));
        let d = &v["data"];
        assert_eq!(d["AWS_SECRET_ACCESS_KEY"], "[redacted:accesskey]");
        assert_eq!(d["pass"], "[redacted:pass]");
        assert_eq!(d["pwd"], "[redacted:pwd]");
        assert_eq!(d["AccountKey"], "[redacted:accountkey]");
        assert_eq!(d["client_secret"], "[redacted:secret]");
        assert_eq!(d["sig"], "[redacted:sig]");
        assert_eq!(d["signing_key"], "[redacted:signingkey]");
        assert_eq!(d["user"], "ops");
        assert_eq!(n, 7);
    }

    #[test]
    fn json_patch_paths_are_read_as_keys() {
        let (v, n) = redact(json!({
            "type": "STATE_DELTA",
            "delta": [
                {"op": "add", "path": "/config/aws_secret_access_key", "value": "wJalrXUtnFEMI/K7MDENG"},
                {"op": "replace", "path": "/credentials/0/user", "value": {"name": "ops"}},
                {"op": "add", "path": "/db/pass", "value": "hunter2"},
                {"op": "add", "path": "/a~1password", "value": "x"},
                {"op": "replace", "path": "/ui/theme", "value": "dark"},
                {"op": "add", "path": "/flags/hasPassword", "value": true},
                {"op": "remove", "path": "/config/token"},
            ]
        }));
        let d = &v["delta"];
        assert_eq!(d[0]["value"], "[redacted:accesskey]");
        assert_eq!(d[0]["path"], "/config/aws_secret_access_key");
        assert_eq!(d[1]["value"], "[redacted:credentials]");
        assert_eq!(d[2]["value"], "[redacted:pass]");
        assert_eq!(d[3]["value"], "[redacted:password]");
        assert_eq!(d[4]["value"], "dark");
        assert_eq!(d[5]["value"], true);
        assert_eq!(n, 4);
    }

    #[test]
    fn the_rule_file_loads_with_unique_ids_and_lower_case_keywords() {
        let file: RuleFile =
            toml::from_str(RULES).unwrap_or_else(|e| panic!("rules.toml does not parse: {e}"));
        assert!(file.rules.len() >= 24, "{} rules", file.rules.len());
        let mut ids: Vec<&str> = file.rules.iter().map(|r| r.id.as_str()).collect();
        ids.sort_unstable();
        let before = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), before, "rule ids are unique");
        for rule in &file.rules {
            for kw in &rule.keywords {
                assert_eq!(
                    kw,
                    &kw.to_lowercase(),
                    "keywords are lower-case: {}",
                    rule.id
                );
            }
        }
    }

    #[test]
    fn overlapping_matches_are_replaced_together() {
        let r = redactor();
        let pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw\n-----END PRIVATE KEY-----";
        let (got, _) = r
            .text(&format!("token: {pem} after"))
            .unwrap_or_else(|| panic!("nothing redacted"));
        assert_eq!(got, "token: [redacted:secret] after");
        // A quoted value is bounded: a long quoted passage after a key name is not one secret.
        let long = format!("secret= \"{}\"", "word ".repeat(40));
        assert_eq!(r.text(&long), None);
    }

    #[test]
    fn redacting_twice_changes_nothing_more() {
        let (once, _) = redact(json!({"password": "x", "m": "Bearer abcdefgh12345678"}));
        let (twice, n) = redact(once.clone());
        assert_eq!(twice, once);
        assert_eq!(n, 0);
    }

    /// The rules a text lets run, found with the keyword set (the reference) and with the
    /// automaton.
    fn candidates_both_ways(r: &Redactor, text: &str) -> (Vec<usize>, Vec<usize>) {
        let mut by_set: Vec<usize> = r
            .keywords
            .matches(text)
            .iter()
            .flat_map(|k| r.keyword_rules[k].iter().copied())
            .collect();
        by_set.sort_unstable();
        by_set.dedup();
        let scan = r
            .keyword_scan
            .as_ref()
            .expect("the built-in keywords are ASCII");
        let mut by_scan: Vec<usize> = scan
            .find_overlapping_iter(text)
            .flat_map(|m| r.keyword_rules[m.pattern().as_usize()].iter().copied())
            .collect();
        by_scan.sort_unstable();
        by_scan.dedup();
        (by_set, by_scan)
    }

    #[test]
    fn the_keyword_automaton_lets_the_same_rules_run_as_the_keyword_set_on_ascii_text() {
        let r = redactor();
        let mut texts: Vec<String> = rule_samples().into_iter().map(|(_, t, _)| t).collect();
        texts.extend(
            [
                "",
                "nothing to see here",
                "SIGNAL passed to the KeyBoard; Tokens: 12",
                "sk-ANT-api03-xyz",
                "GHP_abc ghp_ def Github_Pat_1",
                "postgres://user:PASS@db:5432/x",
                "AKIA ASIA abia AcCa a3T",
                "x:aa:AA :Aa",
            ]
            .map(String::from),
        );
        // Every case of every text, and pairs of texts run together (a keyword across the
        // seam).
        let mut all = Vec::new();
        for t in &texts {
            all.push(t.clone());
            all.push(t.to_ascii_uppercase());
            all.push(t.to_ascii_lowercase());
        }
        for (a, b) in texts.iter().zip(texts.iter().rev()) {
            let (tail, head) = (&a[a.len().saturating_sub(3)..], &b[..b.len().min(3)]);
            all.push(format!("{tail}{head}"));
        }
        let mut checked_with_rules = 0;
        for t in all.iter().filter(|t| t.is_ascii()) {
            let (by_set, by_scan) = candidates_both_ways(&r, t);
            assert_eq!(by_set, by_scan, "keyword rules differ for {t:?}");
            checked_with_rules += usize::from(!by_set.is_empty());
        }
        assert!(checked_with_rules > 20, "the texts exercise the keywords");
        // Outside ASCII the set decides (the Kelvin sign is a `k` without case).
        assert!(!"\u{212A}ey".is_ascii());
        let (by_set, _) = candidates_both_ways(&r, "api_\u{212A}ey=abcdefghijklmnop");
        assert!(!by_set.is_empty());
        assert_eq!(
            r.spans("api_\u{212A}ey=abcdefghijklmnopqrstuvwx").len(),
            r.spans("api_Key=abcdefghijklmnopqrstuvwx").len()
        );
    }
}
