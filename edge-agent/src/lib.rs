//! The edge agent as a library: the binary in `main.rs` and the tests build on these modules.

pub mod bench;
pub mod catalog;
pub mod config;
pub mod filters;
pub mod http;
pub mod link;
pub mod log;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod replicator;
pub mod sources;
pub mod storage;
