"""Several nodes (issue 20): the inter-node fabric in the presets and the time model, plans for N nodes x G GPUs,
real trials over two torchrun agents acting as two nodes on 127.0.0.1 (gloo), and the Slurm export."""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, here

from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend
from autotune.cli import main
from autotune.core.hardware import load_hardware
from autotune.outputs.exporters import make_exporter
from autotune.search.space import load_space
from autotune.timing.calibration import _free_port
from autotune.timing.counts import CollectiveCounts, StepCounts
from autotune.timing.model import group_layout, predict_step_time
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.config_file import parse_config

GB = 1e9


# -- the presets ----------------------------------------------------------------------------------------------


def test_gpu_presets_carry_their_inter_node_fabric():
    h100, a100, cpu = load_hardware("h100-sxm"), load_hardware("a100-80g"), load_hardware("cpu")
    assert h100.gpus_per_node == a100.gpus_per_node == load_hardware("h200").gpus_per_node == 8
    assert h100.rates.inter_node_bytes_per_s == 50 * GB  # 400 Gb/s NDR per GPU
    assert a100.rates.inter_node_bytes_per_s == 25 * GB  # 200 Gb/s HDR per GPU
    assert h100.host_memory_bytes_per_device == 250 * GB  # host memory stays per device: 2 TB / 8
    # a job over several nodes holds NCCL's network buffers too; one node does not
    assert h100.for_nodes(1) == h100
    assert h100.for_nodes(2).runtime_overhead_bytes == h100.runtime_overhead_bytes + h100.nccl_inter_node_buffer_bytes
    assert h100.for_nodes(2).for_nodes(2) == h100.for_nodes(2)
    assert cpu.gpus_per_node == 0 and cpu.rates.inter_node_bytes_per_s == 0 and cpu.for_nodes(2) == cpu


# -- the time model -------------------------------------------------------------------------------------------


def test_group_layout_follows_consecutive_ranks_on_nodes():
    assert group_layout(8, 16, 8) == (1, 8)  # a Ulysses group of 8 stays inside a node of 8
    assert group_layout(16, 16, 8) == (2, 8)  # 16 spans two nodes, 8 ranks on each
    assert group_layout(32, 32, 8) == (4, 8)
    assert group_layout(16, 16, None) == (1, 16)  # one node
    assert group_layout(4, 12, 6) == (2, 2)  # [4, 8) straddles nodes of 6: 2 ranks on each side
    assert group_layout(None, 16, 8) == (1, 1)  # counts without group sizes: as inside a node


def _counts(key: str, wire: float, calls: int = 1) -> StepCounts:
    counts = StepCounts(seq_len=1024)
    counts.collectives[key] = CollectiveCounts(calls=calls, bytes=wire, wire_bytes=wire, max_wire_bytes=wire)
    return counts


def test_an_all_to_all_spanning_nodes_goes_through_one_nic_per_gpu():
    r = load_hardware("h100-sxm").rates
    wire = 15e9  # a group of 16: 15/16 of 16 GB leave each rank
    counts = _counts("all_to_all/forward/sync/16", wire)
    inside = predict_step_time(counts, r, 16, Techniques(ulysses_degree=16))
    across = predict_step_time(counts, r, 16, Techniques(ulysses_degree=16), gpus_per_node=8)
    assert inside.exposed_comm_s == pytest.approx(
        wire / (r.intra_node_bytes_per_s * r.all_to_all_efficiency) + r.collective_latency_s
    )
    # 8 of the 15 peers are on the other node: 8/15 of the bytes through this GPU's own NIC
    nic = wire * 8 / 15 / (r.inter_node_bytes_per_s * r.inter_node_efficiency)
    assert across.exposed_comm_s == pytest.approx(nic + r.inter_node_latency_s)
    assert across.exposed_comm_s > 4 * inside.exposed_comm_s
    # a Ulysses group of 8 inside each node of a 16-rank job: NVLink only
    local = predict_step_time(
        _counts("all_to_all/forward/sync/8", wire), r, 16, Techniques(ulysses_degree=8), gpus_per_node=8
    )
    assert local.exposed_comm_s == pytest.approx(
        wire / (r.intra_node_bytes_per_s * r.all_to_all_efficiency) + r.collective_latency_s
    )


def test_a_ring_collective_across_nodes_uses_every_nic_of_the_node():
    r = load_hardware("h100-sxm").rates
    wire = 8e9
    counts = _counts("all_reduce/other/sync/32", wire)
    across = predict_step_time(counts, r, 32, Techniques(), gpus_per_node=8)
    expected = max(
        wire / (r.intra_node_bytes_per_s * r.all_reduce_efficiency),
        wire / (8 * r.inter_node_bytes_per_s * r.inter_node_efficiency),
    )
    assert across.exposed_comm_s == pytest.approx(expected + r.inter_node_latency_s)
    # an A100 node's 8x 200 Gb/s HDR binds it: half the H100's fabric
    a100 = load_hardware("a100-80g").rates
    slower = predict_step_time(counts, a100, 32, Techniques(), gpus_per_node=8)
    assert slower.exposed_comm_s == pytest.approx(
        wire / (8 * a100.inter_node_bytes_per_s * a100.inter_node_efficiency) + a100.inter_node_latency_s
    )


def test_the_cpu_preset_has_no_fabric_of_its_own():
    """Its "nodes" are agents on one machine: priced on the loopback link, as one node."""
    r = load_hardware("cpu").rates_for(4)
    counts = _counts("all_to_all/forward/sync/4", 1e6)
    assert (
        predict_step_time(counts, r, 4, Techniques(ulysses_degree=4), gpus_per_node=2).step_time_s
        == predict_step_time(counts, r, 4, Techniques(ulysses_degree=4)).step_time_s
    )


def test_old_counts_without_group_sizes_still_predict():
    counts = _counts("all_to_all/forward/sync", 1e9)  # the key format before group sizes
    r = load_hardware("h100-sxm").rates
    assert predict_step_time(counts, r, 16, Techniques(ulysses_degree=16), gpus_per_node=8).exposed_comm_s > 0


# -- plans ----------------------------------------------------------------------------------------------------


def test_a_plan_over_two_nodes_counts_group_sizes_and_prices_the_fabric(tiny_llama):
    """2 nodes x 2 GPUs vs one node of 4, the same stack: the same tensors per rank (plus NCCL's network buffers),
    every collective kept with its group, the Ulysses all-to-all across nodes slower."""
    hw = load_hardware("h100-sxm")
    tech = Techniques(fsdp=True, ulysses_degree=4, activation_checkpointing=True, attention="flash")
    backend = PlanBackend()
    one = backend.evaluate(Evaluation(tiny_llama, tech, 4096, 4, hw))
    counts_one = backend.last_prediction
    two = backend.evaluate(Evaluation(tiny_llama, tech, 4096, 2, hw.for_nodes(2), nodes=2))
    assert one.status == two.status == "ok", (one.error, two.error)
    assert two.peak_allocated_bytes == one.peak_allocated_bytes
    assert two.peak_device_bytes - one.peak_device_bytes == hw.nccl_inter_node_buffer_bytes
    assert two.device == "h100-sxm 2x2 (predicted)"
    assert two.step_time_s > one.step_time_s
    from autotune.backends.plan import step_counts

    sizes = {key.split("/")[0]: int(key.split("/")[3]) for key in step_counts(counts_one).collectives}
    assert sizes["all_to_all"] == 4 and sizes["all_gather"] == 4 and sizes["reduce_scatter"] == 4


def test_the_space_offers_ulysses_degrees_up_to_the_world():
    llama = load_model_config("llama3-8b")  # 32 query heads, 8 kv heads: replicated beyond a degree of 8
    assert load_space(None, llama, 8, 5 << 20).choices["ulysses_degree"] == [1, 2, 4, 8]
    assert load_space(None, llama, 16, 5 << 20).choices["ulysses_degree"] == [1, 2, 4, 8, 16]
    assert load_space(None, llama, 32, 5 << 20).choices["ulysses_degree"] == [1, 2, 4, 8, 16, 32]
    assert load_space(None, llama, 64, 5 << 20).choices["ulysses_degree"] == [1, 2, 4, 8, 16, 32]  # heads bound it


def test_config_files_carry_nodes():
    doc = {"schema": "autotune/config-v1", "model": "tiny-llama", "gpus": 2, "techniques": {}}
    assert parse_config(doc).nodes == 1
    config = parse_config(dict(doc, nodes=4))
    assert config.nodes == 4 and config.to_dict()["nodes"] == 4
    for bad in (0, -1, "two", True):
        with pytest.raises(Exception, match="nodes must be a positive integer"):
            parse_config(dict(doc, nodes=bad))


def test_estimate_on_two_nodes(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "h100-sxm",
                "gpus": 2,
                "nodes": 2,
                "techniques": {"ulysses_degree": 4, "attention": "flash"},
            }
        )
    )
    assert main(["estimate", "--model", "tiny-llama", "--seq", "4K", "--config", str(config), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "ok" and record["device"] == "h100-sxm 2x2 (predicted)"
    assert (
        main(
            [
                "estimate",
                "--model",
                "tiny-llama",
                "--seq",
                "4K",
                "--config",
                str(config),
                "--nodes",
                "1",
                "--gpus",
                "4",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["device"] == "h100-sxm x4 (predicted)"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "16", "--backend", "plan"],
            "(for 16 GPUs: --nodes 2 --gpus 8)",
        ),
        (["trial", "--model", "tiny-llama", "--seq", "1K", "--config", "baseline", "--nodes", "2"], "--rdzv-endpoint"),
        (
            [
                "trial",
                "--model",
                "tiny-llama",
                "--seq",
                "1K",
                "--config",
                "baseline",
                "--rdzv-endpoint",
                "127.0.0.1:29400",
            ],
            "--nodes 2 or more",
        ),
        (
            [
                "trial",
                "--model",
                "tiny-llama",
                "--seq",
                "1K",
                "--config",
                "baseline",
                "--nodes",
                "2",
                "--rdzv-endpoint",
                "no-port",
            ],
            "must be HOST:PORT",
        ),
        (
            [
                "trial",
                "--model",
                "tiny-llama",
                "--seq",
                "1K",
                "--config",
                "baseline",
                "--nodes",
                "2",
                "--rdzv-endpoint",
                "127.0.0.1:99999",
            ],
            "must be HOST:PORT",
        ),
        (["verify", "/nonexistent", "--rdzv-endpoint", "127.0.0.1:29400"], "--nodes 2 or more"),
        (
            ["search", "--model", "llama3-8b", "--target", "5M", "--backend", "plan", "--rdzv-endpoint", "127.0.0.1:1"],
            "--rdzv-endpoint is for real trials",
        ),
    ],
)
def test_bad_multi_node_input_exits_2_with_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("note:")]
    assert len(err) == 1 and fragment in err[0], err


# -- the Slurm export -----------------------------------------------------------------------------------------


def _front(root, techniques: dict, seq_len: int = 1024, hardware: str = "cpu", gpus: int = 1, nodes: int = 2):
    tech = Techniques(**techniques).to_dict()
    record = {
        "status": "ok",
        "source": "predicted",
        "seq_len": seq_len,
        "tokens_per_s": 1000.0,
        "step_time_s": seq_len / 1000.0,
        "peak_device_bytes": 1 << 20,
    }
    (root / "pareto.json").write_text(
        json.dumps(
            {
                "schema": "autotune/pareto-v1",
                "model": "tiny-llama",
                "hardware": hardware,
                "gpus": gpus,
                "nodes": nodes,
                "target": seq_len,
                "front": [
                    {
                        "trial": 0,
                        "seq_len": seq_len,
                        "tokens_per_s": 1000.0,
                        "techniques": tech,
                        "record": record,
                        "predicted": record,
                        "measured": None,
                    }
                ],
            }
        )
    )
    return root


def test_slurm_export_is_an_sbatch_script_for_the_config_nodes(tmp_path):
    _front(tmp_path, {"fsdp": True, "ulysses_degree": 8, "attention": "flash"}, hardware="h100-sxm", gpus=8)
    out = tmp_path / "train.sbatch"
    assert main(["export", str(tmp_path), "--format", "slurm", "-o", str(out)]) == 0
    text = out.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "srun --nodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head_node:$port"',
        "-m trials.train",
    ):
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    exporter = make_exporter("slurm")
    config = load_config_file_from(text)
    assert exporter.launch("train.sbatch", config) == "sbatch train.sbatch"
    # the default 10 steps at the config's step time, x 1.5, plus 30 minutes; the node's CPUs to its task
    from autotune.outputs.exporters.slurm_script import time_limit
    from trials.train import recorded_step_time_s

    assert f"#SBATCH --time={time_limit(recorded_step_time_s(config), 10)}\n" in text
    assert time_limit(7951.0, 10) == "1-09:38:00" and time_limit(1.0, 10) == "0-00:31:00"
    assert '--cpus-per-task="${SLURM_CPUS_ON_NODE:-1}"' in text and "OMP_NUM_THREADS" in text


def _sbatch_under_stand_ins(tmp_path, scontrol: str, srun: str) -> tuple[Path, Path]:
    """The slurm export of a two-node front, and a folder of executable stand-ins (bash bodies) for ``scontrol``
    and ``srun`` to put first on PATH: (script, bin folder)."""
    _front(tmp_path, {"ulysses_degree": 2, "attention": "sdpa"})
    script = tmp_path / "train.sbatch"
    assert main(["export", str(tmp_path), "--format", "slurm", "-o", str(script)]) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", scontrol), ("srun", srun)):
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return script, bin_dir


def test_the_sbatch_script_takes_the_first_host_of_a_long_node_list(tmp_path):
    """The script reads the head node without a pipe into ``head``: under ``pipefail`` an ``scontrol`` killed by
    SIGPIPE after ``head`` took its line failed the job before ``srun`` (seen in CI with a two-line stand-in)."""
    # far more than a pipe holds, so a reader that stops after one line always leaves scontrol writing into a closed pipe
    script, bin_dir = _sbatch_under_stand_ins(
        tmp_path, scontrol="seq -f 'node%g' 1 200000\n", srun='echo "$head_node:$port" > "$OUT_DIR/endpoint"\n'
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[1-200000]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "RDZV_PORT": "29511",
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "endpoint").read_text() == "node1:29511\n"


def test_the_sbatch_scripts_arguments_reach_the_trainer_on_every_node(tmp_path):
    """``sbatch train.sbatch --init ... --save ...``: the arguments reach ``trials.train`` through srun's per-node
    shell (the srun stand-in runs that shell; a python stand-in records what it was asked to run)."""
    script, bin_dir = _sbatch_under_stand_ins(
        tmp_path, scontrol="echo node1; echo node2\n", srun='while [[ $1 == --* ]]; do shift; done; exec "$@"\n'
    )
    (bin_dir / "python").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT_DIR/argv"\n')
    (bin_dir / "python").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "TMPDIR": str(tmp_path),
    }
    args = ["--init", "/models/my model", "--save", "/shared/ckpt", "--resume"]
    done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[argv.index("trials.train") :][-len(args) :] == args  # last, each one argument (spaces kept)


def load_config_file_from(script: str):
    body = script.split("<<'JSON'\n", 1)[1].split("\nJSON\n", 1)[0]
    return parse_config(json.loads(body))


def test_torchrun_export_of_a_multi_node_config_joins_a_rendezvous(tmp_path, capsys):
    _front(tmp_path, {"ulysses_degree": 2, "attention": "sdpa"})
    assert main(["export", str(tmp_path), "--format", "torchrun"]) == 0
    text = capsys.readouterr().out
    assert "--nnodes=2" in text and "RDZV_ENDPOINT" in text and "--standalone" not in text


# -- real trials on two agents (two "nodes" on 127.0.0.1, gloo) -------------------------------------------------


def _cli(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _config(path, techniques: dict, gpus: int, nodes: int = 1):
    path.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": gpus,
                "nodes": nodes,
                "techniques": techniques,
            }
        )
    )
    return str(path)


def _two_agents(config: str, env=None, timeout: float = 600) -> list[tuple[int, dict | None, str]]:
    endpoint = f"127.0.0.1:{_free_port()}"
    args = (
        "trial",
        "--model",
        "tiny-llama",
        "--seq",
        "1K",
        "--config",
        config,
        "--gpus",
        "2",
        "--nodes",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--steps",
        "1",
        "--timeout",
        "300",
        "--json",
    )
    agents = [_cli(*args, env=env)]
    time.sleep(0.5)
    agents.append(_cli(*args, env=env))
    results = []
    for agent in agents:
        out, err = agent.communicate(timeout=timeout)
        results.append((agent.returncode, json.loads(out) if out.strip() else None, err))
    return results


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The plain model's one-rank trial (tiny-llama, 1K, one step): the record whose loss every multi-node trial
    here must give. In-process (``conftest.here``): the reference is the trial's record, not its process, and its
    rank runs as a process of its own."""
    config = _config(tmp_path_factory.mktemp("one-rank") / "one.json", {"attention": "sdpa"}, 1)
    done = here("trial", "--model", "tiny-llama", "--seq", "1K", "--config", config, "--steps", "1", "--timeout", "300",
                "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_trial_over_two_agents_gives_the_loss_of_one_rank(tmp_path, one_rank):
    """2 nodes x 2 ranks (FSDP over all 4, Ulysses over all 4, checkpointing) through torchrun's c10d rendezvous:
    exactly the plain model's first-step loss on one rank; both agents print the same merged record."""
    reference = one_rank
    config = _config(
        tmp_path / "four.json",
        {"fsdp": True, "ulysses_degree": 4, "activation_checkpointing": True, "attention": "sdpa"},
        2,
        nodes=2,
    )
    results = _two_agents(config)
    for code, record, err in results:
        assert code == 0, err[-3000:]
        assert record["status"] == "ok" and record["device"] == "cpu (gloo) x4"
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert results[0][1] == results[1][1]
    assert sum("following the trial" in err for _, _, err in results) == 1  # one driver, one follower


@pytest.mark.slow
def test_a_rank_failing_on_either_node_is_the_root_cause_on_both(tmp_path):
    """Rank 3 crashes (on whichever node the rendezvous put it): both agents report it, exit 1."""
    config = _config(tmp_path / "four.json", {"ulysses_degree": 4, "attention": "sdpa"}, 2, nodes=2)
    for code, record, err in _two_agents(config, env={"AUTOTUNE_TEST_FAULT": "crash:3"}):
        assert code == 1, err[-3000:]
        assert record["status"] == "error" and record["error"].startswith("rank 3: RuntimeError: injected crash")
        assert err.strip().splitlines()[-1].startswith("autotune: the trial ended error: rank 3")


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_under_srun(tmp_path, one_rank):
    """The exported script under stand-ins of ``scontrol`` and ``srun`` that start its per-node task twice on this
    machine: two torchrun agents rendezvous on the first "node" and train; the loss is the one-rank trial's."""
    script, bin_dir = _sbatch_under_stand_ins(
        tmp_path,
        scontrol="echo 127.0.0.1\necho 127.0.0.2\n",
        srun="# stand-in: the task once per node, here\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for node in $(seq 0 $((SLURM_NNODES - 1))); do\n"
        '  SLURM_NODEID=$node TMPDIR=$(mktemp -d) "$@" > "$OUT_DIR/node$node.log" 2>&1 &\n'
        "done\nstatus=0\nfor job in $(jobs -p); do wait $job || status=1; done\nexit $status\n",
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OUT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "STEPS": "1",
        "RDZV_PORT": str(_free_port()),
        "PYTHON": sys.executable,
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    node_logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    assert all(log.exists() for log in node_logs), f"srun never started (exit {done.returncode}): {done.stderr}"
    logs = "".join(log.read_text() for log in node_logs)
    assert done.returncode == 0, done.stderr + logs[-3000:]
    summary = [json.loads(line.split(" ", 1)[1]) for line in logs.splitlines() if line.startswith("summary {")]
    assert len(summary) == 1 and summary[0]["world_size"] == 2, logs[-3000:]  # rank 0 of the one job
    assert summary[0]["first_loss"] == pytest.approx(one_rank["loss"], rel=1e-5), summary[0]


def test_the_bench_says_why_a_layout_cannot_run_instead_of_searching_it():
    """Ulysses over 64 GPUs exceeds llama3-8b's 32 query heads: bench/multi_node.py's row says so and it goes on."""
    done = subprocess.run(
        [sys.executable, "bench/multi_node.py", "--nodes", "8", "--layouts", "all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.lstrip().startswith("8 ")]
    assert len(rows) == 1
    assert "not possible: ulysses_degree 64 does not divide the 32 query heads" in rows[0]
