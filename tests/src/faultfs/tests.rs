//! The fault filesystem's semantics: first on the model alone (what survives which cut, and
//! that every fault is counted), then through a real FUSE mount with `std::fs` and with SQLite
//! in WAL mode, as the agent and the hub use it.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::model::{CutMode, Kind, Meta, Model, ROOT};
use super::{FaultCounts, FaultFs};

fn name(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn meta() -> Meta {
    Meta::new(0o644, 0, 0)
}

/// A model with `/a` holding `base`, everything durable; returns the model and `/a`'s inode.
fn with_durable_file(base: &[u8]) -> (Model, u64) {
    let mut model = Model::new();
    let a = model
        .create(ROOT, name("a"), Kind::File, meta())
        .unwrap()
        .ino;
    model.write(a, 0, base).unwrap();
    model.sync(a).unwrap();
    model.sync(ROOT).unwrap();
    (model, a)
}

fn read_all(model: &Model, parent: u64, file: &str) -> Option<Vec<u8>> {
    let ino = model.lookup(parent, name(file)).ok()?.ino;
    Some(model.read(ino, 0, u32::MAX).unwrap())
}

fn cut(model: &mut Model, mode: CutMode, seed: u64) -> (Model, FaultCounts) {
    model.power_cut(mode, &mut StdRng::seed_from_u64(seed))
}

#[test]
fn unsynced_write_is_lost_and_synced_data_kept() {
    let (mut model, a) = with_durable_file(b"durable");
    assert_eq!(model.write(a, 7, b"-unsynced").unwrap(), 9);
    assert_eq!(read_all(&model, ROOT, "a").unwrap(), b"durable-unsynced");
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    assert_eq!(read_all(&after, ROOT, "a").unwrap(), b"durable");
    assert_eq!(counts.ops_dropped, 1);
    assert_eq!(counts.cuts, 1);
}

#[test]
fn synced_data_survives_every_mode() {
    for mode in CutMode::ALL {
        let (mut model, a) = with_durable_file(b"one");
        model.write(a, 3, b" two").unwrap();
        model.truncate(a, 5).unwrap();
        model.sync(a).unwrap();
        let (after, counts) = cut(&mut model, mode, 7);
        assert_eq!(read_all(&after, ROOT, "a").unwrap(), b"one t", "{mode:?}");
        assert_eq!(counts.faults(), 0, "{mode:?}: nothing was unsynced");
    }
}

#[test]
fn the_dark_filesystem_fails_every_call() {
    let (mut model, a) = with_durable_file(b"x");
    let _ = cut(&mut model, CutMode::Drop, 1);
    assert_eq!(model.read(a, 0, 1), Err(libc::EIO));
    assert_eq!(model.write(a, 0, b"y"), Err(libc::EIO));
    assert_eq!(model.sync(a), Err(libc::EIO));
    assert_eq!(model.lookup(ROOT, name("a")).map(|a| a.ino), Err(libc::EIO));
}

#[test]
fn rename_is_lost_without_a_sync_of_the_directory() {
    let (mut model, a) = with_durable_file(b"data");
    model
        .rename(ROOT, name("a"), ROOT, name("b"), false)
        .unwrap();
    assert!(read_all(&model, ROOT, "a").is_none());
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    assert_eq!(read_all(&after, ROOT, "a").unwrap(), b"data");
    assert!(read_all(&after, ROOT, "b").is_none());
    assert_eq!(counts.dirs_dropped, 1);

    let (mut model, _) = with_durable_file(b"data");
    model
        .rename(ROOT, name("a"), ROOT, name("b"), false)
        .unwrap();
    model.sync(ROOT).unwrap();
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    assert!(read_all(&after, ROOT, "a").is_none());
    assert_eq!(read_all(&after, ROOT, "b").unwrap(), b"data");
    assert_eq!(counts.faults(), 0);
    let _ = a;
}

#[test]
fn a_new_file_needs_its_directory_synced_and_its_data_synced() {
    let mut model = Model::new();
    let dir = model
        .create(ROOT, name("d"), Kind::Dir, meta())
        .unwrap()
        .ino;
    model.sync(ROOT).unwrap();
    let f = model
        .create(dir, name("f"), Kind::File, meta())
        .unwrap()
        .ino;
    model.write(f, 0, b"hello").unwrap();
    model.sync(f).unwrap();
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    let d = after.lookup(ROOT, name("d")).unwrap().ino;
    assert!(
        read_all(&after, d, "f").is_none(),
        "file data synced, entry not"
    );
    assert_eq!(counts.dirs_dropped, 1);

    let mut model = Model::new();
    let f = model
        .create(ROOT, name("f"), Kind::File, meta())
        .unwrap()
        .ino;
    model.write(f, 0, b"hello").unwrap();
    model.sync(ROOT).unwrap();
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    assert_eq!(
        read_all(&after, ROOT, "f").unwrap(),
        b"",
        "entry synced, data not"
    );
    assert_eq!(counts.ops_dropped, 1);
}

#[test]
fn tear_keeps_earlier_writes_and_a_prefix_of_the_last() {
    for seed in 0..20 {
        let (mut model, a) = with_durable_file(b"base:");
        model.write(a, 5, b"first;").unwrap();
        model.write(a, 11, b"0123456789").unwrap();
        let (after, counts) = cut(&mut model, CutMode::Tear, seed);
        let image = read_all(&after, ROOT, "a").unwrap();
        assert!(image.starts_with(b"base:first;0"), "seed {seed}: {image:?}");
        assert!(image.len() < 21, "seed {seed}: the last write is torn");
        assert!(b"base:first;0123456789".starts_with(&image));
        assert_eq!(counts.writes_torn, 1);
    }
}

#[test]
fn zeros_leave_the_size_and_not_the_data() {
    let (mut model, a) = with_durable_file(b"abc");
    model.write(a, 3, b"def").unwrap();
    model.write(a, 0, b"X").unwrap();
    let (after, counts) = cut(&mut model, CutMode::Zeros, 1);
    assert_eq!(read_all(&after, ROOT, "a").unwrap(), b"abc\0\0\0");
    assert_eq!(counts.files_zero_filled, 1);
    assert_eq!(counts.ops_dropped, 2);
}

#[test]
fn reorder_persists_later_writes_without_earlier_ones_and_counts_them() {
    let mut total = FaultCounts::default();
    for seed in 0..64 {
        let (mut model, a) = with_durable_file(b"________");
        for i in 0..8u8 {
            model.write(a, u64::from(i), &[b'0' + i]).unwrap();
        }
        let (after, counts) = cut(&mut model, CutMode::Reorder, seed);
        let image = read_all(&after, ROOT, "a").unwrap();
        let kept = image.iter().filter(|b| **b != b'_').count() as u64;
        assert_eq!(kept + counts.ops_dropped, 8, "seed {seed}: {image:?}");
        // A later write kept after a dropped one shows as a digit after an underscore.
        let gaps = image
            .iter()
            .enumerate()
            .filter(|(i, b)| **b != b'_' && image[..*i].contains(&b'_'))
            .count() as u64;
        assert_eq!(gaps, counts.ops_reordered, "seed {seed}: {image:?}");
        total.add(&counts);
    }
    assert!(total.ops_reordered > 0, "{total:?}");
}

#[test]
fn reorder_can_keep_a_rename_without_the_data() {
    let mut kept = 0;
    for seed in 0..32 {
        let mut model = Model::new();
        let tmp = model
            .create(ROOT, name("tmp"), Kind::File, meta())
            .unwrap()
            .ino;
        model.write(tmp, 0, b"payload").unwrap();
        model
            .rename(ROOT, name("tmp"), ROOT, name("final"), false)
            .unwrap();
        let (after, counts) = cut(&mut model, CutMode::Reorder, seed);
        if let Some(image) = read_all(&after, ROOT, "final") {
            assert_eq!(counts.dirs_kept_unsynced, 1);
            assert!(
                image.is_empty() || image == b"payload",
                "seed {seed}: {image:?}"
            );
            kept += 1;
        } else {
            assert_eq!(counts.dirs_dropped, 1);
        }
    }
    assert!(kept > 0 && kept < 32, "kept the rename {kept} times of 32");
}

#[test]
fn overwritten_pages_are_coalesced() {
    let (mut model, a) = with_durable_file(&[0; 4096]);
    for round in 0..1000u32 {
        model.write(a, 0, &[round as u8; 4096]).unwrap();
    }
    let (after, counts) = cut(&mut model, CutMode::Drop, 1);
    assert_eq!(
        counts.ops_dropped, 1,
        "one pending write after 1000 rewrites of the page"
    );
    assert_eq!(read_all(&after, ROOT, "a").unwrap(), vec![0; 4096]);
}

#[test]
fn remove_and_rename_check_kinds() {
    let mut model = Model::new();
    let d = model
        .create(ROOT, name("d"), Kind::Dir, meta())
        .unwrap()
        .ino;
    model.create(d, name("f"), Kind::File, meta()).unwrap();
    assert_eq!(
        model.remove(ROOT, name("d"), Kind::Dir),
        Err(libc::ENOTEMPTY)
    );
    assert_eq!(model.remove(ROOT, name("d"), Kind::File), Err(libc::EISDIR));
    assert_eq!(model.remove(d, name("f"), Kind::Dir), Err(libc::ENOTDIR));
    assert_eq!(
        model
            .create(d, name("f"), Kind::File, meta())
            .map(|a| a.ino),
        Err(libc::EEXIST)
    );
    model.create(d, name("g"), Kind::File, meta()).unwrap();
    assert_eq!(
        model.rename(d, name("f"), d, name("g"), true),
        Err(libc::EEXIST)
    );
    model.rename(d, name("f"), d, name("g"), false).unwrap();
    assert_eq!(model.entries(d).unwrap().len(), 1);
    model.remove(d, name("g"), Kind::File).unwrap();
    model.remove(ROOT, name("d"), Kind::Dir).unwrap();
    assert!(model.entries(ROOT).unwrap().is_empty());
}

fn mounted() -> (tempfile::TempDir, FaultFs) {
    let scratch = tempfile::tempdir().unwrap();
    let fs = FaultFs::mount(scratch.path().join("mnt")).expect("mounting needs root and /dev/fuse");
    (scratch, fs)
}

fn sync_dir(path: &std::path::Path) {
    File::open(path).unwrap().sync_all().unwrap();
}

#[test]
fn mounted_fs_keeps_only_what_was_synced() {
    let (_scratch, mut fs) = mounted();
    let root = fs.path().to_path_buf();
    let mut synced = File::create(root.join("synced")).unwrap();
    synced.write_all(b"kept").unwrap();
    synced.sync_data().unwrap();
    std::fs::write(root.join("unsynced"), b"lost").unwrap();
    sync_dir(&root);
    synced.write_all(b" and lost").unwrap();
    std::fs::rename(root.join("unsynced"), root.join("renamed")).unwrap();
    std::fs::create_dir(root.join("newdir")).unwrap();
    drop(synced);

    let mut rng = StdRng::seed_from_u64(3);
    let counts = fs.power_cut(CutMode::Drop, &mut rng);
    let dark = std::fs::read(root.join("synced"));
    assert!(
        dark.is_err() || dark.is_ok_and(|d| d == b"kept and lost"),
        "cached or EIO"
    );
    assert!(
        std::fs::write(root.join("x"), b"x").is_err(),
        "a dark fs takes no writes"
    );
    fs.restart().unwrap();

    assert_eq!(std::fs::read(root.join("synced")).unwrap(), b"kept");
    assert_eq!(
        std::fs::read(root.join("unsynced")).unwrap(),
        b"",
        "entry synced, data not"
    );
    assert!(!root.join("renamed").exists());
    assert!(!root.join("newdir").exists());
    assert!(
        counts.ops_dropped >= 2 && counts.dirs_dropped == 1,
        "{counts:?}"
    );
    assert_eq!(fs.counts(), &counts);
}

#[test]
fn mounted_fs_supports_pwrite_truncate_and_rename_over() {
    let (_scratch, mut fs) = mounted();
    let root = fs.path().to_path_buf();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("f"))
        .unwrap();
    file.write_all_at(b"0123456789", 0).unwrap();
    file.write_all_at(b"ab", 4).unwrap();
    file.set_len(8).unwrap();
    let mut buf = [0u8; 8];
    file.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"0123ab67");
    file.sync_all().unwrap();
    std::fs::write(root.join("g"), b"old").unwrap();
    std::fs::rename(root.join("f"), root.join("g")).unwrap();
    sync_dir(&root);
    let listed: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listed, vec![std::ffi::OsString::from("g")]);
    fs.power_cut(CutMode::Reorder, &mut StdRng::seed_from_u64(1));
    fs.restart().unwrap();
    assert_eq!(std::fs::read(root.join("g")).unwrap(), b"0123ab67");
}

/// SQLite in WAL mode with `synchronous = FULL`, as the hub's catalog and the agent's
/// idempotency store use it: committed transactions survive every kind of cut, an open one
/// vanishes whole, and the database stays intact. Also proves WAL (and its `mmap`ed `-shm`)
/// works on the mount at all.
#[test]
fn sqlite_wal_commits_survive_every_cut_mode() {
    let (_scratch, mut fs) = mounted();
    let db = fs.path().join("db.sqlite");
    let mut committed = 0i64;
    for (round, mode) in CutMode::ALL.into_iter().cycle().take(8).enumerate() {
        let conn = rusqlite::Connection::open(&db).unwrap();
        let journal: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .unwrap();
        assert_eq!(journal, "wal");
        // A small page cache makes the open transaction below spill into the WAL unsynced.
        conn.execute_batch(
            "PRAGMA synchronous = FULL;
             PRAGMA cache_size = 8;
             CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, round INTEGER, body BLOB);",
        )
        .unwrap();
        let rows: i64 = conn
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(
            rows, committed,
            "round {round}: committed rows after a {mode:?} cut"
        );
        let check: String = conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(check, "ok", "round {round}");
        for _ in 0..20 {
            conn.execute(
                "INSERT INTO t (round, body) VALUES (?1, zeroblob(3000))",
                [round as i64],
            )
            .unwrap();
            committed += 1;
        }
        conn.execute_batch(
            "BEGIN; INSERT INTO t (round, body) SELECT -1, randomblob(4000) FROM t LIMIT 50;",
        )
        .unwrap();
        let counts = fs.power_cut(mode, &mut StdRng::seed_from_u64(round as u64));
        assert!(
            counts.faults() > 0,
            "round {round}: the open transaction was unsynced"
        );
        drop(conn);
        fs.restart().unwrap();
    }
    assert!(fs.counts().faults() > 0);
}
