"""What every benchmark script here does once it has measured: the load average before and
after beside the record, the table printed, the record written as JSON when asked."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def measure_and_report(
    measure: Callable[[], dict[str, Any]], print_table: Callable[[dict[str, Any]], None], out: Path | None
) -> int:
    """Run ``measure`` between two load-average readings, print its table, write ``out``."""
    load_before = os.getloadavg()
    record = measure()
    record["load_before"], record["load_after"] = load_before, os.getloadavg()
    print_table(record)
    if out:
        out.write_text(json.dumps(record, indent=2) + "\n")
    return 0
