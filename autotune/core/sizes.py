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


def format_tokens(tokens: int) -> str:
    """Exact count with a readable suffix: ``5,242,880 (5M)``."""
    for suffix, unit in (("M", 1024**2), ("K", 1024)):
        if tokens >= unit and tokens % unit == 0:
            return f"{tokens:,} ({tokens // unit}{suffix})"
    return f"{tokens:,}"
