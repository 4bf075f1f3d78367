//! The built-in viewer: a page at `/` that reads the projection API like any other UI would
//! (docs/ui.md). Its three files are plain HTML, CSS and JavaScript compiled into the binary, so
//! it works without a build step, a CDN or any address outside the server it came from.
//!
//! Every file is served with a strict Content-Security-Policy (scripts, styles and connections to
//! this origin only), `nosniff`, no referrer, and an `ETag` so a reload costs a 304.

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// One embedded file.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const ASSETS: [Asset; 4] = [
    Asset {
        name: "index.html",
        content_type: "text/html; charset=utf-8",
        body: include_str!("viewer/index.html"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("viewer/app.js"),
    },
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("viewer/style.css"),
    },
    Asset {
        name: "icon.svg",
        content_type: "image/svg+xml",
        body: include_str!("viewer/icon.svg"),
    },
];

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The strong validator of each asset, computed once.
fn etags() -> &'static [String] {
    static ETAGS: OnceLock<Vec<String>> = OnceLock::new();
    ETAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| {
                format!(
                    "\"{}\"",
                    &hex::encode(Sha256::digest(a.body.as_bytes()))[..16]
                )
            })
            .collect()
    })
}

fn serve(index: usize, headers: &HeaderMap) -> Response {
    let (Some(asset), Some(etag)) = (ASSETS.get(index), etags().get(index)) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut resp = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type),
            )],
            asset.body,
        )
            .into_response()
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(etag) {
        h.insert(header::ETAG, v);
    }
    // Revalidate on every load, so an upgraded server is never paired with an old script.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

async fn index(headers: HeaderMap) -> Response {
    serve(0, &headers)
}

async fn asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS
        .iter()
        .position(|a| a.name == name && name != "index.html")
    {
        Some(i) => serve(i, &headers),
        None => (
            StatusCode::NOT_FOUND,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            "no such viewer file; the viewer is at /\n",
        )
            .into_response(),
    }
}

/// `/` and `/viewer/{file}`. Merge into the server's router next to the API it reads.
pub fn router() -> Router {
    Router::new()
        .route("/", get(index))
        .route("/viewer/{name}", get(asset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get_page(uri: &str, etag: Option<&str>) -> Response {
        let mut req = Request::builder().uri(uri);
        if let Some(e) = etag {
            req = req.header(header::IF_NONE_MATCH, e);
        }
        match req.body(Body::empty()) {
            Ok(r) => match router().oneshot(r).await {
                Ok(resp) => resp,
                Err(e) => match e {},
            },
            Err(e) => unreachable!("a static request is valid: {e}"),
        }
    }

    #[tokio::test]
    async fn the_page_and_its_files_are_served_with_a_strict_policy() {
        for (uri, ty) in [
            ("/", "text/html; charset=utf-8"),
            ("/viewer/app.js", "text/javascript; charset=utf-8"),
            ("/viewer/style.css", "text/css; charset=utf-8"),
            ("/viewer/icon.svg", "image/svg+xml"),
        ] {
            let resp = get_page(uri, None).await;
            assert_eq!(resp.status(), StatusCode::OK, "{uri}");
            let h = resp.headers();
            assert_eq!(h[header::CONTENT_TYPE], ty, "{uri}");
            let csp = h[header::CONTENT_SECURITY_POLICY].to_str().unwrap_or("");
            assert!(csp.contains("connect-src 'self'"), "{uri}: {csp}");
            assert!(csp.contains("script-src 'self'"), "{uri}: {csp}");
            assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
            let etag = h[header::ETAG].to_str().unwrap_or("").to_string();
            assert!(etag.starts_with('"'), "{uri}: {etag}");
            let again = get_page(uri, Some(&etag)).await;
            assert_eq!(again.status(), StatusCode::NOT_MODIFIED, "{uri}");
        }
        for missing in [
            "/viewer/index.html",
            "/viewer/nope.js",
            "/viewer/..%2Fapp.js",
        ] {
            assert_eq!(
                get_page(missing, None).await.status(),
                StatusCode::NOT_FOUND,
                "{missing}"
            );
        }
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for a in &ASSETS {
            for needle in ["http://", "https://", "//cdn", "@import"] {
                let hits: Vec<&str> = a
                    .body
                    .lines()
                    .filter(|l| l.contains(needle) && !l.contains("www.w3.org/2000/svg"))
                    .collect();
                assert!(hits.is_empty(), "{} refers to {needle}: {hits:?}", a.name);
            }
        }
        let html = ASSETS[0].body;
        for needle in [
            "src=\"/viewer/app.js\"",
            "href=\"/viewer/style.css\"",
            "lang=\"en\"",
        ] {
            assert!(html.contains(needle), "index.html lacks {needle}");
        }
        // No inline script or style: the policy would block them.
        assert!(!html.contains("<script>") && !html.contains("style=\""));
    }
}
