#!/usr/bin/env python3
"""Runs examples/duckdb/queries.sql with pip's duckdb (`pip install duckdb`) and prints each
result. An argument replaces the tier-2 directory the file names (SET VARIABLE tier2)."""
import pathlib
import sys

import duckdb

text = (pathlib.Path(__file__).parent / "queries.sql").read_text()
# Comments first (they may hold a `;`), then one statement per `;`.
sql = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("--"))
con = duckdb.connect()
for body in (s.strip() for s in sql.split(";")):
    if not body:
        continue
    if body.startswith("SET VARIABLE tier2") and len(sys.argv) > 1:
        body = "SET VARIABLE tier2 = '" + sys.argv[1].replace("'", "''") + "'"
    result = con.sql(body)
    if result is not None:
        result.show(max_rows=20)
