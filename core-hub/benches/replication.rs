//! Replication benchmarks (placeholder while building).
fn main() {}
