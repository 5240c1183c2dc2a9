"""Parquet in/out and the report every preparation step prints.

Invariant: no row is dropped silently — every skipped row is in ``PrepReport.bad`` with its
index and reason, every duplicate is counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

MAX_REPORTED_BAD = 50


class BadRow(BaseModel):
    index: int
    reason: str


class PrepReport(BaseModel):
    input: str
    output: str
    rows_read: int = 0
    rows_written: int = 0
    bad_rows: int = 0
    duplicates: int = 0
    bad: list[BadRow] = Field(default_factory=list, description=f"first {MAX_REPORTED_BAD} bad rows")

    def add_bad(self, index: int, reason: str) -> None:
        self.bad_rows += 1
        if len(self.bad) < MAX_REPORTED_BAD:
            self.bad.append(BadRow(index=index, reason=reason))

    def summary(self) -> str:
        lines = [
            f"{self.input} -> {self.output}: read {self.rows_read}, wrote {self.rows_written}, "
            f"skipped {self.bad_rows} bad, removed {self.duplicates} duplicates"
        ]
        lines += [f"  row {b.index}: {b.reason}" for b in self.bad]
        if self.bad_rows > len(self.bad):
            lines.append(f"  … and {self.bad_rows - len(self.bad)} more")
        return "\n".join(lines)


def iter_rows(path: str | Path, batch_size: int = 4096) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a parquet file as dicts, with their index, streamed batch by batch."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    index = 0
    for batch in pq.ParquetFile(p).iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def columns_of(path: str | Path) -> list[str]:
    return list(pq.ParquetFile(Path(path)).schema_arrow.names)


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), p)
