//! Secret redaction: applied to every parsed input before anything is derived from it, so no
//! projection, turn record, work session, dead-letter detail or API answer carries a secret.
//!
//! Three rules, at any depth (objects, arrays, and JSON carried inside strings):
//! - the value under a sensitive key (`password`, `api_key`, `Authorization`, `pass`, ...;
//!   compared lower-case with `_`, `-`, `.` and spaces ignored, so `X-Api-Key` and `apiKey`
//!   match) is replaced whole by `[redacted:<key class>]`;
//! - in a JSON Patch operation (`{"op", "path", "value"}`, as in AG-UI's `STATE_DELTA`), a
//!   sensitive name in any segment of `path` counts as the key of `value`;
//! - a secret inside a string (a provider's key format, a bearer token, a JWT, a PEM private
//!   key even without its END line, a URL's `user:password@`, `password = x` or
//!   `'aws_secret_access_key': 'x'` text) is replaced by `[redacted:<kind>]`, the text around it
//!   kept.
//!
//! The rules are data: `src/redact/rules.toml` (key names, and patterns with ids and keywords
//! for a fast prefilter, in the manner of gitleaks' rule files), compiled in. Configuration adds
//! key names and patterns (`redaction.keys`, `redaction.patterns`). Redaction counts what it
//! replaced; the envelope reports the count as `redactions`.
//!
//! Streamed text (AG-UI deltas) is redacted over the assembled message by [`StreamRedactor`].

mod rules;
mod stream;

pub use rules::{ExtraPattern, RedactError, Redactor};
pub use stream::{Flushed, Pushed, StreamId, StreamKind, StreamLimits, StreamRedactor};
