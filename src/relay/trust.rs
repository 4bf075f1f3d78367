//! Who is calling the relay, from a source the operator trusts, and how often each caller may
//! call.
//!
//! The caller's agent id becomes `Collab-From-Agent` on everything the exchange publishes, and the
//! projector puts a main agent's words into `conversation.main`: it must never come from the
//! caller's say-so. Three ways to name it:
//! - fixed (`--from-agent`): one name for every caller;
//! - tokens (`--caller-tokens FILE`): each caller presents `Proxy-Authorization: Bearer <token>`
//!   and the file maps the token to its agent id; no valid token, no exchange;
//! - header (`--from-agent-header H --trust-header-from CIDR,...`): an authenticating proxy in
//!   front of the relay names the caller, and only connections from those ranges are served.

use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The shortest caller token accepted in a token file.
pub const MIN_TOKEN_CHARS: usize = 16;

/// How the relay names its callers.
#[derive(Clone)]
pub enum Callers {
    /// Every caller is this agent.
    Fixed(String),
    /// A bearer token in `Proxy-Authorization` names the caller.
    Tokens(CallerTokens),
    /// A header set by a trusted proxy names the caller; connections from anywhere else are
    /// refused.
    Header {
        name: HeaderName,
        trusted: Vec<IpNet>,
        /// The caller when a trusted proxy sends no header.
        default: String,
    },
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Callers::Fixed(a) => f.debug_tuple("Fixed").field(a).finish(),
            Callers::Tokens(t) => f.debug_tuple("Tokens").field(t).finish(),
            Callers::Header {
                name,
                trusted,
                default,
            } => f
                .debug_struct("Header")
                .field("name", name)
                .field("trusted", trusted)
                .field("default", default)
                .finish(),
        }
    }
}

/// Why a caller is not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Token mode, and no token, or one the file does not hold.
    Unauthorized,
    /// Header mode, and the connection does not come from a trusted proxy.
    UntrustedPeer,
    /// Header mode, and the header comes more than once (a proxy that appends to the caller's
    /// own header instead of replacing it): which one is the proxy's cannot be told.
    AmbiguousHeader,
    /// Header mode, and the header's value cannot be an agent id (letters, digits, `-`, `_`).
    BadCaller,
}

impl Callers {
    /// The mode's name, for the start-up log line.
    pub fn mode(&self) -> &'static str {
        match self {
            Callers::Fixed(_) => "fixed",
            Callers::Tokens(_) => "tokens",
            Callers::Header { .. } => "header",
        }
    }

    /// The caller's agent id, from the request's headers and the connection's peer address.
    pub fn identify(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<String, Refusal> {
        match self {
            Callers::Fixed(agent) => Ok(agent.clone()),
            Callers::Tokens(tokens) => tokens.caller(headers).ok_or(Refusal::Unauthorized),
            Callers::Header {
                name,
                trusted,
                default,
            } => {
                let peer = peer.map(|p| p.to_canonical());
                if !peer.is_some_and(|p| trusted.iter().any(|net| net.contains(&p))) {
                    return Err(Refusal::UntrustedPeer);
                }
                if headers.get_all(name).iter().nth(1).is_some() {
                    return Err(Refusal::AmbiguousHeader);
                }
                let Some(value) = headers.get(name) else {
                    return Ok(default.clone());
                };
                match value.to_str().map(str::trim) {
                    Ok("") => Ok(default.clone()),
                    Ok(agent) if crate::identity::agent_token_ok(agent) => Ok(agent.to_string()),
                    _ => Err(Refusal::BadCaller),
                }
            }
        }
    }
}

/// The caller tokens of a token file, kept as SHA-256 digests only.
#[derive(Clone, Default)]
pub struct CallerTokens {
    entries: Vec<([u8; 32], String)>,
}

impl std::fmt::Debug for CallerTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens or their digests.
        f.debug_list()
            .entries(self.entries.iter().map(|(_, agent)| agent))
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl CallerTokens {
    /// Read a token file: one caller per line, `AGENT_ID TOKEN`, blank lines and lines starting
    /// with `#` ignored. An agent may have several tokens (to rotate them); a token names one
    /// agent.
    pub fn load(path: &Path) -> Result<CallerTokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--caller-tokens: cannot read {}: {e}", path.display()))?;
        CallerTokens::parse(&text).map_err(|e| format!("--caller-tokens {}: {e}", path.display()))
    }

    /// The token file's text, as [`CallerTokens::load`] reads it. Errors name the line, never the
    /// token.
    pub fn parse(text: &str) -> Result<CallerTokens, String> {
        let mut entries: Vec<([u8; 32], String)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(agent), Some(token), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(format!(
                    "line {n}: expected `AGENT_ID TOKEN` (two fields separated by spaces)"
                ));
            };
            if !crate::identity::agent_token_ok(agent) {
                return Err(format!(
                    "line {n}: the agent id is not at most 128 letters, digits, `-` and `_` (not starting with `_`), so it cannot name an identity subject"
                ));
            }
            if token.chars().count() < MIN_TOKEN_CHARS {
                return Err(format!(
                    "line {n}: the token of {agent} is shorter than {MIN_TOKEN_CHARS} characters; use a random one (e.g. `openssl rand -hex 32`)"
                ));
            }
            let d = digest(token);
            if let Some((_, other)) = entries.iter().find(|(e, _)| bool::from(e.ct_eq(&d))) {
                return Err(format!(
                    "line {n}: this token is already {other}'s; every token must name one agent"
                ));
            }
            entries.push((d, agent.to_string()));
        }
        if entries.is_empty() {
            return Err(
                "no caller in the file; add one line `AGENT_ID TOKEN` per caller".to_string(),
            );
        }
        Ok(CallerTokens { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The agent whose token the request presents in `Proxy-Authorization: Bearer <token>`.
    /// Every entry is compared, in constant time, whether or not one matched already.
    pub fn caller(&self, headers: &HeaderMap) -> Option<String> {
        let presented = crate::api::auth::bearer_token(headers, &header::PROXY_AUTHORIZATION)?;
        let d = digest(presented);
        let mut found: Option<&String> = None;
        for (e, agent) in &self.entries {
            let eq: bool = e.ct_eq(&d).into();
            if eq && found.is_none() {
                found = Some(agent);
            }
        }
        found.cloned()
    }
}

/// Parse one `--trust-header-from` entry: a CIDR range, or a single address.
pub fn parse_net(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| {
            format!(
                "{text:?} is not an address range; write it as CIDR (10.0.0.0/8, fd00::/8) or a single address"
            )
        })
}

/// A sustained request rate: `count` requests per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: NonZeroU32,
    pub per: Duration,
}

/// Parse `--rate-limit`: `N/s`, `N/min` or `N/h`; `0` or `off` for no limit.
pub fn parse_rate(text: &str) -> Result<Option<Rate>, String> {
    let text = text.trim();
    if text == "0" || text.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = || {
        format!(
            "{text:?} is not a rate; write requests per second, minute or hour (20/s, 600/min, 1000/h), or off"
        )
    };
    let (count, unit) = text.split_once('/').ok_or_else(bad)?;
    let per = match unit.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        _ => return Err(bad()),
    };
    let count: u32 = count.trim().parse().map_err(|_| bad())?;
    Ok(NonZeroU32::new(count).map(|count| Rate { count, per }))
}

/// `--rate-limit` as a flag value: a rate, or none (the flag parser treats a bare `Option` as an
/// optional flag, not as a value that may be "off").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit(pub Option<Rate>);

/// [`parse_rate`] for the command line.
pub fn parse_rate_limit(text: &str) -> Result<RateLimit, String> {
    parse_rate(text).map(RateLimit)
}

/// A token bucket per caller: the rate sustained, up to `burst` requests at once.
pub struct Limiter {
    buckets: DefaultKeyedRateLimiter<String>,
}

impl Limiter {
    /// `None` without a rate (no limit). A burst of 0 is read as 1.
    pub fn new(rate: Option<Rate>, burst: u32) -> Option<Limiter> {
        let rate = rate?;
        let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::with_period(rate.per / rate.count.get())?.allow_burst(burst);
        Some(Limiter {
            buckets: RateLimiter::keyed(quota),
        })
    }

    /// Take one request from the caller's bucket; `Err` holds how long until the next one fits.
    pub fn check(&self, caller: &str) -> Result<(), Duration> {
        let key = caller.to_string();
        self.buckets
            .check_key(&key)
            .map_err(|not_until| not_until.wait_time_from(self.buckets.clock().now()))
    }

    /// Forget the buckets that are full again, so callers seen once hold no memory.
    pub fn forget_idle(&self) {
        self.buckets.retain_recent();
    }
}

/// A byte budget per caller: `per_second` bytes sustained, up to `burst` bytes at once. What
/// each request costs is the part of its body the relay could store (at most
/// `--max-message-bytes`).
pub struct ByteBudget {
    buckets: DefaultKeyedRateLimiter<String>,
    burst: NonZeroU32,
}

impl ByteBudget {
    /// `None` when `per_second` is 0 (no budget). A burst below one request's largest cost
    /// would refuse such a request forever: the caller checks `burst >= max_message_bytes`.
    pub fn new(per_second: u32, burst: u32) -> Option<ByteBudget> {
        let rate = NonZeroU32::new(per_second)?;
        let burst = NonZeroU32::new(burst).unwrap_or(rate);
        let quota = Quota::per_second(rate).allow_burst(burst);
        Some(ByteBudget {
            buckets: RateLimiter::keyed(quota),
            burst,
        })
    }

    /// Take `bytes` from the caller's budget (at least 1, at most the burst: a request is
    /// never refused for its size alone); `Err` holds how long until it fits.
    pub fn take(&self, caller: &str, bytes: usize) -> Result<(), Duration> {
        let n = u32::try_from(bytes)
            .unwrap_or(u32::MAX)
            .clamp(1, self.burst.get());
        let n = NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        let key = caller.to_string();
        match self.buckets.check_key_n(&key, n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(self.buckets.clock().now())),
            // Not reachable with n clamped to the burst; read as "wait a second".
            Err(_) => Err(Duration::from_secs(1)),
        }
    }

    /// Forget the buckets that are full again.
    pub fn forget_idle(&self) {
        self.buckets.retain_recent();
    }
}

/// The status and `code` a refusal answers with.
impl Refusal {
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::Unauthorized => StatusCode::UNAUTHORIZED,
            Refusal::UntrustedPeer => StatusCode::FORBIDDEN,
            Refusal::AmbiguousHeader | Refusal::BadCaller => StatusCode::BAD_REQUEST,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Unauthorized => "unauthorized",
            Refusal::UntrustedPeer => "untrusted_peer",
            Refusal::AmbiguousHeader => "ambiguous_caller",
            Refusal::BadCaller => "bad_caller",
        }
    }
}
