"""The common tail of the research commands: log a result's markdown table and, with --out, write the result as
JSON and the table as markdown into that folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any


def report(log: logging.Logger, res: dict[str, Any], table: str, out: Path | None,
           names: tuple[str, str] = ("results.json", "table.md")) -> None:
    log.info("\n%s", table)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / names[0]).write_text(json.dumps(res, indent=2))
        (out / names[1]).write_text(table + "\n")
