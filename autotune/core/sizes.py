"""Token counts in the long-context convention: K = 1024, M = 1024**2 (``5M`` = 5,242,880)."""

import re

from autotune.core.errors import UserError

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_PATTERN = re.compile(r"^\s*(\d[\d_]*)\s*([KMG]?)\s*$", re.IGNORECASE)
MAX_TOKENS = 1024**4  # far past any node; refuses typos like 1e99


def parse_tokens(text: "str | int", what: str = "length") -> int:
    """Parse ``5M``, ``128K``, ``5_242_880`` or ``4096`` into a positive integer token count."""
    if isinstance(text, bool):
        raise UserError(f"{what} {text!r} is not a token count")
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(str(text))
        if not match:
            raise UserError(f"{what} {text!r} is not a token count: use an integer or a K/M suffix (128K, 5M)")
        value = int(match.group(1).replace("_", "")) * _SUFFIX[match.group(2).upper()]
    if value <= 0:
        raise UserError(f"{what} {text!r} must be positive")
    if value > MAX_TOKENS:
        raise UserError(f"{what} {text!r} is beyond any node ({MAX_TOKENS:,} tokens at most)")
    return value


def short_tokens(tokens: int) -> str:
    """The count as ``parse_tokens`` reads it, as short as exact: ``5M``, ``128K``, ``1000``."""
    for suffix, unit in (("M", 1024**2), ("K", 1024)):
        if tokens >= unit and tokens % unit == 0:
            return f"{tokens // unit}{suffix}"
    return str(tokens)


def format_tokens(tokens: int) -> str:
    """Exact count with its short form when that differs: ``5,242,880 (5M)``; ``1,000``."""
    short = short_tokens(tokens)
    return f"{tokens:,}" if short == str(tokens) else f"{tokens:,} ({short})"


def format_count(count: int) -> str:
    """A count (of parameters) in the decimal unit that fits: ``1.75 M``, ``8.03 B``, ``512``."""
    for suffix, unit in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if round(count / unit, 2) >= 1:  # 999,999 is 1.00 M, not 1000.00 K
            return f"{count / unit:.2f} {suffix}"
    return str(count)


def format_memory(size_bytes: int) -> str:
    """Bytes in the binary unit that reads best: ``12.3 GiB``, ``76 MiB``, ``512 KiB`` (a tiny model's peak is not
    ``0.0 GiB``)."""
    if size_bytes >= 2**30:
        return f"{size_bytes / 2**30:.1f} GiB"
    return f"{size_bytes / 2**20:.0f} MiB" if size_bytes >= 2**20 else f"{size_bytes / 2**10:.0f} KiB"


def format_duration(seconds: float) -> str:
    """A time in the unit that reads best: ``0.42 s``, ``12.3 s``, ``14 min``, ``2.2 h``, ``3.1 days``."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
