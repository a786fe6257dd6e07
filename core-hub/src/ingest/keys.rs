//! Record keys at ingest: every key is checked segment by segment, and on streams with
//! `keys_prefixed_by_device` the device prefix is compared on those segments.
//!
//! A key is a `/`-separated path of segments (`truck-0042/engine`). At the hub a record's
//! identity is `(device, key)`: every read and every Parquet row carries `device`, so a device
//! writing the key `dev9/x` writes *its own* `dev9/x`, visibly not `dev9`'s. What makes keys
//! unambiguous is that they cannot be spelled two ways: a key with an empty segment (`a//b`,
//! a leading or trailing `/`), a `.` or `..` segment, or a NUL or other control character is
//! refused, so `dev1/../dev2/x` never reaches a stream, a topic template or a file name, and
//! the device-prefix rule compares the first segment exactly (`dev1x/…` is not `dev1/…`).
//! The rule itself ([`key_problem`]) lives in the sync crate: the agent applies it at ingest,
//! so a producer's bad key is refused there and never stalls a stream at the hub.

use super::{Hub, IngestError};
use sync::record::Record;

pub use sync::record::key_problem;

/// Whether a valid key's first segment is exactly `device`.
pub fn key_in_device(key: &str, device: &str) -> bool {
    key.split('/').next() == Some(device) && key.len() > device.len()
}

impl Hub {
    /// Refuses a block with any invalid key ([`key_problem`]) or tags
    /// ([`sync::record::tags_problem`]), and on a stream configured
    /// with `keys_prefixed_by_device` a key whose first segment is not the device id. Every
    /// record of the block counts, resent ones included, so a block is either wholly
    /// admitted or wholly refused.
    pub(super) fn check_keys(
        &self,
        device: &str,
        stream: &str,
        records: &[Record],
    ) -> Result<(), IngestError> {
        let prefixed = self.policy.keys_prefixed_by_device.contains(stream);
        let mut last: Option<&str> = None;
        let mut last_tags: Option<&[(String, String)]> = None;
        for r in records {
            if !r.tags.is_empty() && last_tags != Some(r.tags.as_slice()) {
                if let Some(why) = sync::record::tags_problem(&r.tags) {
                    return Err(IngestError::BadTags {
                        stream: stream.to_owned(),
                        key: r.key.chars().take(120).collect(),
                        why,
                    });
                }
                last_tags = Some(&r.tags);
            }
            // Blocks repeat keys: check each run once.
            if last == Some(r.key.as_str()) {
                continue;
            }
            last = Some(r.key.as_str());
            if let Some(why) = key_problem(&r.key) {
                return Err(IngestError::BadKey {
                    stream: stream.to_owned(),
                    key: r.key.chars().take(120).collect(),
                    why,
                });
            }
            if prefixed && !key_in_device(&r.key, device) {
                return Err(IngestError::ForbiddenKey {
                    stream: stream.to_owned(),
                    // A hostile key could be huge; the error only needs to identify it.
                    key: r.key.chars().take(120).collect(),
                    prefix: format!("{device}/"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_by_segment() {
        for ok in [
            "k",
            "dev1/engine",
            "a.b/c..d/.e",
            "site=a,line=b",
            "dev1/x y",
        ] {
            assert_eq!(key_problem(ok), None, "{ok}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a//b",
            ".",
            "..",
            "dev1/../dev2/x",
            "dev1/./x",
            "a\0b",
            "a\nb",
            "a\u{7f}",
        ] {
            assert!(key_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn the_device_prefix_is_the_first_segment() {
        assert!(key_in_device("dev1/x", "dev1"));
        assert!(key_in_device("dev1/a/b", "dev1"));
        assert!(!key_in_device("dev1", "dev1"));
        assert!(!key_in_device("dev1x/x", "dev1"));
        assert!(!key_in_device("dev9/x", "dev1"));
    }
}
