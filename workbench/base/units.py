"""Sizes as users write them: bytes from "24GiB", "80GB" or a number (GB = 10^9, GiB = 2^30)."""

import re

from workbench.base.errors import WorkbenchError

GiB = 2**30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from 25769803776, "24GiB", "80GB", "16 GiB" or "1.5 TiB" (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise WorkbenchError(f"device memory must be positive, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise WorkbenchError(f"device memory: cannot read {value!r} (use bytes or e.g. 24GiB, 80GB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """A size as a message shows it: GiB from a tenth of one up, MiB below."""
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.0f} MiB"
