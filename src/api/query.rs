//! Query parameters shared by the endpoints: csv-or-repeated lists, roles and types, presets,
//! limits, cursors, and the JetStream subject filters a selection maps to.

use super::error::ApiError;
use crate::model::Role;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use base64::Engine;

/// Query pairs, with a JSON error for a malformed query string.
pub struct QueryPairs(pub Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map(|q| QueryPairs(q.0))
            .map_err(|_| {
                ApiError::bad_request("bad_query", "the query string is not valid URL encoding")
            })
    }
}

/// The query of an endpoint that takes no parameter: any one given is a `400` that says so, as
/// an unknown parameter is elsewhere, rather than being ignored.
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let QueryPairs(pairs) = QueryPairs::from_request_parts(parts, state).await?;
        match pairs.first() {
            None => Ok(NoQuery),
            Some((name, _)) => Err(ApiError::bad_request(
                "unknown_parameter",
                format!(
                    "unknown query parameter `{}`; this endpoint takes no query parameters",
                    crate::model::shorten(name, 64)
                ),
            )),
        }
    }
}

/// One path parameter, with a JSON error when it is not URL-encoded UTF-8 (`/api/threads/%FF`).
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map(|p| PathParam(p.0))
            .map_err(|_| {
                ApiError::bad_request(
                    "bad_path",
                    "the path's last segment is not URL-encoded UTF-8: percent-encode the UTF-8 bytes of the id",
                )
            })
    }
}

/// The raw query pairs, checked against the parameters an endpoint accepts.
#[derive(Debug, Clone)]
pub struct Params(Vec<(String, String)>);

impl Params {
    pub fn new(pairs: Vec<(String, String)>, accepted: &[&str]) -> Result<Params, ApiError> {
        let unknown: Vec<&str> = pairs
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !accepted.contains(k))
            .collect();
        if let Some(first) = unknown.first() {
            return Err(ApiError::bad_request(
                "unknown_parameter",
                format!(
                    "unknown query parameter `{first}`; this endpoint accepts: {}",
                    accepted.join(", ")
                ),
            )
            .with_valid(accepted.iter()));
        }
        Ok(Params(pairs))
    }

    /// The raw values of `name`, one per occurrence.
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name`: repeated parameters and comma-separated values alike, ASCII
    /// whitespace around each trimmed, empty ones dropped, duplicates removed (first occurrence
    /// kept).
    pub fn list(&self, name: &str) -> Vec<String> {
        // A set, not a scan of `out`: a query of many distinct values costs linear time.
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<String> = Vec::new();
        for v in self.values(name) {
            for part in v.split(',').map(trim).filter(|p| !p.is_empty()) {
                if seen.insert(part) {
                    out.push(part.to_string());
                }
            }
        }
        out
    }

    /// The single value of `name`, exactly as given; repeating it with different values is an
    /// error.
    pub fn one(&self, name: &str) -> Result<Option<String>, ApiError> {
        let mut values = self.values(name);
        let first = values.next();
        if values.any(|v| Some(v) != first) {
            return Err(ApiError::bad_request(
                "bad_parameter",
                format!("`{name}` takes one value (repeat it only with the same value)"),
            ));
        }
        Ok(first.map(str::to_string))
    }

    /// The single value of `name` (as [`Params::one`]) without the ASCII whitespace around it
    /// ([`trim`]); `None` when it is absent or blank. Other blanks (U+00A0, say) are part of
    /// the value, so a parameter with a fixed set of values refuses them.
    pub fn one_trimmed(&self, name: &str) -> Result<Option<String>, ApiError> {
        Ok(self
            .one(name)?
            .map(|v| trim(&v).to_string())
            .filter(|v| !v.is_empty()))
    }
}

/// `s` without leading and trailing ASCII whitespace (space, tab, CR, LF, form feed): what the
/// list parameters ignore around each value.
pub fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii_whitespace())
}

/// The role names, for error messages.
pub fn role_names() -> Vec<&'static str> {
    Role::ALL.iter().map(|r| r.as_str()).collect()
}

/// Event types a UI commonly filters on (any dotted token string is valid).
pub const KNOWN_TYPES: [&str; 9] = [
    "a2a.send",
    "a2a.response",
    "a2a.complete",
    "a2a.error",
    "a2a.spawn",
    "a2a.spawn_result",
    "a2a.response.suppressed",
    "task.updated",
    "run.started",
];

/// `role` values; `None` when none is given.
pub fn roles(params: &Params) -> Result<Option<Vec<Role>>, ApiError> {
    let names = params.list("role");
    if names.is_empty() {
        return Ok(None);
    }
    let mut roles = Vec::new();
    for n in names {
        match n.parse::<Role>() {
            Ok(r) => roles.push(r),
            Err(_) => {
                return Err(ApiError::bad_request(
                    "invalid_role",
                    format!(
                        "unknown role `{n}`; valid roles are: {}",
                        role_names().join(", ")
                    ),
                )
                .with_valid(role_names()))
            }
        }
    }
    Ok(Some(roles))
}

/// Whether `t` is an event type (dot-separated subject tokens, no wildcards, whitespace or
/// control characters). Its length is bounded by [`MAX_TYPE_VALUE`]; a type longer than an
/// event's may be (256 bytes) is well-formed and matches nothing.
pub fn valid_type(t: &str) -> bool {
    t.split('.').all(|token| {
        !token.is_empty()
            && !token
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>')
    })
}

/// Longest `type` value (one occurrence, commas included); a longer list is split over several
/// `type` parameters. It also bounds each type to the length an event's type may have.
pub const MAX_TYPE_VALUE: usize = 256;

/// Most `type` parameters one request may repeat, and most comma-separated types in each: a
/// request names at most 16 types.
pub const MAX_TYPE_PARAMS: usize = 4;
pub const MAX_TYPES_PER_PARAM: usize = 4;
/// Most `key` parameters one request may repeat. With the four roles, the widest selection
/// expands to 4 x 16 x 16 = [`MAX_FILTERS`] subject filters.
pub const MAX_KEYS: usize = 16;

/// `type` values (any well-formed dotted type is valid).
pub fn types(params: &Params) -> Result<Vec<String>, ApiError> {
    let occurrences = params.values("type").count();
    let widest = params
        .values("type")
        .map(|v| v.split(',').count())
        .max()
        .unwrap_or(0);
    if occurrences > MAX_TYPE_PARAMS || widest > MAX_TYPES_PER_PARAM {
        return Err(ApiError::bad_request(
            "too_many_types",
            format!(
                "at most {MAX_TYPE_PARAMS} `type` parameters of at most {MAX_TYPES_PER_PARAM} comma-separated types each (this request has {occurrences}, the widest with {widest}); read the other types with another request"
            ),
        ));
    }
    if let Some(long) = params
        .values("type")
        .find(|v| v.chars().count() > MAX_TYPE_VALUE)
    {
        return Err(ApiError::bad_request(
            "invalid_type",
            format!(
                "a `type` value is at most {MAX_TYPE_VALUE} characters (this one has {}); repeat the parameter for more types",
                long.chars().count()
            ),
        ));
    }
    let types = params.list("type");
    if let Some(bad) = types.iter().find(|t| !valid_type(t)) {
        return Err(ApiError::bad_request(
            "invalid_type",
            format!(
                "type `{bad}` is not valid: a type is dot-separated tokens without spaces, `*` or `>`, for example {}",
                KNOWN_TYPES.join(", ")
            ),
        )
        .with_valid_pattern(r"^[^.\s*>]+(\.[^.\s*>]+)*$", KNOWN_TYPES));
    }
    Ok(types)
}

/// `key` values as subject tokens: a token is used as it is, any other id is encoded by the
/// id rule (`model::encode_id`), so `agent:eden:main` finds `_bYWdlbnQ6ZWRlbjptYWlu`.
pub fn keys(params: &Params) -> Result<Vec<String>, ApiError> {
    let given = params.values("key").count();
    if given > MAX_KEYS {
        return Err(ApiError::bad_request(
            "too_many_keys",
            format!(
                "at most {MAX_KEYS} `key` parameters (this request has {given}); read the other keys with another request"
            ),
        ));
    }
    let mut out: Vec<String> = Vec::new();
    for v in params.values("key") {
        let v = trim(v);
        if v.is_empty() {
            continue;
        }
        let token = crate::model::key_token(v);
        if !out.contains(&token) {
            out.push(token);
        }
    }
    Ok(out)
}

/// The key a path names (`/api/threads/{key}`, `/api/tree/{key}`), trimmed; refused when empty.
pub fn path_key(key: &str) -> Result<&str, ApiError> {
    let key = key.trim();
    if key.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_key",
            "the key is empty: give a conversation, AG-UI thread or session id",
        ));
    }
    Ok(key)
}

/// What to read: roles (`None`: the caller's grant), types (empty: all), keys (empty: all).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    pub roles: Option<Vec<Role>>,
    pub types: Vec<String>,
    pub keys: Vec<String>,
}

/// The presets of seed 000.
pub const VIEWS: [&str; 2] = ["conversations", "debug"];

/// `role`, `type`, `key` and the `view` preset (an explicit `role` or `type` replaces the
/// preset's value for that parameter).
pub fn selection(params: &Params) -> Result<Selection, ApiError> {
    let mut sel = Selection {
        roles: roles(params)?,
        types: types(params)?,
        keys: keys(params)?,
    };
    if let Some(view) = params.one("view")?.filter(|v| !v.is_empty()) {
        let (roles, types): (Option<Vec<Role>>, &[&str]) = match view.as_str() {
            "conversations" => (Some(vec![Role::ConversationMain]), &["a2a.response"]),
            "debug" => (None, &["a2a.send", "a2a.response", "a2a.complete"]),
            other => {
                return Err(ApiError::bad_request(
                    "invalid_view",
                    format!(
                        "unknown view `{other}`; valid views are: conversations (role=conversation.main, type=a2a.response), debug (type=a2a.send,a2a.response,a2a.complete)"
                    ),
                )
                .with_valid(VIEWS))
            }
        };
        if sel.roles.is_none() {
            sel.roles = roles;
        }
        if sel.types.is_empty() {
            sel.types = types.iter().map(|t| t.to_string()).collect();
        }
    }
    Ok(sel)
}

/// `limit`: default `default`, between 1 and `max`.
pub fn limit(params: &Params, default: usize, max: usize) -> Result<usize, ApiError> {
    match params.one("limit")? {
        None => Ok(default),
        // Digits only: `usize`'s parser also takes a leading `+`, which the OpenAPI document's
        // `integer` does not.
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) && v.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
            _ => Err(ApiError::bad_request(
                "invalid_limit",
                format!("`limit` must be a whole number from 1 to {max}, got `{v}`"),
            )),
        },
    }
}

/// The subject filters of a selection on the projection stream:
/// `<prefix>.proj.<role>.<key|*>.<type|>>`.
pub fn subject_filters(
    prefix: &str,
    roles: &[Role],
    keys: &[String],
    types: &[String],
) -> Vec<String> {
    let any_key = ["*".to_string()];
    let any_type = [">".to_string()];
    let keys: &[String] = if keys.is_empty() { &any_key } else { keys };
    let types: &[String] = if types.is_empty() { &any_type } else { types };
    let mut out = Vec::with_capacity(roles.len() * keys.len() * types.len());
    for r in roles {
        for k in keys {
            for t in types {
                out.push(format!("{prefix}.proj.{}.{k}.{t}", r.as_str()));
            }
        }
    }
    out
}

/// Most subject filters one request may expand to.
pub const MAX_FILTERS: usize = 1024;

/// A cursor: an opaque string wrapping the projection stream's sequence, behind the three-byte
/// prefix of the projection version that issued it ([`cursor_prefix`]): a cursor of one version is
/// never read against another's stream.
pub fn encode_cursor(tag: u16, seq: u64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{}{seq}", cursor_prefix(tag)))
}

/// The three bytes a cursor starts with: `v1:` for the deployment's own projections (tag 0, the
/// cursors issued before versions existed), two lowercase letters and `:` for a version (tags
/// 1..=676, [`crate::served::cursor_tag`]). Three bytes keep the digits after them on base64's
/// 3-byte boundary, so the document can give each version's cursors one exact pattern.
pub fn cursor_prefix(tag: u16) -> String {
    if tag == 0 {
        return "v1:".to_string();
    }
    let t = (tag - 1) % 676;
    let letter = |n: u16| char::from(b'a' + u8::try_from(n % 26).unwrap_or(0));
    format!("{}{}:", letter(t / 26), letter(t))
}

/// Whether `p` is the prefix of some version's cursors.
fn is_cursor_prefix(p: &[u8]) -> bool {
    p == b"v1:"
        || (p.len() == 3 && p[0].is_ascii_lowercase() && p[1].is_ascii_lowercase() && p[2] == b':')
}

/// The error for a cursor another projection version issued.
pub fn version_switched() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::GONE,
        "version_switched",
        "the cursor is a position in a projection version this API no longer serves (it was switched to another version since); start again without a cursor",
    )
}

/// What to send instead of a cursor this server never issued.
const CURSOR_ADVICE: &str =
    "use the `next`, `prev` or `oldest` value of a response, or an event's `cursor`";

/// The error for a cursor this server never issued.
pub fn bad_cursor() -> ApiError {
    ApiError::bad_request(
        "bad_cursor",
        format!("the cursor is not one this server issued; {CURSOR_ADVICE}"),
    )
}

/// [`bad_cursor`] naming the value given (shortened), so a caller sees which of its cursors is
/// at fault.
fn bad_cursor_given(cursor: &str) -> ApiError {
    ApiError::bad_request(
        "bad_cursor",
        format!(
            "the cursor {:?} is not one this server issued; {CURSOR_ADVICE}",
            crate::model::shorten(cursor, 40)
        ),
    )
}

/// Most digits of a cursor's sequence: every sequence a stream reaches (below 10^19) fits.
const MAX_CURSOR_DIGITS: usize = 19;

/// The sequence of a cursor of the version whose tag is `tag`: unpadded base64url of its prefix
/// and 1 to 19 decimal digits (the document's cursor pattern). Anything else is refused like any
/// cursor this server never issued; a cursor of another version is gone (410
/// `version_switched`).
pub fn decode_cursor(tag: u16, cursor: &str) -> Result<u64, ApiError> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| bad_cursor_given(cursor))?;
    if bytes.len() < 4 || !is_cursor_prefix(&bytes[..3]) {
        return Err(bad_cursor_given(cursor));
    }
    let (prefix, digits) = bytes.split_at(3);
    if digits.len() > MAX_CURSOR_DIGITS || !digits.iter().all(u8::is_ascii_digit) {
        return Err(bad_cursor_given(cursor));
    }
    let seq = std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse::<u64>().ok())
        .ok_or_else(|| bad_cursor_given(cursor))?;
    if prefix != cursor_prefix(tag).as_bytes() {
        return Err(version_switched());
    }
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pairs: &[(&str, &str)]) -> Params {
        Params(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn many_distinct_values_are_listed_once_each_in_order() {
        let values: Vec<String> = (0..100_000).map(|i| format!("r{i}")).collect();
        let joined = values.join(",");
        let q = p(&[("role", joined.as_str()), ("role", "r0,r99999,r5")]);
        assert_eq!(q.list("role"), values);
        assert!(roles(&q).is_err_and(|e| e.code == "invalid_role"));
    }

    #[test]
    fn csv_and_repeated_agree() {
        let a = p(&[("type", "a2a.send,a2a.response")]);
        let b = p(&[("type", "a2a.send"), ("type", "a2a.response")]);
        let c = p(&[("type", " a2a.send , ,a2a.response,a2a.send")]);
        assert_eq!(a.list("type"), b.list("type"));
        assert_eq!(a.list("type"), c.list("type"));
    }

    #[test]
    fn roles_and_types_are_validated() {
        assert_eq!(
            roles(&p(&[("role", "conversation.main,system.observability")]))
                .ok()
                .flatten(),
            Some(vec![Role::ConversationMain, Role::SystemObservability])
        );
        let e = roles(&p(&[("role", "conversation.mian")])).err();
        assert!(
            e.is_some_and(|e| e.message.contains("conversation.main") && e.code == "invalid_role")
        );
        assert!(types(&p(&[("type", "custom.thing.v2")])).is_ok());
        for bad in ["a b", "a.*", "a.>", "a..b", ".a"] {
            assert!(types(&p(&[("type", bad)])).is_err(), "{bad}");
        }
    }

    #[test]
    fn presets_expand_and_explicit_values_win() {
        let s = selection(&p(&[("view", "conversations")])).ok();
        assert_eq!(
            s,
            Some(Selection {
                roles: Some(vec![Role::ConversationMain]),
                types: vec!["a2a.response".into()],
                keys: vec![],
            })
        );
        let d = selection(&p(&[("view", "debug")])).ok().map(|s| s.types);
        assert_eq!(
            d,
            Some(vec![
                "a2a.send".into(),
                "a2a.response".into(),
                "a2a.complete".into()
            ])
        );
        let e = selection(&p(&[("view", "conversations"), ("type", "a2a.send")]))
            .ok()
            .map(|s| s.types);
        assert_eq!(e, Some(vec!["a2a.send".to_string()]));
        assert!(selection(&p(&[("view", "nope")])).is_err());
    }

    #[test]
    fn filters_map_onto_subjects() {
        let f = subject_filters(
            "collab",
            &[Role::ConversationMain],
            &["c1".into()],
            &["a2a.response".into()],
        );
        assert_eq!(f, ["collab.proj.conversation.main.c1.a2a.response"]);
        let all = subject_filters("collab", &Role::ALL, &[], &[]);
        assert_eq!(all.len(), 4);
        assert_eq!(all[0], "collab.proj.conversation.main.*.>");
        assert_eq!(
            keys(&p(&[("key", "agent:eden:main")]))
                .ok()
                .unwrap_or_default(),
            ["_bYWdlbnQ6ZWRlbjptYWlu"]
        );
        assert_eq!(
            keys(&p(&[("key", "conv-1")])).ok().unwrap_or_default(),
            ["conv-1"]
        );
    }

    #[test]
    fn cursors_round_trip_and_reject_junk() {
        for s in [0, 1, 42, 9_999_999_999_999_999_999] {
            assert_eq!(decode_cursor(0, &encode_cursor(0, s)).ok(), Some(s));
            assert_eq!(decode_cursor(677, &encode_cursor(677, s)).ok(), Some(s));
        }
        // The deployment's cursors are what they were before versions existed.
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        assert_eq!(encode_cursor(0, 42), b64("v1:42"));
        assert_eq!(cursor_prefix(1), "aa:");
        assert_eq!(cursor_prefix(676), "zz:");
        for junk in [
            "".to_string(),
            "42".into(),
            "djE6".into(),
            "!!".into(),
            "djI6NA".into(),
            format!(" {}", encode_cursor(0, 7)),
            b64("v1:+7"),
            b64("v1:10000000000000000000"),
            b64("A1:42"),
            b64("aa42"),
        ] {
            assert_eq!(
                decode_cursor(0, &junk).err().map(|e| e.body().error.code),
                Some("bad_cursor".to_string()),
                "{junk}"
            );
        }
        // The refusal names the value at fault, shortened.
        let long = "x".repeat(500);
        for (given, named) in [("djE6", "\"djE6\""), (long.as_str(), "\"xxxx")] {
            let message = decode_cursor(0, given)
                .err()
                .map(|e| e.message)
                .unwrap_or_default();
            assert!(message.contains(named), "{message}");
            assert!(message.len() < 250, "{message}");
        }
    }

    #[test]
    fn a_cursor_of_another_version_is_gone() {
        let other = encode_cursor(crate::served::cursor_tag("v2"), 42);
        let e = decode_cursor(0, &other).err().map(|e| e.body().error.code);
        assert_eq!(e, Some("version_switched".to_string()));
        let own = encode_cursor(0, 42);
        let e = decode_cursor(crate::served::cursor_tag("v2"), &own)
            .err()
            .map(|e| e.body().error.code);
        assert_eq!(e, Some("version_switched".to_string()));
    }

    #[test]
    fn types_and_keys_are_bounded_so_every_selection_fits_the_filter_limit() {
        let four = "a.b,c.d,e.f,g.h";
        let ok: Vec<(&str, &str)> = vec![("type", four); MAX_TYPE_PARAMS];
        assert_eq!(types(&p(&ok)).map(|t| t.len()).ok(), Some(4));
        let mut too_many = ok.clone();
        too_many.push(("type", "x.y"));
        assert!(types(&p(&too_many)).is_err_and(|e| e.code == "too_many_types"));
        assert!(types(&p(&[("type", "a,b,c,d,e")])).is_err_and(|e| e.code == "too_many_types"));
        let distinct: Vec<String> = (0..MAX_KEYS).map(|i| format!("k{i}")).collect();
        let pairs: Vec<(&str, &str)> = distinct.iter().map(|k| ("key", k.as_str())).collect();
        let keys_ok = keys(&p(&pairs)).ok().unwrap_or_default();
        assert_eq!(keys_ok.len(), MAX_KEYS);
        let mut one_more = pairs.clone();
        one_more.push(("key", "k-extra"));
        assert!(keys(&p(&one_more)).is_err_and(|e| e.code == "too_many_keys"));
        let widest_types: Vec<String> = (0..MAX_TYPE_PARAMS * MAX_TYPES_PER_PARAM)
            .map(|i| format!("t{i}"))
            .collect();
        assert!(
            subject_filters("collab", &Role::ALL, &keys_ok, &widest_types).len() <= MAX_FILTERS
        );
    }

    #[test]
    fn limits_and_unknown_parameters() {
        assert_eq!(limit(&p(&[]), 100, 1000).ok(), Some(100));
        assert_eq!(limit(&p(&[("limit", "1000")]), 100, 1000).ok(), Some(1000));
        for bad in ["0", "1001", "-1", "x"] {
            assert!(limit(&p(&[("limit", bad)]), 100, 1000).is_err());
        }
        assert!(Params::new(vec![("roles".into(), "x".into())], &["role"]).is_err());
    }
}
