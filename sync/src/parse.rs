//! Ingest parsers: JSON objects and InfluxDB line protocol.
