//! Replays every committed fuzz corpus file through its target's body on stable Rust, so the
//! corpora in `sync/fuzz/corpus/<target>/` are regression tests even where nightly and
//! libFuzzer are absent. A crash found by `cargo fuzz` is fixed, then its input is added to the
//! target's corpus, where this test keeps it fixed.
//!
//! `write_seed_corpus` regenerates the hand-made seeds when `TRIBUTARY_WRITE_FIXTURES=1`;
//! otherwise it checks that they are all present.

#[path = "../fuzz/replay.rs"]
mod replay;

use std::path::PathBuf;
use sync::block;
use sync::segment;

use replay::Target;

const TARGETS: [(&str, Target); 5] = [
    ("segment_scan", sync::fuzzing::segment_scan),
    ("block_decode", sync::fuzzing::block_decode),
    ("block_body_decode", sync::fuzzing::block_body_decode),
    ("ndjson_parse", sync::fuzzing::ndjson_parse),
    ("line_parse", sync::fuzzing::line_parse),
];

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

#[test]
fn every_corpus_file_passes_its_target() {
    replay::replay(env!("CARGO_MANIFEST_DIR"), &TARGETS);
}

/// The v1 fixture's frames in a version 2 segment, a sync mark before each, then a torn mark.
fn with_sync_marks(v1: &[u8]) -> Vec<u8> {
    let mut out = segment::segment_header().to_vec();
    for f in segment::scan(v1).unwrap().frames {
        let synced = out.len() as u64;
        out.extend_from_slice(&segment::encode_sync_mark(synced));
        out.extend_from_slice(&v1[f.offset as usize..f.end() as usize]);
    }
    let mark = segment::encode_sync_mark(out.len() as u64);
    out.extend_from_slice(&mark[..mark.len() - 3]);
    out
}

/// The hand-made seeds: small valid inputs of each kind, plus a few broken ones.
fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    let seg = std::fs::read(fixture.join("segment.trseg")).unwrap();
    let scan = segment::scan(&seg).unwrap();
    let blocks: Vec<&[u8]> = scan.frames.iter().map(|f| f.block(&seg).unwrap()).collect();
    let frames_only = seg[segment::SEGMENT_HEADER_LEN..].to_vec();
    let mut seeds = vec![
        ("segment_scan", "fixture_v1.trseg", seg.clone()),
        (
            "segment_scan",
            "torn_tail.trseg",
            seg[..seg.len() - 7].to_vec(),
        ),
        (
            "segment_scan",
            "header_only.trseg",
            seg[..segment::SEGMENT_HEADER_LEN].to_vec(),
        ),
        (
            "segment_scan",
            "header_only_v2.trseg",
            segment::segment_header().to_vec(),
        ),
        ("segment_scan", "sync_marks_v2.trseg", with_sync_marks(&seg)),
        ("segment_scan", "frames_only.bin", frames_only),
        (
            "block_decode",
            "truncated.trbk",
            blocks[0][..blocks[0].len() / 2].to_vec(),
        ),
    ];
    for (i, b) in blocks.iter().enumerate() {
        let name: &'static str = [
            "v1_block0.trbk",
            "v1_block1.trbk",
            "v1_block2.trbk",
            "v1_block3.trbk",
        ][i];
        seeds.push(("block_decode", name, b.to_vec()));
        // The body target takes a selector byte (version bit, count-1) and a raw body.
        let h = block::decode_header(b).unwrap();
        let raw = zstd::bulk::decompress(&b[block::HEADER_LEN..], h.raw_len as usize).unwrap();
        let mut input = vec![(h.count - 1) as u8 & 0x7f];
        input.extend_from_slice(&raw);
        let name: &'static str = [
            "v1_body0.bin",
            "v1_body1.bin",
            "v1_body2.bin",
            "v1_body3.bin",
        ][i];
        seeds.push(("block_body_decode", name, input));
    }
    let ndjson = std::fs::read(fixture.join("records.ndjson")).unwrap();
    seeds.extend([
        ("ndjson_parse", "fixture_v1.ndjson", ndjson),
        (
            "ndjson_parse",
            "generator.ndjson",
            br#"{"key":"truck-0007/engine","ts":1764374400000000000,"fields":{"engine_temp_c":71.28,"odometer_m":12345,"ignition":true,"note":"x"}}"#.to_vec(),
        ),
        (
            "ndjson_parse",
            "escapes.ndjson",
            b"{\"key\":\"k\\u00e9\\ud83d\\ude00\",\"ts\":null,\"fields\":{\"b\":{\"$bytes\":\"AQID\"},\"f\":-1.5e-3}}\r\n\n".to_vec(),
        ),
        ("ndjson_parse", "bad_ts.ndjson", br#"{"key":"k","ts":"abc","fields":{"a":1}}"#.to_vec()),
        (
            "line_parse",
            "generator.lp",
            b"telemetry,device=truck-0007,unit=engine engine_temp_c=71.28,odometer_m=12345i,ignition=true,note=\"x\" 1764374400000000000\n".to_vec(),
        ),
        (
            "line_parse",
            "escapes.lp",
            b"# comment\nmy\\ meas,host=a\\ b,rack=r\\,1 x=\"he said \\\"hi\\\"\",u=5u,f=-1.5E-3,b=t\r\n".to_vec(),
        ),
        ("line_parse", "multiline_string.lp", b"m s=\"a\nb\" 1\nm x=1i 2\n".to_vec()),
        ("line_parse", "bad_uint.lp", b"m a=18446744073709551615u 1\n".to_vec()),
    ]);
    seeds
}

#[test]
fn write_seed_corpus() {
    let write = std::env::var_os("TRIBUTARY_WRITE_FIXTURES").is_some();
    for (target, name, data) in seeds() {
        let path = corpus_dir(target).join(name);
        if write {
            std::fs::create_dir_all(corpus_dir(target)).unwrap();
            std::fs::write(&path, &data).unwrap();
        } else {
            let on_disk =
                std::fs::read(&path).unwrap_or_else(|e| panic!("seed {}: {e}", path.display()));
            assert_eq!(
                on_disk,
                data,
                "seed {} differs from its generator",
                path.display()
            );
        }
    }
}
