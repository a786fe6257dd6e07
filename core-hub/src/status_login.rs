//! The status page for browsers when tokens are set: `GET /` without a token answers this
//! sign-in page (200), which shows nothing about the fleet. The operator pastes a reader (or
//! admin) token into it; the page keeps it in `sessionStorage` (this tab only, gone when the
//! tab closes, never in a URL, a cookie or the server's logs), fetches `/` with
//! `Authorization: Bearer <token>` every 5 s and shows the status page in place
//! (`#status-view`). A token the hub refuses (401) is dropped and the form comes back with
//! `#login-error`.
//!
//! Element ids for tests and scripts: `login` (the form), `token` (its field), `login-error`,
//! `login-view`, `status-view`. The script is served from `/status-login.js` under a
//! `script-src 'self'` policy, so no inline script runs on either page.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// The sign-in page.
pub const LOGIN_HTML: &str = "<!doctype html>\n<html lang=en><head><meta charset=utf-8>\
<title>Tributary hub status</title>\
<style>body{font-family:system-ui,sans-serif;margin:1.5em}label{margin-right:.5em}\
#login-error{color:#b00020;font-weight:600}</style></head><body>\n\
<main id=login-view><h1>Tributary hub</h1>\n\
<p>This hub requires a token. Paste a reader token (<code>http.reader_tokens</code>); it is \
kept in this tab only.</p>\n\
<form id=login><label for=token>Reader token</label>\
<input id=token name=token type=password autocomplete=current-password required> \
<button type=submit>Open status</button></form>\n\
<p id=login-error role=alert hidden></p></main>\n\
<div id=status-view hidden></div>\n\
<script src=\"/status-login.js\"></script>\n</body></html>\n";

/// The sign-in page's script.
pub const LOGIN_JS: &str = r#""use strict";
(() => {
  const KEY = "tributary-hub-token";
  const $ = (id) => document.getElementById(id);
  const fail = (msg) => {
    $("login-error").textContent = msg;
    $("login-error").hidden = false;
    $("login-view").hidden = false;
    $("status-view").hidden = true;
  };
  let timer = null;
  async function load() {
    clearTimeout(timer);
    const token = sessionStorage.getItem(KEY);
    if (!token) return;
    let r;
    try {
      r = await fetch("/", { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    } catch (e) {
      fail("cannot reach the hub: " + e);
      timer = setTimeout(load, 5000);
      return;
    }
    if (r.status === 401) {
      sessionStorage.removeItem(KEY);
      fail("the hub refused this token");
      return;
    }
    if (!r.ok) {
      fail("the hub answered " + r.status);
      timer = setTimeout(load, 5000);
      return;
    }
    const doc = new DOMParser().parseFromString(await r.text(), "text/html");
    const styles = [...doc.head.querySelectorAll("style")].map((s) => s.outerHTML).join("");
    $("status-view").innerHTML = styles + doc.body.innerHTML;
    $("login-view").hidden = true;
    $("status-view").hidden = false;
    timer = setTimeout(load, 5000);
  }
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("token").value.trim());
    $("token").value = "";
    $("login-error").hidden = true;
    load();
  });
  load();
})();
"#;

/// What the sign-in page may load: its script from this origin, and the status page's inline
/// styles; nothing else, and no framing.
const POLICY: &str = "default-src 'none'; script-src 'self'; connect-src 'self'; \
style-src 'unsafe-inline'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'";

/// `GET /` without a token while tokens are set.
pub fn page() -> Response {
    let mut r = axum::response::Html(LOGIN_HTML).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `GET /status-login.js`.
pub fn script() -> Response {
    let mut r = LOGIN_JS.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/javascript; charset=utf-8"),
    );
    r
}
