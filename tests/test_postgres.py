"""One search spread over several workers on a real PostgreSQL server (issue 20, "Search across machines").

The server is Debian's ``postgresql`` package (``.ci/run`` installs it when missing), started for this module on
127.0.0.1 in a temporary folder: ``initdb`` + ``pg_ctl`` as an unprivileged user (PostgreSQL refuses to run as
root: as root, the binaries run through ``runuser`` as ``postgres``, else ``nobody``). Skipped, with the reason,
only when no PostgreSQL binaries are found.

Storages that cannot be reached (a wrong password, a closed port, a server that accepts the connection and never
answers) fail within seconds with one line, exit 2, never printing the password.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import optuna
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, run_cli, tiny_plan_search

from autotune.timing.calibration import _free_port

PASSWORD = "s3cr3t-p@ss:w0rd"  # characters a URL must escape: the message must hide it either way
USER = "autotune"
TINY = tiny_plan_search()


def _postgres_bin() -> Path | None:
    """The folder of initdb/pg_ctl: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


class Server:
    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # postgres will not run as root
            user = "postgres" if _has_user("postgres") else "nobody"
            self.as_user = ["runuser", "-u", user, "--"]
            entry = pwd.getpwnam(user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        os.chmod(self.dir, 0o700)
        pwfile = self.dir / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.as_user:
            os.chown(pwfile, pwd.getpwnam(self.as_user[2]).pw_uid, -1)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",
            "--auth-local=scram-sha-256",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=60 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "-t", "60", "start")
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=USER,
            password=PASSWORD,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as connection:
            connection.execute("CREATE DATABASE autotune")

    def url(self, password: str = PASSWORD, port: int | None = None) -> str:
        return f"postgresql://{USER}:{quote(password, safe='')}@127.0.0.1:{port or self.port}/autotune"

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run(
            [*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120, cwd=self.dir
        )
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="module")
def postgres():
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql (.ci/run installs it)")
    server = Server(bin_dir)
    try:
        yield server
    finally:
        server.stop()


def _assert_one_line_exit_2(result: subprocess.CompletedProcess, elapsed: float, *hidden: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for secret in hidden:
        assert secret not in result.stderr + result.stdout, "the password was printed"
    assert elapsed < 45, f"took {elapsed:.0f} s"
    return lines[0]


def _search(url: str, out: Path, *more: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = run_cli(
        "search", *TINY, "--trials", "4", "--storage", url, "--study", "s", "--out", str(out), *more, timeout=120
    )
    return result, time.monotonic() - start


def test_wrong_password_fails_in_seconds_without_printing_it(postgres, tmp_path):
    wrong = "n0t-the-p@ssword"
    result, elapsed = _search(postgres.url(password=wrong), tmp_path / "o")
    line = _assert_one_line_exit_2(result, elapsed, wrong, quote(wrong, safe=""), PASSWORD)
    assert "password authentication failed" in line and "***" in line, line


def test_closed_port_fails_in_seconds(tmp_path):
    port = _free_port()  # nothing listens there
    url = f"postgresql://{USER}:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/autotune"
    result, elapsed = _search(url, tmp_path / "o")
    line = _assert_one_line_exit_2(result, elapsed, PASSWORD, quote(PASSWORD, safe=""))
    assert "refused" in line, line


def test_silent_server_fails_within_the_connect_timeout(tmp_path):
    """A server that accepts the TCP connection and never says a word (a wedged proxy, a stopped process)."""
    from autotune.search.storage import CONNECT_TIMEOUT_S

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    accepted, stop = [], threading.Event()

    def accept_and_ignore():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_ignore, daemon=True)
    thread.start()
    try:
        url = f"postgresql://{USER}:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/autotune"
        result, elapsed = _search(url, tmp_path / "o")
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()
    line = _assert_one_line_exit_2(result, elapsed, PASSWORD, quote(PASSWORD, safe=""))
    assert accepted, "the client never connected"
    assert elapsed >= CONNECT_TIMEOUT_S - 1 and "timeout" in line, (elapsed, line)


def test_storage_messages_hide_the_password():
    from autotune.search.storage import database_url, redact, scrub

    url = f"postgresql://{USER}:{quote(PASSWORD, safe='')}@db-host:5432/autotune"
    assert PASSWORD not in redact(url) and quote(PASSWORD, safe="") not in redact(url)
    assert redact(url) == f"postgresql://{USER}:***@db-host:5432/autotune"
    text = scrub(f"could not connect to {url} with password {PASSWORD}", url)
    assert PASSWORD not in text and quote(PASSWORD, safe="") not in text
    # postgresql:// is psycopg 3 (installed with autotune) whatever SQLAlchemy maps it to; timeouts unless set
    pinned, kwargs = database_url(url)
    assert pinned.startswith("postgresql+psycopg://")
    assert kwargs["connect_args"]["connect_timeout"] > 0 and "statement_timeout" in kwargs["connect_args"]["options"]
    _, kwargs = database_url(url + "?connect_timeout=30")
    assert "connect_timeout" not in kwargs["connect_args"]
    assert database_url("postgresql+psycopg2://u:p@h/d")[0].startswith("postgresql+psycopg2://")


def _worker(url: str, out: Path, seed: int, trials: int) -> subprocess.Popen:
    args = [
        "search",
        *TINY,
        "--trials",
        str(trials),
        "--storage",
        url,
        "--study",
        "shared",
        "--out",
        str(out),
        "--seed",
        str(seed),
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_workers_on_postgres_make_one_search(postgres, tmp_path):
    trials = 16
    url = postgres.url()
    workers = [_worker(url, tmp_path / f"w{i}", i, trials) for i in range(2)]
    outputs = []
    for worker in workers:
        out, err = worker.communicate(timeout=900)
        assert worker.returncode in (0, 1), err[-3000:]
        assert PASSWORD not in out + err and quote(PASSWORD, safe="") not in out + err
        outputs.append(json.loads(out))
    study = optuna.load_study(study_name="shared", storage=url.replace("postgresql://", "postgresql+psycopg://"))
    every = study.get_trials(deepcopy=False)
    done = [t for t in every if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    # exactly the trials asked, both workers did some, nothing stuck
    assert len(done) == trials, [(t.number, t.state.name) for t in every]
    assert len({t.user_attrs["worker"] for t in done}) == 2, "one worker did all the work"
    assert not [t for t in every if t.state == optuna.trial.TrialState.RUNNING], "a trial was left RUNNING"
    # no config+length evaluated twice by a backend (repeats are answered from the study: cache, monotone)
    evaluated = [
        (t.user_attrs["record"]["seq_len"], json.dumps(t.user_attrs["techniques"], sort_keys=True))
        for t in done
        if t.user_attrs["answered_by"] == "plan"
    ]
    assert len(evaluated) == len(set(evaluated)), "a point was evaluated twice"
    # no queued follow-up lost: every point a failed (surplus) trial had been handed is queued again
    for failed in (t for t in every if t.state == optuna.trial.TrialState.FAIL):
        fixed = failed.system_attrs.get("fixed_params")
        if fixed:
            assert any(t.system_attrs.get("fixed_params") == fixed and t.number > failed.number for t in every), (
                f"trial {failed.number}'s queued point was lost"
            )
    # every worker's outputs hold the whole study
    numbers = sorted(t.number for t in done)
    front = None
    for i in range(2):
        rows = pq.read_table(tmp_path / f"w{i}" / "trials.parquet").to_pylist()
        assert sorted(r["trial"] for r in rows) == numbers, f"worker {i}'s trials.parquet misses trials"
        assert outputs[i]["rows"] == trials
        pareto = json.loads((tmp_path / f"w{i}" / "pareto.json").read_text())["front"]
        points = sorted((p["seq_len"], p["tokens_per_s"]) for p in pareto)
        assert front is None or points == front, "the workers' fronts differ"
        front = points
    # out-of-memory trials are infeasible where Optuna and optuna-dashboard read it
    ooms = [t for t in done if t.user_attrs["record"]["status"] == "oom"]
    assert ooms, "the 0.5 GiB capacity never bound"
    for t in done:
        (violation,) = t.system_attrs["constraints"]
        assert (violation > 0) == (t.user_attrs["record"]["status"] != "ok")
    assert _dashboard_front(url, "shared") == front


def _dashboard_front(url: str, study_name: str) -> list[tuple[float, float]]:
    """The Pareto front optuna-dashboard draws for the study, from its own server code: its REST API's trials
    (state, values, constraints) split as its Pareto-front plot splits them (``getFeasibleTrials``: complete,
    every constraint <= 0), non-dominated among the feasible ones (``getIsDominated``)."""
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is in the test extra")
    import io
    from wsgiref.util import setup_testing_defaults

    from optuna_dashboard import wsgi

    storage = optuna.storages.RDBStorage(url.replace("postgresql://", "postgresql+psycopg://"))
    app = wsgi(storage)

    def get(path: str) -> dict:
        environ: dict = {}
        setup_testing_defaults(environ)
        environ.update(
            {
                "PATH_INFO": path,
                "QUERY_STRING": "after=0" if "studies/" in path else "",
                "REQUEST_METHOD": "GET",
                "wsgi.input": io.BytesIO(),
            }
        )
        status = []
        body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
        assert status[0].startswith("200"), (path, status, body[:500])
        return json.loads(body)

    (study_id,) = [s["study_id"] for s in get("/api/studies")["study_summaries"] if s["study_name"] == study_name]
    detail = get(f"/api/studies/{study_id}")
    trials = [t for t in detail["trials"] if t["state"] == "Complete" and t.get("values")]
    assert all(t["constraints"] for t in trials), "the dashboard sees no constraints"
    feasible = [tuple(t["values"]) for t in trials if all(c <= 0 for c in t["constraints"])]
    infeasible = [t for t in trials if not all(c <= 0 for c in t["constraints"])]
    assert infeasible, "the dashboard shows every trial as feasible"
    front = {v for v in feasible if not any(o[0] >= v[0] and o[1] >= v[1] and o != v for o in feasible)}
    return sorted(front)


def test_a_point_being_evaluated_is_waited_for_not_evaluated_again(tmp_path):
    """Two trials sample the same config and length: the second waits for the first's record (a cache answer)
    instead of evaluating it again; a point no one claims is claimed at once. (SQLite here; the same code runs
    under a PostgreSQL advisory lock in the two-worker test.)"""
    from autotune.core.record import ResultRecord
    from autotune.search.sharing import CLAIM_ATTR, claim_or_answer
    from autotune.search.storage import open_storage
    from trials.stack.techniques import BASELINE

    study = optuna.create_study(storage=open_storage(None, tmp_path), directions=["maximize", "maximize"])
    first, second = study.ask(), study.ask()
    assert claim_or_answer(study, first, BASELINE, 4096) is None  # claimed: evaluate it
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(claim_or_answer(study, second, BASELINE, 4096)))
    waiter.start()
    time.sleep(2)
    assert waiter.is_alive() and not answers, "the second trial did not wait for the first"
    first.set_user_attr("techniques", BASELINE.to_dict())
    first.set_user_attr(
        "record", ResultRecord(status="ok", source="predicted", seq_len=4096, tokens_per_s=10.0).to_dict()
    )
    study.tell(first, [4096.0, 10.0])
    waiter.join(timeout=30)
    ((record, how),) = answers
    assert how == "cache" and record.tokens_per_s == 10.0
    assert CLAIM_ATTR not in study._storage.get_trial(second._trial_id).system_attrs
    other = study.ask()  # another length: no one evaluates it, claimed at once
    assert claim_or_answer(study, other, BASELINE, 8192) is None


def test_a_surplus_trial_puts_its_queued_point_back(tmp_path):
    from autotune.search.sharing import requeue_surplus
    from autotune.search.storage import open_storage

    study = optuna.create_study(storage=open_storage(None, tmp_path), directions=["maximize", "maximize"])
    study.enqueue_trial({"seq_len": 4096}, user_attrs={"follow_up_of": 3})
    surplus = study.ask()
    assert requeue_surplus(study, surplus)
    study.tell(surplus, state=optuna.trial.TrialState.FAIL)
    (waiting,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert waiting.system_attrs["fixed_params"] == {"seq_len": 4096}
    assert waiting.user_attrs == {"follow_up_of": 3, "requeued_from": surplus.number}
    again = study.ask()  # the queued point is handed out again
    assert again._trial_id == waiting._trial_id
    study.tell(again, state=optuna.trial.TrialState.FAIL)
    assert not requeue_surplus(study, study.ask())  # a trial that was handed no queued point: nothing to put back
