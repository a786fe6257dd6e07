//! An adversarial device: a real QUIC client holding a valid device certificate that speaks the
//! replication protocol (`sync::protocol` frames, `sync::block` headers, version 2 columnar
//! bodies) and then misbehaves on purpose.
//!
//! - [`Adversary`]: one client endpoint with one device's certificate; it opens raw
//!   connections ([`Adversary::connect`]) and protocol sessions ([`Adversary::session`]).
//! - [`Session`]: a connection with its control stream; frames are sent on the control stream
//!   or each on its own data stream, as the agent sends blocks, and [`Session::ending`] waits
//!   for the hub to end the connection and reports the code it gave ([`Ending`]).
//! - [`bombs`]: hand-made blocks: decode bombs of every shape (one long dictionary key, many
//!   field names, long strings, headers that understate the body), valid blocks with many
//!   columns, and plain honest blocks.
//! - [`RssSampler`]: the hub's VmRSS sampled in a background thread while an attack runs, and
//!   its VmHWM.
//!
//! The client reuses the agent's own TLS setup (`edge_agent::link`), so the hub sees exactly
//! what a real device presents during the handshake.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use sync::protocol::frame::{Hello, Welcome};
use sync::protocol::{Backlog, ErrorCode, Frame, FrameBuffer, LaneAnnounce, PROTOCOL_VERSION};

use crate::cluster::DeviceCert;

/// Frames larger than this from the hub are a hub bug; the client refuses them.
const ANSWER_FRAME_MAX: u32 = 64 << 20;

/// A device client with one certificate. Every connection it opens shares one UDP endpoint.
pub struct Adversary {
    endpoint: quinn::Endpoint,
    hub: SocketAddr,
    pub cert: DeviceCert,
}

impl Adversary {
    /// A client endpoint on a free loopback port, presenting `cert` to the hub at `hub`.
    /// Must be called inside a tokio runtime.
    pub fn new(hub: SocketAddr, cert: &DeviceCert) -> Result<Adversary> {
        let tls = edge_agent::link::TlsPaths {
            ca: cert.dir.join("ca.pem"),
            cert: cert.dir.join("device.pem"),
            key: cert.dir.join("device.key"),
        };
        let mut endpoint = edge_agent::link::client_endpoint("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(edge_agent::link::client_config(&tls)?);
        Ok(Adversary {
            endpoint,
            hub,
            cert: cert.clone(),
        })
    }

    /// A QUIC connection after the mutual-TLS handshake, with no stream opened.
    pub async fn connect(&self) -> Result<quinn::Connection> {
        let connecting = self.endpoint.connect(self.hub, "localhost")?;
        tokio::time::timeout(Duration::from_secs(20), connecting)
            .await
            .context("QUIC handshake timed out")?
            .context("QUIC handshake")
    }

    /// A connection whose control stream carries `hello` (not yet answered).
    pub async fn session(&self, hello: &Hello) -> Result<Session> {
        let conn = self.connect().await?;
        let (mut control, answers) = conn.open_bi().await?;
        control
            .write_all(&Frame::Hello(hello.clone()).encode())
            .await?;
        Ok(Session {
            conn,
            control,
            answers,
            frames: FrameBuffer::new(ANSWER_FRAME_MAX),
            error: None,
        })
    }

    /// A session announcing `lanes`, answered with a Welcome.
    pub async fn welcomed(&self, epoch: u64, lanes: Vec<LaneAnnounce>) -> Result<Session> {
        let mut session = self.session(&hello(epoch, lanes)).await?;
        session.welcome(Duration::from_secs(30)).await?;
        Ok(session)
    }
}

/// A Hello for version 1 with `lanes`.
pub fn hello(current_epoch: u64, lanes: Vec<LaneAnnounce>) -> Hello {
    Hello {
        version_min: PROTOCOL_VERSION,
        version_max: PROTOCOL_VERSION,
        current_epoch,
        lanes,
        capabilities: 0,
    }
}

/// A lane announcing seqs `first_seq..=last_seq` held, none acknowledged.
pub fn lane(stream: &str, epoch: u64, first_seq: u64, last_seq: u64) -> LaneAnnounce {
    LaneAnnounce {
        stream: stream.into(),
        epoch,
        first_seq,
        last_seq,
        acked_seq: 0,
        backlog: Backlog {
            blocks: 1,
            bytes: 1,
            oldest_unsent_ts: Some(1),
        },
        gaps: Vec::new(),
    }
}

/// A Block frame for `stream`.
pub fn block_frame(stream: &str, block: Vec<u8>) -> Vec<u8> {
    Frame::Block {
        stream: stream.into(),
        block,
    }
    .encode()
}

/// How the hub ended a connection: the Error frame it sent, if one arrived first, and the
/// QUIC close.
#[derive(Debug, Clone)]
pub struct Ending {
    /// Code and message of the hub's Error frame on the control stream.
    pub error_frame: Option<(u16, String)>,
    /// The application close code the hub closed the connection with.
    pub close_code: Option<u16>,
    /// The connection error as quinn reports it.
    pub reason: String,
}

impl Ending {
    /// The protocol code the hub gave: the Error frame's, else the close code.
    pub fn code(&self) -> Option<u16> {
        self.error_frame.as_ref().map(|e| e.0).or(self.close_code)
    }

    /// Whether the hub gave `code`, in the Error frame or the close.
    pub fn is(&self, code: ErrorCode) -> bool {
        let want = code.to_u16();
        self.error_frame.as_ref().is_some_and(|e| e.0 == want) || self.close_code == Some(want)
    }
}

/// The application close code of a connection error, if the peer closed it with one.
pub fn close_code(error: &quinn::ConnectionError) -> Option<u16> {
    match error {
        quinn::ConnectionError::ApplicationClosed(c) => {
            u16::try_from(c.error_code.into_inner()).ok()
        }
        _ => None,
    }
}

/// A connection with its control stream open.
pub struct Session {
    pub conn: quinn::Connection,
    control: quinn::SendStream,
    answers: quinn::RecvStream,
    frames: FrameBuffer,
    error: Option<(u16, String)>,
}

impl Session {
    /// Waits for the Welcome; an Error frame or a close instead is an error naming its code.
    pub async fn welcome(&mut self, within: Duration) -> Result<Welcome> {
        loop {
            match tokio::time::timeout(within, self.next_frame()).await {
                Err(_) => bail!("no Welcome within {within:?}"),
                Ok(Err(e)) => bail!("no Welcome: {e:#}"),
                Ok(Ok(Frame::Welcome(w))) => return Ok(w),
                Ok(Ok(Frame::Error(e))) => {
                    bail!(
                        "refused with {:?} ({}): {}",
                        e.code,
                        e.code.to_u16(),
                        e.message
                    )
                }
                Ok(Ok(_)) => {}
            }
        }
    }

    /// The next frame from the hub on the control stream. An Error frame is also remembered
    /// for [`Session::ending`].
    pub async fn next_frame(&mut self) -> Result<Frame> {
        loop {
            if let Some(bytes) = self.frames.next_frame()? {
                let frame = Frame::decode(&bytes, ANSWER_FRAME_MAX)?;
                if let Frame::Error(e) = &frame {
                    self.error = Some((e.code.to_u16(), e.message.clone()));
                }
                return Ok(frame);
            }
            let chunk = self
                .answers
                .read_chunk(64 << 10, true)
                .await?
                .context("the hub finished the control stream")?;
            self.frames.push(&chunk.bytes);
        }
    }

    /// Writes an encoded frame (or any bytes) on the control stream.
    pub async fn send_control(&mut self, bytes: &[u8]) -> Result<()> {
        self.control.write_all(bytes).await?;
        Ok(())
    }

    /// Sends one frame on its own unidirectional stream, as the agent sends blocks.
    pub async fn send_data(&self, frame: &[u8]) -> Result<()> {
        let mut stream = self.conn.open_uni().await?;
        stream.write_all(frame).await?;
        stream.finish()?;
        Ok(())
    }

    /// Opens a data stream, writes `bytes` and leaves it open (never finished).
    pub async fn open_unfinished(&self, bytes: &[u8]) -> Result<quinn::SendStream> {
        let mut stream = self.conn.open_uni().await?;
        stream.write_all(bytes).await?;
        Ok(stream)
    }

    /// Reads answers until the hub ends the connection, for at most `within`; returns how it
    /// ended. A connection still open at the deadline is an error.
    pub async fn ending(&mut self, within: Duration) -> Result<Ending> {
        let drain = async { while self.next_frame().await.is_ok() {} };
        let _ = tokio::time::timeout(within, drain).await;
        let error = tokio::time::timeout(Duration::from_secs(5), self.conn.closed())
            .await
            .with_context(|| format!("the hub did not end the connection within {within:?}"))?;
        Ok(Ending {
            error_frame: self.error.clone(),
            close_code: close_code(&error),
            reason: error.to_string(),
        })
    }
}

/// How a bare connection (no session) ended, waiting at most `within`.
pub async fn connection_ending(conn: &quinn::Connection, within: Duration) -> Result<Ending> {
    let error = tokio::time::timeout(within, conn.closed())
        .await
        .with_context(|| format!("the hub did not end the connection within {within:?}"))?;
    Ok(Ending {
        error_frame: None,
        close_code: close_code(&error),
        reason: error.to_string(),
    })
}

/// Hand-made blocks. Bodies are written byte by byte after `docs/format/columnar.md`, so a
/// bomb can say what no honest encoder would.
pub mod bombs {
    use sync::block::{self, BlockHeader};
    use sync::varint;
    use sync::{Record, Value};

    /// Seals `raw` as a block body of `version` with an honest header.
    pub fn seal(version: u8, epoch: u64, first_seq: u64, count: u32, raw: &[u8]) -> Vec<u8> {
        let body = zstd::bulk::compress(raw, 3).expect("zstd compresses in memory");
        let header = BlockHeader {
            version,
            flags: 0,
            epoch,
            first_seq,
            count,
            raw_len: u32::try_from(raw.len()).expect("raw body under 4 GiB"),
            min_ts: 0,
            max_ts: 0,
            body_len: u32::try_from(body.len()).expect("body under 4 GiB"),
            body_crc: crc32c::crc32c(&body),
            raw_crc: crc32c::crc32c(raw),
        };
        let mut out = block::write_header(&header).to_vec();
        out.extend_from_slice(&body);
        out
    }

    /// A plain int column of `n` zeros (transform 0, one zero byte per value).
    fn zeros_col(raw: &mut Vec<u8>, n: usize) {
        raw.push(0);
        varint::put_bytes(raw, &vec![0u8; n]);
    }

    /// A columnar body with the given dictionary of keys and columns (`(name, type)`), one
    /// shape listing every column, every record of key 0, shape 0 and ts 0; `field_cols`
    /// appends the field columns.
    fn body(
        keys: &[Vec<u8>],
        columns: &[(Vec<u8>, u8)],
        records: usize,
        field_cols: impl FnOnce(&mut Vec<u8>),
    ) -> Vec<u8> {
        let mut raw = vec![0u8];
        varint::put_u64(&mut raw, keys.len() as u64);
        for k in keys {
            varint::put_bytes(&mut raw, k);
        }
        varint::put_u64(&mut raw, columns.len() as u64);
        for (name, kind) in columns {
            varint::put_bytes(&mut raw, name);
            raw.push(*kind);
        }
        raw.push(1); // one shape: every column
        varint::put_u64(&mut raw, columns.len() as u64);
        for c in 0..columns.len() {
            varint::put_u64(&mut raw, c as u64);
        }
        for _ in 0..3 {
            zeros_col(&mut raw, records); // key ids, shape ids, timestamps
        }
        field_cols(&mut raw);
        raw
    }

    /// One dictionary key of `key_len` bytes that every one of `records` records copies, and
    /// no field: a few hundred bytes sealed, `records * (64 + key_len)` decoded.
    pub fn long_key(epoch: u64, key_len: usize, records: u32) -> Vec<u8> {
        let raw = body(&[vec![b'k'; key_len]], &[], records as usize, |_| {});
        seal(block::VERSION_COLUMNAR, epoch, 1, records, &raw)
    }

    /// `fields` distinct boolean columns with names of `name_len` bytes, all in every record:
    /// each record decodes to `fields * (64 + name_len)` bytes.
    pub fn many_field_names(epoch: u64, fields: usize, name_len: usize, records: u32) -> Vec<u8> {
        let columns: Vec<(Vec<u8>, u8)> =
            (0..fields).map(|i| (field_name(i, name_len), 2)).collect();
        let n = records as usize;
        let raw = body(&[b"k".to_vec()], &columns, n, |raw| {
            for _ in 0..fields {
                varint::put_bytes(raw, &vec![0u8; n.div_ceil(8)]);
            }
        });
        seal(block::VERSION_COLUMNAR, epoch, 1, records, &raw)
    }

    /// One string column whose dictionary holds one string of `len` bytes, used by every one
    /// of `records` records.
    pub fn long_string(epoch: u64, len: usize, records: u32) -> Vec<u8> {
        let n = records as usize;
        let raw = body(&[b"k".to_vec()], &[(b"s".to_vec(), 3)], n, |raw| {
            raw.push(1);
            varint::put_bytes(raw, &vec![b's'; len]);
            zeros_col(raw, n);
        });
        seal(block::VERSION_COLUMNAR, epoch, 1, records, &raw)
    }

    /// A version 1 block whose header says its body inflates to 4 KiB while the zstd frame
    /// inflates to `inflated` bytes of zeros.
    pub fn understated_raw_len(epoch: u64, inflated: u64) -> Vec<u8> {
        let mut body = Vec::new();
        let mut zeros = std::io::Read::take(std::io::repeat(0), inflated);
        zstd::stream::copy_encode(&mut zeros, &mut body, 19).expect("zstd compresses in memory");
        let header = BlockHeader {
            version: block::VERSION_ROWS,
            flags: 0,
            epoch,
            first_seq: 1,
            count: 1,
            raw_len: 4096,
            min_ts: 1,
            max_ts: 1,
            body_len: u32::try_from(body.len()).expect("small body"),
            body_crc: crc32c::crc32c(&body),
            raw_crc: 0,
        };
        let mut out = block::write_header(&header).to_vec();
        out.extend_from_slice(&body);
        out
    }

    /// An honest block whose header's `body_len` is half the body that follows it (header
    /// CRC recomputed, so only the size lies).
    pub fn understated_body_len(epoch: u64, records: &[Record]) -> Vec<u8> {
        let mut sealed = honest(epoch, 1, records);
        let mut header = block::decode_header(&sealed).expect("an honest header");
        header.body_len /= 2;
        sealed[..block::HEADER_LEN].copy_from_slice(&block::write_header(&header));
        sealed
    }

    /// An ordinary version 2 block of `records` from `first_seq`.
    pub fn honest(epoch: u64, first_seq: u64, records: &[Record]) -> Vec<u8> {
        block::encode_block(block::VERSION_COLUMNAR, epoch, first_seq, records)
            .expect("valid records encode")
    }

    /// `n` small records with keys `k0..`, each with one integer field `v`.
    pub fn records(n: usize, tag: &str) -> Vec<Record> {
        (0..n)
            .map(|i| Record {
                tags: Vec::new(),
                key: format!("{tag}/k{}", i % 4),
                ts: 1_700_000_000_000_000_000 + i as i64,
                fields: vec![("v".into(), Value::I64(i as i64))],
            })
            .collect()
    }

    /// One record with `fields` distinct field names (`{prefix}{i}`), all i64.
    pub fn wide_record(prefix: &str, fields: usize) -> Record {
        Record {
            tags: Vec::new(),
            key: "wide".into(),
            ts: 1_700_000_000_000_000_000,
            fields: (0..fields)
                .map(|i| (format!("{prefix}{i}"), Value::I64(i as i64)))
                .collect(),
        }
    }

    /// A field name of exactly `len` bytes, distinct for each `i`.
    fn field_name(i: usize, len: usize) -> Vec<u8> {
        let mut name = format!("f{i}_").into_bytes();
        name.resize(len.max(name.len()), b'x');
        name
    }
}

/// The hub's VmRSS sampled every few milliseconds in a background thread, so a spike between
/// two assertions is not missed; [`vm_hwm`] gives the kernel's own peak.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    /// Starts sampling process `pid`.
    pub fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let (s, p, n) = (stop.clone(), peak.clone(), samples.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Ok(rss) = status_bytes(pid, "VmRSS:") {
                    p.fetch_max(rss, Ordering::Relaxed);
                    n.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        RssSampler {
            stop,
            peak,
            samples,
            thread: Some(thread),
        }
    }

    /// Stops sampling; returns the highest VmRSS seen and how many samples were taken.
    pub fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (
            self.peak.load(Ordering::Relaxed),
            self.samples.load(Ordering::Relaxed),
        )
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// VmRSS of `pid` in bytes.
pub fn vm_rss(pid: u32) -> Result<u64> {
    status_bytes(pid, "VmRSS:")
}

/// VmHWM (the peak resident set since the process started) of `pid` in bytes.
pub fn vm_hwm(pid: u32) -> Result<u64> {
    status_bytes(pid, "VmHWM:")
}

fn status_bytes(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .with_context(|| format!("{field} without a value"))?
        .parse()?;
    Ok(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::bombs;
    use sync::block::{self, DecodeLimits};

    /// Each bomb is what it claims: it verifies, and its decoded size (computed by the same
    /// code the hub runs) is far above any budget, while its sealed size is small.
    #[test]
    fn bombs_are_small_on_the_wire_and_huge_decoded() {
        let limits = DecodeLimits {
            decoded_bytes_max: u64::MAX,
            ..DecodeLimits::default()
        };
        for (name, bomb) in [
            ("long key", bombs::long_key(1, 4096, 200_000)),
            (
                "field names",
                bombs::many_field_names(1, 20_000, 100, 1_000),
            ),
            ("long string", bombs::long_string(1, 1 << 20, 100_000)),
        ] {
            let sized = block::size_block(&bomb, &limits).expect(name);
            assert!(bomb.len() < 1 << 20, "{name}: {} bytes sealed", bomb.len());
            assert!(
                sized.decoded_bytes() > 500 << 20,
                "{name}: {}",
                sized.decoded_bytes()
            );
        }
        let honest = bombs::honest(1, 1, &bombs::records(10, "t"));
        assert!(block::size_block(&honest, &DecodeLimits::default()).is_ok());
        let lie = bombs::understated_body_len(1, &bombs::records(10, "t"));
        assert!(block::size_block(&lie, &DecodeLimits::default()).is_err());
        let inflating = bombs::understated_raw_len(1, 64 << 20);
        assert!(block::size_block(&inflating, &DecodeLimits::default()).is_err());
    }
}
