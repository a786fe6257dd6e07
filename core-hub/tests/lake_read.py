"""Reads a hub stream's Iceberg table with engines nobody here wrote, and prints one JSON object.

Usage: lake_read.py CATALOG_URI WAREHOUSE STREAM

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

import duckdb
import duckdb_extension_avro
import duckdb_extension_iceberg
import polars as pl
from pyiceberg.catalog.sql import SqlCatalog


def extension(module, name):
    root = pathlib.Path(module.__path__[0]) / "extensions"
    return str(next(root.glob(f"*/{name}.duckdb_extension")))


def main():
    uri, warehouse, stream = sys.argv[1:4]
    catalog = SqlCatalog("tributary", uri=uri, warehouse=warehouse)
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
    location = table.metadata_location.removeprefix("file://")
    duck = con.execute(
        f"SELECT count(*), count(DISTINCT hub_offset) FROM iceberg_scan('{location}')"
    ).fetchone()

    polars_rows = pl.scan_iceberg(table).select(pl.len()).collect().item()

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
