"""What the benchmark scripts print and write: a markdown table on stdout, rows and their setting as
JSON."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def print_table(header: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


def write_json(path: Path, rows: list[dict], **meta) -> None:
    """rows plus meta (the run's setting; the machine is added) to path, folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.processor() or platform.machine(), **meta)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {path}", file=sys.stderr)
