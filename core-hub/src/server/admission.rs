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
//!
//! # Receive windows
//!
//! What quinn may buffer for a connection is its QUIC receive window (connection-level flow
//! control: bytes received and not yet read by the hub). Every connection's window is reserved
//! from the ingest budget for its lifetime, so the windows of all connections together never
//! exceed `ingest.memory_bytes_max`:
//! - the handshake advertises only [`WINDOW_FLOOR_BYTES`], which is part of
//!   [`CONNECTION_COST_BYTES`]: a connection that is refused, or not admitted yet, can never
//!   have more than the floor in flight, and a connection that does not fit its cost (and so
//!   its floor) is refused with `LIMIT_EXCEEDED`;
//! - once admitted, a connection is raised towards the full window (the receiver's block
//!   window plus 1 MiB for control frames) with what is free now, without waiting, of both the
//!   budget and the windows' share ([`WINDOWS_BUDGET_SHARE`]): the first connections of an
//!   idle hub get the full window, later ones less, down to the floor
//!   (`tributary_hub_ingest_windows_reduced_total`). The share keeps the windows from
//!   crowding out the blocks' part of the budget.
//!
//! The receiver's block window (what the agent may have in flight, in the Welcome) stays as
//! configured: QUIC flow control paces a connection whose receive window is smaller, and the
//! agent writes its data streams one after the other, in the order the hub reads them, so the
//! credit of the stream being read is never used up by later ones (a client that interleaves
//! its streams can stall only its own connection, until `IDLE_TIMEOUT`).
//! `tributary_hub_ingest_window_reserved_bytes` is the sum of the windows
//! of live connections; it is released when a connection ends.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, OwnedSemaphorePermit};

use super::{ConnCtx, ConnStats};
use crate::ingest::{Hub, MEMORY_PERMIT_BYTES};
use crate::pki;

/// The QUIC receive window every admitted connection is sure of (see the module docs).
pub const WINDOW_FLOOR_BYTES: u64 = 128 << 10;
/// What an idle, established connection holds besides its window: its quinn and TLS state,
/// the protocol receiver and the driver's buffers (measured at 109–115 KiB).
const CONNECTION_STATE_BYTES: u64 = 128 << 10;
/// What a connection reserves of the ingest budget for its lifetime before its window is
/// raised: its state and the window floor.
pub const CONNECTION_COST_BYTES: u64 = CONNECTION_STATE_BYTES + WINDOW_FLOOR_BYTES;
/// The share of the ingest budget connections' costs may hold together, in quarters: 3/4.
pub const CONNECTIONS_BUDGET_SHARE: (u64, u64) = (3, 4);
/// The share of the ingest budget that receive windows above the floor may hold together:
/// 1/8. With the connections' share, blocks always keep at least the last 1/8.
pub const WINDOWS_BUDGET_SHARE: (u64, u64) = (1, 8);
/// How long a new connection waits for its share of the budget before it is refused.
const CONNECTION_ADMIT_WAIT: Duration = Duration::from_secs(5);

/// A connection's reservation: its slot among connections, its bytes of the ingest budget
/// and its receive window above the floor; dropping it releases all of them.
pub(super) struct ConnectionCharge {
    // Dropped first: the gauge never counts a window whose bytes were released.
    _window: WindowGrant,
    _slot: OwnedSemaphorePermit,
    _memory: OwnedSemaphorePermit,
    _raise: Option<Raise>,
}

/// A connection's receive window, counted in `tributary_hub_ingest_window_reserved_bytes`
/// while it lives.
struct WindowGrant {
    hub: Arc<Hub>,
    bytes: u64,
}

/// A window's reservation above the floor: of the windows' share and of the ingest budget.
type Raise = (OwnedSemaphorePermit, OwnedSemaphorePermit);

impl WindowGrant {
    fn new(hub: &Arc<Hub>, bytes: u64) -> WindowGrant {
        let stats = &hub.stats().connections;
        stats
            .window_reserved_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        WindowGrant {
            hub: hub.clone(),
            bytes,
        }
    }
}

impl Drop for WindowGrant {
    fn drop(&mut self) {
        let stats = &self.hub.stats().connections;
        stats
            .window_reserved_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Charges a new connection to the ingest budget, waiting a little when it is spent; with
/// `wait_for_slot` (it superseded a connection that is closing) it waits for a slot too. Then
/// raises its receive window with what the budget has free (see the module docs).
pub(super) async fn admit_connection(
    ctx: &ConnCtx,
    conn: &quinn::Connection,
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
    let permits = CONNECTION_COST_BYTES.div_ceil(MEMORY_PERMIT_BYTES) as u32;
    let memory = tokio::time::timeout(
        CONNECTION_ADMIT_WAIT,
        ctx.hub.memory().clone().acquire_many_owned(permits),
    )
    .await
    .map_err(|_| "the ingest memory budget is spent; retry later".to_string())?
    .map_err(|_| "the ingest budget is closed".to_string())?;
    let (raise, window) = match ctx.mutation.unreserved_windows() {
        // The test-only mutation: the full window, reserved nowhere.
        true => (None, full_window(ctx)),
        false => raise_window(ctx),
    };
    assert!(window >= WINDOW_FLOOR_BYTES, "a window below the floor");
    if window < full_window(ctx) {
        ConnStats::bump(&ctx.hub.stats().connections.windows_reduced);
    }
    let window_var = quinn::VarInt::from_u64(window).unwrap_or(quinn::VarInt::MAX);
    conn.set_receive_window(window_var);
    Ok(ConnectionCharge {
        _window: WindowGrant::new(&ctx.hub, window),
        _slot: slot,
        _memory: memory,
        _raise: raise,
    })
}

/// The receive window a connection gets with the budget to spare: the receiver's block
/// window plus 1 MiB for control frames.
pub(super) fn full_window(ctx: &ConnCtx) -> u64 {
    (ctx.receiver_cfg.window_bytes + (1 << 20)).max(WINDOW_FLOOR_BYTES)
}

/// The window above the floor a new connection gets: as much of the rest of its full window
/// as both the windows' share and the ingest budget have free now, never waiting. Returns
/// the reservation and the whole window.
fn raise_window(ctx: &ConnCtx) -> (Option<Raise>, u64) {
    let want = (full_window(ctx) - WINDOW_FLOOR_BYTES) / MEMORY_PERMIT_BYTES;
    let free = ctx
        .windows
        .available_permits()
        .min(ctx.hub.memory().available_permits()) as u64;
    let n = want.min(free) as u32;
    if n == 0 {
        return (None, WINDOW_FLOOR_BYTES);
    }
    let share = ctx.windows.clone().try_acquire_many_owned(n);
    let memory = ctx.hub.memory().clone().try_acquire_many_owned(n);
    match (share, memory) {
        (Ok(share), Ok(memory)) => (
            Some((share, memory)),
            WINDOW_FLOOR_BYTES + u64::from(n) * MEMORY_PERMIT_BYTES,
        ),
        // Another connection or a block took it meanwhile: the floor, which is reserved.
        _ => (None, WINDOW_FLOOR_BYTES),
    }
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
    /// How many devices `held` holds, for `tributary_hub_devices_connected`.
    connected: Arc<std::sync::atomic::AtomicU64>,
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
    pub(super) fn new(max: u32, connected: Arc<std::sync::atomic::AtomicU64>) -> Arc<DeviceSlots> {
        Arc::new(DeviceSlots {
            max: max as usize,
            next: Default::default(),
            held: Default::default(),
            connected,
        })
    }

    fn count(&self, held: &HashMap<String, VecDeque<SlotEntry>>) {
        let n = held.len() as u64;
        self.connected
            .store(n, std::sync::atomic::Ordering::Relaxed);
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
        self.count(&held);
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
        self.slots.count(&held);
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
    let retry = busy && ctx.mutation.retries();
    let incoming = if retry && !incoming.remote_address_validated() && incoming.may_retry() {
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
