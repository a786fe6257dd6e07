//! Connection admission: the device id the handshake verified, the device's connection
//! slots, and the connection's share of the ingest budget, held for its lifetime.
//!
//! A device holds at most `ingest.connections_per_device_max` connections (1 by default). A
//! new connection from a device at its limit supersedes the device's oldest, which closes with
//! `SUPERSEDED` once its commits settled: a device that reconnects after a network change is
//! never locked out by its own stale session, and one certificate can never hold more than its
//! share of the hub's connection capacity. A connection that superseded another waits (up to
//! the admission wait) for the slot the old one frees; any other connection at the hub's
//! capacity is refused with `LIMIT_EXCEEDED` at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, OwnedSemaphorePermit};

use super::{ConnCtx, ConnStats};
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

/// Charges a new connection to the ingest budget, waiting a little when it is spent; with
/// `wait_for_slot` (it superseded a connection that is closing) it waits for a slot too.
pub(super) async fn admit_connection(
    ctx: &ConnCtx,
    wait_for_slot: bool,
) -> Result<ConnectionCharge, String> {
    let full = || {
        format!(
            "the hub is at its connection capacity ({} connections within the ingest memory budget)",
            ctx.connections.available_permits()
        )
    };
    let slots = ctx.connections.clone();
    let slot = match wait_for_slot {
        false => slots.try_acquire_owned().map_err(|_| full())?,
        true => tokio::time::timeout(CONNECTION_ADMIT_WAIT, slots.acquire_owned())
            .await
            .map_err(|_| full())?
            .map_err(|_| full())?,
    };
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

/// The live connections of every device, oldest first, so that a device's new connection
/// can supersede its oldest when it is at `ingest.connections_per_device_max`.
#[derive(Debug)]
pub(super) struct DeviceSlots {
    max: usize,
    next: std::sync::atomic::AtomicU64,
    held: std::sync::Mutex<HashMap<String, VecDeque<SlotEntry>>>,
}

/// A live connection's id and how to tell it that it was superseded.
type SlotEntry = (u64, Arc<Notify>);

/// One connection's place among its device's; dropping it frees the place.
#[derive(Debug)]
pub(super) struct DeviceSlot {
    slots: Arc<DeviceSlots>,
    device: String,
    id: u64,
    /// Notified when a newer connection of the device took this one's place.
    pub(super) superseded: Arc<Notify>,
}

impl DeviceSlots {
    pub(super) fn new(max: u32) -> Arc<DeviceSlots> {
        Arc::new(DeviceSlots {
            max: max as usize,
            next: Default::default(),
            held: Default::default(),
        })
    }

    /// Places a new connection of `device`; with `supersede`, its oldest connections beyond
    /// the limit are told to close. Returns the slot and how many were superseded.
    pub(super) fn claim(self: &Arc<Self>, device: &str, supersede: bool) -> (DeviceSlot, usize) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        let mut held = self.held.lock().expect("device slots lock");
        let queue = held.entry(device.to_owned()).or_default();
        queue.push_back((id, notify.clone()));
        let mut superseded = 0;
        while supersede && queue.len() > self.max {
            let (_, oldest) = queue
                .pop_front()
                .expect("a queue over its limit is not empty");
            // A stored permit: the old connection sees it even if it is not waiting yet.
            oldest.notify_one();
            superseded += 1;
        }
        assert!(!supersede || queue.len() <= self.max);
        let slot = DeviceSlot {
            slots: self.clone(),
            device: device.to_owned(),
            id,
            superseded: notify,
        };
        (slot, superseded)
    }
}

impl Drop for DeviceSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().expect("device slots lock");
        if let Some(queue) = held.get_mut(&self.device) {
            queue.retain(|(id, _)| *id != self.id);
            if queue.is_empty() {
                held.remove(&self.device);
            }
        }
    }
}

/// A connection whose handshake the accept loop let through, counted among the handshakes in
/// progress until it completes or fails.
pub(super) struct Handshake {
    pub(super) incoming: quinn::Incoming,
    pub(super) guard: HandshakeGuard,
}

/// Counts one handshake in progress for its lifetime.
pub(super) struct HandshakeGuard(Arc<crate::ingest::Hub>);

impl Drop for HandshakeGuard {
    fn drop(&mut self) {
        let handshakes = &self.0.stats().connections.handshakes;
        handshakes.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// QUIC address validation under handshake load: while `ingest.retry_above_handshakes` or
/// more handshakes are in progress, a client whose address is not validated yet is sent a
/// Retry (it comes back with a token proving its address, and is let through then), so a
/// flood of spoofed Initial packets costs the hub no handshake state. `None` when the
/// connection was answered with a Retry.
pub(super) fn validate_or_retry(ctx: &ConnCtx, incoming: quinn::Incoming) -> Option<Handshake> {
    let stats = &ctx.hub.stats().connections;
    let busy = stats.handshakes.load(std::sync::atomic::Ordering::Relaxed)
        >= u64::from(ctx.quotas.retry_above_handshakes);
    let incoming = if busy && !incoming.remote_address_validated() && incoming.may_retry() {
        match incoming.retry() {
            Ok(()) => {
                ConnStats::bump(&stats.retries);
                return None;
            }
            Err(e) => e.into_incoming(),
        }
    } else {
        incoming
    };
    stats
        .handshakes
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(Handshake {
        incoming,
        guard: HandshakeGuard(ctx.hub.clone()),
    })
}
