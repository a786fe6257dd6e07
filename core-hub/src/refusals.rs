//! The devices the hub refused for a revocation, each with the rule that did it and when, so
//! the status page, `GET /v1/devices` and `core-hub devices` can say why a device is shut out.
//!
//! A device revoked as a whole is known from the list alone; a device whose certificate is
//! revoked by serial is not (its re-issued certificate is accepted), so what the page shows for
//! it is what the hub did: it refused a certificate of that device at the handshake, when its
//! session started, or it closed its live session when a new revocation named it. A refusal
//! stays until the device starts a session with a certificate the list accepts, or a reload of
//! the list no longer refuses that certificate.
//!
//! Only certificates whose chain verified are recorded (the CN is then the fleet CA's word), so
//! the table holds at most one entry per device the fleet issued to, and never more than
//! [`REFUSED_DEVICES_MAX`].

use std::collections::HashMap;
use std::sync::Mutex;

use rustls::pki_types::CertificateDer;

use crate::pki::{RevocationList, RevocationRule, cert_identity};

/// Devices remembered at most; past it the one refused longest ago is forgotten.
pub const REFUSED_DEVICES_MAX: usize = 10_000;

/// Where the hub refused a revoked certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedAt {
    /// The TLS handshake failed with "certificate revoked".
    Handshake,
    /// The list changed between the handshake and the session's start.
    SessionStart,
    /// A reload of the list revoked it while its session ran: the session was closed.
    LiveSession,
}

impl RefusedAt {
    /// The name `GET /v1/devices` gives it.
    pub fn name(self) -> &'static str {
        match self {
            RefusedAt::Handshake => "handshake",
            RefusedAt::SessionStart => "session_start",
            RefusedAt::LiveSession => "live_session",
        }
    }

    fn words(self) -> &'static str {
        match self {
            RefusedAt::Handshake => "refused at the TLS handshake",
            RefusedAt::SessionStart => "refused at the start of its session",
            RefusedAt::LiveSession => "live session closed",
        }
    }
}

/// One device's latest refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The refused certificate's serial, normalised.
    pub serial: String,
    /// The line of the revocation list that refused it.
    pub rule: RevocationRule,
    /// Where the latest refusal happened.
    pub at: RefusedAt,
    /// The first refusal under this rule, ns since the Unix epoch.
    pub first_ns: i64,
    /// The latest refusal, ns since the Unix epoch.
    pub last_ns: i64,
}

impl Refusal {
    /// "refused at the TLS handshake for certificate serial 42bb57 (first at T, last at T)".
    pub fn describe(&self) -> String {
        let first = format_ns(self.first_ns);
        let when = if self.first_ns == self.last_ns {
            format!("at {first}")
        } else {
            format!("first at {first}, last at {}", format_ns(self.last_ns))
        };
        format!(
            "{} for certificate serial {} ({when})",
            self.at.words(),
            self.serial
        )
    }
}

/// The refused devices by name, shared by the TLS verifier and the sessions.
#[derive(Debug, Default)]
pub struct Refusals {
    devices: Mutex<HashMap<String, Refusal>>,
}

impl Refusals {
    /// Records that `cert` was refused `at`, under the rule of `list` that revokes it. A
    /// certificate that does not parse, or that no rule names, records nothing.
    pub fn refused(&self, list: &RevocationList, cert: &CertificateDer<'_>, at: RefusedAt) {
        let Ok((device, serial)) = cert_identity(cert) else {
            return;
        };
        let Some(rule) = list.rule_for(&device, &serial) else {
            return;
        };
        self.record(&device, &serial, rule, at, unix_ns());
    }

    /// Records a refusal of `device`'s certificate `serial` under `rule` at `now_ns`.
    pub fn record(
        &self,
        device: &str,
        serial: &str,
        rule: &RevocationRule,
        at: RefusedAt,
        now_ns: i64,
    ) {
        let mut map = self.lock();
        if let Some(r) = map.get_mut(device) {
            if r.rule != *rule || r.serial != serial {
                r.first_ns = now_ns;
            }
            r.rule = rule.clone();
            r.serial = serial.to_string();
            r.at = at;
            r.last_ns = now_ns;
            return;
        }
        if map.len() >= REFUSED_DEVICES_MAX {
            let oldest = map
                .iter()
                .min_by_key(|(_, r)| r.last_ns)
                .map(|(d, _)| d.clone());
            map.remove(&oldest.expect("a full table is not empty"));
        }
        let refusal = Refusal {
            serial: serial.to_string(),
            rule: rule.clone(),
            at,
            first_ns: now_ns,
            last_ns: now_ns,
        };
        map.insert(device.to_string(), refusal);
    }

    /// `device` started a session with a certificate the list accepts: it is not refused.
    pub fn accepted(&self, device: &str) {
        self.lock().remove(device);
    }

    /// After a reload: forgets refusals the new list no longer makes, and names the line
    /// that makes the others now (an edit may have moved it).
    pub fn reloaded(&self, list: &RevocationList) {
        self.lock()
            .retain(|device, r| match list.rule_for(device, &r.serial) {
                Some(rule) => {
                    r.rule = rule.clone();
                    true
                }
                None => false,
            });
    }

    /// `device`'s latest refusal.
    pub fn of(&self, device: &str) -> Option<Refusal> {
        self.lock().get(device).cloned()
    }

    /// Every refused device, sorted by name.
    pub fn all(&self) -> Vec<(String, Refusal)> {
        let mut out: Vec<(String, Refusal)> = self
            .lock()
            .iter()
            .map(|(d, r)| (d.clone(), r.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Refusal>> {
        self.devices.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The refused devices `devices` (the catalog's) does not hold: refused before any session
/// of theirs started, so they have no catalog row.
pub fn uncatalogued(hub: &crate::Hub, devices: &[crate::catalog::DeviceRow]) -> Vec<String> {
    let known: std::collections::HashSet<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    hub.stats()
        .revocation
        .refused_devices()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !known.contains(name.as_str()))
        .collect()
}

fn unix_ns() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

fn format_ns(ns: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_of(list: &RevocationList, device: &str, serial: &str) -> RevocationRule {
        list.rule_for(device, serial).expect("a rule").clone()
    }

    #[test]
    fn a_serial_refusal_names_its_line_and_when() {
        let list = RevocationList::parse("# fleet\ndev-1 0A:0B\n");
        let rule = rule_of(&list, "dev-1", "a0b");
        assert_eq!(rule.line, 2);
        let refusals = Refusals::default();
        refusals.record("dev-1", "a0b", &rule, RefusedAt::Handshake, 1_000_000_000);
        refusals.record("dev-1", "a0b", &rule, RefusedAt::Handshake, 61_000_000_000);
        let r = refusals.of("dev-1").expect("refused");
        let text = r.describe();
        assert!(
            text.contains("refused at the TLS handshake for certificate serial a0b"),
            "{text}"
        );
        assert!(
            text.contains("first at 1970-01-01T00:00:01Z, last at 1970-01-01T00:01:01Z"),
            "{text}"
        );
        assert!(rule.why.contains("line 2 `dev-1 0A:0B`"), "{}", rule.why);
    }

    #[test]
    fn a_reload_forgets_what_it_no_longer_refuses_and_renames_the_line() {
        let list = RevocationList::parse("dev-1 0a\ndev-2\n");
        let refusals = Refusals::default();
        refusals.record(
            "dev-1",
            "a",
            &rule_of(&list, "dev-1", "a"),
            RefusedAt::LiveSession,
            5,
        );
        refusals.record(
            "dev-2",
            "b",
            &rule_of(&list, "dev-2", "b"),
            RefusedAt::Handshake,
            6,
        );
        refusals.reloaded(&RevocationList::parse("# moved\ndev-2\n"));
        assert_eq!(refusals.of("dev-1"), None);
        let r = refusals.of("dev-2").expect("still refused");
        assert_eq!((r.rule.line, r.first_ns), (2, 6));
        refusals.accepted("dev-2");
        assert!(refusals.all().is_empty());
    }

    #[test]
    fn the_table_is_bounded() {
        let list = RevocationList::parse("dev-x\n");
        let rule = rule_of(&list, "dev-x", "");
        let refusals = Refusals::default();
        for i in 0..=REFUSED_DEVICES_MAX as i64 {
            refusals.record(&format!("d{i}"), "1", &rule, RefusedAt::Handshake, i);
        }
        let all = refusals.all();
        assert_eq!(all.len(), REFUSED_DEVICES_MAX);
        assert!(refusals.of("d0").is_none(), "the oldest goes first");
    }
}
