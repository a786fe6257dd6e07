//! `GET /v1/republish/dead-letters[?stream=S&limit=N]` (mounted by `crate::api::router` under
//! the reader token): the newest dead letters, newest first, and the counts per stream and
//! reason. Each entry names the record's stream and hub offset, so
//! `GET /v1/streams/{stream}/records?from={offset}&limit=1` shows the record itself.

use super::store;
use crate::ingest::Hub;
use axum::Router;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Entries per answer unless `limit` says otherwise.
pub const DEFAULT_LIMIT: usize = 100;
/// Most entries per answer.
pub const LIMIT_MAX: usize = 1000;

/// The routes, with their own state; mount with `Router::merge`.
pub fn routes<S: Clone + Send + Sync + 'static>(hub: Arc<Hub>) -> Router<S> {
    Router::new()
        .route("/v1/republish/dead-letters", get(dead_letters))
        .with_state(hub)
}

#[derive(Debug, Deserialize)]
struct DeadLetterQuery {
    stream: Option<String>,
    limit: Option<usize>,
}

#[derive(Debug, Serialize)]
struct Count {
    stream: String,
    reason: String,
    count: u64,
}

#[derive(Debug, Serialize)]
struct Answer {
    counts: Vec<Count>,
    dead_letters: Vec<super::DeadLetter>,
}

async fn dead_letters(State(hub): State<Arc<Hub>>, Query(q): Query<DeadLetterQuery>) -> Response {
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, LIMIT_MAX);
    let answer = tokio::task::spawn_blocking(move || Answer {
        counts: store::dead_letter_counts(&hub)
            .into_iter()
            .filter(|(s, _, _)| q.stream.as_ref().is_none_or(|want| want == s))
            .map(|(stream, reason, count)| Count {
                stream,
                reason,
                count,
            })
            .collect(),
        dead_letters: store::dead_letters(&hub, q.stream.as_deref(), limit),
    })
    .await;
    match answer {
        Ok(a) => Json(a).into_response(),
        Err(e) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("{e}\n"),
        )
            .into_response(),
    }
}
