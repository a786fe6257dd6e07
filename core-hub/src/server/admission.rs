//! Connection admission: the device id the handshake verified, and the connection's share
//! of the ingest budget, held for its lifetime.

use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::sync::OwnedSemaphorePermit;

use super::ConnCtx;
use crate::pki;

/// What an idle, established connection costs the hub (see the module docs), charged to the
/// ingest budget for the connection's lifetime.
pub const CONNECTION_COST_BYTES: u64 = 128 << 10;
/// The share of the ingest budget connections may hold together, in quarters: 3/4.
pub const CONNECTIONS_BUDGET_SHARE: (u64, u64) = (3, 4);
/// How long a new connection waits for its share of the budget before it is refused.
const CONNECTION_ADMIT_WAIT: Duration = Duration::from_secs(5);

/// A connection's reservation: its slot among connections and its bytes of the ingest budget.
pub(super) struct ConnectionCharge {
    _slot: OwnedSemaphorePermit,
    _memory: OwnedSemaphorePermit,
}

/// Charges a new connection to the ingest budget, waiting a little when it is spent.
pub(super) async fn admit_connection(ctx: &ConnCtx) -> Result<ConnectionCharge, String> {
    let full = || {
        format!(
            "the hub is at its connection capacity ({} connections within the ingest memory budget)",
            ctx.connections.available_permits()
        )
    };
    let slot = ctx
        .connections
        .clone()
        .try_acquire_owned()
        .map_err(|_| full())?;
    let permits = CONNECTION_COST_BYTES.div_ceil(crate::ingest::MEMORY_PERMIT_BYTES) as u32;
    let memory = tokio::time::timeout(
        CONNECTION_ADMIT_WAIT,
        ctx.hub.memory().clone().acquire_many_owned(permits),
    )
    .await
    .map_err(|_| "the ingest memory budget is spent; retry later".to_string())?
    .map_err(|_| "the ingest budget is closed".to_string())?;
    Ok(ConnectionCharge {
        _slot: slot,
        _memory: memory,
    })
}

/// The device id and the leaf certificate (for revocation checks) the handshake verified.
pub(super) fn peer_device(
    conn: &quinn::Connection,
) -> Result<(String, CertificateDer<'static>), String> {
    let identity = conn.peer_identity().ok_or("no client certificate")?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| "unexpected peer identity type".to_string())?;
    let leaf = certs.first().ok_or("empty client certificate chain")?;
    let device = pki::device_id_from_cert(leaf).map_err(|e| format!("client certificate: {e}"))?;
    Ok((device, leaf.clone()))
}
