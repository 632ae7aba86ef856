"""``autotune verify`` (issue 16): a plan search's front re-measured with real trials on this node (CPU + gloo here),
the measurements stored beside the predictions, the outputs rewritten from them, and a second run that skips them."""

from __future__ import annotations

import json
import sqlite3

import optuna
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, here, run_cli

from autotune.backends import Backend
from autotune.cli import main
from autotune.core.hardware import load_hardware
from autotune.core.record import ResultRecord
from autotune.outputs import report, verify
from autotune.search.front import front_points, measurements
from autotune.search.job import SearchJob
from trials.kernels.documents import DocumentsSpec
from trials.models.config import load_model_config
from trials.stack.techniques import BASELINE
from trials.training.config_file import load_config_file

SEARCH = [
    "search",
    "--model",
    "tiny-llama",
    "--target",
    "2K",
    "--gpus",
    "2",
    "--backend",
    "plan",
    "--hardware",
    "cpu",
    "--memory-gib",
    "0.5",
    "--space",
    str(ROOT / "search_spaces/reduced-tiny.yaml"),
    "--trials",
    "6",
]


def _key(techniques: dict, seq_len: int):
    return seq_len, tuple(sorted(techniques.items()))


def _row_key(row: dict):
    return row["seq_len"], tuple(sorted((k, row[k]) for k in report.KNOBS))


# --- a real plan search, then real trials of its front (tiny-llama, 2 gloo ranks) ---------------------------------


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "out"
    # the search in-process (a fresh interpreter would import torch again); the first verify as a user runs it, whose
    # exit status test_exit_codes.py counts on
    searched = here(*SEARCH, "--out", str(out), "--json")
    assert searched.returncode in (0, 1), searched.stderr[-3000:]
    before = {
        "front": json.loads((out / "pareto.json").read_text())["front"],
        "best": json.loads((out / "best.json").read_text()),
    }
    first = run_cli("verify", str(out), "--top", "2", "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    return out, before, json.loads(first.stdout), first


@pytest.mark.slow
def test_verify_measures_the_top_of_the_front_and_the_best(verified):
    out, before, result, first = verified
    fastest = sorted(before["front"], key=lambda f: -f["tokens_per_s"])[:2]
    ran = {o["trial"]: o for o in result["verified"] if o["ran"]}
    assert {f["trial"] for f in fastest} <= set(ran), (fastest, list(ran))
    best_before = before["best"]
    assert any(
        _key(o["techniques"], o["seq_len"]) == _key(best_before["techniques"], best_before["seq_len"])
        for o in result["verified"]
    )
    for outcome in ran.values():
        assert outcome["predicted"]["source"] == "predicted"
        assert outcome["measured"]["source"] == "measured" and outcome["measured"]["status"] in ("ok", "oom")
        assert outcome["depth"] == "full"
        # one progress line per trial: its label, predicted -> measured
        assert f"trial {outcome['trial']} " in first.stderr
    assert "Traceback" not in first.stderr
    # trials.parquet: the measured columns are filled for exactly the verified configs, the predictions untouched
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    verified_keys = {_key(o["techniques"], o["seq_len"]) for o in ran.values()}
    for row in rows:
        assert row["source"] == "predicted"
        filled = row["measured_status"] is not None
        assert filled == (_row_key(row) in verified_keys), row["trial"]
        if filled:
            assert row["measured_depth"] == "full" and row["measured_peak_device_bytes"] > 0
            if row["measured_status"] == "ok":
                assert row["measured_tokens_per_s"] > 0 and row["measured_host_bytes"] is not None
    assert {r["trial"] for r in rows if r["measured_status"] is not None} >= set(ran)


@pytest.mark.slow
def test_front_and_best_carry_the_measured_records(verified, capsys):
    out, _, result, _ = verified
    doc = json.loads((out / "pareto.json").read_text())
    for entry in doc["front"]:
        if entry["measured"] is not None:  # a verified config: ranked by its measurement, both sides kept
            assert entry["record"] == entry["measured"] and entry["record"]["status"] == "ok"
            assert entry["predicted"]["source"] == "predicted" and entry["measured_depth"] == "full"
            assert entry["tokens_per_s"] == entry["measured"]["tokens_per_s"]
        else:
            assert entry["record"]["source"] == "predicted"
    front = {e["trial"]: e for e in doc["front"]}
    for outcome in result["verified"]:
        record = outcome["measured"]
        if record["status"] != "ok":  # a measured OOM is off the front
            assert outcome["trial"] not in front
        elif outcome["trial"] in front:  # on the front with its measurement
            assert front[outcome["trial"]]["measured"] == record
        else:  # measured slower than predicted (a loaded host): off the front only behind a point as long and faster
            assert any(
                e["seq_len"] >= outcome["seq_len"] and e["tokens_per_s"] >= record["tokens_per_s"]
                for e in front.values()
            ), (outcome, doc["front"])
    best = load_config_file(out / "best.json")  # still a valid config-v1 file
    assert best.measured is not None and best.measured["source"] == "measured" and best.measured["status"] == "ok"
    assert best.predicted is not None and best.predicted["source"] == "predicted"
    assert result["best"]["measured"] == best.measured
    # an export of the front is the measured config too
    assert main(["export", str(out)]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["measured"] == best.measured and exported["predicted"] == best.predicted


@pytest.mark.slow
def test_a_second_run_skips_what_was_measured(verified):
    out, _, result, _ = verified
    before = pq.read_table(out / "trials.parquet").to_pylist()
    again = here("verify", str(out), "--top", "2", "--json")  # in-process: its trials run as processes of their own
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert second["verified"] and not any(o["ran"] for o in second["verified"])
    ran_first = {o["trial"] for o in result["verified"] if o["ran"]}
    assert {o["trial"] for o in second["verified"]} <= ran_first | {o["trial"] for o in result["verified"]}
    assert "already measured" in again.stderr
    assert pq.read_table(out / "trials.parquet").to_pylist() == before


@pytest.mark.slow
def test_verify_for_other_documents_measures_them_and_keeps_the_search_records(verified):
    """``--documents`` other than the search's: one line says so; each chosen config is predicted and measured for
    those documents; the folder's study and outputs stay the search's."""
    out = verified[0]
    files = {name: (out / name).read_bytes() for name in ("pareto.json", "best.json", "trials.parquet")}
    study = verify.open_folder(out).study
    stored = measurements(study)
    done = here("verify", str(out), "--top", "1", "--documents", "512", "--json")  # in-process, its trials not
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "--documents" in line]
    assert said == [
        f"--documents 512 overrides the search's one: each config is predicted and measured for documents of 512 "
        f"tokens; {str(out)!r} keeps the search's records"
    ]
    result = json.loads(done.stdout)
    assert result["documents"] == 512 and result["verified"] and all(o["ran"] for o in result["verified"])
    for outcome in result["verified"]:
        searched = study.trials[outcome["trial"]].user_attrs["record"]
        assert outcome["measured"]["status"] == "ok" and outcome["measured"]["source"] == "measured"
        # 4 documents of 512 tokens: a quarter of the causal pairs of one 2K document, predicted faster
        assert outcome["predicted"]["tokens_per_s"] > searched["tokens_per_s"]
    assert {name: (out / name).read_bytes() for name in files} == files
    assert measurements(verify.open_folder(out).study) == stored


# --- the logic, with a scripted backend (no real trials) -----------------------------------------------------------


class Scripted(Backend):
    """Answers from a table {seq_len: record fields}, or {(config name, seq_len): record fields} where a config has its
    own answer (``NAMES``); counts its calls."""

    def __init__(self, answers: dict, source: str = "measured"):
        self.answers, self.calls, self.source = answers, [], source
        self.name = "plan" if source == "predicted" else "scripted"

    def evaluate(self, evaluation):
        self.calls.append(evaluation.seq_len)
        name = NAMES.get(json.dumps(evaluation.techniques.to_dict(), sort_keys=True))
        answer = self.answers.get((name, evaluation.seq_len), self.answers.get(evaluation.seq_len))
        return ResultRecord(source=self.source, seq_len=evaluation.seq_len, **answer)


def _folder(tmp_path, trials: list[tuple[dict, int, float]], target: int = 2048) -> verify.Folder:
    """A plan study of ``(techniques, seq_len, predicted tokens/s)`` trials (all fit), written like a search."""
    study = optuna.create_study(
        directions=["maximize", "maximize"], study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}"
    )
    for techniques, seq_len, rate in trials:
        record = ResultRecord(
            status="ok", source="predicted", seq_len=seq_len, tokens_per_s=rate, peak_device_bytes=2**27, host_bytes=0
        )
        study.add_trial(
            optuna.trial.create_trial(
                values=[float(seq_len), rate],
                user_attrs={"techniques": techniques, "record": record.to_dict(), "answered_by": "plan"},
            )
        )
    job = SearchJob(
        model="tiny-llama",
        model_config=load_model_config("tiny-llama"),
        target=target,
        gpus=2,
        hardware=load_hardware("cpu").with_memory_gib(0.5),
        space=None,
        backend=None,
        out=tmp_path,
        trials=len(trials),
    )
    report.write_outputs(job, study)
    return verify.Folder(tmp_path, study, job)


PLAIN = BASELINE.to_dict()
FSDP = {**PLAIN, "fsdp": True}
CKPT = {**PLAIN, "fsdp": True, "activation_checkpointing": True}
NAMES = {json.dumps(c, sort_keys=True): name for name, c in (("plain", PLAIN), ("fsdp", FSDP), ("ckpt", CKPT))}


def test_a_measured_oom_drops_a_config_and_the_new_best_is_measured_too(tmp_path):
    # 4K fastest, then 3K, then 2K (the target); cache duplicate of the 4K config (trial 3)
    folder = _folder(
        tmp_path, [(CKPT, 4096, 3000.0), (FSDP, 3072, 2000.0), (PLAIN, 2048, 1000.0), (CKPT, 4096, 3000.0)]
    )
    # the configs that reach past the target, predicted at it: the 4K one is the fastest there too
    ok = {"status": "ok", "peak_device_bytes": 2**27, "host_bytes": 0}
    predictor = Scripted(
        {("ckpt", 2048): {**ok, "tokens_per_s": 3500.0}, ("fsdp", 2048): {**ok, "tokens_per_s": 2500.0}}, "predicted"
    )
    backend = Scripted(
        {
            4096: {"status": "oom", "peak_device_bytes": 2**30},
            ("ckpt", 2048): {"status": "oom", "peak_device_bytes": 2**30},
            ("fsdp", 2048): {**ok, "tokens_per_s": 1500.0},
            ("plain", 2048): {**ok, "tokens_per_s": 900.0},
        }
    )
    chosen = verify.select(folder, top=1, predictor=predictor)
    assert predictor.calls == [2048, 2048]
    # the fastest of the front, and the best: the same config, at the target
    assert [(p.number, p.own["seq_len"]) for p in chosen] == [(0, 4096), (0, 2048)]
    hw = load_hardware("cpu").with_memory_gib(0.5)
    result = verify.verify(folder, chosen, backend, hw)
    # the 4K config OOMs for real, at the target too: the best moves to the 3K config at the target, measured as well
    assert backend.calls == [4096, 2048, 2048]
    assert [(o.trial, o.seq_len, o.why, o.ran) for o in result.outcomes] == [
        (0, 4096, "front", True),
        (0, 2048, "front", True),
        (1, 2048, "best", True),
    ]
    assert not result.failed and not result.interrupted
    front = front_points(folder.study)
    assert 4096 not in {p.record["seq_len"] for p in front}  # both trials of the OOM config are off the front
    best = json.loads((tmp_path / "best.json").read_text())
    assert best["seq_len"] == 2048 and best["techniques"] == FSDP
    assert best["measured"]["tokens_per_s"] == 1500.0 and best["predicted"]["tokens_per_s"] == 2500.0
    assert json.loads((tmp_path / "pareto.json").read_text())["best"]["trial"] == 1
    rows = {r["trial"]: r for r in pq.read_table(tmp_path / "trials.parquet").to_pylist()}
    assert rows[0]["measured_status"] == rows[3]["measured_status"] == "oom"  # a measurement is of a config
    assert rows[1]["measured_status"] is None and rows[2]["measured_status"] is None  # measured at 2K, not at 3K
    assert rows[0]["status"] == "ok" and rows[0]["tokens_per_s"] == 3000.0  # the prediction is untouched
    # the measurements live in the study, beside the trials' own records
    stored = measurements(folder.study)
    assert len(stored) == 3 and all(m["depth"] == "full" for m in stored.values())
    assert folder.study.trials[0].user_attrs["record"]["source"] == "predicted"

    # again: nothing runs; --force runs the chosen ones again (the front's fastest and the best now)
    again = verify.verify(folder, verify.select(folder, top=1, predictor=predictor), backend, hw)
    assert backend.calls == [4096, 2048, 2048] and not any(o.ran for o in again.outcomes)
    assert predictor.calls == [2048, 2048]  # what was predicted at the target is not predicted again
    verify.verify(folder, verify.select(folder, top=1), backend, hw, force=True)
    assert backend.calls[3:] == [4096, 2048]


class Remembering(Scripted):
    """A scripted backend that keeps each evaluation it was given."""

    def __init__(self, answers: dict, source: str = "measured"):
        super().__init__(answers, source)
        self.evaluations = []

    def evaluate(self, evaluation):
        self.evaluations.append(evaluation)
        return super().evaluate(evaluation)


def test_verify_for_documents_predicts_and_measures_them_and_stores_nothing(tmp_path):
    folder = _folder(tmp_path, [(FSDP, 2048, 2000.0), (PLAIN, 1024, 2500.0)])
    written = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.suffix in (".json", ".parquet")}
    ok = {"status": "ok", "peak_device_bytes": 2**27, "host_bytes": 0}
    predictor = Remembering({2048: {**ok, "tokens_per_s": 4000.0}, 1024: {**ok, "tokens_per_s": 4500.0}}, "predicted")
    backend = Remembering({2048: {**ok, "tokens_per_s": 3800.0}, 1024: {**ok, "tokens_per_s": 4400.0}})
    node = load_hardware("cpu").with_memory_gib(0.25)
    packed = DocumentsSpec((512,))
    result = verify.verify_for_documents(folder, verify.select(folder, None), packed, backend, predictor, node)
    assert [(o.trial, o.seq_len, o.ran) for o in result.outcomes] == [(1, 1024, True), (0, 2048, True)]
    assert [o.ratio("tokens_per_s") for o in result.outcomes] == [4400.0 / 4500.0, 3800.0 / 4000.0]
    assert all(e.documents == packed for e in predictor.evaluations + backend.evaluations)
    assert {e.hardware for e in predictor.evaluations} == {folder.job.hardware}  # predicted for the search's
    assert {e.hardware for e in backend.evaluations} == {node}  # measured on this node
    assert measurements(folder.study) == {}
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.name in written} == written


def test_a_failed_trial_is_reported_and_tried_again(tmp_path):
    folder = _folder(tmp_path, [(FSDP, 2048, 2000.0)])
    hw = load_hardware("cpu").with_memory_gib(0.5)
    failing = Scripted({2048: {"status": "error", "error": "rank 1: boom"}})
    result = verify.verify(folder, verify.select(folder, top=None), failing, hw)
    assert [o.trial for o in result.failed] == [0]
    assert "boom" in verify.progress_line(result.outcomes[0], 1, 1)
    assert not (tmp_path / "best.json").exists()  # the only config failed: nothing reaches the target
    working = Scripted({2048: {"status": "ok", "tokens_per_s": 1800.0}})
    result = verify.verify(folder, verify.select(folder, top=None), working, hw)
    assert working.calls == [2048] and not result.failed
    assert load_config_file(tmp_path / "best.json").measured["tokens_per_s"] == 1800.0


def test_reduced_depth_reuses_a_full_measurement_but_not_the_reverse(tmp_path):
    folder = _folder(tmp_path, [(FSDP, 2048, 2000.0)])
    hw = load_hardware("cpu").with_memory_gib(0.5)
    backend = Scripted({2048: {"status": "ok", "tokens_per_s": 1800.0}})
    verify.verify(folder, verify.select(folder, None), backend, hw, depth="reduced")
    verify.verify(folder, verify.select(folder, None), backend, hw, depth="full")
    verify.verify(folder, verify.select(folder, None), backend, hw, depth="reduced")
    assert backend.calls == [2048, 2048]
    assert json.loads((tmp_path / "pareto.json").read_text())["front"][0]["measured_depth"] == "full"


# --- bad input: exit 2, one line, no traceback ---------------------------------------------------------------------


def test_a_missing_folder_exits_2_with_one_line(tmp_path):
    done = run_cli("verify", str(tmp_path / "nowhere"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "nowhere" in lines[0] and "Traceback" not in done.stderr and done.stdout == ""


def _old_folder(tmp_path):
    """A search folder written before the search job was stored in the study."""
    folder = _folder(tmp_path, [(FSDP, 2048, 2000.0)])
    with sqlite3.connect(tmp_path / "study.db") as db:
        db.execute("delete from study_user_attributes where key = ?", (report.JOB_ATTR,))
    return folder


@pytest.mark.parametrize(
    "case",
    [
        "not a search folder",
        "a file",
        "--top 0",
        "--depth",
        "older folder",
        "no study.db",
        "unknown --study",
        "--documents",
    ],
)
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    argv = {
        "not a search folder": lambda: ["verify", str(tmp_path)],
        "a file": lambda: ["verify", str(_touch(tmp_path / "f.txt"))],
        "--top 0": lambda: ["verify", str(tmp_path), "--top", "0"],
        "--depth": lambda: ["verify", str(tmp_path), "--depth", "half"],
        "older folder": lambda: ["verify", str(_old_folder(tmp_path).directory)],
        "no study.db": lambda: ["verify", str(_no_study(tmp_path))],
        "unknown --study": lambda: [
            "verify",
            str(_folder(tmp_path, [(FSDP, 2048, 1.0)]).directory),
            "--study",
            "other",
        ],
        "--documents": lambda: [
            "verify",
            str(_folder(tmp_path, [(FSDP, 2048, 1.0)]).directory),
            "--documents",
            "half",
        ],
    }[case]()
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (case, captured.err)
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), (case, captured.err)
    assert "Traceback" not in captured.err and captured.out == ""
    if case == "older folder":
        assert "older autotune" in lines[0]


def _touch(path):
    path.write_text("x")
    return path


def _no_study(tmp_path):
    _folder(tmp_path, [(FSDP, 2048, 1.0)])
    (tmp_path / "study.db").unlink()
    return tmp_path
