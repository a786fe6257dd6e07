//! The corpus replay shared by every crate's `tests/fuzz_*corpus.rs` (included by path): each
//! committed corpus file goes through the same function its cargo-fuzz target calls, on stable
//! Rust, so the corpora are regression tests in `cargo test` even where nightly and libFuzzer
//! are absent; and the hand-made seeds are checked to be on disk. See docs/fuzzing.md.

// Each including test uses what it needs of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// `<crate>/fuzz/corpus/<target>`.
pub fn corpus_dir(manifest_dir: &str, target: &str) -> PathBuf {
    Path::new(manifest_dir).join("fuzz/corpus").join(target)
}

/// Runs every corpus file of every target through its body; none may panic.
pub fn replay(manifest_dir: &str, targets: &[(&str, Target)]) {
    for &(name, run) in targets {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(manifest_dir, name))
            .unwrap_or_else(|e| panic!("corpus of {name}: {e}"))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(
            files.len() >= 3,
            "corpus of {name} has only {} files",
            files.len()
        );
        for path in files {
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{name} panicked on {}", path.display());
        }
    }
}

/// Checks that every hand-made seed `(target, file, bytes)` is in its corpus;
/// `TRIBUTARY_WRITE_FIXTURES=1` (re)writes them first. Seeds are inputs, not golden outputs.
pub fn seeds_on_disk<N: AsRef<Path>>(manifest_dir: &str, seeds: Vec<(&str, N, Vec<u8>)>) {
    let write = std::env::var_os("TRIBUTARY_WRITE_FIXTURES").is_some();
    for (target, name, data) in seeds {
        let dir = corpus_dir(manifest_dir, target);
        let path = dir.join(name);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &data).unwrap();
        }
        assert!(
            path.exists(),
            "missing seed {}; run with TRIBUTARY_WRITE_FIXTURES=1",
            path.display()
        );
    }
}
