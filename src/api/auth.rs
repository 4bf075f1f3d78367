//! Access control: bearer tokens, each granted a set of roles (`http.tokens`).
//!
//! Tokens are compared as SHA-256 digests in constant time, against every configured token, so
//! neither the comparison nor the position of a match leaks through timing. Tokens are never
//! logged; only a grant's name is. With no token configured, access control is off, and
//! [`check_bind`] refuses to serve the API on anything but a loopback address.

use super::error::ApiError;
use crate::config::HttpSettings;
use crate::model::Role;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The configured grants, tokens kept as digests only.
#[derive(Clone, Default)]
pub struct Grants {
    grants: Vec<Grant>,
}

#[derive(Clone)]
struct Grant {
    name: String,
    digest: [u8; 32],
    roles: Vec<Role>,
}

impl std::fmt::Debug for Grants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print tokens or their digests.
        f.debug_list()
            .entries(self.grants.iter().map(|g| (&g.name, &g.roles)))
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Grants {
    pub fn new(settings: &HttpSettings) -> Grants {
        Grants {
            grants: settings
                .tokens
                .iter()
                .map(|t| Grant {
                    name: t.name.clone(),
                    digest: digest(&t.token),
                    roles: t.roles.clone(),
                })
                .collect(),
        }
    }

    /// Whether access control is on.
    pub fn enabled(&self) -> bool {
        !self.grants.is_empty()
    }

    /// Who is calling, from the `Authorization` header.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if !self.enabled() {
            return Ok(Caller {
                name: None,
                allowed: Role::ALL.to_vec(),
            });
        }
        let presented =
            bearer_token(headers, &header::AUTHORIZATION).ok_or_else(ApiError::unauthorized)?;
        let d = digest(presented);
        // Check every grant; no early exit.
        let mut found: Option<&Grant> = None;
        for g in &self.grants {
            let eq: bool = g.digest.ct_eq(&d).into();
            if eq && found.is_none() {
                found = Some(g);
            }
        }
        match found {
            Some(g) => Ok(Caller {
                name: Some(g.name.clone()),
                allowed: Role::ALL
                    .into_iter()
                    .filter(|r| g.roles.contains(r))
                    .collect(),
            }),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the bearer token is not valid",
            )),
        }
    }
}

/// An authenticated caller and the roles it may read.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The grant's name; `None` with access control off.
    pub name: Option<String>,
    pub allowed: Vec<Role>,
}

impl Caller {
    /// The roles a request reads: those it names, which must all be granted (403 otherwise), or
    /// its whole grant when it names none.
    pub fn roles(&self, requested: Option<&[Role]>) -> Result<Vec<Role>, ApiError> {
        match requested {
            None => Ok(self.allowed.clone()),
            Some(req) => {
                let denied: Vec<&str> = req
                    .iter()
                    .filter(|r| !self.allowed.contains(r))
                    .map(|r| r.as_str())
                    .collect();
                if denied.is_empty() {
                    Ok(Role::ALL.into_iter().filter(|r| req.contains(r)).collect())
                } else {
                    Err(ApiError::new(
                        StatusCode::FORBIDDEN,
                        "forbidden",
                        format!(
                            "this token may not read role(s) {}; it may read: {}",
                            denied.join(", "),
                            self.allowed
                                .iter()
                                .map(|r| r.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                    .with_granted(&self.allowed))
                }
            }
        }
    }
}

/// Middleware: authenticate, and hand the [`Caller`] to the handler.
pub async fn require(
    State(grants): State<Arc<Grants>>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let caller = grants.caller(req.headers())?;
    if let Some(name) = &caller.name {
        tracing::debug!(grant = %name, path = %req.uri().path(), "API request");
    }
    req.extensions_mut().insert(caller);
    Ok(next.run(req).await)
}

/// Refuse to serve the projection API on a non-loopback address with access control off.
pub fn check_bind(addr: &SocketAddr, settings: &HttpSettings) -> Result<(), String> {
    if !settings.enabled || !settings.api || !settings.tokens.is_empty() {
        return Ok(());
    }
    if addr.ip().is_loopback() {
        return Ok(());
    }
    Err(format!(
        "refusing to serve the projection API on {addr} without access control: it would expose every event to the network. Configure bearer tokens (http.tokens, each with the roles it may read), bind a loopback address (--http-addr 127.0.0.1:8080), or switch the API off (http.api = false)"
    ))
}

/// The token of a `Bearer <token>` credential in header `name` (scheme case-insensitive, spaces
/// trimmed); `None` when absent, of another scheme, or empty.
pub(crate) fn bearer_token<'h>(
    headers: &'h HeaderMap,
    name: &header::HeaderName,
) -> Option<&'h str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim())
                .filter(|t| !t.is_empty())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenGrant;
    use axum::http::HeaderValue;

    fn settings() -> HttpSettings {
        HttpSettings {
            tokens: vec![
                TokenGrant {
                    name: "ui".into(),
                    token: "s3cret-ui".into(),
                    token_env: None,
                    roles: vec![Role::ConversationMain],
                },
                TokenGrant {
                    name: "ops".into(),
                    token: "s3cret-ops".into(),
                    token_env: None,
                    roles: vec![Role::SystemObservability, Role::OrchestrationTask],
                },
            ],
            ..HttpSettings::default()
        }
    }

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(v) {
            h.insert(header::AUTHORIZATION, v);
        }
        h
    }

    #[test]
    fn tokens_map_to_their_grants() {
        let g = Grants::new(&settings());
        let ui = g.caller(&headers("Bearer s3cret-ui")).map(|c| c.allowed);
        assert_eq!(ui.ok(), Some(vec![Role::ConversationMain]));
        let ops = g.caller(&headers("bearer  s3cret-ops ")).map(|c| c.allowed);
        assert_eq!(
            ops.ok(),
            Some(vec![Role::OrchestrationTask, Role::SystemObservability])
        );
        for bad in ["", "Bearer", "Bearer wrong", "Basic s3cret-ui", "s3cret-ui"] {
            let e = g.caller(&headers(bad)).err().map(|e| e.status);
            assert_eq!(e, Some(StatusCode::UNAUTHORIZED), "{bad:?}");
        }
        assert!(!format!("{g:?}").contains("s3cret"));
    }

    #[test]
    fn naming_roles_outside_the_grant_is_forbidden() {
        let g = Grants::new(&settings());
        let Ok(ui) = g.caller(&headers("Bearer s3cret-ui")) else {
            panic!("ui token must be accepted")
        };
        assert_eq!(ui.roles(None).ok(), Some(vec![Role::ConversationMain]));
        assert!(ui.roles(Some(&[Role::ConversationMain])).is_ok());
        let e = ui
            .roles(Some(&[Role::ConversationMain, Role::SystemObservability]))
            .err();
        assert_eq!(e.map(|e| e.status), Some(StatusCode::FORBIDDEN));
    }

    #[test]
    fn no_tokens_means_open_access() {
        let g = Grants::new(&HttpSettings::default());
        assert!(!g.enabled());
        let c = g.caller(&HeaderMap::new()).map(|c| c.allowed);
        assert_eq!(c.ok(), Some(Role::ALL.to_vec()));
    }

    #[test]
    fn non_loopback_bind_needs_tokens() {
        let open = HttpSettings::default();
        let lan: SocketAddr = ([0, 0, 0, 0], 8080).into();
        let lo: SocketAddr = ([127, 0, 0, 1], 8080).into();
        let lo6: SocketAddr = (std::net::Ipv6Addr::LOCALHOST, 8080).into();
        assert!(check_bind(&lan, &open).is_err());
        assert!(check_bind(&lo, &open).is_ok());
        assert!(check_bind(&lo6, &open).is_ok());
        assert!(check_bind(&lan, &settings()).is_ok());
        let no_api = HttpSettings {
            api: false,
            ..HttpSettings::default()
        };
        assert!(check_bind(&lan, &no_api).is_ok());
    }
}
