//! The hub's diagnostic log: the agent's module (one source file for both binaries: text
//! without colour off a terminal, or `log.format = "json"`), and [`OncePer`], which keeps a
//! line that a peer can trigger at will (a refused device's handshake) to one per key and
//! period, so a flood cannot fill the disk.

#[path = "../../edge-agent/src/logging.rs"]
mod shared;

pub use shared::*;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Keys remembered at most; past it, entries older than the period are forgotten, and if
/// all are recent the key is not logged (counters still count it).
const KEYS_MAX: usize = 4096;

/// Says yes once per key per `period`.
#[derive(Debug)]
pub struct OncePer {
    period: Duration,
    seen: Mutex<HashMap<String, Instant>>,
}

impl OncePer {
    pub fn new(period: Duration) -> OncePer {
        OncePer {
            period,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `key` should be logged now (and, if so, not again for the period).
    pub fn allow(&self, key: &str, now: Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = seen.get(key)
            && now.saturating_duration_since(*at) < self.period
        {
            return false;
        }
        if seen.len() >= KEYS_MAX && !seen.contains_key(key) {
            let period = self.period;
            seen.retain(|_, at| now.saturating_duration_since(*at) < period);
            if seen.len() >= KEYS_MAX {
                return false;
            }
        }
        seen.insert(key.to_owned(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_key_per_period() {
        let once = OncePer::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(once.allow("truck-1", t0));
        assert!(!once.allow("truck-1", t0 + Duration::from_secs(59)));
        assert!(once.allow("truck-2", t0 + Duration::from_secs(1)));
        assert!(once.allow("truck-1", t0 + Duration::from_secs(60)));
    }

    #[test]
    fn a_flood_of_keys_is_bounded() {
        let once = OncePer::new(Duration::from_secs(60));
        let t0 = Instant::now();
        for i in 0..KEYS_MAX {
            assert!(once.allow(&format!("d{i}"), t0));
        }
        assert!(!once.allow("one-more", t0));
        assert!(once.allow("one-more", t0 + Duration::from_secs(61)));
        assert!(once.seen.lock().unwrap().len() <= KEYS_MAX);
    }
}
