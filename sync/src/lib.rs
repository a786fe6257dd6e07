//! Tributary's shared core.
//!
//! Everything the edge agent, the hub and the tools must agree on lives here and only here:
//! the record model ([`record`]), the ingest parsers ([`parse`]), the one time parser
//! ([`time`]), the sealed block and segment file format ([`block`], [`segment`]), and the
//! replication protocol.
//!
//! Nothing in this crate performs network IO or reads the clock. The segment scanner works on
//! byte slices handed to it; files are the caller's business.

pub mod block;
pub mod columnar;
pub mod config_key;
pub mod decoded;
pub mod epoch;
pub mod fuzzing;
pub mod parse;
pub mod protocol;
pub mod record;
pub mod segment;
#[cfg(feature = "sparkplug")]
pub mod sparkplug;
pub mod time;
pub mod varint;

pub use record::{Origin, Record, Value};
