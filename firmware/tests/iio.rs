//! IIO devices against fake sysfs trees: `(raw + offset) * scale` applied exactly, per-channel
//! attributes winning over type-wide ones, a missing scale meaning 1, `_input` used as is, and
//! a specific error per bad channel while the others still read.

use std::fs;
use std::path::Path;

use firmware::SensorError;
use firmware::iio::IioSource;
use sync::{Record, Value};

const NOW: i64 = 42;

fn write(root: &Path, rel: &str, content: &str) {
    let path = root.join("bus/iio/devices").join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
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

fn fake_iio(root: &Path) {
    // An ADC: type-wide scale and offset, one channel overriding both, three broken channels.
    write(root, "iio:device0/name", "ads1015\n");
    write(root, "iio:device0/in_voltage_scale", "0.5\n");
    write(root, "iio:device0/in_voltage_offset", "-100\n");
    write(root, "iio:device0/in_voltage0_raw", "2048\n");
    write(root, "iio:device0/in_voltage1_raw", "1000\n");
    write(root, "iio:device0/in_voltage1_scale", "0.125\n");
    write(root, "iio:device0/in_voltage1_offset", "0\n");
    write(root, "iio:device0/in_voltage2_raw", "abc\n");
    write(root, "iio:device0/in_voltage3_raw", "");
    write(
        root,
        "iio:device0/in_voltage4_raw",
        "123456789012345678901234567890\n",
    );
    write(
        root,
        "iio:device0/in_voltage0_raw_available",
        "[0 1 4095]\n",
    );
    write(root, "iio:device0/sampling_frequency", "1600\n");
    // An environmental sensor with processed values.
    write(root, "iio:device1/name", "bme280");
    write(root, "iio:device1/in_temp_input", "23450");
    write(root, "iio:device1/in_humidityrelative_input", "45123");
    write(root, "iio:device1/in_pressure_input", "101.325");
    // An IMU: a modifier channel with a type-wide scale, and a temperature with an offset.
    write(root, "iio:device2/name", "mpu6050");
    write(root, "iio:device2/in_accel_x_raw", "16384");
    write(root, "iio:device2/in_accel_scale", "0.000598550");
    write(root, "iio:device2/in_temp_raw", "2000");
    write(root, "iio:device2/in_temp_offset", "12420");
    write(root, "iio:device2/in_temp_scale", "2.941176");
    // A counter: no scale at all (scale 1), an unknown type, and a garbage scale.
    write(root, "iio:device3/name", "counter");
    write(root, "iio:device3/in_count0_raw", "42");
    write(root, "iio:device3/in_count1_raw", "5");
    write(root, "iio:device3/in_count1_scale", "bogus");
    // No name file, an unreadable channel, one good channel; both raw and input for one.
    write(root, "iio:device4/in_voltage1_raw", "10");
    fs::create_dir_all(root.join("bus/iio/devices/iio:device4/in_voltage0_raw")).unwrap();
    write(root, "iio:device4/in_voltage2_raw", "999");
    write(root, "iio:device4/in_voltage2_input", "1234");
    write(root, "trigger0/name", "not a device");
}

#[test]
fn scale_and_offset_are_applied_exactly() {
    let dir = tempfile::tempdir().unwrap();
    fake_iio(dir.path());
    let poll = IioSource::new(dir.path(), "edge-3").poll(NOW);

    let adc = record(&poll.records, "edge-3/iio/ads1015");
    assert_eq!(adc.ts, NOW);
    // (2048 + -100) * 0.5 = 974 mV; per-channel (1000 + 0) * 0.125 = 125 mV.
    assert_eq!(
        adc.fields,
        vec![
            ("voltage0_v".to_owned(), Value::F64(0.974)),
            ("voltage1_v".to_owned(), Value::F64(0.125))
        ]
    );
    let bme = record(&poll.records, "edge-3/iio/bme280");
    assert_eq!(
        bme.fields,
        vec![
            ("humidityrelative_pct".to_owned(), Value::F64(45.123)),
            ("pressure_kpa".to_owned(), Value::F64(101.325)),
            ("temp_c".to_owned(), Value::F64(23.45)),
        ]
    );
    let imu = record(&poll.records, "edge-3/iio/mpu6050");
    assert_eq!(
        imu.field("accel_x_m_s2"),
        Some(&Value::F64((16384.0 + 0.0) * 0.000598550))
    );
    assert_eq!(
        imu.field("temp_c"),
        Some(&Value::F64((2000.0 + 12420.0) * 2.941176 / 1000.0))
    );
    // No scale file: scale 1, unit as the ABI gives it, field named after the channel.
    assert_eq!(
        record(&poll.records, "edge-3/iio/counter").fields,
        vec![("count0".to_owned(), Value::F64(42.0))]
    );
    // `_input` wins over `_raw` and takes no scale.
    let unnamed = record(&poll.records, "edge-3/iio/iio_device4");
    assert_eq!(
        unnamed.fields,
        vec![
            ("voltage1_v".to_owned(), Value::F64(0.01)),
            ("voltage2_v".to_owned(), Value::F64(1.234))
        ]
    );
    assert_eq!(poll.records.len(), 5);
}

#[test]
fn bad_channels_get_specific_errors() {
    let dir = tempfile::tempdir().unwrap();
    fake_iio(dir.path());
    let poll = IioSource::new(dir.path(), "edge-3").poll(NOW);

    assert!(matches!(
        error_for(&poll.errors, "iio:device0/in_voltage2_raw"),
        SensorError::NotNumeric { value, .. } if value == "abc"
    ));
    assert!(matches!(
        error_for(&poll.errors, "iio:device0/in_voltage3_raw"),
        SensorError::Empty { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "iio:device0/in_voltage4_raw"),
        SensorError::OutOfRange { value, unit: "V", .. } if *value > 1e25
    ));
    assert!(matches!(
        error_for(&poll.errors, "iio:device3/in_count1_scale"),
        SensorError::NotNumeric { value, .. } if value == "bogus"
    ));
    assert!(matches!(
        error_for(&poll.errors, "iio:device4/name"),
        SensorError::Read { .. }
    ));
    assert!(matches!(
        error_for(&poll.errors, "iio:device4/in_voltage0_raw"),
        SensorError::Read { .. }
    ));
    assert_eq!(poll.errors.len(), 6, "{:#?}", poll.errors);
}

#[test]
fn a_missing_bus_is_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let poll = IioSource::new(dir.path(), "dev").poll(NOW);
    assert!(poll.records.is_empty());
    assert_eq!(poll.errors.len(), 1);
    assert!(
        matches!(&poll.errors[0], SensorError::Read { path, .. } if path.ends_with("bus/iio/devices"))
    );
}
