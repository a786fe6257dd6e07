//! `kind = "modbus"` sources: the raw register map as the file holds it, and its typed form.
//!
//! Everything about a channel is checked here, once, at load: the function and type fit each
//! other, the registers a type needs fit below 65536, names are unique (they become the fields
//! of one record), and scale and offset are finite. Overlapping addresses are allowed: two
//! channels may read the same registers in different orders.
//!
//! A device is reached over TCP (`address`) or over a serial line (`transport = "rtu"` with a
//! `[sources.serial]` table). Several RTU devices may share one line: [`check_buses`] makes
//! sure they agree on its settings and that no unit id is polled twice on it.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, StreamConfig, host_name, host_of, parse_duration, required};

/// A Modbus device polled on an interval. See `sources::modbus`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModbusSourceConfig {
    /// `transport` with `address` or `[sources.serial]`: how the device is reached.
    pub transport: ModbusTransport,
    /// `unit_id`: the unit (slave) id in every request; default 1 (1 to 247 on a serial line).
    pub unit_id: u8,
    /// `poll_interval`: how often every channel is read; default 1 s.
    pub poll_interval: Duration,
    /// `timeout`: for the connect and for each read; default 1 s.
    pub timeout: Duration,
    pub stream: String,
    /// `key`: the routing key of every record; default the host name.
    pub key: String,
    /// `[[sources.channels]]`: one field of the record each.
    pub channels: Vec<ModbusChannel>,
}

impl Eq for ModbusSourceConfig {}

impl ModbusSourceConfig {
    /// The device as `/v1/status` names it: `host:port`, or the serial line and unit.
    pub fn describe(&self) -> String {
        match &self.transport {
            ModbusTransport::Tcp { address } => address.clone(),
            ModbusTransport::Rtu(line) => format!("{} unit {}", line.describe(), self.unit_id),
        }
    }
}

/// How a Modbus device is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModbusTransport {
    /// `transport = "tcp"` (the default): Modbus TCP to `address`, `host:port`.
    Tcp { address: String },
    /// `transport = "rtu"`: Modbus RTU on a serial line, shared by every RTU device with the
    /// same `serial.path`.
    Rtu(SerialLine),
}

/// `[sources.serial]`: one serial line (an RS-485 bus, an RS-232 port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SerialLine {
    /// `path`: the port, such as `/dev/ttyUSB0`.
    pub path: PathBuf,
    /// `baud`: bits per second.
    pub baud: u32,
    /// `parity`: default even, the Modbus serial line default.
    pub parity: Parity,
    /// `data_bits`: 5 to 8; default 8 (RTU devices use 8).
    pub data_bits: u8,
    /// `stop_bits`: 1 or 2; default 1.
    pub stop_bits: u8,
}

impl SerialLine {
    /// `/dev/ttyUSB0 19200 8E1`.
    pub fn describe(&self) -> String {
        let p = match self.parity {
            Parity::None => 'N',
            Parity::Even => 'E',
            Parity::Odd => 'O',
        };
        format!(
            "{} {} {}{p}{}",
            self.path.display(),
            self.baud,
            self.data_bits,
            self.stop_bits
        )
    }
}

/// A serial line's parity bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parity {
    None,
    Even,
    Odd,
}

/// One value read from the device: `value = raw * scale + offset`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModbusChannel {
    pub name: String,
    pub function: ModbusFunction,
    pub address: u16,
    pub ty: ModbusType,
    /// `byte_order`: the order of the two bytes inside each register; default big.
    pub byte_order: Order,
    /// `word_order`: the order of the registers of a 32- or 64-bit value; default big (the
    /// first register holds the most significant word).
    pub word_order: Order,
    pub scale: f64,
    pub offset: f64,
}

/// Which Modbus table a channel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModbusFunction {
    /// Function 3.
    Holding,
    /// Function 4.
    Input,
    /// Function 1.
    Coil,
    /// Function 2.
    Discrete,
}

impl ModbusFunction {
    /// Coils and discrete inputs are bits; holding and input registers are words.
    pub fn is_bit(self) -> bool {
        matches!(self, ModbusFunction::Coil | ModbusFunction::Discrete)
    }
}

/// How a channel's registers are read as a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModbusType {
    U16,
    I16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
    Bool,
}

impl ModbusType {
    /// Registers (or bits, for `bool`) one value spans.
    pub fn count(self) -> u16 {
        match self {
            ModbusType::U16 | ModbusType::I16 | ModbusType::Bool => 1,
            ModbusType::U32 | ModbusType::I32 | ModbusType::F32 => 2,
            ModbusType::U64 | ModbusType::I64 | ModbusType::F64 => 4,
        }
    }

    fn parse(key: &str, s: &str) -> Result<Self, ConfigError> {
        Ok(match s {
            "u16" => ModbusType::U16,
            "i16" => ModbusType::I16,
            "u32" => ModbusType::U32,
            "i32" => ModbusType::I32,
            "f32" => ModbusType::F32,
            "u64" => ModbusType::U64,
            "i64" => ModbusType::I64,
            "f64" => ModbusType::F64,
            "bool" => ModbusType::Bool,
            other => {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "expected u16 | i16 | u32 | i32 | f32 | u64 | i64 | f64 | bool, found {other:?}"
                    ),
                ));
            }
        })
    }
}

/// Byte order inside a register, or word order across registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Big,
    Little,
}

impl Order {
    fn parse(key: &str, v: Option<String>) -> Result<Self, ConfigError> {
        match v.as_deref().unwrap_or("big") {
            "big" => Ok(Order::Big),
            "little" => Ok(Order::Little),
            other => Err(ConfigError::invalid(
                key,
                format!("expected big | little, found {other:?}"),
            )),
        }
    }
}

/// The settings of a `kind = "modbus"` source, as `RawSource` collects them.
#[derive(Debug, Default)]
pub(super) struct RawModbus {
    pub transport: Option<String>,
    pub address: Option<String>,
    pub serial: Option<RawSerial>,
    pub unit_id: Option<String>,
    pub poll_interval: Option<String>,
    pub timeout: Option<String>,
    pub stream: Option<String>,
    pub key: Option<String>,
    pub channels: Option<Vec<RawChannel>>,
}

/// `[sources.serial]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSerial {
    path: Option<String>,
    baud: Option<String>,
    parity: Option<String>,
    data_bits: Option<String>,
    stop_bits: Option<String>,
}

/// `[[sources.channels]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawChannel {
    name: Option<String>,
    function: Option<String>,
    address: Option<String>,
    #[serde(rename = "type")]
    ty: Option<String>,
    byte_order: Option<String>,
    word_order: Option<String>,
    scale: Option<String>,
    offset: Option<String>,
}

impl RawModbus {
    pub(super) fn into_typed(
        self,
        index: usize,
        streams: &[StreamConfig],
        base: &std::path::Path,
    ) -> Result<ModbusSourceConfig, ConfigError> {
        let key = |k: &str| format!("sources[{index}].{k}");
        if !cfg!(feature = "modbus") {
            return Err(ConfigError::invalid(
                key("kind"),
                "this agent was built without Modbus support: build it with \
                 `cargo build -p edge-agent --features modbus`",
            ));
        }
        let transport = transport_typed(&key, self.transport, self.address, self.serial, base)?;
        let rtu = matches!(transport, ModbusTransport::Rtu(_));
        let unit_id = match self.unit_id {
            None => 1,
            Some(s) => s
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|u| !rtu || (1..=247).contains(u))
                .ok_or_else(|| {
                    let range = if rtu {
                        "1 to 247 on a serial line (0 is broadcast, which no device answers)"
                    } else {
                        "0 to 255"
                    };
                    ConfigError::invalid(key("unit_id"), format!("expected {range}, found {s:?}"))
                })?,
        };
        let duration = |k: &str, v: Option<String>| -> Result<Duration, ConfigError> {
            let d = match v {
                None => Duration::from_secs(1),
                Some(s) => parse_duration(&key(k), &s)?,
            };
            if d.is_zero() {
                return Err(ConfigError::invalid(
                    key(k),
                    "must be above zero, such as 1s",
                ));
            }
            Ok(d)
        };
        let poll_interval = duration("poll_interval", self.poll_interval)?;
        let timeout = duration("timeout", self.timeout)?;
        let stream = required(&key("stream"), self.stream)?;
        super::source_stream_ok(&key("stream"), &stream, streams)?;
        let raw_channels = self.channels.unwrap_or_default();
        if raw_channels.is_empty() {
            return Err(ConfigError::invalid(
                key("channels"),
                "expected at least one [[sources.channels]] entry",
            ));
        }
        let mut channels: Vec<ModbusChannel> = Vec::with_capacity(raw_channels.len());
        for (j, c) in raw_channels.into_iter().enumerate() {
            let c = c.into_typed(&key(&format!("channels[{j}]")))?;
            if channels.iter().any(|o| o.name == c.name) {
                return Err(ConfigError::invalid(
                    key(&format!("channels[{j}].name")),
                    format!("{:?} is already the name of another channel", c.name),
                ));
            }
            channels.push(c);
        }
        Ok(ModbusSourceConfig {
            transport,
            unit_id,
            poll_interval,
            timeout,
            stream,
            key: self.key.filter(|k| !k.is_empty()).unwrap_or_else(host_name),
            channels,
        })
    }
}

/// `transport`, with `address` for TCP or `[sources.serial]` for RTU and never both.
fn transport_typed(
    key: &dyn Fn(&str) -> String,
    transport: Option<String>,
    address: Option<String>,
    serial: Option<RawSerial>,
    base: &std::path::Path,
) -> Result<ModbusTransport, ConfigError> {
    match transport.as_deref().unwrap_or("tcp") {
        "tcp" => {
            if serial.is_some() {
                return Err(ConfigError::invalid(
                    key("serial"),
                    "only for transport = \"rtu\" (this source is Modbus TCP)",
                ));
            }
            let address = required(&key("address"), address)?;
            host_of(&key("address"), &address)?;
            Ok(ModbusTransport::Tcp { address })
        }
        "rtu" => {
            if address.is_some() {
                return Err(ConfigError::invalid(
                    key("address"),
                    "not for transport = \"rtu\": the device is on [sources.serial] path, \
                     picked by unit_id",
                ));
            }
            let serial = serial.ok_or_else(|| {
                ConfigError::invalid(
                    key("serial"),
                    "required with transport = \"rtu\": a table with path and baud",
                )
            })?;
            serial
                .into_typed(&key("serial"), base)
                .map(ModbusTransport::Rtu)
        }
        other => Err(ConfigError::invalid(
            key("transport"),
            format!("expected tcp | rtu, found {other:?}"),
        )),
    }
}

impl RawSerial {
    fn into_typed(self, prefix: &str, base: &std::path::Path) -> Result<SerialLine, ConfigError> {
        let key = |k: &str| format!("{prefix}.{k}");
        let path = required(&key("path"), self.path)?;
        let baud_text = required(&key("baud"), self.baud)?;
        let baud = baud_text
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                ConfigError::invalid(
                    key("baud"),
                    format!("expected bits per second such as 19200, found {baud_text:?}"),
                )
            })?;
        let parity = match self.parity.as_deref().unwrap_or("even") {
            "none" => Parity::None,
            "even" => Parity::Even,
            "odd" => Parity::Odd,
            other => {
                return Err(ConfigError::invalid(
                    key("parity"),
                    format!("expected none | even | odd, found {other:?}"),
                ));
            }
        };
        let small = |k: &str, v: Option<String>, default: u8, ok: &[u8]| {
            let Some(s) = v else { return Ok(default) };
            s.trim()
                .parse::<u8>()
                .ok()
                .filter(|n| ok.contains(n))
                .ok_or_else(|| {
                    ConfigError::invalid(key(k), format!("expected one of {ok:?}, found {s:?}"))
                })
        };
        Ok(SerialLine {
            path: super::resolve_path(&key("path"), &path, base)?,
            baud,
            parity,
            data_bits: small("data_bits", self.data_bits, 8, &[5, 6, 7, 8])?,
            stop_bits: small("stop_bits", self.stop_bits, 1, &[1, 2])?,
        })
    }
}

/// Checks the serial lines the RTU sources share. `sources` pairs each Modbus source with its
/// index in `[[sources]]`. Every source on one `serial.path` must give the line the same
/// settings (there is one line), and no unit id may be polled twice on it.
pub(super) fn check_buses(sources: &[(usize, &ModbusSourceConfig)]) -> Result<(), ConfigError> {
    for (n, (j, cfg)) in sources.iter().enumerate() {
        let ModbusTransport::Rtu(line) = &cfg.transport else {
            continue;
        };
        let earlier = sources[..n].iter().filter_map(|(i, c)| match &c.transport {
            ModbusTransport::Rtu(l) if l.path == line.path => Some((i, c, l)),
            _ => None,
        });
        for (i, other, other_line) in earlier {
            if other_line != line {
                return Err(ConfigError::invalid(
                    format!("sources[{j}].serial"),
                    format!(
                        "{} is also the line of sources[{i}], set there as {}: every device on \
                         one line must give it the same baud, parity, data_bits and stop_bits",
                        line.describe(),
                        other_line.describe()
                    ),
                ));
            }
            if other.unit_id == cfg.unit_id {
                return Err(ConfigError::invalid(
                    format!("sources[{j}].unit_id"),
                    format!(
                        "unit {} on {} is already polled by sources[{i}]",
                        cfg.unit_id,
                        line.path.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl RawChannel {
    fn into_typed(self, prefix: &str) -> Result<ModbusChannel, ConfigError> {
        let key = |k: &str| format!("{prefix}.{k}");
        let name = required(&key("name"), self.name)?;
        let function = match required(&key("function"), self.function)?.as_str() {
            "holding" => ModbusFunction::Holding,
            "input" => ModbusFunction::Input,
            "coil" => ModbusFunction::Coil,
            "discrete" => ModbusFunction::Discrete,
            other => {
                return Err(ConfigError::invalid(
                    key("function"),
                    format!("expected holding | input | coil | discrete, found {other:?}"),
                ));
            }
        };
        let address_text = required(&key("address"), self.address)?;
        let address = address_text.trim().parse::<u16>().map_err(|_| {
            ConfigError::invalid(
                key("address"),
                format!("expected 0 to 65535, found {address_text:?}"),
            )
        })?;
        let default_ty = if function.is_bit() { "bool" } else { "u16" };
        let ty = ModbusType::parse(&key("type"), self.ty.as_deref().unwrap_or(default_ty))?;
        if function.is_bit() != (ty == ModbusType::Bool) {
            return Err(ConfigError::invalid(
                key("type"),
                if function.is_bit() {
                    "coils and discrete inputs are bits: the type must be bool"
                } else {
                    "registers hold numbers: bool is only for function = coil | discrete"
                },
            ));
        }
        if u32::from(address) + u32::from(ty.count()) > 65_536 {
            return Err(ConfigError::invalid(
                key("address"),
                format!(
                    "a {ty:?} at {address} spans {} registers, past the last address 65535",
                    ty.count()
                ),
            ));
        }
        let number = |k: &str, v: Option<String>, default: f64| -> Result<f64, ConfigError> {
            let Some(s) = v else { return Ok(default) };
            if ty == ModbusType::Bool {
                return Err(ConfigError::invalid(
                    key(k),
                    "not allowed for a bool channel",
                ));
            }
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| {
                    ConfigError::invalid(key(k), format!("expected a finite number, found {s:?}"))
                })
        };
        Ok(ModbusChannel {
            name,
            function,
            address,
            ty,
            byte_order: Order::parse(&key("byte_order"), self.byte_order)?,
            word_order: Order::parse(&key("word_order"), self.word_order)?,
            scale: number("scale", self.scale, 1.0)?,
            offset: number("offset", self.offset, 0.0)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ConfigError, EdgeConfig, SourceConfig};
    use std::path::Path;

    fn load(channels: &str) -> Result<EdgeConfig, ConfigError> {
        let text = format!(
            "data_dir = \"d\"\n[[streams]]\nname = \"plc\"\n[[sources]]\nkind = \"modbus\"\n\
             address = \"127.0.0.1:5020\"\nunit_id = 7\npoll_interval = \"250ms\"\nstream = \"plc\"\n\
             key = \"line-1/plc\"\n{channels}"
        );
        EdgeConfig::from_toml(&text, Path::new("/etc/tributary"), None)
    }

    fn error_key(channels: &str) -> String {
        load(channels)
            .expect_err("config should be refused")
            .key()
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn a_register_map_loads_into_types() {
        let cfg = load(
            "[[sources.channels]]\nname = \"temp\"\nfunction = \"holding\"\naddress = 10\n\
             type = \"f32\"\nword_order = \"little\"\nscale = 0.5\noffset = -3\n\
             [[sources.channels]]\nname = \"run\"\nfunction = \"coil\"\naddress = 0\n",
        )
        .unwrap();
        let SourceConfig::Modbus(m) = &cfg.sources[0] else {
            panic!("not a modbus source: {:?}", cfg.sources[0]);
        };
        assert_eq!(m.unit_id, 7);
        assert_eq!(m.poll_interval.as_millis(), 250);
        assert_eq!(m.key, "line-1/plc");
        assert_eq!(m.channels.len(), 2);
        assert_eq!(m.channels[0].ty, super::ModbusType::F32);
        assert_eq!(m.channels[0].word_order, super::Order::Little);
        assert_eq!(m.channels[0].byte_order, super::Order::Big);
        assert_eq!((m.channels[0].scale, m.channels[0].offset), (0.5, -3.0));
        assert_eq!(m.channels[1].ty, super::ModbusType::Bool);
    }

    #[test]
    fn each_bad_channel_setting_names_its_key() {
        let ch = |extra: &str| {
            format!(
                "[[sources.channels]]\nname = \"a\"\nfunction = \"holding\"\naddress = 1\n{extra}"
            )
        };
        let cases = [
            (ch("type = \"u128\"\n"), "sources[0].channels[0].type"),
            (ch("type = \"bool\"\n"), "sources[0].channels[0].type"),
            (ch("byte_order = \"middle\"\n"), "sources[0].channels[0].byte_order"),
            (ch("word_order = \"x\"\n"), "sources[0].channels[0].word_order"),
            (ch("scale = \"fast\"\n"), "sources[0].channels[0].scale"),
            (ch("colour = 1\n"), "sources[0].channels[0].colour"),
            (
                "[[sources.channels]]\nname = \"a\"\nfunction = \"fifo\"\naddress = 1\n".into(),
                "sources[0].channels[0].function",
            ),
            (
                "[[sources.channels]]\nname = \"a\"\nfunction = \"holding\"\naddress = 65535\ntype = \"u32\"\n".into(),
                "sources[0].channels[0].address",
            ),
            (
                "[[sources.channels]]\nname = \"a\"\nfunction = \"coil\"\naddress = 1\nscale = 2\n".into(),
                "sources[0].channels[0].scale",
            ),
            (
                format!("{}{}", ch(""), ch("").replace("address = 1", "address = 2")),
                "sources[0].channels[1].name",
            ),
            (String::new(), "sources[0].channels"),
        ];
        for (channels, key) in cases {
            let got = error_key(&channels);
            assert!(
                got.ends_with(key) || got == key,
                "{channels:?}: key {got:?}, expected {key:?}"
            );
        }
    }

    const CH: &str = "[[sources.channels]]\nname = \"a\"\nfunction = \"holding\"\naddress = 1\n";

    /// An RTU source for unit `unit` with `serial` as the body of its `[sources.serial]`.
    fn rtu(unit: u8, serial: &str) -> String {
        format!(
            "[[sources]]\nkind = \"modbus\"\ntransport = \"rtu\"\nunit_id = {unit}\nstream = \"plc\"\n\
             [sources.serial]\n{serial}{CH}"
        )
    }

    fn load_sources(sources: &str) -> Result<EdgeConfig, ConfigError> {
        let text = format!("data_dir = \"d\"\n[[streams]]\nname = \"plc\"\n{sources}");
        EdgeConfig::from_toml(&text, Path::new("/etc/tributary"), None)
    }

    #[test]
    fn rtu_units_on_one_line_load_into_types() {
        let line = "path = \"/dev/ttyUSB0\"\nbaud = 19200\n";
        let cfg = load_sources(&format!("{}{}", rtu(1, line), rtu(2, line))).unwrap();
        let SourceConfig::Modbus(m) = &cfg.sources[1] else {
            panic!("not a modbus source: {:?}", cfg.sources[1]);
        };
        let super::ModbusTransport::Rtu(l) = &m.transport else {
            panic!("not RTU: {m:?}");
        };
        assert_eq!(l.path, Path::new("/dev/ttyUSB0"));
        assert_eq!(
            (l.baud, l.parity, l.data_bits, l.stop_bits),
            (19200, super::Parity::Even, 8, 1)
        );
        assert_eq!(m.unit_id, 2);
        assert_eq!(m.describe(), "/dev/ttyUSB0 19200 8E1 unit 2");
        let odd = "path = \"tty\"\nbaud = 9600\nparity = \"odd\"\ndata_bits = 7\nstop_bits = 2\n";
        let cfg = load_sources(&rtu(5, odd)).unwrap();
        let SourceConfig::Modbus(m) = &cfg.sources[0] else {
            panic!("not a modbus source");
        };
        assert_eq!(
            m.describe(),
            "/etc/tributary/tty 9600 7O2 unit 5",
            "relative to the config"
        );
    }

    #[test]
    fn each_bad_transport_setting_names_its_key() {
        let line = "path = \"/dev/ttyS0\"\nbaud = 19200\n";
        let tcp = "[[sources]]\nkind = \"modbus\"\naddress = \"127.0.0.1:502\"\nstream = \"plc\"\n";
        let cases = [
            (
                rtu(1, line).replace("\"rtu\"", "\"udp\""),
                "sources[0].transport",
            ),
            (
                format!(
                    "[[sources]]\nkind = \"modbus\"\ntransport = \"rtu\"\nstream = \"plc\"\n{CH}"
                ),
                "sources[0].serial",
            ),
            (
                rtu(1, line).replace("unit_id = 1", "unit_id = 1\naddress = \"127.0.0.1:502\""),
                "sources[0].address",
            ),
            (
                format!("{tcp}[sources.serial]\n{line}{CH}"),
                "sources[0].serial",
            ),
            (rtu(1, "path = \"/dev/ttyS0\"\n"), "sources[0].serial.baud"),
            (rtu(1, "baud = 9600\n"), "sources[0].serial.path"),
            (
                rtu(1, &format!("{line}baud_rate = 1\n")),
                "sources[0].serial.baud_rate",
            ),
            (
                rtu(1, &format!("{line}parity = \"mark\"\n")),
                "sources[0].serial.parity",
            ),
            (
                rtu(1, &format!("{line}data_bits = 9\n")),
                "sources[0].serial.data_bits",
            ),
            (
                rtu(1, &format!("{line}stop_bits = 3\n")),
                "sources[0].serial.stop_bits",
            ),
            (
                rtu(1, "path = \"/dev/ttyS0\"\nbaud = 0\n"),
                "sources[0].serial.baud",
            ),
            (rtu(0, line), "sources[0].unit_id"),
            (rtu(248, line), "sources[0].unit_id"),
            (
                format!("{}{}", rtu(1, line), rtu(2, &line.replace("19200", "9600"))),
                "sources[1].serial",
            ),
            (
                format!("{}{}", rtu(4, line), rtu(4, line)),
                "sources[1].unit_id",
            ),
        ];
        for (sources, key) in cases {
            let got = load_sources(&sources)
                .expect_err("config should be refused")
                .key()
                .unwrap_or_default()
                .to_owned();
            assert!(
                got.ends_with(key) || got == key,
                "{sources:?}: key {got:?}, expected {key:?}"
            );
        }
        // The same unit id on two different lines is two devices.
        let other = "path = \"/dev/ttyS1\"\nbaud = 19200\n";
        load_sources(&format!("{}{}", rtu(4, line), rtu(4, other))).unwrap();
    }
}
