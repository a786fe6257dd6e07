//! The data directory lock: `data_dir/LOCK`, held with `flock` by `run` (and `inspect`), so two
//! processes never share a data directory. The kernel drops the lock when the holder exits,
//! even on `kill -9`, so a stale file never blocks a restart.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::Path;

use anyhow::Context as _;

/// Held for as long as the value lives.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

impl DataDirLock {
    /// Takes the lock or explains who holds it. Creates the data directory if needed.
    pub fn acquire(data_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("creating the data directory {}", data_dir.display()))?;
        let path = data_dir.join("LOCK");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {holder})")
                };
                anyhow::bail!(
                    "another edge-agent{who} is using the data directory {}: stop it first \
                     (use `edge-agent status` to look at a running agent)",
                    data_dir.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
        }
        // The pid is only for the message above; the flock is what excludes.
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        writeln!(file, "{}", std::process::id())?;
        Ok(DataDirLock { _file: file })
    }
}
