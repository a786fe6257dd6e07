//! Wire frames of the replication protocol: types, encoding and defensive decoding.
//!
//! ```text
//! frame := len u32 LE | type u8 | payload (len - 1 bytes)
//! ```
//!
//! `len` counts the type byte and the payload. It is checked against the configured maximum
//! before anything is allocated ([`frame_len`], [`FrameBuffer`]), so a peer cannot make us
//! reserve memory by announcing a huge frame. Payload integers are LEB128 varints
//! ([`crate::varint`]) unless noted; strings are a varint length followed by UTF-8.
//! The byte layouts are specified in `docs/protocol/sync.md`.
//!
//! Two frames have a layout frozen across all protocol versions, because they are read before
//! a version is agreed: [`Hello`] (its fixed prefix: magic and version range) and
//! [`ErrorFrame`]. A Hello may carry trailing bytes after the version-1 body: extensions.
//! The first is the edge's [`capability`] bits (a varint, written only when non-zero); any
//! later or undecodable extension bytes are ignored. Every other frame must be consumed
//! exactly.

use crate::varint::{self, ReadError, Reader};
use thiserror::Error;

/// `TRSY`: opens every Hello payload, so a stray connection is refused on its first bytes.
pub const HELLO_MAGIC: [u8; 4] = *b"TRSY";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes before the type byte: the `u32` length.
pub const LEN_PREFIX: usize = 4;
/// The default bound on `len`: 16 MiB, enough for any block the edge seals.
pub const FRAME_BYTES_MAX_DEFAULT: u32 = 16 << 20;
/// Longest stream name accepted.
pub const STREAM_NAME_BYTES_MAX: usize = 128;
/// Most lanes one Hello or Welcome may list.
pub const LANES_MAX: usize = 4096;
/// Most gap markers one lane may announce in a Hello.
pub const GAPS_PER_LANE_MAX: usize = 1024;
/// Longest error message carried in an Error frame.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1024;

/// Frame type bytes. Numbers are never reused; retired types stay listed as reserved.
pub mod frame_type {
    pub const HELLO: u8 = 0x01;
    pub const WELCOME: u8 = 0x02;
    pub const BLOCK: u8 = 0x03;
    pub const GAP: u8 = 0x04;
    pub const ACK: u8 = 0x05;
    pub const BACKLOG: u8 = 0x06;
    pub const PING: u8 = 0x07;
    pub const VERDICT: u8 = 0x08;
    pub const ERROR: u8 = 0x09;
    pub const STREAM_REFUSED: u8 = 0x0a;
}

/// Capability bits an edge announces in its Hello (the first Hello extension). A hub sends a
/// frame type only to an edge that announced the bit for it, so an older agent never gets a
/// frame it cannot decode. Bits are never reused.
pub mod capability {
    /// The edge understands [`super::Frame::StreamRefused`]: the hub refuses one stream
    /// without closing the session.
    pub const STREAM_REFUSED: u64 = 1;
    /// Every bit this build understands.
    pub const ALL: u64 = STREAM_REFUSED;
}

/// Numbered error codes carried by [`ErrorFrame`]. A code is never reused for another meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// A malformed frame, or a frame that is not allowed in the current state.
    ProtocolViolation,
    /// No protocol version in common.
    UnsupportedVersion,
    /// A frame longer than the receiver's maximum.
    FrameTooLarge,
    /// The sender exceeded the window the hub advertised.
    FlowControl,
    /// Same `(device, epoch, stream, seqs)` with different content: the device is fenced.
    ConflictFenced,
    /// A block failed its checksum or could not be decoded within limits.
    BadBlock,
    /// Nothing was received for the idle timeout.
    IdleTimeout,
    /// The device may not write this stream (hub allow-list), or the name is invalid.
    UnauthorizedStream,
    /// The device was fenced earlier; the hub refuses it until an operator clears the fence.
    DeviceFenced,
    /// The peer is shutting down.
    Shutdown,
    /// A per-connection limit (lanes, streams, memory) was exceeded.
    LimitExceeded,
    /// The hub failed internally (for example, its log could not be written).
    Internal,
    /// The device's certificate was revoked.
    Revoked,
    /// The hub cannot store data now (its disk is full, or tier 1 is over its budget while
    /// tier 2 is away). Nothing of the refused data was kept; the device keeps it and retries
    /// after a short fixed delay, since the condition clears without the device doing anything.
    StorageFull,
    /// A block whose records would take more memory than the hub's
    /// `ingest.block_decoded_bytes_max` (their decoded size, computed before decoding them).
    /// Resending the same block cannot succeed.
    DecodedTooLarge,
    /// A newer connection of the same device took this one's place (the hub keeps at most
    /// `ingest.connections_per_device_max` per device and closes the oldest). The device
    /// reconnects with its usual backoff; its newest session is the one that carries on.
    Superseded,
    /// The connection did not open its control stream and deliver a complete Hello within the
    /// hub's `ingest.hello_timeout`.
    HelloTimeout,
    /// A per-device state quota (streams, epochs or lanes per device, columns per stream) would
    /// be exceeded: the hub created nothing for it. The message names the stream and the
    /// limit's key; sent in a [`StreamRefused`] to an edge that understands it, so the device's
    /// other lanes are unaffected.
    QuotaExceeded,
    /// A code this build does not know; kept so that newer peers' codes are reported.
    Unknown(u16),
}

impl ErrorCode {
    /// The wire number.
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::ProtocolViolation => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::FrameTooLarge => 3,
            ErrorCode::FlowControl => 4,
            ErrorCode::ConflictFenced => 5,
            ErrorCode::BadBlock => 6,
            ErrorCode::IdleTimeout => 7,
            ErrorCode::UnauthorizedStream => 8,
            ErrorCode::DeviceFenced => 9,
            ErrorCode::Shutdown => 10,
            ErrorCode::LimitExceeded => 11,
            ErrorCode::Internal => 12,
            ErrorCode::Revoked => 13,
            ErrorCode::StorageFull => 14,
            ErrorCode::DecodedTooLarge => 15,
            ErrorCode::Superseded => 16,
            ErrorCode::HelloTimeout => 17,
            ErrorCode::QuotaExceeded => 18,
            ErrorCode::Unknown(n) => n,
        }
    }

    /// Parses a wire number; unknown numbers are kept as [`ErrorCode::Unknown`].
    pub fn from_u16(n: u16) -> ErrorCode {
        match n {
            1 => ErrorCode::ProtocolViolation,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::FrameTooLarge,
            4 => ErrorCode::FlowControl,
            5 => ErrorCode::ConflictFenced,
            6 => ErrorCode::BadBlock,
            7 => ErrorCode::IdleTimeout,
            8 => ErrorCode::UnauthorizedStream,
            9 => ErrorCode::DeviceFenced,
            10 => ErrorCode::Shutdown,
            11 => ErrorCode::LimitExceeded,
            12 => ErrorCode::Internal,
            13 => ErrorCode::Revoked,
            14 => ErrorCode::StorageFull,
            15 => ErrorCode::DecodedTooLarge,
            16 => ErrorCode::Superseded,
            17 => ErrorCode::HelloTimeout,
            18 => ErrorCode::QuotaExceeded,
            other => ErrorCode::Unknown(other),
        }
    }
}

/// Why records were lost on the edge. Numbers are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GapReason {
    /// The disk budget forced a drop (`on_full = "drop-oldest"`).
    DiskFull,
    /// A corrupt sealed block was quarantined.
    Corrupt,
    /// The sender found seqs missing from its log with no marker covering them.
    Missing,
    /// A reason this build does not know.
    Unknown(u8),
}

impl GapReason {
    pub fn to_u8(self) -> u8 {
        match self {
            GapReason::DiskFull => 1,
            GapReason::Corrupt => 2,
            GapReason::Missing => 3,
            GapReason::Unknown(n) => n,
        }
    }

    pub fn from_u8(n: u8) -> GapReason {
        match n {
            1 => GapReason::DiskFull,
            2 => GapReason::Corrupt,
            3 => GapReason::Missing,
            other => GapReason::Unknown(other),
        }
    }
}

/// An explicit record of lost seqs `first_seq..=last_seq` of one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GapMarker {
    pub first_seq: u64,
    pub last_seq: u64,
    pub reason: GapReason,
    /// Records the agent counted as lost; at most `last_seq - first_seq + 1`.
    pub count: u64,
}

impl GapMarker {
    /// The marker restricted to seqs at or above `from`, or `None` if nothing is left.
    /// This is how markers are clipped against the hub's mark.
    pub fn clip_from(&self, from: u64) -> Option<GapMarker> {
        if from > self.last_seq {
            return None;
        }
        let first_seq = self.first_seq.max(from);
        let count = self.count.min(self.last_seq - first_seq + 1);
        Some(GapMarker {
            first_seq,
            count,
            ..*self
        })
    }
}

/// Backlog figures of one lane, as the edge reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Backlog {
    /// Sealed blocks not yet acknowledged as durable.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Event time (ns) of the oldest unsent record, if any.
    pub oldest_unsent_ts: Option<i64>,
}

/// What the edge announces about one `(stream, epoch)` lane in its Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneAnnounce {
    pub stream: String,
    pub epoch: u64,
    /// First seq the edge still holds (0: holds nothing).
    pub first_seq: u64,
    /// Highest fsynced seq the edge holds (0: holds nothing).
    pub last_seq: u64,
    /// The `durable_seq` the edge last persisted from an Ack (0: none).
    pub acked_seq: u64,
    pub backlog: Backlog,
    pub gaps: Vec<GapMarker>,
}

/// The edge's first frame. The prefix up to `version_max` is frozen across versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version_min: u16,
    pub version_max: u16,
    /// The epoch the edge writes new data into.
    pub current_epoch: u64,
    pub lanes: Vec<LaneAnnounce>,
    /// [`capability`] bits; 0 for an edge that sends no extension.
    pub capabilities: u64,
}

/// The hub's answer for one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneWelcome {
    pub durable_seq: u64,
    pub tiered_seq: u64,
    /// Where the edge resumes: at most `durable_seq + 1`. Below it only when the hub wants
    /// the block ending at its mark again, to check that the edge's history matches.
    pub resume_from: u64,
}

/// The hub's first frame: the agreed version, flow-control limits and the marks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub version: u16,
    /// Unacknowledged block bytes the edge may have in flight.
    pub window_bytes: u64,
    /// Unacknowledged blocks and gap markers the edge may have in flight.
    pub window_items: u64,
    /// Highest epoch the hub has seen from this device; a minted epoch must exceed it.
    pub epoch_max: u64,
    pub lanes: Vec<(String, u64, LaneWelcome)>,
}

/// One lane's line in a Backlog frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BacklogEntry {
    pub stream: String,
    pub epoch: u64,
    pub backlog: Backlog,
}

/// A protocol error report; its layout is frozen across versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    pub code: ErrorCode,
    pub message: String,
}

/// The hub refuses one stream of the session (not on the device's allow-list, a per-device
/// quota, a key the device may not write). Sent only to an edge that announced
/// [`capability::STREAM_REFUSED`]; the session and every other stream carry on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRefused {
    pub stream: String,
    /// The lane whose block was refused (0 when refused at the handshake); the refusal covers
    /// every lane of the stream.
    pub epoch: u64,
    /// `UNAUTHORIZED_STREAM` or `QUOTA_EXCEEDED` so far; any code is carried.
    pub code: ErrorCode,
    /// The edge offers the stream again on the same session after this long.
    pub retry_after_ms: u64,
    /// For logs and status; at most [`ERROR_MESSAGE_BYTES_MAX`] bytes, lossy UTF-8.
    pub message: String,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    Welcome(Welcome),
    /// A sealed block (see [`crate::block`]); its header carries the epoch and the seqs.
    Block {
        stream: String,
        block: Vec<u8>,
    },
    Gap {
        stream: String,
        epoch: u64,
        gap: GapMarker,
    },
    Ack {
        stream: String,
        epoch: u64,
        durable_seq: u64,
        tiered_seq: u64,
    },
    Backlog(Vec<BacklogEntry>),
    Ping,
    /// For a lane whose history the hub is ahead of: the edge's records up to
    /// `matched_through` are identical to the hub's; later ones are not confirmed.
    Verdict {
        stream: String,
        epoch: u64,
        matched_through: u64,
    },
    Error(ErrorFrame),
    StreamRefused(StreamRefused),
}

/// Why bytes are not a valid frame. Decoding never panics.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("frame truncated: have {got} bytes, need {need}")]
    Truncated { got: usize, need: usize },
    #[error("frame length {len} exceeds the maximum {max}")]
    TooLarge { len: u64, max: u32 },
    #[error("frame length 0: every frame has a type byte")]
    Empty,
    #[error("unknown frame type {0:#04x}")]
    UnknownType(u8),
    #[error("malformed {frame} frame at payload byte {offset}: {what}")]
    Malformed {
        frame: &'static str,
        offset: usize,
        what: &'static str,
    },
}

impl Frame {
    /// The frame's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        type_name(self.type_byte())
    }

    pub fn type_byte(&self) -> u8 {
        use frame_type::*;
        match self {
            Frame::Hello(_) => HELLO,
            Frame::Welcome(_) => WELCOME,
            Frame::Block { .. } => BLOCK,
            Frame::Gap { .. } => GAP,
            Frame::Ack { .. } => ACK,
            Frame::Backlog(_) => BACKLOG,
            Frame::Ping => PING,
            Frame::Verdict { .. } => VERDICT,
            Frame::Error(_) => ERROR,
            Frame::StreamRefused(_) => STREAM_REFUSED,
        }
    }

    /// Encodes the frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; LEN_PREFIX];
        out.push(self.type_byte());
        self.encode_payload(&mut out);
        let len = u32::try_from(out.len() - LEN_PREFIX).expect("frame larger than 4 GiB");
        out[..LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
        out
    }

    fn encode_payload(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Hello(h) => encode_hello(h, out),
            Frame::Welcome(w) => encode_welcome(w, out),
            Frame::Block { stream, block } => {
                varint::put_bytes(out, stream.as_bytes());
                out.extend_from_slice(block);
            }
            Frame::Gap { stream, epoch, gap } => {
                varint::put_bytes(out, stream.as_bytes());
                varint::put_u64(out, *epoch);
                put_gap(out, gap);
            }
            Frame::Ack {
                stream,
                epoch,
                durable_seq,
                tiered_seq,
            } => {
                varint::put_bytes(out, stream.as_bytes());
                for v in [*epoch, *durable_seq, *tiered_seq] {
                    varint::put_u64(out, v);
                }
            }
            Frame::Backlog(entries) => {
                varint::put_u64(out, entries.len() as u64);
                for e in entries {
                    varint::put_bytes(out, e.stream.as_bytes());
                    varint::put_u64(out, e.epoch);
                    put_backlog(out, &e.backlog);
                }
            }
            Frame::Ping => {}
            Frame::Verdict {
                stream,
                epoch,
                matched_through,
            } => {
                varint::put_bytes(out, stream.as_bytes());
                varint::put_u64(out, *epoch);
                varint::put_u64(out, *matched_through);
            }
            Frame::Error(e) => {
                out.extend_from_slice(&e.code.to_u16().to_le_bytes());
                let msg = truncate_utf8(&e.message, ERROR_MESSAGE_BYTES_MAX);
                varint::put_bytes(out, msg.as_bytes());
            }
            Frame::StreamRefused(r) => {
                varint::put_bytes(out, r.stream.as_bytes());
                varint::put_u64(out, r.epoch);
                out.extend_from_slice(&r.code.to_u16().to_le_bytes());
                varint::put_u64(out, r.retry_after_ms);
                let msg = truncate_utf8(&r.message, ERROR_MESSAGE_BYTES_MAX);
                varint::put_bytes(out, msg.as_bytes());
            }
        }
    }

    /// Decodes exactly one frame occupying all of `bytes` (length prefix included).
    pub fn decode(bytes: &[u8], frame_bytes_max: u32) -> Result<Frame, FrameError> {
        let len = frame_len(bytes, frame_bytes_max)?;
        let need = LEN_PREFIX + len;
        if bytes.len() < need {
            return Err(FrameError::Truncated {
                got: bytes.len(),
                need,
            });
        }
        if bytes.len() > need {
            return Err(FrameError::Malformed {
                frame: "frame",
                offset: need,
                what: "bytes after the frame",
            });
        }
        decode_body(bytes[LEN_PREFIX], &bytes[LEN_PREFIX + 1..])
    }
}

/// Reads and checks the length prefix: the number of bytes that follow it (type + payload).
/// Call this on the first 4 bytes before reading or allocating the rest of a frame.
pub fn frame_len(prefix: &[u8], frame_bytes_max: u32) -> Result<usize, FrameError> {
    if prefix.len() < LEN_PREFIX {
        return Err(FrameError::Truncated {
            got: prefix.len(),
            need: LEN_PREFIX,
        });
    }
    let len = u32::from_le_bytes(prefix[..LEN_PREFIX].try_into().expect("4 bytes"));
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > frame_bytes_max {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: frame_bytes_max,
        });
    }
    Ok(len as usize)
}

fn type_name(t: u8) -> &'static str {
    use frame_type::*;
    match t {
        HELLO => "Hello",
        WELCOME => "Welcome",
        BLOCK => "Block",
        GAP => "Gap",
        ACK => "Ack",
        BACKLOG => "Backlog",
        PING => "Ping",
        VERDICT => "Verdict",
        ERROR => "Error",
        STREAM_REFUSED => "StreamRefused",
        _ => "unknown",
    }
}

fn decode_body(t: u8, payload: &[u8]) -> Result<Frame, FrameError> {
    use frame_type::*;
    let name = type_name(t);
    let mut r = Reader::new(payload);
    let bad = |e: ReadError| FrameError::Malformed {
        frame: name,
        offset: e.offset,
        what: e.what,
    };
    let frame = match t {
        HELLO => return decode_hello(&mut r).map_err(bad),
        WELCOME => Frame::Welcome(decode_welcome(&mut r).map_err(bad)?),
        BLOCK => {
            let stream = stream_name(&mut r).map_err(bad)?;
            let block = r.take(r.remaining()).map_err(bad)?.to_vec();
            Frame::Block { stream, block }
        }
        GAP => {
            let (stream, epoch) = lane_key(&mut r).map_err(bad)?;
            Frame::Gap {
                stream,
                epoch,
                gap: get_gap(&mut r).map_err(bad)?,
            }
        }
        ACK => {
            let (stream, epoch) = lane_key(&mut r).map_err(bad)?;
            let durable_seq = r.u64().map_err(bad)?;
            Frame::Ack {
                stream,
                epoch,
                durable_seq,
                tiered_seq: r.u64().map_err(bad)?,
            }
        }
        BACKLOG => Frame::Backlog(decode_backlog(&mut r).map_err(bad)?),
        PING => Frame::Ping,
        VERDICT => {
            let (stream, epoch) = lane_key(&mut r).map_err(bad)?;
            Frame::Verdict {
                stream,
                epoch,
                matched_through: r.u64().map_err(bad)?,
            }
        }
        ERROR => return decode_error(&mut r).map_err(bad),
        STREAM_REFUSED => Frame::StreamRefused(decode_refused(&mut r).map_err(bad)?),
        other => return Err(FrameError::UnknownType(other)),
    };
    if r.remaining() != 0 {
        return Err(FrameError::Malformed {
            frame: name,
            offset: r.offset(),
            what: "trailing bytes",
        });
    }
    Ok(frame)
}

fn encode_hello(h: &Hello, out: &mut Vec<u8>) {
    out.extend_from_slice(&HELLO_MAGIC);
    out.extend_from_slice(&h.version_min.to_le_bytes());
    out.extend_from_slice(&h.version_max.to_le_bytes());
    varint::put_u64(out, h.current_epoch);
    varint::put_u64(out, h.lanes.len() as u64);
    for l in &h.lanes {
        varint::put_bytes(out, l.stream.as_bytes());
        for v in [l.epoch, l.first_seq, l.last_seq, l.acked_seq] {
            varint::put_u64(out, v);
        }
        put_backlog(out, &l.backlog);
        varint::put_u64(out, l.gaps.len() as u64);
        for g in &l.gaps {
            put_gap(out, g);
        }
    }
    if h.capabilities != 0 {
        varint::put_u64(out, h.capabilities);
    }
}

/// Hello versions are read before anything else, so that a Hello from a future version with
/// an unknown body still yields its version range ([`hello_versions`]).
fn decode_hello(r: &mut Reader<'_>) -> Result<Frame, ReadError> {
    let (version_min, version_max) = hello_prefix(r)?;
    let current_epoch = r.u64()?;
    let n = count(r, LANES_MAX)?;
    let mut lanes = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        let (stream, epoch) = lane_key(r)?;
        let first_seq = r.u64()?;
        let last_seq = r.u64()?;
        let acked_seq = r.u64()?;
        let backlog = get_backlog(r)?;
        let ngaps = count(r, GAPS_PER_LANE_MAX)?;
        let mut gaps = Vec::with_capacity(ngaps.min(r.remaining()));
        for _ in 0..ngaps {
            gaps.push(get_gap(r)?);
        }
        lanes.push(LaneAnnounce {
            stream,
            epoch,
            first_seq,
            last_seq,
            acked_seq,
            backlog,
            gaps,
        });
    }
    // The first extension is the capability bits; anything after it (or an extension this
    // build cannot read) comes from a newer version and is ignored by design.
    let capabilities = if r.remaining() > 0 {
        r.u64().unwrap_or(0)
    } else {
        0
    };
    Ok(Frame::Hello(Hello {
        version_min,
        version_max,
        current_epoch,
        lanes,
        capabilities,
    }))
}

fn hello_prefix(r: &mut Reader<'_>) -> Result<(u16, u16), ReadError> {
    let at = r.offset();
    if r.take(4)? != HELLO_MAGIC {
        return Err(ReadError {
            offset: at,
            what: "bad Hello magic",
        });
    }
    let min = u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes"));
    let max = u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes"));
    Ok((min, max))
}

/// Reads only the frozen prefix of a Hello frame (type + payload, without the length prefix
/// or with it: pass the whole frame). Used when the rest does not decode, so that the hub can
/// still answer `UNSUPPORTED_VERSION` to a newer agent.
pub fn hello_versions(frame: &[u8]) -> Option<(u16, u16)> {
    let body = frame.get(LEN_PREFIX..)?;
    if *body.first()? != frame_type::HELLO {
        return None;
    }
    hello_prefix(&mut Reader::new(&body[1..])).ok()
}

fn encode_welcome(w: &Welcome, out: &mut Vec<u8>) {
    out.extend_from_slice(&w.version.to_le_bytes());
    for v in [w.window_bytes, w.window_items, w.epoch_max] {
        varint::put_u64(out, v);
    }
    varint::put_u64(out, w.lanes.len() as u64);
    for (stream, epoch, l) in &w.lanes {
        varint::put_bytes(out, stream.as_bytes());
        for v in [*epoch, l.durable_seq, l.tiered_seq, l.resume_from] {
            varint::put_u64(out, v);
        }
    }
}

fn decode_welcome(r: &mut Reader<'_>) -> Result<Welcome, ReadError> {
    let version = u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes"));
    let window_bytes = r.u64()?;
    let window_items = r.u64()?;
    let epoch_max = r.u64()?;
    let n = count(r, LANES_MAX)?;
    let mut lanes = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        let (stream, epoch) = lane_key(r)?;
        let durable_seq = r.u64()?;
        let tiered_seq = r.u64()?;
        let resume_from = r.u64()?;
        lanes.push((
            stream,
            epoch,
            LaneWelcome {
                durable_seq,
                tiered_seq,
                resume_from,
            },
        ));
    }
    Ok(Welcome {
        version,
        window_bytes,
        window_items,
        epoch_max,
        lanes,
    })
}

fn decode_backlog(r: &mut Reader<'_>) -> Result<Vec<BacklogEntry>, ReadError> {
    let n = count(r, LANES_MAX)?;
    let mut entries = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        let (stream, epoch) = lane_key(r)?;
        entries.push(BacklogEntry {
            stream,
            epoch,
            backlog: get_backlog(r)?,
        });
    }
    Ok(entries)
}

fn decode_error(r: &mut Reader<'_>) -> Result<Frame, ReadError> {
    let code = ErrorCode::from_u16(u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes")));
    let at = r.offset();
    let raw = r.bytes()?;
    if raw.len() > ERROR_MESSAGE_BYTES_MAX {
        return Err(ReadError {
            offset: at,
            what: "error message too long",
        });
    }
    // A peer's message is only for logs: replace invalid UTF-8 rather than refuse the frame.
    let message = String::from_utf8_lossy(raw).into_owned();
    Ok(Frame::Error(ErrorFrame { code, message }))
}

fn decode_refused(r: &mut Reader<'_>) -> Result<StreamRefused, ReadError> {
    let (stream, epoch) = lane_key(r)?;
    let code = ErrorCode::from_u16(u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes")));
    let retry_after_ms = r.u64()?;
    let at = r.offset();
    let raw = r.bytes()?;
    if raw.len() > ERROR_MESSAGE_BYTES_MAX {
        return Err(ReadError {
            offset: at,
            what: "refusal message too long",
        });
    }
    Ok(StreamRefused {
        stream,
        epoch,
        code,
        retry_after_ms,
        message: String::from_utf8_lossy(raw).into_owned(),
    })
}

fn put_gap(out: &mut Vec<u8>, g: &GapMarker) {
    varint::put_u64(out, g.first_seq);
    varint::put_u64(out, g.last_seq);
    out.push(g.reason.to_u8());
    varint::put_u64(out, g.count);
}

fn get_gap(r: &mut Reader<'_>) -> Result<GapMarker, ReadError> {
    let at = r.offset();
    let first_seq = r.u64()?;
    let last_seq = r.u64()?;
    let reason = GapReason::from_u8(r.byte()?);
    let count = r.u64()?;
    if first_seq == 0 || first_seq > last_seq || count > last_seq - first_seq + 1 {
        return Err(ReadError {
            offset: at,
            what: "gap marker range is invalid",
        });
    }
    Ok(GapMarker {
        first_seq,
        last_seq,
        reason,
        count,
    })
}

fn put_backlog(out: &mut Vec<u8>, b: &Backlog) {
    varint::put_u64(out, b.blocks);
    varint::put_u64(out, b.bytes);
    match b.oldest_unsent_ts {
        None => out.push(0),
        Some(ts) => {
            out.push(1);
            varint::put_i64(out, ts);
        }
    }
}

fn get_backlog(r: &mut Reader<'_>) -> Result<Backlog, ReadError> {
    let blocks = r.u64()?;
    let bytes = r.u64()?;
    let at = r.offset();
    let oldest_unsent_ts = match r.byte()? {
        0 => None,
        1 => Some(r.i64()?),
        _ => {
            return Err(ReadError {
                offset: at,
                what: "bad option tag",
            });
        }
    };
    Ok(Backlog {
        blocks,
        bytes,
        oldest_unsent_ts,
    })
}

fn lane_key(r: &mut Reader<'_>) -> Result<(String, u64), ReadError> {
    let stream = stream_name(r)?;
    Ok((stream, r.u64()?))
}

fn count(r: &mut Reader<'_>, max: usize) -> Result<usize, ReadError> {
    let at = r.offset();
    let n = r.u64()?;
    if n > max as u64 {
        return Err(ReadError {
            offset: at,
            what: "count exceeds limit",
        });
    }
    Ok(n as usize)
}

fn stream_name(r: &mut Reader<'_>) -> Result<String, ReadError> {
    let at = r.offset();
    let s = r.string()?;
    if !valid_stream_name(&s) {
        return Err(ReadError {
            offset: at,
            what: "invalid stream name",
        });
    }
    Ok(s)
}

/// Stream names are 1 to 128 bytes of `[A-Za-z0-9_.-]`, not starting with `.`, so they are
/// safe as path components on every side.
pub fn valid_stream_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= STREAM_NAME_BYTES_MAX
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// Splits a byte stream into frames. The length is checked against the maximum before the
/// frame's bytes are buffered, so an oversized announcement costs nothing.
#[derive(Debug)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    frame_bytes_max: u32,
}

impl FrameBuffer {
    pub fn new(frame_bytes_max: u32) -> Self {
        FrameBuffer {
            buf: Vec::new(),
            frame_bytes_max,
        }
    }

    /// Appends bytes read from the transport.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Takes the next complete frame (length prefix included), `Ok(None)` if more bytes are
    /// needed, or an error if the announced length is invalid (the connection must close).
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < LEN_PREFIX {
            return Ok(None);
        }
        let len = frame_len(&self.buf, self.frame_bytes_max)?;
        if self.buf.len() < LEN_PREFIX + len {
            return Ok(None);
        }
        let rest = self.buf.split_off(LEN_PREFIX + len);
        Ok(Some(std::mem::replace(&mut self.buf, rest)))
    }

    /// Bytes buffered but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_round_trips_and_numbers_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for n in 1..=18u16 {
            let c = ErrorCode::from_u16(n);
            assert!(!matches!(c, ErrorCode::Unknown(_)), "{n}");
            assert_eq!(c.to_u16(), n);
            assert!(seen.insert(c));
        }
        assert_eq!(ErrorCode::from_u16(999), ErrorCode::Unknown(999));
    }

    #[test]
    fn stream_refused_round_trips_and_rejects_bad_input() {
        let r = StreamRefused {
            stream: "status".into(),
            epoch: 3,
            code: ErrorCode::QuotaExceeded,
            retry_after_ms: 30_000,
            message: "stream `status` refused: it would exceed ingest.streams_per_device_max = 1"
                .into(),
        };
        let f = Frame::StreamRefused(r.clone());
        let bytes = f.encode();
        assert_eq!(bytes[LEN_PREFIX], frame_type::STREAM_REFUSED);
        assert_eq!(Frame::decode(&bytes, 1 << 20), Ok(f.clone()));
        assert_eq!(f.name(), "StreamRefused");
        // Every truncation is an error, never a panic.
        for cut in LEN_PREFIX + 1..bytes.len() {
            let mut t = bytes[..cut].to_vec();
            let len = (cut - LEN_PREFIX) as u32;
            t[..LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
            assert!(Frame::decode(&t, 1 << 20).is_err(), "cut at {cut}");
        }
        // An invalid stream name is refused.
        let bad = Frame::StreamRefused(StreamRefused {
            stream: "a/b".into(),
            ..r.clone()
        });
        assert!(matches!(
            Frame::decode(&bad.encode(), 1 << 20),
            Err(FrameError::Malformed { .. })
        ));
        // A long message is cut to the limit on encode.
        let long = Frame::StreamRefused(StreamRefused {
            message: "x".repeat(5000),
            ..r
        });
        match Frame::decode(&long.encode(), 1 << 20) {
            Ok(Frame::StreamRefused(d)) => assert_eq!(d.message.len(), ERROR_MESSAGE_BYTES_MAX),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hello_capabilities_are_an_optional_extension() {
        let hello = |capabilities| Hello {
            version_min: 1,
            version_max: 1,
            current_epoch: 2,
            lanes: Vec::new(),
            capabilities,
        };
        // Without capabilities the Hello is byte for byte the version-1 body.
        let plain = Frame::Hello(hello(0)).encode();
        let with = Frame::Hello(hello(capability::STREAM_REFUSED)).encode();
        assert_eq!(with.len(), plain.len() + 1);
        assert_eq!(with[LEN_PREFIX..plain.len()], plain[LEN_PREFIX..]);
        assert_eq!(
            Frame::decode(&with, 1 << 20),
            Ok(Frame::Hello(hello(capability::STREAM_REFUSED)))
        );
        assert_eq!(Frame::decode(&plain, 1 << 20), Ok(Frame::Hello(hello(0))));
        // Later extensions, or an unreadable one, are ignored.
        let mut more = with.clone();
        more.extend_from_slice(&[0xff, 0xff]);
        let len = (more.len() - LEN_PREFIX) as u32;
        more[..LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(Frame::decode(&more, 1 << 20), Ok(Frame::Hello(_))));
    }

    #[test]
    fn gap_clipping() {
        let g = GapMarker {
            first_seq: 10,
            last_seq: 19,
            reason: GapReason::DiskFull,
            count: 10,
        };
        assert_eq!(g.clip_from(5), Some(g));
        let c = g.clip_from(15).unwrap();
        assert_eq!((c.first_seq, c.last_seq, c.count), (15, 19, 5));
        assert_eq!(g.clip_from(20), None);
    }

    #[test]
    fn stream_names() {
        assert!(valid_stream_name("telemetry.v2_a-b"));
        for bad in ["", ".hidden", "a/b", "..", "a b", "ä"] {
            assert!(!valid_stream_name(bad), "{bad}");
        }
    }
}
