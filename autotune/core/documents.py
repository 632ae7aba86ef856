"""``--documents SPEC``: the documents a workload trains on, parsed once for every command that takes it.

SPEC is ``one`` (one document per sequence, the default), a fixed length (``64K``: a token count as ``--seq``
takes it), or a file of documents: a JSON list of lengths or of documents' token ids, a parquet file whose first
integer column holds lengths or whose first list column holds token ids, or a CSV file whose first integer column
holds lengths (with a header row or without). Documents are packed in the file's order
into each sequence (``trials.kernels.documents.Documents.packed``), as the trainer packs them.
"""

from __future__ import annotations

import json
from pathlib import Path

from autotune.core.errors import UserError
from autotune.core.sizes import parse_tokens, short_tokens
from trials.kernels.documents import ONE, DocumentsSpec

DOCUMENTS_HELP = (
    "the documents packed into each sequence: 'one' (one document per sequence), a length (64K), or a JSON/parquet "
    "file of document lengths or token ids, or a CSV file of lengths; attention stays inside each document"
)


def parse_documents(text: str | None) -> DocumentsSpec:
    """``--documents``'s value as a ``DocumentsSpec`` (UserError, one line, on bad input)."""
    if text is None or text.strip().lower() == "one":
        return ONE
    path = Path(text)
    if path.suffix.lower() in (".json", ".parquet", ".csv") or path.exists():
        return DocumentsSpec(_lengths_of_file(path))
    try:
        return DocumentsSpec((parse_tokens(text, "--documents"),))
    except UserError:
        raise UserError(
            f"--documents {text!r} is not 'one', a token count (64K) or an existing .json/.parquet/.csv file"
        ) from None


def describe_documents(spec: DocumentsSpec) -> str:
    """Short form for a line of output: ``one``, ``64K``, or ``N documents (mean L)``."""
    if spec.one:
        return "one"
    if len(spec.lengths) == 1:
        return short_tokens(spec.lengths[0])
    return spec.describe()


def _lengths_of_file(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        raise UserError(f"--documents file {str(path)!r} does not exist")
    if path.suffix.lower() == ".parquet":
        values = _parquet_values(path)
    elif path.suffix.lower() == ".csv":
        values = _csv_values(path)
    else:
        try:
            values = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(
                f"--documents file {str(path)!r} is not valid JSON ({exc}); lengths come as a .json list, a .parquet "
                "or a .csv file"
            ) from None
        if not isinstance(values, list):
            raise UserError(f"--documents file {str(path)!r} must hold a JSON list of lengths or of token-id lists")
    lengths = [len(v) if isinstance(v, list) else v for v in values]
    if not lengths:
        raise UserError(f"--documents file {str(path)!r} holds no documents")
    bad = next((n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 1), None)
    if bad is not None:
        raise UserError(f"--documents file {str(path)!r}: a document length must be a positive integer, got {bad!r}")
    return tuple(lengths)


def _csv_values(path: Path) -> list:
    """The first integer column of a CSV file; a first row of numbers is data, not a header."""
    import pyarrow as pa
    import pyarrow.csv as csv

    first = path.read_text(errors="replace").split("\n", 1)[0]
    headless = all(part.strip().isdigit() for part in first.split(",")) if first.strip() else True
    try:
        table = csv.read_csv(path, read_options=csv.ReadOptions(autogenerate_column_names=headless))
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"--documents file {str(path)!r} is not a readable CSV file ({exc})") from None
    for column in table.columns:
        if pa.types.is_integer(column.type):
            return column.to_pylist()
    raise UserError(f"--documents file {str(path)!r} has no column of integer lengths")


def _parquet_values(path: Path) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"--documents file {str(path)!r} is not a readable parquet file ({exc})") from None
    for column in table.columns:
        if pa.types.is_integer(column.type):
            return column.to_pylist()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            return [len(v) if v is not None else 0 for v in column.to_pylist()]
    raise UserError(f"--documents file {str(path)!r} has no column of lengths (integers) or token ids (lists)")
