//! Secret redaction: applied to every parsed input before anything is derived from it, so no
//! projection, turn record, work session, dead-letter detail or API answer carries a secret.
//!
//! Two rules, at any depth (objects, arrays, and JSON carried inside strings):
//! - the value under a sensitive key (`password`, `api_key`, `Authorization`, ...; compared
//!   lower-case with `_`, `-`, `.` and spaces ignored, so `X-Api-Key` and `apiKey` match) is
//!   replaced whole by `[redacted:<key class>]`;
//! - a secret inside a string (a bearer token, a JWT, a PEM private key, a cloud or SaaS key
//!   format, a URL's `user:password@`) is replaced by `[redacted:<kind>]`, the text around it
//!   kept.
//!
//! The string patterns follow the rule families of gitleaks' default configuration (provider key
//! prefixes and lengths); the sensitive key names follow its generic-secret keywords. Both can
//! be extended in configuration (`redaction.keys`, `redaction.patterns`). Redaction counts what
//! it replaced; the envelope reports the count as `redactions`.

use regex::{Regex, RegexSet};
use serde_json::{Map, Value};

/// Key classes: a key is sensitive when, normalised, it equals or ends with one of these.
/// (`tokens` is not one: it usually counts a model's tokens.)
const KEY_CLASSES: &[&str] = &[
    "password",
    "passwords",
    "passwd",
    "passphrase",
    "secret",
    "secrets",
    "token",
    "authorization",
    "apikey",
    "apikeys",
    "credential",
    "credentials",
    "cookie",
    "cookies",
    "privatekey",
];

/// Built-in string patterns: (kind, pattern, replacement). In a replacement `$1` keeps the
/// first capture group (a scheme word or a URL's scheme), so the text stays readable. A
/// fixed-length key takes every key character glued to it (`{40,}`, `{35,}`), so a marker never
/// lands in the middle of a run of word characters, where it would make a word boundary for
/// another rule to match at on a second pass.
const PATTERNS: &[(&str, &str, &str)] = &[
    (
        "private_key",
        r"-----BEGIN[A-Z ]*PRIVATE KEY( BLOCK)?-----[\s\S]*?-----END[A-Z ]*PRIVATE KEY( BLOCK)?-----",
        "[redacted:private_key]",
    ),
    (
        "jwt",
        r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
        "[redacted:jwt]",
    ),
    (
        "bearer",
        r"(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/]*[0-9][A-Za-z0-9\-._~+/]*=*",
        "$1 [redacted:bearer]",
    ),
    (
        "basic",
        r"\b(Basic|BASIC|basic)\s+[A-Za-z0-9+/]*[0-9+/][A-Za-z0-9+/]*={0,2}",
        "$1 [redacted:basic]",
    ),
    (
        "aws_access_key",
        r"\b(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b",
        "[redacted:aws_access_key]",
    ),
    (
        "aws_secret",
        r#"(?i)(aws_?secret_?access_?key\s*[:=]\s*["']?)[A-Za-z0-9/+=]{40,}"#,
        "$1[redacted:aws_secret]",
    ),
    (
        "github",
        r"\b(?:(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{22,255})\b",
        "[redacted:github]",
    ),
    ("gitlab", r"\bglpat-[A-Za-z0-9_-]{20,}", "[redacted:gitlab]"),
    (
        "slack",
        r"\b(?:xox[baprs]-[A-Za-z0-9-]{10,}|https://hooks\.slack\.com/services/[A-Za-z0-9/_]+)",
        "[redacted:slack]",
    ),
    (
        "anthropic",
        r"\bsk-ant-[A-Za-z0-9_-]{20,}",
        "[redacted:anthropic]",
    ),
    (
        "openai",
        r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",
        "[redacted:openai]",
    ),
    (
        "google_api_key",
        r"\bAIza[0-9A-Za-z_-]{35,}",
        "[redacted:google_api_key]",
    ),
    (
        "url_credentials",
        r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@",
        "$1[redacted:url_credentials]@",
    ),
];

/// Strings longer than this that look like JSON are not parsed to look inside (a bound on work).
const MAX_NESTED_JSON: usize = 256 * 1024;
/// Nesting beyond which values are left as they are (the normaliser bounds depth before this).
const MAX_DEPTH: usize = 128;
/// Passes of the rules over one string before its redaction is taken as final (two suffice for
/// every combination of the built-in rules: the second finds nothing).
const MAX_PASSES: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum RedactError {
    #[error("redaction pattern {name:?} is not a valid regular expression: {detail}")]
    BadPattern { name: String, detail: String },
}

/// A pattern given in configuration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct ExtraPattern {
    /// The kind named in the marker: `[redacted:<name>]`.
    pub name: String,
    /// A regular expression (Rust `regex` syntax); the whole match is replaced.
    pub pattern: String,
}

/// The compiled rules.
#[derive(Debug, Clone)]
pub struct Redactor {
    keys: Vec<String>,
    any: RegexSet,
    rules: Vec<(Regex, String)>,
}

impl Redactor {
    /// The built-in rules plus `extra_keys` (key names, compared normalised) and
    /// `extra_patterns`.
    pub fn new(
        extra_keys: &[String],
        extra_patterns: &[ExtraPattern],
    ) -> Result<Redactor, RedactError> {
        let mut keys: Vec<String> = KEY_CLASSES.iter().map(|k| k.to_string()).collect();
        keys.extend(extra_keys.iter().map(|k| normalise_key(k)));
        let mut sources = Vec::new();
        let mut rules = Vec::new();
        let built_in = PATTERNS
            .iter()
            .map(|(name, p, r)| (name.to_string(), p.to_string(), r.to_string()));
        let extra = extra_patterns.iter().map(|e| {
            (
                e.name.clone(),
                e.pattern.clone(),
                format!("[redacted:{}]", e.name),
            )
        });
        for (name, pattern, replacement) in built_in.chain(extra) {
            let re = Regex::new(&pattern).map_err(|e| RedactError::BadPattern {
                name: name.clone(),
                detail: e.to_string(),
            })?;
            sources.push(pattern);
            rules.push((re, replacement));
        }
        let any = RegexSet::new(&sources).map_err(|e| RedactError::BadPattern {
            name: "(all patterns together)".into(),
            detail: e.to_string(),
        })?;
        Ok(Redactor { keys, any, rules })
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
    fn patterns(&self, text: &str) -> Option<(String, u64)> {
        if !self.any.is_match(text) {
            return None;
        }
        let mut count = 0u64;
        let mut s = text.to_string();
        for idx in self.any.matches(text).iter() {
            let Some((re, replacement)) = self.rules.get(idx) else {
                continue;
            };
            let mut n = 0u64;
            let replaced = re.replace_all(&s, |caps: &regex::Captures<'_>| {
                let mut marker = String::new();
                caps.expand(replacement, &mut marker);
                // A marker that matches its own rule (a URL's `scheme://[redacted:..]@`) is
                // replaced by itself: that is not a redaction.
                if caps.get(0).map(|m| m.as_str()) != Some(marker.as_str()) {
                    n += 1;
                }
                marker
            });
            if n == 0 {
                continue;
            }
            count += n;
            s = replaced.into_owned();
        }
        (count > 0).then_some((s, count))
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
        self.keys
            .iter()
            .find(|class| k.ends_with(class.as_bytes()))
            .map(|class| format!("[redacted:{class}]"))
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
                for (k, v) in map.iter_mut() {
                    let sensitive = !matches!(v, Value::Null | Value::Bool(_));
                    match self.key_marker(k).filter(|_| sensitive) {
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

    #[test]
    fn redacting_twice_changes_nothing_more() {
        let (once, _) = redact(json!({"password": "x", "m": "Bearer abcdefgh12345678"}));
        let (twice, n) = redact(once.clone());
        assert_eq!(twice, once);
        assert_eq!(n, 0);
    }
}
