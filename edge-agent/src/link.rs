//! The agent's side of the QUIC link: mutual-TLS client configuration and the endpoint.
//!
//! Certificate validity is checked against `max(now, build time)`: a board with no RTC boots at
//! 1970 and must still reach its hub, and a clock can never be older than the binary it runs.
//! The client certificate and key are re-read on every connection attempt, so a rotated
//! certificate staged while offline takes effect on the next connect.

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use thiserror::Error;

/// ALPN id of protocol version 1 of the sync protocol.
pub const ALPN: &[u8] = b"tributary/1";

/// Seconds since the Unix epoch when this binary was built.
pub const BUILD_UNIX: &str = env!("TRIBUTARY_BUILD_UNIX");

/// Where the device's TLS material lives.
#[derive(Debug, Clone)]
pub struct TlsPaths {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Why the link could not be configured.
#[derive(Debug, Error)]
pub enum LinkError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("CA certificate rejected: {0}")]
    Verifier(String),
    #[error("QUIC configuration: {0}")]
    Quic(String),
    #[error("UDP socket: {0}")]
    Socket(#[from] std::io::Error),
}

/// The build time as a rustls timestamp.
pub fn build_time() -> UnixTime {
    UnixTime::since_unix_epoch(Duration::from_secs(BUILD_UNIX.parse().unwrap_or(0)))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, LinkError> {
    let bytes = std::fs::read(path).map_err(|source| LinkError::Read {
        path: path.into(),
        source,
    })?;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&bytes).collect();
    let certs = certs.map_err(|e| LinkError::Pem {
        path: path.into(),
        what: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(LinkError::Pem {
            path: path.into(),
            what: "no CERTIFICATE block found".into(),
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, LinkError> {
    let bytes = std::fs::read(path).map_err(|source| LinkError::Read {
        path: path.into(),
        source,
    })?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| LinkError::Pem {
        path: path.into(),
        what: e.to_string(),
    })
}

/// Verifies the hub's certificate with webpki, at `max(now, build time)`.
#[derive(Debug)]
struct ClockTolerantVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    floor: UnixTime,
}

impl ServerCertVerifier for ClockTolerantVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let now = now.max(self.floor);
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Builds the rustls client configuration: our CA only, our device certificate, TLS 1.3, no 0-RTT.
pub fn rustls_client_config(
    paths: &TlsPaths,
    floor: UnixTime,
) -> Result<rustls::ClientConfig, LinkError> {
    let mut roots = RootCertStore::empty();
    for ca in read_certs(&paths.ca)? {
        roots
            .add(ca)
            .map_err(|e| LinkError::Verifier(format!("{}: {e}", paths.ca.display())))?;
    }
    let inner = rustls::client::WebPkiServerVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| LinkError::Verifier(e.to_string()))?;
    let verifier = Arc::new(ClockTolerantVerifier { inner, floor });
    let chain = read_certs(&paths.cert)?;
    let key = read_key(&paths.key)?;
    let mut cfg = rustls::ClientConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain, key)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.enable_early_data = false;
    Ok(cfg)
}

/// Flow-control and liveness settings for the link, documented in docs/protocol/sync.md.
///
/// The connection window bounds how many unacknowledged bytes may be in flight on a link; 32 MiB
/// covers a 1 Gbit/s link with 250 ms of round trip. Keepalives every 5 s keep NAT bindings open
/// on cellular links; 30 s of silence ends the connection so a dead path is noticed.
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
    t.receive_window(quinn::VarInt::from_u32(32 << 20));
    t.send_window(32 << 20);
    t.keep_alive_interval(Some(Duration::from_secs(5)));
    t.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        30_000,
    ))));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(256));
    // BBR, not the default loss-based Cubic: on lossy cellular and satellite links random loss
    // is not congestion, and Cubic halving its window on every loss at 100 ms of round trip
    // drains a backlog ~30x slower than the clean link (issue 4, "Network faults").
    t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
    t
}

/// The full quinn client configuration.
pub fn client_config(paths: &TlsPaths) -> Result<quinn::ClientConfig, LinkError> {
    let tls = rustls_client_config(paths, build_time())?;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| LinkError::Quic(e.to_string()))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    cfg.transport_config(Arc::new(transport_config()));
    Ok(cfg)
}

/// Socket buffer size requested for the UDP socket. The kernel may clamp it to
/// `net.core.rmem_max` / `wmem_max`; quinn works either way, only more slowly.
pub const UDP_BUFFER_BYTES: usize = 8 << 20;

/// Opens a UDP socket with raised buffers and wraps it in a quinn client endpoint.
pub fn client_endpoint(bind: SocketAddr) -> Result<quinn::Endpoint, LinkError> {
    let socket = udp_socket(bind)?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| LinkError::Quic("no async runtime".into()))?;
    let endpoint = quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime)?;
    Ok(endpoint)
}

/// A UDP socket with send and receive buffers raised to [`UDP_BUFFER_BYTES`].
pub fn udp_socket(bind: SocketAddr) -> Result<UdpSocket, LinkError> {
    let domain = socket2::Domain::for_address(bind);
    let sock = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    // Best effort: an unprivileged process may be clamped, which is not an error.
    let _ = sock.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(UDP_BUFFER_BYTES);
    sock.bind(&bind.into())?;
    Ok(sock.into())
}
