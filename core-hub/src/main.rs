//! The hub binary.
fn main() {}
