"""Each trainer's own code judging autotune's exports (run by tests/test_exports.py in a fresh process each:
the trainers set up process groups, loggers and environment variables that must not leak into the tests).

    python tests/trainer_judges.py arctic MODEL_DIR WORLD RECIPE...   ArcticTraining's config loader
    python tests/trainer_judges.py accelerate CONFIG...               Accelerate's loader and launcher, and the
                                                                      config the .train.py it launches carries
    python tests/trainer_judges.py accelerate-deepspeed CONFIG...     Accelerate's loader, launcher,
                                                                      ParallelismConfig, DeepSpeedPlugin, and the
                                                                      Trainer snippet's TrainingArguments
    python tests/trainer_judges.py alst ALST_PY MODEL_DIR             a DeepSpeed .alst.py run on a tiny model
    python tests/trainer_judges.py alst-packed ALST_PY MODEL_DIR LENGTHS  the same on documents of LENGTHS
                                                                      (comma-separated) packed by the .alst.py

Prints one JSON object per judged file; a refusal is the trainer's exception (the process exits non-zero).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def judge_arctic(model_dir: str, world: int, recipes: list[str]) -> None:
    """``arctic_training.config.trainer.get_config``: the loader ``arctic_training RECIPE`` runs. It initialises
    DeepSpeed's process group (a 1-rank gloo group here, so no other rank is waited for) and reads the world size
    from WORLD_SIZE; the model's config.json is read from ``model_dir`` (no hub on this machine)."""
    import torch.distributed as dist
    import yaml

    from autotune.timing.calibration import _free_port

    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("JUDGE_PORT") or str(_free_port()),  # judges run side by side (pytest-xdist)
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    os.environ["WORLD_SIZE"] = str(world)
    os.chdir(tempfile.mkdtemp())  # the loader creates train-log-metrics.jsonl in the working folder
    from arctic_training.config.trainer import get_config

    for path in recipes:
        recipe = yaml.safe_load(Path(path).read_text())
        recipe["model"]["name_or_path"] = model_dir  # the user's model: here a folder with the preset's config
        config = get_config(recipe)
        print(
            json.dumps(
                {
                    "path": path,
                    "type": config.type,
                    "world_size": config.world_size,
                    "sequence_parallel_size": config.sequence_parallel_size,
                    "activation_checkpoint_cpu_offload": config.activation_checkpoint_cpu_offload,
                    "tiled_mlp_compute": config.tiled_mlp_compute,
                    "disable_activation_checkpoint": config.model.disable_activation_checkpoint,
                    "attn_implementation": config.model.attn_implementation,
                    "max_length": config.data.max_length,
                    "optimizer": config.optimizer.type,
                    "zero": config.deepspeed["zero_optimization"],
                    "train_batch_size": config.deepspeed["train_batch_size"],
                }
            ),
            flush=True,
        )


def judge_accelerate(configs: list[str]) -> None:
    """``accelerate launch --config_file CONFIG CONFIG.train.py`` up to the launcher Accelerate picks (recorded,
    not run: ``torch.distributed.run``'s for several processes, the plain one for one) with the arguments and
    environment it would start them with; then the ``.train.py`` imported (not run) for the config it carries."""
    import importlib.util

    import accelerate.commands.launch as launch
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    from trials.training.config_file import parse_config

    for path in configs:
        loaded = load_config_from_file(path)
        script = str(Path(path).with_suffix(".train.py"))
        seen: dict = {}

        def multi_gpu(args):
            seen.update(launcher="torch.distributed.run", env=prepare_multi_gpu_env(args))
            seen["processes"] = int(args.nproc_per_node) * int(getattr(args, "nnodes", None) or 1)

        def simple(args):
            seen.update(launcher="simple", env=prepare_simple_launcher_cmd_env(args)[1], processes=1)

        def refuse(*args):
            raise AssertionError("accelerate chose a launcher that starts no torch.distributed job")

        launch.multi_gpu_launcher, launch.simple_launcher, launch.deepspeed_launcher = multi_gpu, simple, refuse
        launch.launch_command(launch.launch_command_parser().parse_args(["--config_file", path, script]))
        spec = importlib.util.spec_from_file_location("exported_train", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # defines CONFIG and main; main runs only as a script
        carried = parse_config(module.CONFIG, script)
        print(
            json.dumps(
                {
                    "path": path,
                    "distributed_type": str(loaded.distributed_type),
                    "num_processes": loaded.num_processes,
                    "launcher": seen["launcher"],
                    "processes": seen["processes"],
                    "mixed_precision": seen["env"].get("ACCELERATE_MIXED_PRECISION"),
                    "script_seq_len": carried.seq_len,
                    "script_techniques": carried.techniques.to_dict(),
                }
            ),
            flush=True,
        )


def judge_accelerate_deepspeed(configs: list[str]) -> None:
    """``accelerate launch --config_file CONFIG train.py`` up to the DeepSpeed launcher (recorded, not run):
    the config loader, the launch-argument validation, the environment it hands the processes; then what those
    processes build from it (``ParallelismConfig``, ``DeepSpeedPlugin`` reading the DeepSpeed JSON) and the
    Trainer snippet's ``TrainingArguments`` (with ``use_cpu``: this machine has no GPU for bf16)."""
    import accelerate.commands.launch as launch
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    for path in configs:
        loaded = load_config_from_file(path)
        seen: dict = {}

        def record(args):
            seen["env"] = prepare_deepspeed_cmd_env(args)[1]

        def refuse(*args):
            raise AssertionError("accelerate chose a launcher other than DeepSpeed's")

        launch.deepspeed_launcher = record
        launch.simple_launcher = launch.multi_gpu_launcher = refuse
        launch.launch_command(launch.launch_command_parser().parse_args(["--config_file", path, "train.py"]))
        env = {k: v for k, v in seen["env"].items() if k.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_"))}
        saved = dict(os.environ)
        os.environ.update(env)
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedPlugin

        parallelism = ParallelismConfig()
        plugin = DeepSpeedPlugin()
        namespace: dict = {}
        snippet = Path(path).with_suffix(".trainer.py").read_text()
        exec(compile(snippet.replace("bf16=True,", "bf16=True, use_cpu=True,"), "trainer.py", "exec"), namespace)
        args = namespace["training_args"]
        os.environ.clear()
        os.environ.update(saved)
        handler = parallelism.sp_handler
        print(
            json.dumps(
                {
                    "path": path,
                    "distributed_type": str(loaded.distributed_type),
                    "num_processes": loaded.num_processes,
                    "use_parallelism_config": env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true",
                    "sp_size": parallelism.sp_size,
                    "sp_backend": parallelism.sp_backend,
                    "sp_attn_implementation": handler.sp_attn_implementation if handler else None,
                    "sp_seq_length_is_variable": handler.sp_seq_length_is_variable if handler else None,
                    "deepspeed_config_file": env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                    "zero_stage": plugin.deepspeed_config["zero_optimization"]["stage"],
                    "trainer_sp_size": args.parallelism_config.sp_size if args.parallelism_config else 1,
                    "trainer_checkpointing": args.activation_checkpointing,
                    "trainer_checkpointing_kwargs": args.activation_checkpointing_kwargs,
                    "trainer_deepspeed": args.deepspeed,
                }
            ),
            flush=True,
        )


def _import_alst(alst_path: str):
    """The exported DeepSpeed ``.alst.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("alst", alst_path)
    alst = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alst)
    return alst


def _worst_relative_grad_error(grads: dict, model) -> float:
    """The largest |grads[n] - reference| / |reference| (max norms) over ``model``'s parameters, whose ``.grad`` holds
    the reference."""
    return max(
        float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12))
        for n, p in model.named_parameters()
    )


def run_alst(alst_path: str, model_dir: str) -> None:
    """Import a DeepSpeed ``.alst.py`` and train one step of a tiny Llama with it (one rank, CPU): its tiled MLP,
    tiled loss and checkpoint offload, against the model's own loss and gradients without any of them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    alst = _import_alst(alst_path)
    config = {k: v for k, v in json.loads((Path(model_dir) / "config.json").read_text()).items()}
    mpu = alst.before_model()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=alst.ATTENTION))
    alst.after_model(model)
    model.train()
    ids = torch.randint(0, config["vocab_size"], (1, alst.SEQ_LEN))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(alst.SEQ_LEN)[None]}
    with alst.offload_context():
        loss = alst.tiled_loss(model, batch)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tiled_mlp = type(model.model.layers[0].mlp).forward
    type(model.model.layers[0].mlp).forward = alst._mlp  # the plain MLP: the reference runs nothing of ALST
    model.gradient_checkpointing_disable()
    reference = model(input_ids=ids, labels=ids, position_ids=batch["position_ids"]).loss
    reference.backward()
    worst = _worst_relative_grad_error(grads, model)
    print(
        json.dumps(
            {
                "path": alst_path,
                "mpu": mpu is not None,
                "loss": float(loss),
                "reference": float(reference),
                "worst_relative_grad_error": worst,
                "mlp_tiled": tiled_mlp is alst._tiled_mlp_forward,
                "checkpointing": alst.CHECKPOINTING,
                "offloaded_layers": alst.OFFLOADED_LAYERS,
            }
        ),
        flush=True,
    )


def run_alst_packed(alst_path: str, model_dir: str, lengths: list[int]) -> None:
    """Import a DeepSpeed ``.alst.py``, pack seeded documents of ``lengths`` with its ``packed_windows`` and train
    its first window one step (one rank, CPU, SDPA: transformers masks the documents its position_ids mark)
    against the plain model run on each document of that window alone: the loss (each document's predictions,
    none across a boundary) and the gradients."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    alst = _import_alst(alst_path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, config["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
    batch = next(iter(alst.packed_windows(documents)))
    alst.before_model()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=alst.ATTENTION))
    alst.after_model(model)
    model.train()
    with alst.offload_context():
        loss = alst.tiled_loss(model, batch)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    type(model.model.layers[0].mlp).forward = alst._mlp  # the plain model: nothing of ALST
    model.gradient_checkpointing_disable()
    pieces, start = [], 0  # the window's documents as packed: back to back, the last cut at the window's end
    for n in lengths:
        take = min(n, alst.SEQ_LEN - start)
        pieces.append(batch["input_ids"][0, start : start + take])
        start += take
        if start == alst.SEQ_LEN:
            break
    predictions = sum(len(piece) - 1 for piece in pieces)
    reference = (
        sum(
            model(input_ids=piece[None], labels=piece[None]).loss * (len(piece) - 1)
            for piece in pieces
            if len(piece) > 1
        )
        / predictions
    )
    reference.backward()
    worst = _worst_relative_grad_error(grads, model)
    print(
        json.dumps(
            {
                "path": alst_path,
                "documents": [len(piece) for piece in pieces],
                "window": int(batch["input_ids"].shape[-1]),
                "position_ids_restart": int((batch["position_ids"][0] == 0).sum()) if "position_ids" in batch else 0,
                "loss": float(loss),
                "reference": float(reference),
                "worst_relative_grad_error": worst,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    trainer, rest = sys.argv[1], sys.argv[2:]
    if trainer == "arctic":
        judge_arctic(rest[0], int(rest[1]), rest[2:])
    elif trainer == "accelerate":
        judge_accelerate(rest)
    elif trainer == "accelerate-deepspeed":
        judge_accelerate_deepspeed(rest)
    elif trainer == "alst":
        run_alst(rest[0], rest[1])
    elif trainer == "alst-packed":
        run_alst_packed(rest[0], rest[1], [int(n) for n in rest[2].split(",")])
    else:
        raise SystemExit(f"unknown trainer {trainer!r}")
