//! The hub's HTTP server under abuse: the same accept loop, timeouts, caps, Host/Origin check
//! and bounded body reads as the agent's (one source file, `edge-agent/src/http/limits.rs`,
//! compiled into both binaries so the two servers cannot drift), with the hub's defaults.

#[path = "../../edge-agent/src/http/limits.rs"]
mod shared;

pub use shared::*;

/// Default `http.connections_max` of the hub.
pub const DEFAULT_CONNECTIONS_MAX: usize = 1024;
/// Default `http.requests_max` of the hub.
pub const DEFAULT_REQUESTS_MAX: usize = 256;
/// Largest request body the hub's API takes: its requests carry their arguments in the query,
/// so a body is at most a little JSON.
pub const BODY_BYTES_MAX: usize = 64 << 10;

/// The hub's defaults.
pub fn default_limits() -> HttpLimits {
    HttpLimits::new(
        DEFAULT_CONNECTIONS_MAX,
        DEFAULT_REQUESTS_MAX,
        BODY_BYTES_MAX,
    )
}
