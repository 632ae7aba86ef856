"""Plan records kept on disk, across studies and runs: one evaluation of the plan backend is never traced twice.

A plan record is a pure function of what the backend is asked (model, techniques, length, GPUs, the whole
hardware preset including its rates and calibration), the backend's options (``throughput``, where a trace may
stop) and the code that computes it (``autotune`` and ``trials``, and the versions of torch, transformers and
DeepSpeed whose code the fake trace runs). The store keys each record by all of these, so a record read back
is exactly the record the backend would compute (``tests/test_plan_parallel.py`` checks it).

Where traces may stop (``PlanBackend(stop_above=...)``: the search only needs to know that a config does not
fit) two kinds of entries are kept:
  - a *whole* entry: the trace ran to its end (it never crossed a limit, or none was asked). It answers every
    request whose limits lie at or above what the trace reached (the traced copies' and the extension's tensor
    peaks and host bytes): such a request would have run the same trace, unstopped;
  - a *stopped* entry: the trace was cut short at its limits; it answers only requests with those limits.
So a search's record of a config that fits (its trace never stopped) answers ``estimate`` of that config exactly,
and an out-of-memory record the search cut short never does (its breakdown stops at the crossing). The 3- and
4-layer copies a deep model's trace ran to their end are kept as whole entries of their own evaluations
(``autotune.backends.plan.shallow_copies``): a reduced-depth trial's deadline asks for those.

Layout: ``<cache>/plan/<code digest>/<key>.json`` under the cache directory of ``autotune.core.calibration_store``
(``$AUTOTUNE_CACHE_DIR``, ``$XDG_CACHE_HOME/autotune`` or ``~/.cache/autotune``); ``AUTOTUNE_PLAN_CACHE=off``
turns the store off. Writes go to a temporary file and are renamed into place, so concurrent workers and runs
never read half an entry. Only the ``KEEP_VERSIONS`` most recently used code digests are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from autotune.core import calibration_store
from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord

ENV = "AUTOTUNE_PLAN_CACHE"  # "off" (or 0/no/false): no store
KEEP_VERSIONS = 4
_LIBRARIES = ("torch", "transformers", "deepspeed")


@lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of every source file of ``autotune`` and ``trials`` and of the library versions a trace runs."""
    import autotune
    import trials

    digest = hashlib.sha256(f"python {sys.version_info[:2]}".encode())
    for name in _LIBRARIES:
        try:
            digest.update(f"{name} {metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name} -".encode())
    for package in (autotune, trials):
        root = Path(package.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def evaluation_key(evaluation: Evaluation, options: dict) -> str:
    """The digest of one request: every field of the evaluation (the whole hardware preset with it) and the
    backend's options that shape a whole record (not where it may stop: see the module doc)."""
    text = json.dumps([dataclasses.asdict(evaluation), options], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Entry:
    """What the store keeps of one evaluation."""

    record: ResultRecord
    peak_segment: tuple | None  # where the peak is (the backend's ``peak_at``)
    reached: dict  # the most any traced copy or the extension reached: {"device": tensor bytes,
    # "host": bytes per rank}
    limits: dict | None  # the limits it was traced under when they stopped it; None: it ran to its end

    def to_json(self) -> str:
        return json.dumps(
            {
                "record": self.record.to_dict(),
                "peak_segment": self.peak_segment,
                "reached": self.reached,
                "limits": self.limits,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Entry:
        data = json.loads(text)
        segment = data["peak_segment"]
        return cls(
            ResultRecord.from_dict(data["record"]),
            tuple(segment) if segment is not None else None,
            dict(data["reached"]),
            data["limits"],
        )

    def answers(self, limits: dict | None) -> bool:
        """Would a trace under ``limits`` ({"device": tensor bytes, "host": bytes or None}; None: no limits) have
        given this entry's record?"""
        if self.limits is not None:
            return limits == self.limits
        return limits is None or all(limit is None or self.reached[name] <= limit for name, limit in limits.items())


class PlanStore:
    """Plan records on disk, under ``root / code_digest()``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.directory = self.root / code_digest()

    def __reduce__(self):  # worker processes get the same store (they compute the same digest)
        return (PlanStore, (self.root,))

    def get(self, key: str, limits: dict | None) -> Entry | None:
        """The entry that answers a request traced under ``limits`` (see ``Entry.answers``), or None."""
        for path in (self._path(key, None),) + ((self._path(key, limits),) if limits is not None else ()):
            entry = self._read(path)
            if entry is not None and entry.answers(limits):
                return entry
        return None

    def put(self, key: str, entry: Entry) -> None:
        """Keep ``entry`` (a stopped one under its limits). A store that cannot be written is only slower: the
        record in hand is the answer either way."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(handle, "w") as out:
                out.write(entry.to_json())
            os.replace(tmp, self._path(key, entry.limits))
        except OSError:
            return

    def _path(self, key: str, limits: dict | None) -> Path:
        if limits is None:
            return self.directory / f"{key}.json"
        return self.directory / f"{key}-stop-{limits['device']}-{limits['host']}.json"

    def _read(self, path: Path) -> Entry | None:
        try:
            text = path.read_text()
        except OSError:
            return None
        try:
            return Entry.from_json(text)
        except (ValueError, KeyError, TypeError):  # a damaged file: computed again, and rewritten
            return None

    def prune(self, keep: int = KEEP_VERSIONS) -> None:
        """Delete the entries of all but the ``keep`` most recently used code digests (this one is kept)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.utime(self.directory)
            versions = sorted(
                (p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True
            )
        except OSError:
            return
        for old in versions[keep:]:
            if old != self.directory:
                shutil.rmtree(old, ignore_errors=True)


def default_store() -> PlanStore | None:
    """The store under the user's cache directory, or None when ``AUTOTUNE_PLAN_CACHE`` turns it off."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    store = PlanStore(calibration_store.cache_path().parent / "plan")
    store.prune()
    return store
