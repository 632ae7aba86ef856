"""Opening a study's storage, and what several workers sharing one study need of it.

- ``open_storage``: SQLite in the out dir by default; any SQLAlchemy database URL (PostgreSQL, MySQL, SQLite); a
  journal file. ``postgresql://`` always means psycopg 3 (``psycopg[binary]``, installed with autotune), whatever
  the SQLAlchemy version maps it to; ``postgresql+psycopg2://`` still works where psycopg2 is installed.
- Every database connection has a connect timeout (``CONNECT_TIMEOUT_S``; a server that accepts the connection
  and never answers fails in seconds instead of hanging), TCP keepalives, and on PostgreSQL a statement and a lock
  timeout (``STATEMENT_TIMEOUT_S``, ``LOCK_TIMEOUT_S``), so a worker never waits forever on the database. Settings
  given in the URL's query (``?connect_timeout=30``, ``?options=...``) win over these.
- A storage that cannot be opened is bad input: one line (``UserError``) that names the URL with its password
  hidden and never prints the password, whatever the driver's message says.
- ``study_lock``: a lock shared by every worker of the storage (a PostgreSQL advisory lock, MySQL ``GET_LOCK``, a
  lock file for a SQLite database, beside a journal file), for short critical sections such as claiming a config
  before evaluating it (``autotune.search.sharing``).
- ``set_constraints``: a trial's constraint values where every reader looks: Optuna reads the system attribute
  ``constraints`` (a list; its own ``set_constraint`` writes ``constraints:<name>``, which optuna-dashboard does
  not read), optuna-dashboard reads only that list.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import tempfile
import threading
import time
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend, JournalStorage

from autotune.core.errors import UserError

CONNECT_TIMEOUT_S = 10  # libpq's connect_timeout (the whole connection: TCP, TLS, authentication)
STATEMENT_TIMEOUT_S = 300  # PostgreSQL: no statement of the search runs longer (Optuna's take milliseconds)
LOCK_TIMEOUT_S = 120  # PostgreSQL: no row or advisory lock is waited for longer
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
JOURNAL_SUFFIXES = (".log", ".jsonl", ".journal")
CONSTRAINTS_KEY = "constraints"  # the trial system attribute optuna-dashboard and Optuna both read (a list)


def open_storage(storage: str | None, out: Path):
    """SQLite in ``out`` by default; an RDB URL; or a journal file (path ending .log/.jsonl or ``journal:PATH``).
    Raises ``UserError`` (one line, no password) when it cannot be opened."""
    try:
        if storage is None:
            return _rdb(f"sqlite:///{(out / 'study.db').resolve()}")
        if storage.startswith("journal:") or storage.endswith(JOURNAL_SUFFIXES):
            path = storage.removeprefix("journal:")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            opened = JournalStorage(JournalFileBackend(path))
            opened._autotune_lock_path = f"{path}.autotune-lock"
            return opened
        if "://" not in storage:
            raise UserError(f"--storage {storage!r} is neither a database URL nor a journal file (.log)")
        return _rdb(storage)
    except UserError:
        raise
    except Exception as exc:  # sqlalchemy/driver errors: a bad URL, a missing driver, an unreachable server
        raise UserError(f"--storage {redact(storage)!r} cannot be opened: {_cause(exc, storage)}") from None


def redact(storage: str | None) -> str:
    """``storage`` as it may be printed: a URL's password replaced by ``***`` (``None``: the default SQLite)."""
    if storage is None:
        return "study.db"
    if "://" not in storage:
        return storage
    try:
        from sqlalchemy.engine import make_url

        url = make_url(storage)
        if url.password is None:
            return storage
        return url.render_as_string(hide_password=True)
    except Exception:  # not parseable as a URL: hide everything between '://' and the last '@'
        scheme, _, rest = storage.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else storage


def scrub(text: str, storage: str | None) -> str:
    """``text`` with ``storage``'s password (raw and URL-decoded) and its full URL replaced."""
    if not storage or "://" not in storage:
        return text
    text = text.replace(storage, redact(storage))
    secrets = set()
    try:
        from urllib.parse import unquote

        from sqlalchemy.engine import make_url

        password = make_url(storage).password
        if password:
            secrets |= {str(password), unquote(str(password))}
    except Exception:
        userinfo = storage.partition("://")[2].rpartition("@")[0]
        if ":" in userinfo:
            secrets.add(userinfo.partition(":")[2])
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def _cause(exc: BaseException, storage: str | None) -> str:
    """The first line of what went wrong, without the password and without SQLAlchemy's link footer."""
    if isinstance(exc, ImportError):
        module = getattr(exc.__cause__, "name", None) or str(exc.__cause__ or exc)
        return (
            f"the database driver is not installed ({module}); postgresql:// uses psycopg 3, installed with "
            f"autotune (pip install 'psycopg[binary]')"
        )
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("(Background on this error"):
            text = line
            break
    if "timeout expired" in text or "timed out" in text:
        text += f" (no answer within the {CONNECT_TIMEOUT_S} s connect timeout)"
    return scrub(text, storage)


def database_url(url: str) -> tuple[str, dict]:
    """(URL for SQLAlchemy, engine kwargs): ``postgresql://`` pinned to psycopg 3; connect, statement and lock
    timeouts and keepalives for the database's driver, unless the URL's query sets them."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername == "postgresql":  # SQLAlchemy < 2.1 maps it to psycopg2; autotune installs psycopg 3
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend, query = parsed.get_backend_name(), parsed.query
    connect_args: dict = {}
    if backend == "postgresql":
        connect_args = {k: v for k, v in {"connect_timeout": CONNECT_TIMEOUT_S, **KEEPALIVES}.items() if k not in query}
        if "options" not in query:
            connect_args["options"] = (
                f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000} -c lock_timeout={LOCK_TIMEOUT_S * 1000}"
            )
    elif backend == "mysql" and "connect_timeout" not in query:
        connect_args = {"connect_timeout": CONNECT_TIMEOUT_S}
    engine_kwargs = {"connect_args": connect_args} if connect_args else {}
    if backend != "sqlite":
        engine_kwargs["pool_pre_ping"] = True  # a connection the server dropped is replaced, not an error
    return parsed.render_as_string(hide_password=False), engine_kwargs


# workers starting together race to create the schema: the loser sees "already exists" or a lock, or both insert
# the schema version (a UNIQUE violation on alembic_version; PostgreSQL: a duplicate key in its catalogue)
_SCHEMA_RACE = ("already exists", "locked", "UNIQUE constraint failed", "duplicate key value violates unique")


def _rdb(url: str, attempts: int = 5):
    url, engine_kwargs = database_url(url)
    for attempt in range(attempts):
        try:
            # heartbeats: a trial whose worker was killed is marked FAIL after the grace period and retried once
            return RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=5,
                grace_period=20,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
            )
        except Exception as exc:
            transient = any(sign in str(exc) for sign in _SCHEMA_RACE)
            if not transient or attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


_LOCAL_LOCKS: dict[int, threading.Lock] = {}


@contextlib.contextmanager
def study_lock(storage, name: str):
    """Hold the lock ``name`` shared by every worker of ``storage`` (other processes and hosts included) for a
    short critical section."""
    key = int.from_bytes(hashlib.sha256(f"autotune:{name}".encode()).digest()[:8], "big", signed=True)
    storage = backend_of(storage)
    if isinstance(storage, RDBStorage):
        dialect = storage.engine.dialect.name
        if dialect == "postgresql":
            from sqlalchemy import text

            with storage.engine.begin() as connection:  # released when the transaction ends
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
                yield
            return
        if dialect in ("mysql", "mariadb"):
            from sqlalchemy import text

            lock_name = f"autotune-{key & 0xFFFFFFFFFFFF:x}"
            with storage.engine.connect() as connection:
                connection.execute(text("SELECT GET_LOCK(:name, :wait)"), {"name": lock_name, "wait": LOCK_TIMEOUT_S})
                try:
                    yield
                finally:
                    connection.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": lock_name})
            return
        database = storage.engine.url.database
        if dialect == "sqlite" and database and database != ":memory:":  # workers of one host: a temp-dir lock
            where = hashlib.sha256(str(Path(database).resolve()).encode()).hexdigest()[:16]
            with _file_lock(str(Path(tempfile.gettempdir()) / f"autotune-{where}.lock")):
                yield
            return
    path = getattr(storage, "_autotune_lock_path", None)
    if path:
        with _file_lock(path):
            yield
        return
    with _LOCAL_LOCKS.setdefault(id(storage), threading.Lock()):  # in-memory storage: one process
        yield


@contextlib.contextmanager
def _file_lock(path: str):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def backend_of(storage):
    """The storage itself: a study's ``_storage`` wraps an ``RDBStorage`` in Optuna's cache (``_CachedStorage``)."""
    return getattr(storage, "_backend", storage)


def has_heartbeat(storage) -> bool:
    """Whether a dead worker's RUNNING trials are failed by heartbeat (any host), not only reaped on this host."""
    storage = backend_of(storage)
    return isinstance(storage, RDBStorage) and storage.heartbeat_interval is not None


def set_constraints(trial: optuna.Trial, values: list[float]) -> None:
    """Store ``values`` as the trial's constraints (<= 0 feasible) in the system attribute ``constraints``, the
    list Optuna reads (``FrozenTrial.constraints``: ``{"0": value, ...}``; TPE's feasibility) and the only place
    optuna-dashboard reads (its Pareto-front plot greys out infeasible trials and draws the front from the
    feasible ones). ``Trial.set_constraint`` (Optuna 5) writes ``constraints:<name>``, which the dashboard
    never reads: out-of-memory trials would look feasible there."""
    values = [float(v) for v in values]
    trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, values)
    cached = getattr(trial, "_cached_frozen_trial", None)
    if cached is not None:
        cached.system_attrs[CONSTRAINTS_KEY] = values
