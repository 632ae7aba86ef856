"""What a command that takes ``--config`` runs (``estimate``, ``trial``): one rule for every such command.

A config file supplies the model, the GPUs per node, the nodes, the hardware and the length (``seq_len``). An
option given on the command line overrides the file's value, and each override is a notice the command prints
as one line on stderr (``--gpus 4 overrides the config's 8``). ``--attention`` names the kernel over the file's (or the baseline's ``sdpa``). ``--config baseline`` supplies techniques only:
``--model`` is required then, and the command's own defaults (``Defaults``) fill in the rest. A ``--model`` of
another architecture than the file's model (a field of ``ARCHITECTURE`` differs) is refused, naming both,
unless ``other_model`` is given: then the file's techniques run on that model, and a notice says so."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.core.documents import describe_documents, parse_documents
from autotune.core.errors import UserError
from autotune.core.evaluation import Evaluation
from autotune.core.sizes import parse_tokens, short_tokens
from trials import model_config as model_configs  # looked up at call time: tests replace load_model_config
from trials.kernels.documents import ONE, DocumentsSpec
from trials.kernels.registry import KERNEL_NAMES
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.models.model import lora_mismatch
from trials.stack.techniques import BASELINE, Techniques
from trials.training import config_file

# the fields of a Hugging Face config.json that make a config's techniques another model's when they differ
ARCHITECTURE = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")


@dataclass(frozen=True)
class Defaults:
    """A command's values where neither a config file nor an option gives one (``--config baseline``)."""

    gpus: int
    nodes: int = 1
    hardware: str = "h100-sxm"


@dataclass
class ConfigRun:
    """The model, techniques, world, hardware and length a command runs, and the overrides it says it made."""

    model: str
    model_config: dict
    techniques: Techniques
    gpus: int  # per node
    nodes: int
    hardware: str
    seq_len: int | None  # None: neither --seq nor the file's seq_len
    notices: list[str] = field(default_factory=list)
    trainer: str | None = None  # the config file's: the trainer it was searched for
    documents: DocumentsSpec = ONE  # --documents over the config file's
    lora: LoraSpec = FULL_TRAINING  # --lora-rank (and its options) over the config file's

    def evaluation(self, hardware, seq_len: int | None = None) -> Evaluation:
        """What the command evaluates on ``hardware``: at ``seq_len`` (default: the run's own, 0 when none)."""
        length = self.seq_len if seq_len is None else seq_len
        return Evaluation(
            self.model_config, self.techniques, length or 0, self.gpus, hardware, self.nodes, self.documents, self.lora
        )


def resolve_config(
    config: str,
    defaults: Defaults,
    *,
    model: str | None = None,
    seq: str | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    hardware: str | None = None,
    other_model: bool = False,
    attention: str | None = None,
    documents: str | None = None,
    lora: LoraSpec | None = None,
) -> ConfigRun:
    """``--config`` (a config file or ``baseline``) with the command line's options over it (None: not given);
    ``attention`` replaces the techniques' attention kernel; ``lora`` (``autotune.core.lora.parse_lora``) the
    config file's adapters."""
    seq_len = parse_tokens(seq, "--seq") if seq is not None else None
    packed = parse_documents(documents) if documents is not None else None
    if attention is not None and attention not in KERNEL_NAMES:
        raise UserError(f"--attention {attention!r} must be one of {', '.join(KERNEL_NAMES)}")
    if config == "baseline":
        if model is None:
            raise UserError("--model is required with --config baseline (a config file names its own model)")
        return _checked(
            ConfigRun(
                model=model,
                model_config=model_configs.load_model_config(model),
                techniques=replace(BASELINE, attention=attention or BASELINE.attention),
                gpus=gpus if gpus is not None else defaults.gpus,
                nodes=nodes if nodes is not None else defaults.nodes,
                hardware=hardware if hardware is not None else defaults.hardware,
                seq_len=seq_len,
                documents=packed or ONE,
                lora=lora or FULL_TRAINING,
            )
        )
    loaded = config_file.load_config_file(config)
    notices: list[str] = []
    chosen, chosen_config, techniques = _model(config, loaded, model, other_model, notices)
    techniques = replace(techniques, attention=_override("--attention", attention, techniques.attention, notices))
    if gpus is None and loaded.gpus < 1:
        raise UserError(f"config {config!r} has gpus {loaded.gpus}: it must be at least 1")
    return _checked(
        ConfigRun(
            model=chosen,
            model_config=chosen_config,
            techniques=techniques,
            gpus=_override("--gpus", gpus, loaded.gpus, notices),
            nodes=_override("--nodes", nodes, loaded.nodes, notices),
            hardware=_override("--hardware", hardware, loaded.hardware, notices),
            seq_len=_override("--seq", seq_len, loaded.seq_len, notices, short_tokens),
            notices=notices,
            trainer=loaded.trainer,
            documents=_override("--documents", packed, loaded.documents, notices, describe_documents),
            lora=_override("--lora-rank", lora, loaded.lora, notices, LoraSpec.describe),
        )
    )


def _checked(run: ConfigRun) -> ConfigRun:
    """``run`` with its adapters checked against its model (``UserError`` naming what matches nothing) and its
    documents noted (``_noting_whole_documents``)."""
    problem = lora_mismatch(run.model_config, run.lora)
    if problem:
        raise UserError(problem)
    return _noting_whole_documents(run)


def _noting_whole_documents(run: ConfigRun) -> ConfigRun:
    """``run``, with a notice when its documents are no shorter than its sequence: each sequence is then one
    document (``DocumentsSpec.for_length``), whatever ``--documents`` said."""
    documents = run.documents
    if not documents.one and run.seq_len is not None and documents.for_length(run.seq_len) is None:
        run.notices.append(
            f"--documents {describe_documents(documents)} is not shorter than the sequence "
            f"({short_tokens(run.seq_len)}): each sequence is one document"
        )
    return run


def _override(flag: str, given, from_file, notices: list[str], show: Callable = str):
    """``given`` when the command line gave it (a notice when it differs from the file's), else the file's."""
    if given is None:
        return from_file
    if from_file is not None and given != from_file:
        notices.append(f"{flag} {show(given)} overrides the config's {show(from_file)}")
    return given


def _model(
    config: str, loaded: config_file.TrialConfig, model: str | None, other_model: bool, notices: list[str]
) -> tuple[str, dict, Techniques]:
    """(model, its config.json, techniques): the file's, or ``--model`` of the same architecture, or with
    ``other_model`` any model (the file's techniques parsed again for it: ``all`` means its own layer count)."""
    file_config = model_configs.load_model_config(loaded.model)
    if model is None or model == loaded.model:
        return loaded.model, file_config, loaded.techniques
    given = model_configs.load_model_config(model)
    differs = [
        f"{key} {given.get(key)} vs {file_config.get(key)}"
        for key in ARCHITECTURE
        if given.get(key) != file_config.get(key)
    ]
    if not differs:
        notices.append(f"--model {model} overrides the config's {loaded.model} (the same architecture)")
        return model, given, loaded.techniques
    if not other_model:
        raise UserError(
            f"--model {model} is not the architecture of the config's model {loaded.model} ({', '.join(differs)}): "
            f"give --other-model to run the config's techniques on it"
        )
    notices.append(f"--other-model: running the techniques the config has for {loaded.model} on {model}")
    raw = json.loads(Path(config).read_text()).get("techniques", {})
    return model, given, Techniques.from_dict(raw, given["num_hidden_layers"])
