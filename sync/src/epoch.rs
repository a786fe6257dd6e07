//! How an epoch is written wherever a person or a program reads it: 16 lowercase hex digits
//! (`00f3a9c2e1b04d57`), as in the agent's segment file names.
//!
//! Epochs are random 64-bit numbers, so most are above 2^53 and a JavaScript client would
//! round them as JSON numbers. One form in logs, metrics labels (`epoch="..."`), CLI output
//! and JSON strings lets edge and hub metrics be joined on the label and keeps JSON exact.
//! [`serde_hex`] writes that string and reads it back (a plain number is accepted too, from
//! older peers).

/// `epoch` as 16 lowercase hex digits.
pub fn format(epoch: u64) -> String {
    format!("{epoch:016x}")
}

/// An epoch written by [`format`] (any number of hex digits up to 16, optional `0x`).
pub fn parse(s: &str) -> Option<u64> {
    let s = s.strip_prefix("0x").unwrap_or(s);
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// `#[serde(with = "sync::epoch::serde_hex")]` on a `u64` epoch field.
pub mod serde_hex {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(epoch: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format(*epoch))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Hex(String),
            Number(u64),
        }
        match Either::deserialize(d)? {
            Either::Number(n) => Ok(n),
            Either::Hex(s) => super::parse(&s)
                .ok_or_else(|| D::Error::custom(format!("`{s}` is not a hex epoch"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct Mark {
        #[serde(with = "serde_hex")]
        epoch: u64,
    }

    #[test]
    fn round_trips_above_two_to_the_53() {
        let m = Mark {
            epoch: u64::MAX - 1,
        };
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, r#"{"epoch":"fffffffffffffffe"}"#);
        assert_eq!(serde_json::from_str::<Mark>(&json).unwrap(), m);
        assert_eq!(
            serde_json::from_str::<Mark>(r#"{"epoch":7}"#)
                .unwrap()
                .epoch,
            7
        );
        assert_eq!(format(0xab), "00000000000000ab");
        assert_eq!(parse("0x00ab"), Some(0xab));
        assert_eq!(parse("xyz"), None);
        assert_eq!(parse("11112222333344445"), None);
    }
}
