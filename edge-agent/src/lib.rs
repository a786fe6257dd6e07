//! The edge agent as a library: the binary in `main.rs` and the tests build on these modules.

pub mod catalog;
pub mod log;
pub mod storage;
pub mod config;
pub mod http;
pub mod metrics;
pub mod bench;
pub mod link;
pub mod replicator;
pub mod sources;
pub mod notify;
pub mod filters;
