-- The README's DuckDB queries over tier 2 (the hub's Parquet files), for the hub of
-- examples/hub.toml after examples/run-fleet.sh posted examples/sample.ndjson:
--
--   duckdb < examples/duckdb/queries.sql            # the duckdb CLI, or with pip's duckdb:
--   python3 examples/duckdb/run.py [TIER2_DIR]
--
-- Each file holds one chunk of one stream; every record is in exactly one file, so counts are
-- exact. Files carry only the columns their records use: always read with union_by_name.
-- `ts` is the event time (TIMESTAMP WITH TIME ZONE, microseconds); `ingest_ts` the hub's.
-- A record arrives in tier 2 once its chunk is sealed (tier2.chunk_age_max, 10 s here); until
-- then it is in tier 1 only, readable with `core-hub read` or `core-hub export`.

SET VARIABLE tier2 = '/var/tmp/tributary/tier2';

-- Records per device and the event-time range each one covers.
SELECT device, count(*) AS records, min(ts) AS first_ts, max(ts) AS last_ts
FROM read_parquet(getvariable('tier2') || '/streams/telemetry/**/*.parquet', union_by_name = true)
GROUP BY device
ORDER BY device;

-- Exactly once: no (device, epoch, seq) appears twice.
SELECT count(*) AS records, count(DISTINCT (device, epoch, seq)) AS distinct_records
FROM read_parquet(getvariable('tier2') || '/streams/telemetry/**/*.parquet', union_by_name = true);

-- Per truck: mean engine temperature and top speed per minute of event time.
SELECT key, time_bucket(INTERVAL 1 minute, ts) AS minute,
       round(avg(engine_temp_c), 2) AS engine_temp_c, max(speed_kmh) AS speed_kmh_max
FROM read_parquet(getvariable('tier2') || '/streams/telemetry/**/*.parquet', union_by_name = true)
GROUP BY key, minute
ORDER BY key, minute;

-- The hub's ingest delay: event time to hub commit.
SELECT quantile_cont(epoch_ms(ingest_ts) - epoch_ms(ts), [0.5, 0.99]) AS delay_ms_p50_p99
FROM read_parquet(getvariable('tier2') || '/streams/telemetry/**/*.parquet', union_by_name = true);
