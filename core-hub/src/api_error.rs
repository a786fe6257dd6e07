//! The hub API's one error shape: a JSON body `{"error": "<what to fix>", "code": "<CODE>"}`,
//! like the agent's (`{"error": ..}`) with a stable machine-readable `code` beside it.
//!
//! Handlers answer with [`error`] and a code of their own ([`codes`]). Everything else that
//! would leave as text (axum's extractor rejections, an unknown route, a wrong method, a
//! limit of the shared HTTP guard) is rewritten by [`json_errors`], a layer over the whole
//! router, with a code derived from the status ([`code_for_status`]). Codes are never reused
//! for another meaning; the table is in `docs/operations.md` ("API errors").

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The stable codes of the hub API's errors.
pub mod codes {
    pub const BAD_REQUEST: &str = "BAD_REQUEST";
    pub const BAD_TIME: &str = "BAD_TIME";
    pub const BAD_CUT: &str = "BAD_CUT";
    pub const BAD_NAME: &str = "BAD_NAME";
    pub const TOKEN_REQUIRED: &str = "TOKEN_REQUIRED";
    pub const ADMIN_TOKEN_REQUIRED: &str = "ADMIN_TOKEN_REQUIRED";
    pub const ADMIN_TOKEN_NOT_CONFIGURED: &str = "ADMIN_TOKEN_NOT_CONFIGURED";
    pub const METRICS_TOKEN_REQUIRED: &str = "METRICS_TOKEN_REQUIRED";
    pub const FORBIDDEN: &str = "FORBIDDEN";
    pub const NOT_FOUND: &str = "NOT_FOUND";
    pub const UNKNOWN_STREAM: &str = "UNKNOWN_STREAM";
    pub const UNKNOWN_DEVICE: &str = "UNKNOWN_DEVICE";
    pub const UNKNOWN_GROUP: &str = "UNKNOWN_GROUP";
    pub const READER_GONE: &str = "READER_GONE";
    pub const METHOD_NOT_ALLOWED: &str = "METHOD_NOT_ALLOWED";
    pub const REQUEST_TIMEOUT: &str = "REQUEST_TIMEOUT";
    pub const CONFLICT: &str = "CONFLICT";
    pub const BODY_TOO_LARGE: &str = "BODY_TOO_LARGE";
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "UNSUPPORTED_MEDIA_TYPE";
    pub const TOO_MANY_REQUESTS: &str = "TOO_MANY_REQUESTS";
    pub const FOLLOWS_MAX: &str = "FOLLOWS_MAX";
    pub const NOT_READY: &str = "NOT_READY";
    pub const UNAVAILABLE: &str = "UNAVAILABLE";
    pub const HUB_SHUTTING_DOWN: &str = "HUB_SHUTTING_DOWN";
    pub const INTERNAL: &str = "INTERNAL";
}

/// Largest text body [`json_errors`] carries over into the JSON message.
const TEXT_BODY_BYTES_MAX: usize = 16 << 10;

/// The JSON error body for `status` with a stable `code`.
pub fn error(status: StatusCode, code: &'static str, message: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({ "error": message.to_string(), "code": code });
    (status, axum::Json(body)).into_response()
}

/// [`error`] with further fields (`limit`, `max`, ..) beside `error` and `code`.
pub fn error_with(
    status: StatusCode,
    code: &'static str,
    message: impl std::fmt::Display,
    extra: serde_json::Value,
) -> Response {
    let mut body = serde_json::json!({ "error": message.to_string(), "code": code });
    if let (Some(map), serde_json::Value::Object(more)) = (body.as_object_mut(), extra) {
        map.extend(more);
    }
    (status, axum::Json(body)).into_response()
}

/// A 500 for a failure of ours; logged, since the client cannot fix it.
pub fn internal(message: impl std::fmt::Display) -> Response {
    tracing::error!(error = %message, "HTTP API error");
    error(StatusCode::INTERNAL_SERVER_ERROR, codes::INTERNAL, message)
}

/// The error function of the shared HTTP guard (Host/Origin, body bounds and timeouts).
pub fn guard_error(status: StatusCode, message: String) -> Response {
    error(status, code_for_status(status), message)
}

/// The code of an error that carries none of its own.
pub fn code_for_status(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => codes::BAD_REQUEST,
        StatusCode::UNAUTHORIZED => codes::TOKEN_REQUIRED,
        StatusCode::FORBIDDEN => codes::FORBIDDEN,
        StatusCode::NOT_FOUND => codes::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED => codes::METHOD_NOT_ALLOWED,
        StatusCode::REQUEST_TIMEOUT => codes::REQUEST_TIMEOUT,
        StatusCode::CONFLICT => codes::CONFLICT,
        StatusCode::PAYLOAD_TOO_LARGE => codes::BODY_TOO_LARGE,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => codes::UNSUPPORTED_MEDIA_TYPE,
        StatusCode::TOO_MANY_REQUESTS => codes::TOO_MANY_REQUESTS,
        StatusCode::SERVICE_UNAVAILABLE => codes::UNAVAILABLE,
        s if s.is_client_error() => codes::BAD_REQUEST,
        _ => codes::INTERNAL,
    }
}

/// Rewrites every error response that is not JSON yet into the JSON shape, keeping its
/// status and headers; its text (an axum rejection's explanation) becomes the message.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let what = format!("{} {}", req.method(), req.uri().path());
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(&resp) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, TEXT_BODY_BYTES_MAX).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let message = match (text.is_empty(), status) {
        (false, _) => text,
        (true, StatusCode::NOT_FOUND) => format!("no such route: {what}"),
        (true, StatusCode::METHOD_NOT_ALLOWED) => format!("method not allowed: {what}"),
        (true, s) => format!("{what}: {}", s.canonical_reason().unwrap_or("error")),
    };
    let fresh = error(status, code_for_status(status), message);
    let (fresh_parts, body) = fresh.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        fresh_parts.headers[header::CONTENT_TYPE].clone(),
    );
    Response::from_parts(parts, body)
}

fn is_json(resp: &Response) -> bool {
    resp.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn error_bodies_carry_message_and_code() {
        let resp = error(
            StatusCode::NOT_FOUND,
            codes::UNKNOWN_STREAM,
            "unknown stream `x`",
        );
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["code"], "UNKNOWN_STREAM");
        assert_eq!(v["error"], "unknown stream `x`");
    }

    #[test]
    fn every_error_status_has_a_code() {
        assert_eq!(code_for_status(StatusCode::IM_A_TEAPOT), codes::BAD_REQUEST);
        assert_eq!(code_for_status(StatusCode::BAD_GATEWAY), codes::INTERNAL);
        assert_eq!(
            code_for_status(StatusCode::PAYLOAD_TOO_LARGE),
            codes::BODY_TOO_LARGE
        );
    }
}
