import pytest

from autotune.core.errors import UserError
from autotune.core.sizes import format_duration, format_tokens, parse_tokens


@pytest.mark.parametrize(
    "text, tokens",
    [
        ("5M", 5_242_880),
        ("5m", 5_242_880),
        ("128K", 131_072),
        ("5242880", 5_242_880),
        ("5_242_880", 5_242_880),
        ("4K", 4096),
        (4096, 4096),
        ("1G", 1024**3),
    ],
)
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["5Q", "0", "-1", "1e99", "2.5M", "1.5", "", "M", "K5", True])
def test_parse_tokens_refuses(text):
    with pytest.raises(UserError):
        parse_tokens(text)


def test_format_tokens_is_exact():
    assert format_tokens(5_242_880) == "5,242,880 (5M)"
    assert format_tokens(131_072) == "131,072 (128K)"
    assert format_tokens(1000) == "1,000"


@pytest.mark.parametrize(
    "seconds, words",
    [(0.4234, "0.42 s"), (12.34, "12.3 s"), (840, "14 min"), (7950, "2.2 h"), (3 * 86400, "3.0 days")],
)
def test_format_duration_picks_the_unit_that_reads_best(seconds, words):
    assert format_duration(seconds) == words
