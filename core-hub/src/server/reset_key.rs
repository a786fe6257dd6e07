//! The QUIC stateless-reset key, kept across restarts in `data_dir/quic-reset.key`.
//!
//! Every connection the hub accepts carries a stateless-reset token derived from this key and
//! the connection's id (RFC 9000, section 10.3). When the hub dies without closing its
//! connections (`kill -9`, a crash, power loss) and comes back, the agents' next packets
//! (a keepalive every 5 s, or data) reach a hub that no longer knows those connections. With
//! the same key it answers each with a stateless reset the agent recognises, so the agent
//! drops the dead connection and reconnects at once. With a fresh random key per process,
//! quinn's default, the reset is not recognised and the agent waits out its 30 s idle timeout
//! first.
//!
//! The file holds [`KEY_BYTES`] random bytes, written once (temporary file, fsync, rename,
//! directory fsync) through the hub's [`Storage`], so a power cut leaves the old key, the new
//! one, or none, never half of one. A file of the wrong size is replaced with a warning: the
//! key protects nothing stored, and losing it costs only one idle timeout per connection.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::storage::Storage;

/// Key length: the SHA-256 HMAC block size, as quinn's own default key.
pub const KEY_BYTES: usize = 64;
/// The key's file name in the data directory.
pub const FILE_NAME: &str = "quic-reset.key";

/// Why the key could not be loaded or created.
#[derive(Debug, thiserror::Error)]
#[error("QUIC stateless-reset key {}: {source}", path.display())]
pub struct ResetKeyError {
    path: PathBuf,
    source: io::Error,
}

/// The key as quinn takes it.
pub fn hmac_key(bytes: &[u8; KEY_BYTES]) -> Arc<dyn quinn::crypto::HmacKey> {
    Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes))
}

/// The key of quinn's connection-id generator, derived from the reset key. quinn drops a
/// packet whose connection id its generator does not recognise before it considers a reset,
/// so the generator must recognise the ids of the hub's earlier incarnations too.
pub fn cid_generator_key(bytes: &[u8; KEY_BYTES]) -> u64 {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes);
    let tag = ring::hmac::sign(&key, b"tributary connection-id generator");
    let mut first = [0u8; 8];
    first.copy_from_slice(&tag.as_ref()[..8]);
    u64::from_le_bytes(first)
}

/// The endpoint configuration with the kept key: stateless resets and connection ids that a
/// restarted hub still recognises.
pub fn endpoint_config(bytes: &[u8; KEY_BYTES]) -> quinn::EndpointConfig {
    let mut cfg = quinn::EndpointConfig::new(hmac_key(bytes));
    let cid_key = cid_generator_key(bytes);
    cfg.cid_generator(move || {
        Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
    });
    cfg
}

/// Reads the key from `data_dir`, or creates and durably stores a new one.
pub fn load_or_create(
    storage: &dyn Storage,
    data_dir: &Path,
) -> Result<[u8; KEY_BYTES], ResetKeyError> {
    let path = data_dir.join(FILE_NAME);
    let err = |source| ResetKeyError {
        path: path.clone(),
        source,
    };
    match storage.read(&path) {
        Ok(bytes) => match <[u8; KEY_BYTES]>::try_from(bytes.as_slice()) {
            Ok(key) => return Ok(key),
            Err(_) => tracing::warn!(
                path = %path.display(),
                len = bytes.len(),
                expected = KEY_BYTES,
                "the QUIC stateless-reset key has the wrong size; writing a new one \
                 (connections from before this start wait out their idle timeout once)"
            ),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let mut key = [0u8; KEY_BYTES];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
        .map_err(|_| err(io::Error::other("the system random source failed")))?;
    let tmp = data_dir.join(format!("{FILE_NAME}.tmp"));
    let file = storage.create(&tmp).map_err(err)?;
    file.append(&key).map_err(err)?;
    file.sync().map_err(err)?;
    storage.rename(&tmp, &path).map_err(err)?;
    storage.sync_dir(data_dir).map_err(err)?;
    tracing::info!(path = %path.display(), "created the QUIC stateless-reset key");
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{CrashMode, MemStorage};

    #[test]
    fn the_key_survives_a_restart_and_a_power_cut_after_creation() {
        for mode in CrashMode::ALL {
            let storage = MemStorage::with_seed(7);
            let dir = Path::new("/data");
            storage.create_dir(dir).unwrap();
            let first = load_or_create(&storage, dir).unwrap();
            storage.crash(mode);
            let second = load_or_create(&storage, dir).unwrap();
            assert_eq!(
                first, second,
                "a restart after a {mode:?} power cut must keep the key"
            );
            assert_ne!(first, [0u8; KEY_BYTES]);
        }
    }

    #[test]
    fn a_power_cut_during_creation_leaves_a_whole_key_or_none() {
        // Every operation of the creation in turn is the moment the power goes, until a
        // crash point lies past the creation's last operation.
        let mut landed = 0;
        for crash_at in 1..=16 {
            let mut reached = false;
            for mode in CrashMode::ALL {
                let storage = MemStorage::with_seed(crash_at);
                let dir = Path::new("/data");
                storage.create_dir(dir).unwrap();
                storage.set_crash_at(storage.ops() + crash_at);
                let _ = load_or_create(&storage, dir);
                reached |= storage.crash(mode).is_some();
                let path = dir.join(FILE_NAME);
                if let Ok(bytes) = storage.read(&path) {
                    assert_eq!(
                        bytes.len(),
                        KEY_BYTES,
                        "a torn key survived ({mode:?}, op {crash_at})"
                    );
                }
                let key = load_or_create(&storage, dir).unwrap();
                assert_eq!(storage.read(&path).unwrap(), key.to_vec());
            }
            if !reached {
                break;
            }
            landed += 1;
        }
        // read, create, append, sync, rename, sync_dir.
        assert!(
            landed >= 5,
            "only {landed} crash points landed in the creation"
        );
    }

    #[test]
    fn a_second_start_reads_the_same_key() {
        let storage = MemStorage::with_seed(1);
        let dir = Path::new("/data");
        storage.create_dir(dir).unwrap();
        let first = load_or_create(&storage, dir).unwrap();
        let second = load_or_create(&storage, dir).unwrap();
        assert_eq!(first, second, "a second start must read the same key");
    }

    #[test]
    fn a_key_of_the_wrong_size_is_replaced() {
        let storage = MemStorage::with_seed(3);
        let dir = Path::new("/data");
        storage.create_dir(dir).unwrap();
        let f = storage.create(&dir.join(FILE_NAME)).unwrap();
        f.append(b"short").unwrap();
        f.sync().unwrap();
        let key = load_or_create(&storage, dir).unwrap();
        assert_eq!(storage.read(&dir.join(FILE_NAME)).unwrap(), key.to_vec());
    }
}
