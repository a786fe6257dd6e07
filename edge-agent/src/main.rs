//! The edge agent binary.
fn main() {}
