"""Multi-node: the longest sequence Llama-3-8B trains on with the full stack on 1, 2, 4 and 8 nodes of 8x H100 80 GB.

    .venv/bin/python bench/multi_node.py [--model llama3-8b] [--hardware h100-sxm] [--nodes 1,2,4,8]
        --layouts all,per-node | tee bench/results/multi_node.txt
    .venv/bin/python bench/multi_node.py --nodes 2,4,8 --layouts usp | tee bench/results/multi_node_usp.txt
    .venv/bin/python bench/multi_node.py --nodes 2 --explain 12910592   # where the memory goes at that length

Every row is the plan backend's ``find_max_seq`` (``autotune estimate --nodes N --gpus 8 --max-seq``: the memory
oracle on a fake world of N x 8 ranks, the time model with the preset's inter-node fabric), for the full stack of
bench/ablation.py with two ways to use the nodes:

- Ulysses over every GPU of every node (degree N x 8; kv heads replicated beyond 8): one sequence spans the
  nodes, its all-to-alls cross the InfiniBand fabric;
- Ulysses over each node's 8 GPUs, data-parallel across nodes: each node trains its own sequence, the all-to-alls
  stay on NVLink and FSDP's collectives cross the fabric;
- Ulysses over each node's 8 GPUs x a ring across the nodes (USP, ``ring_degree`` N): one sequence spans the nodes
  in zigzag chunks, the all-to-alls stay on NVLink and only the ring's K/V (and dK/dV) cross the fabric, each hop
  through the sending GPU's own NIC.

A layout the model cannot run (Ulysses over more GPUs than the model has query heads: Llama-3-8B's 32 on 8 nodes)
is a row saying why (``Techniques.validate``'s reason), not a search.

Columns: the longest length that fits, the predicted peak per rank there (device, and host per rank against the
node's RAM share), which memory binds one grid step further, the predicted tokens/s and step time, the collectives'
exposed seconds per step, and the step time the same counts would take if all N x 8 GPUs shared one NVLink island
(what ``--gpus 16`` predicted before presets had an inter-node fabric).
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

K = 1024
GIB = 2.0**30
FULL_STACK = {
    "attention": "flash",
    "fsdp": True,
    "activation_checkpointing": True,
    "head_chunk": 1,
    "loss_tile_tokens": 4 * K,
    "mlp_tile_tokens": 16 * K,
    "activation_offload_layers": "all",
    "optimizer_offload": True,
    "norm_tile_tokens": 64 * K,
}  # bench/ablation.py's last row
PUBLISHED = {1: "ALST: 3.7M (arXiv 2506.13996); UPipe: 5M (arXiv 2602.21196)", 4: "ALST: 15M on 32x H100"}


def binds(record, hardware) -> str:
    """Which memory a record that does not fit ran out of."""
    if record.status == "ok":
        return "-"
    if "host" in (record.error or ""):
        return "host"
    return "device" if record.status == "oom" else record.status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument(
        "--layouts",
        default="all,per-node,usp",
        help="rows per node count: all (Ulysses over every GPU), per-node (Ulysses per node, data parallel across), "
        "usp (Ulysses per node x a ring across the nodes)",
    )
    parser.add_argument(
        "--explain",
        type=int,
        default=None,
        metavar="SEQ",
        help="instead of the table: the memory per segment and the largest live tensors at the peak of "
        "Ulysses over all GPUs of --nodes (one number) at SEQ tokens; with --layouts usp, of Ulysses per node x "
        "a ring across the nodes",
    )
    args = parser.parse_args(argv)

    # the table goes to stdout; libraries' messages (DeepSpeed's import and JIT builds, written to fd 1) to stderr
    table = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def print(*parts, **kwargs):  # noqa: A001 -- the table's own print
        kwargs.pop("flush", None)
        builtins.print(*parts, file=table, flush=True, **kwargs)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts, step_time
    from autotune.core.hardware import load_hardware
    from autotune.core.sizes import format_tokens
    from autotune.search.max_seq import find_max_seq
    from autotune.timing.model import predict_step_time
    from trials.core.errors import ConfigError
    from trials.models.config import load_model_config
    from trials.stack.rules import length_unit
    from trials.stack.techniques import Techniques

    model_config = load_model_config(args.model)
    preset = load_hardware(args.hardware)
    if args.explain is not None:
        from autotune.oracle import explain

        nodes = int(args.nodes)
        usp = args.layouts == "usp"
        degree, ring = (args.gpus, nodes) if usp else (nodes * args.gpus, 1)
        techniques = Techniques.from_dict(
            dict(FULL_STACK, ulysses_degree=degree, ring_degree=ring), model_config["num_hidden_layers"]
        )
        layout = f"Ulysses x{degree} per node x ring {ring}" if usp else f"Ulysses x{degree}"
        print(
            f"{args.model}, full stack, {layout} on {nodes} nodes x {args.gpus} {preset.name}, {args.explain:,} tokens"
        )
        print(explain(Evaluation(model_config, techniques, args.explain, args.gpus, preset.for_nodes(nodes), nodes)))
        return 0
    r = preset.rates
    layers = model_config["num_hidden_layers"]
    print(
        f"{args.model}, full stack (bench/ablation.py's last row), on N nodes x {args.gpus} {preset.name}, "
        f"predicted by the memory oracle and the time model"
    )
    print(
        f"links: NVLink {r.intra_node_bytes_per_s / 1e9:.0f} GB/s per GPU per direction (all-to-all x"
        f"{r.all_to_all_efficiency}, all-gather/reduce-scatter x{r.all_gather_efficiency}); between nodes one "
        f"{r.inter_node_bytes_per_s * 8 / 1e9:.0f} Gb/s NIC per GPU = {r.inter_node_bytes_per_s / 1e9:.0f} GB/s per "
        f"direction x{r.inter_node_efficiency} achieved, {r.inter_node_latency_s * 1e6:.0f} us per collective "
        f"spanning nodes; host RAM {preset.host_memory_bytes_per_device / 1e9:.0f} GB per GPU; device "
        f"{preset.device_memory_bytes / GIB:.2f} GiB, runtime overheads "
        f"{preset.runtime_overhead_bytes / GIB:.1f} GiB (+{preset.nccl_inter_node_buffer_bytes / GIB:.1f} GiB "
        f"NCCL network buffers on several nodes) + {preset.allocator_fragmentation:.0%} fragmentation\n"
    )
    header = (
        f"{'nodes':>5} {'GPUs':>4} {'Ulysses':<24} {'max seq (tokens)':>22} {'peak GiB':>8} {'host GiB':>8} "
        f"{'binds':>6} {'tokens/s':>9} {'step s':>8} {'comm s':>7} {'1 island s':>10}  published"
    )
    print(header)
    print("-" * len(header))
    for nodes in [int(n) for n in args.nodes.split(",")]:
        world = nodes * args.gpus
        hardware = preset.for_nodes(nodes)
        wanted = args.layouts.split(",")
        layouts = [(world, f"x{world} (all GPUs)")] if "all" in wanted else []
        if nodes > 1 and "per-node" in wanted:
            layouts.append((args.gpus, f"x{args.gpus} per node, DP x{nodes}"))
        if nodes > 1 and "usp" in wanted:
            layouts.append((args.gpus, f"x{args.gpus} per node x ring {nodes}"))
        for degree, label in layouts:
            ring = world // degree if "ring" in label else 1
            techniques = Techniques.from_dict(dict(FULL_STACK, ulysses_degree=degree, ring_degree=ring), layers)
            try:
                techniques.validate(model_config, world)
            except ConfigError as why:
                print(f"{nodes:>5} {world:>4} {label:<24} {'not possible':>22}: {why}", flush=True)
                continue
            guess = 7 * 1024 * K * world // (args.gpus * max(1, world // (degree * ring)))
            evaluation = Evaluation(model_config, techniques, guess, args.gpus, hardware, nodes)
            backend = PlanBackend()
            started = time.perf_counter()
            record = find_max_seq(evaluation, backend=backend)
            elapsed = time.perf_counter() - started
            if record.status != "ok":
                print(
                    f"{nodes:>5} {world:>4} {label:<24} {'does not fit at ' + format(record.seq_len, ','):>22} "
                    f"({record.status}: {record.error}) ({elapsed:.0f} s)",
                    flush=True,
                )
                continue
            above = backend.evaluate(replace(evaluation, seq_len=record.seq_len + length_unit(techniques)))
            # the step at the max seq again, for its breakdown: the fabric's share, and one NVLink island's time
            at_max = replace(evaluation, seq_len=record.seq_len)
            fresh = PlanBackend()
            fresh.evaluate(at_max)
            timing = step_time(at_max, fresh.last_prediction)
            island = predict_step_time(
                step_counts(fresh.last_prediction), hardware.rates_for(world), world, techniques, seq_len=record.seq_len
            )
            print(
                f"{nodes:>5} {world:>4} {label:<24} {format_tokens(record.seq_len):>22} "
                f"{record.peak_device_bytes / GIB:8.1f} {record.host_bytes / GIB:8.1f} "
                f"{binds(above, hardware):>6} {record.tokens_per_s:9,.0f} {record.step_time_s:8,.0f} "
                f"{timing.exposed_comm_s:7,.0f} {island.step_time_s:10,.0f}  "
                f"{PUBLISHED.get(nodes, '') if degree * ring == world else ''} ({elapsed:.0f} s)",
                flush=True,
            )
    print(
        "\nbinds: the memory that runs out one grid step (lcm of 1024, the degree and the tiles) beyond the max "
        "seq; host = the offloaded activations and optimizer states per GPU exceed its share of the node's RAM; "
        "comm s: collectives' exposed seconds per step; 1 island s: the step if every GPU shared one NVLink island"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
