//! Shared harness for system tests: spawning the real binaries, free ports, and the ledger checker.
