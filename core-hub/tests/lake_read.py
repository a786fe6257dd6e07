"""Reads a hub stream's Iceberg table with engines nobody here wrote, and prints one JSON object.

Usage: lake_read.py CATALOG_URI WAREHOUSE STREAM

With a tier 2 on S3, `TRIBUTARY_LAKE_S3` holds `endpoint,access_key,secret_key` (path-style,
plain HTTP), and DuckDB loads its httpfs extension too.

- pyiceberg (its SqlCatalog on the hub's catalog): the table's columns and types, its
  snapshots with their `tributary.tiered-end`, every row's (device, seq, hub_offset) in the
  current snapshot, and the rows each earlier snapshot held (time travel);
- DuckDB's iceberg extension (from the `duckdb-extension-iceberg` wheel, loaded by path,
  no network): rows and distinct hub offsets of the current metadata file;
- polars `scan_iceberg`: the row count.

Run with the interpreter `.ci/test` prepares (`/opt/tributary-lake/bin/python`).
"""

import json
import pathlib
import sys

import os

import duckdb
import duckdb_extension_avro
import duckdb_extension_httpfs
import duckdb_extension_iceberg
import polars as pl
from pyiceberg.catalog.sql import SqlCatalog


def extension(module, name):
    root = pathlib.Path(module.__path__[0]) / "extensions"
    return str(next(root.glob(f"*/{name}.duckdb_extension")))


def main():
    uri, warehouse, stream = sys.argv[1:4]
    s3 = os.environ.get("TRIBUTARY_LAKE_S3")
    props = {}
    if s3:
        endpoint, key, secret = s3.split(",")
        props = {
            "s3.endpoint": endpoint,
            "s3.access-key-id": key,
            "s3.secret-access-key": secret,
            "s3.region": "us-east-1",
        }
    catalog = SqlCatalog("tributary", uri=uri, warehouse=warehouse, **props)
    table = catalog.load_table(f"tributary.{stream}")
    columns = {f.name: str(f.field_type) for f in table.schema().fields}
    rows = table.scan(selected_fields=("device", "seq", "hub_offset")).to_arrow()
    current = sorted(zip(rows["device"].to_pylist(), rows["seq"].to_pylist(), rows["hub_offset"].to_pylist()))
    snapshots = []
    for snap in sorted(table.snapshots(), key=lambda s: s.sequence_number):
        props = snap.summary.additional_properties if snap.summary else {}
        held = table.scan(snapshot_id=snap.snapshot_id, selected_fields=("hub_offset",)).to_arrow()
        snapshots.append(
            {
                "id": snap.snapshot_id,
                "tiered_end": int(props.get("tributary.tiered-end", "-1")),
                "offsets": sorted(held["hub_offset"].to_pylist()),
            }
        )
    data_files = [t.file.file_path for t in table.scan().plan_files()]

    con = duckdb.connect()
    con.execute(f"LOAD '{extension(duckdb_extension_avro, 'avro')}'")
    con.execute(f"LOAD '{extension(duckdb_extension_iceberg, 'iceberg')}'")
    if s3:
        con.execute(f"LOAD '{extension(duckdb_extension_httpfs, 'httpfs')}'")
        host = endpoint.removeprefix("http://")
        con.execute(
            f"CREATE SECRET (TYPE s3, KEY_ID '{key}', SECRET '{secret}', ENDPOINT '{host}', "
            "URL_STYLE 'path', USE_SSL false, REGION 'us-east-1')"
        )
    location = table.metadata_location.removeprefix("file://")
    duck = con.execute(
        f"SELECT count(*), count(DISTINCT hub_offset) FROM iceberg_scan('{location}')"
    ).fetchone()

    options = None
    if s3:
        options = {
            "aws_endpoint_url": endpoint,
            "aws_access_key_id": key,
            "aws_secret_access_key": secret,
            "aws_region": "us-east-1",
            "aws_allow_http": "true",
        }
    polars_rows = pl.scan_iceberg(table, storage_options=options).select(pl.len()).collect().item()

    print(
        json.dumps(
            {
                "columns": columns,
                "rows": current,
                "snapshots": snapshots,
                "data_files": data_files,
                "duckdb": {"rows": duck[0], "distinct_offsets": duck[1]},
                "polars_rows": polars_rows,
            }
        )
    )


main()
