//! hwmon and thermal zones against fake sysfs trees in temporary directories: SI conversion,
//! field naming, and one specific error per bad channel while the good channels still read.

use std::fs;
use std::path::Path;

use firmware::SensorError;
use firmware::hwmon::HwmonSource;
use sync::{Record, Value};

const NOW: i64 = 1_764_374_400_000_000_000;

fn write(root: &Path, rel: &str, content: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

/// A file that exists but cannot be read as a value: a directory in its place (EISDIR).
fn unreadable(root: &Path, rel: &str) {
    fs::create_dir_all(root.join(rel)).unwrap();
}

fn record<'a>(records: &'a [Record], key: &str) -> &'a Record {
    records
        .iter()
        .find(|r| r.key == key)
        .unwrap_or_else(|| panic!("no record {key} in {records:#?}"))
}

fn error_for<'a>(errors: &'a [SensorError], file: &str) -> &'a SensorError {
    let matching: Vec<_> = errors.iter().filter(|e| e.path().ends_with(file)).collect();
    assert_eq!(
        matching.len(),
        1,
        "expected one error for {file}, got {errors:#?}"
    );
    matching[0]
}

fn fake_hwmon(root: &Path) {
    // A CPU package sensor with every kind of broken channel next to good ones.
    write(root, "class/hwmon/hwmon0/name", "coretemp\n");
    write(root, "class/hwmon/hwmon0/temp1_input", "45000\n");
    write(root, "class/hwmon/hwmon0/temp1_label", "Package id 0\n");
    write(root, "class/hwmon/hwmon0/temp2_input", "47500\n"); // no label: named after channel
    write(root, "class/hwmon/hwmon0/temp3_input", "abc\n");
    write(root, "class/hwmon/hwmon0/temp4_input", "");
    write(root, "class/hwmon/hwmon0/temp5_input", "99999999999\n");
    unreadable(root, "class/hwmon/hwmon0/temp6_input");
    write(root, "class/hwmon/hwmon0/temp7_input", "-5250\n");
    write(root, "class/hwmon/hwmon0/temp8_input", "30000\n");
    unreadable(root, "class/hwmon/hwmon0/temp8_label");
    write(root, "class/hwmon/hwmon0/temp1_max", "100000\n"); // not an input: ignored
    // A super-I/O chip with the other channel types.
    write(root, "class/hwmon/hwmon1/name", "nct6775");
    write(root, "class/hwmon/hwmon1/in0_input", "1200");
    write(root, "class/hwmon/hwmon1/in0_label", "Vcore");
    write(root, "class/hwmon/hwmon1/fan1_input", "1450");
    write(root, "class/hwmon/hwmon1/power1_input", "12500000");
    write(root, "class/hwmon/hwmon1/curr1_input", "2500");
    write(
        root,
        "class/hwmon/hwmon1/fan2_input",
        "999999999999999999999999999",
    );
    // A chip without its name file.
    write(root, "class/hwmon/hwmon2/temp1_input", "30000");
    // An old driver keeping its attributes under device/.
    write(root, "class/hwmon/hwmon3/device/name", "lm75");
    write(root, "class/hwmon/hwmon3/device/temp1_input", "25000");
    // Two chips with the same name.
    write(root, "class/hwmon/hwmon4/name", "nvme");
    write(root, "class/hwmon/hwmon4/temp1_input", "38850");
    write(root, "class/hwmon/hwmon5/name", "nvme");
    write(root, "class/hwmon/hwmon5/temp1_input", "41850");
}

#[test]
fn hwmon_converts_units_and_names_fields() {
    let dir = tempfile::tempdir().unwrap();
    fake_hwmon(dir.path());
    let poll = HwmonSource::new(dir.path(), "edge-7").poll_hwmon(NOW);

    let core = record(&poll.records, "edge-7/hwmon/coretemp");
    assert_eq!(core.ts, NOW);
    assert_eq!(
        core.fields,
        vec![
            ("package_id_0_c".to_owned(), Value::F64(45.0)),
            ("temp2_c".to_owned(), Value::F64(47.5)),
            ("temp7_c".to_owned(), Value::F64(-5.25)),
            ("temp8_c".to_owned(), Value::F64(30.0)),
        ]
    );
    let nct = record(&poll.records, "edge-7/hwmon/nct6775");
    assert_eq!(
        nct.fields,
        vec![
            ("curr1_a".to_owned(), Value::F64(2.5)),
            ("fan1_rpm".to_owned(), Value::I64(1450)),
            ("vcore_v".to_owned(), Value::F64(1.2)),
            ("power1_w".to_owned(), Value::F64(12.5)),
        ]
    );
    assert_eq!(
        record(&poll.records, "edge-7/hwmon/hwmon2").fields,
        vec![("temp1_c".to_owned(), Value::F64(30.0))]
    );
    assert_eq!(
        record(&poll.records, "edge-7/hwmon/lm75").fields,
        vec![("temp1_c".to_owned(), Value::F64(25.0))]
    );
    assert_eq!(
        record(&poll.records, "edge-7/hwmon/nvme-4").field("temp1_c"),
        Some(&Value::F64(38.85))
    );
    assert_eq!(
        record(&poll.records, "edge-7/hwmon/nvme-5").field("temp1_c"),
        Some(&Value::F64(41.85))
    );
    assert_eq!(poll.records.len(), 6);
}

#[test]
fn hwmon_reports_each_bad_channel_specifically() {
    let dir = tempfile::tempdir().unwrap();
    fake_hwmon(dir.path());
    let poll = HwmonSource::new(dir.path(), "edge-7").poll_hwmon(NOW);

    assert!(matches!(
        error_for(&poll.errors, "hwmon0/temp3_input"),
        SensorError::NotNumeric { value, .. } if value == "abc"
    ));
    assert!(matches!(
        error_for(&poll.errors, "hwmon0/temp4_input"),
        SensorError::Empty { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "hwmon0/temp5_input"),
        SensorError::OutOfRange { value, unit: "degC", .. } if *value == 99_999_999.999
    ));
    assert!(matches!(
        error_for(&poll.errors, "hwmon0/temp6_input"),
        SensorError::Read { .. }
    ));
    // The label is unreadable; the reading is kept under the channel's own name.
    assert!(matches!(
        error_for(&poll.errors, "hwmon0/temp8_label"),
        SensorError::Read { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "hwmon1/fan2_input"),
        SensorError::OutOfRange { unit: "RPM", .. }
    ));
    let missing_name = error_for(&poll.errors, "hwmon2/name");
    assert!(
        matches!(missing_name, SensorError::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    );
    assert_eq!(poll.errors.len(), 7, "{:#?}", poll.errors);

    // Every error names its file in its message, so a log line is enough to find it.
    for e in &poll.errors {
        assert!(
            e.to_string().contains(&e.path().display().to_string()),
            "{e}"
        );
    }
}

#[test]
fn thermal_zones_read_with_errors_per_zone() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    write(root, "class/thermal/thermal_zone0/type", "x86_pkg_temp\n");
    write(root, "class/thermal/thermal_zone0/temp", "52000\n");
    write(root, "class/thermal/thermal_zone1/type", "acpitz\n");
    write(root, "class/thermal/thermal_zone1/temp", "garbage\n");
    write(root, "class/thermal/thermal_zone2/type", "acpitz\n");
    write(root, "class/thermal/thermal_zone3/temp", "40000\n");
    write(root, "class/thermal/thermal_zone4/type", "soc thermal\n");
    write(root, "class/thermal/thermal_zone4/temp", "1000000000\n");
    write(root, "class/thermal/cooling_device0/type", "Processor\n");
    let poll = HwmonSource::new(root, "dev").poll_thermal(NOW);

    let keys: Vec<_> = poll.records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(
        keys,
        ["dev/thermal/x86_pkg_temp", "dev/thermal/thermal_zone3"]
    );
    assert_eq!(
        poll.records[0].fields,
        vec![("temp_c".to_owned(), Value::F64(52.0))]
    );
    assert_eq!(
        poll.records[1].fields,
        vec![("temp_c".to_owned(), Value::F64(40.0))]
    );
    assert!(matches!(
        error_for(&poll.errors, "thermal_zone1/temp"),
        SensorError::NotNumeric { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "thermal_zone2/temp"),
        SensorError::Read { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "thermal_zone3/type"),
        SensorError::Read { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "thermal_zone4/temp"),
        SensorError::OutOfRange { .. }
    ));
    assert_eq!(poll.errors.len(), 4);
}

#[test]
fn poll_covers_hwmon_and_thermal_and_survives_missing_classes() {
    let dir = tempfile::tempdir().unwrap();
    let source = HwmonSource::new(dir.path(), "dev");
    // Neither class directory exists: one error each, no records, no panic.
    let poll = source.poll(NOW);
    assert!(poll.records.is_empty());
    assert_eq!(poll.errors.len(), 2);
    assert!(
        poll.errors
            .iter()
            .all(|e| matches!(e, SensorError::Read { .. }))
    );

    fake_hwmon(dir.path());
    write(
        dir.path(),
        "class/thermal/thermal_zone0/type",
        "cpu-thermal",
    );
    write(dir.path(), "class/thermal/thermal_zone0/temp", "48312");
    let poll = source.poll(NOW);
    assert_eq!(poll.records.len(), 7);
    assert_eq!(
        record(&poll.records, "dev/thermal/cpu-thermal").field("temp_c"),
        Some(&Value::F64(48.312))
    );
}

#[test]
fn the_real_sysfs_reads_without_panicking() {
    // Whatever this machine has (possibly nothing in a container): no panic, and every error
    // points under /sys.
    let source = HwmonSource::new(firmware::hwmon::SYSFS_ROOT, "host");
    let poll = source.poll(NOW);
    for e in &poll.errors {
        assert!(e.path().starts_with("/sys"), "{e}");
    }
    for r in &poll.records {
        assert!(r.key.starts_with("host/"));
        assert!(!r.fields.is_empty());
    }
}
