"""Search spaces from YAML (the ``search_spaces`` package's ``*.yaml``, or a user's file: ``--space FILE``; its
README.md describes the format): knob choices, the sequence-length grid, and the constraints of the model and node
applied before sampling.

Everything per knob derives from its declaration in ``trials.stack.techniques.Techniques`` (kind, words, conditions,
which change needs less memory); the rules of what fits a model and node are ``trials.stack.rules``'. Conditional
knobs (define-by-run, so Optuna's TPE learns each branch) are those with a ``sampled_when`` or ``requires``:
    optimizer_offload       only with fsdp
    head_chunk              only when ulysses_degree > 1 (choices depend on the degree, so each degree
                            has its own parameter name ``head_chunk_u{degree}``: ``split_by``, whose rule
                            says which chunks each degree keeps)
    ring_degree             per Ulysses degree (``ring_degree_u{degree}``): the rings that Ulysses x ring fits
                            in the world (the context-parallel world factored into Ulysses x ring)
    activation_offload_layers  only with activation_checkpointing

The ``attention`` knob's choices may hold the word ``hardware``: the attention kernels the search's hardware runs
(``load_space``'s ``kernels``: the preset's list, on a local search those this node runs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from autotune.core.errors import UserError
from autotune.core.sizes import parse_tokens
from autotune.core.trainers import AUTOTUNE, ExportJob, Trainer, memory_rank
from trials.kernels.documents import ONE, DocumentsSpec
from trials.kernels.registry import attention_kernel_problem
from trials.models.config import attention_features
from trials.stack.rules import ring_degree_problem, ring_documents_problem, split_unit, ulysses_degree_problem
from trials.stack.techniques import ALL_LAYERS, Knob, Techniques, knob_names, knobs

SPACE_SCHEMA = "autotune/space-v1"
# a trial between two grid lengths or above the grid (``policy``: reaching a config's memory wall) keeps ``seq_len``
# at the grid length below it, a choice TPE knows, and evaluates the length this parameter holds
WALL_PARAM = "wall_seq_len"
_WALL_RANGE = (1, 2**40)
SPACES_DIR = Path(str(resources.files("search_spaces")))  # the shipped spaces: package data of ``search_spaces``
DEFAULT_SPACE = SPACES_DIR / "default.yaml"
KNOBS = knob_names()
_SEQ_KEYS = {"min_fraction": 0.0625, "max_fraction": 4.0, "points_per_doubling": 2, "multiple_of": 1024}
_TABLE = {k.name: k for k in knobs()}
HARDWARE_KERNELS = "hardware"  # the attention choice that stands for the kernels the hardware runs


def param_name(knob: Knob, values: dict) -> str:
    """The Optuna parameter of ``knob`` given the other knobs' values (``split_by``: one per value)."""
    if knob.split_by is None:
        return knob.name
    other, tag, _ = knob.split_by
    return f"{knob.name}_{tag}{values[other]}"


def _active(knob: Knob, values: dict) -> bool:
    """Is ``knob`` sampled, given the values of the knobs before it?"""
    if knob.requires and not values[knob.requires[0]]:
        return False
    if knob.sampled_when:
        other, predicate = knob.sampled_when
        return predicate(values[other])
    return True


@dataclass
class SearchSpace:
    """Choices per knob (already filtered for a model and node) and the sequence-length grid."""

    choices: dict[str, list]
    seq_lens: list[int]
    # each ``split_by`` knob: the value of the knob it is split by -> its choices there (its rule's survivors)
    split_choices: dict[str, dict[Any, list]]
    trainer: Trainer = AUTOTUNE  # the trainer the search is for: its choices only, evaluated as it runs them
    model_config: dict = field(default_factory=dict)
    gpus: int = 1  # the world: every node's GPUs

    def runs(self, asked: Techniques, seq_len: int) -> Techniques:
        """What the trainer runs for a sampled config at ``seq_len`` (``Trainer.runs``): the config a trial
        evaluates, the front shows and the export writes. The search's own bookkeeping (climbing, walls, steps
        down in memory) follows the sampled config, which stays the same at every length."""
        if all(e.as_asked for e in self.trainer.expresses.values()):
            return asked
        return self.trainer.runs(ExportJob("", self.model_config, self.gpus, seq_len, asked))

    def frugal(self, num_layers: int, layout: tuple[int, int] | None = None) -> Techniques:
        """The config of this space that needs the least memory: every knob at its most memory-saving choice
        (``memory_rank``), the attention kernel ALST's where the space has it. The search climbs it to its wall,
        which is the node's wall for the trainer. ``layout``: (Ulysses degree, ring degree) held fixed, every
        other knob at its most memory-saving choice under them (one of ``layouts``)."""
        values: dict[str, Any] = {}
        fixed = dict(zip(("ulysses_degree", "ring_degree"), layout)) if layout else {}
        for knob in knobs():
            if not _active(knob, values):
                values[knob.name] = knob.default
                continue
            choices = [num_layers if c == ALL_LAYERS else c for c in self.knob_choices(knob, values)]
            if knob.name in fixed:
                values[knob.name] = fixed[knob.name]
            elif knob.less_memory is None:
                values[knob.name] = knob.alst if knob.alst in choices else choices[0]
            else:
                values[knob.name] = max(choices, key=lambda c: memory_rank(knob, c))
        return Techniques(**values)

    def layouts(self, world_size: int, gpus_per_node: int) -> list[tuple[int, int]]:
        """The (Ulysses degree, ring degree) layouts over several nodes that the space holds and that span the
        whole world: Ulysses inside a node x a ring across the nodes, and the mixes up to Ulysses over every GPU
        (a ring of 1). None on one node, where Ulysses over the node is the layout the space's frugal config takes."""
        if world_size <= gpus_per_node:
            return []
        rings = self.split_choices.get("ring_degree", {})
        return [
            (ulysses, world_size // ulysses)
            for ulysses in sorted(self.choices["ulysses_degree"])
            if ulysses >= gpus_per_node
            and world_size % ulysses == 0
            and world_size // ulysses in rings.get(ulysses, [1])
        ]

    def knob_choices(self, knob: Knob, values: dict) -> list:
        """The choices of ``knob`` given the knobs before it (a ``split_by`` knob's depend on that knob's value;
        a value the space does not hold leaves only the default)."""
        if knob.split_by is None:
            return self.choices[knob.name]
        return self.split_choices[knob.name].get(values[knob.split_by[0]], [knob.default])

    def sample(self, trial, num_layers: int, queued: dict | None = None) -> tuple[Techniques, int]:
        """Suggest one config and sequence length on an Optuna trial (knobs in declaration order). ``queued``: the
        params the trial was handed (default: ``queued_params(trial)``); one with ``WALL_PARAM`` gives that length."""
        values: dict[str, Any] = {}
        for knob in knobs():
            if not _active(knob, values):
                values[knob.name] = knob.default
                continue
            choices = self.knob_choices(knob, values)
            if knob.split_by and len(choices) <= 1:  # no choice: no parameter (the only choice, or off)
                values[knob.name] = choices[0] if choices else knob.default
                continue
            value = trial.suggest_categorical(param_name(knob, values), choices)
            values[knob.name] = num_layers if value == ALL_LAYERS else value
        unit = split_unit(values["ulysses_degree"], values["ring_degree"])
        seq_len = trial.suggest_categorical("seq_len", [s for s in self.seq_lens if s % unit == 0])
        if WALL_PARAM in (queued_params(trial) if queued is None else queued):  # queued between two grid lengths
            seq_len = trial.suggest_int(WALL_PARAM, *_WALL_RANGE)
        return Techniques(**values), seq_len

    def point_of(self, params: dict, num_layers: int) -> tuple[Techniques, int]:
        """The config and length ``sample`` gives under ``params`` (a queued trial's)."""
        return self.sample(optuna.trial.FixedTrial(params), num_layers, queued=params)

    def head_chunks(self, degree: int) -> list:
        """``head_chunk``'s choices under a Ulysses degree (``knob_choices``), for grids built by hand."""
        knob = _TABLE["head_chunk"]
        return self.knob_choices(knob, {knob.split_by[0]: degree})

    def params_for(self, techniques: Techniques, seq_len: int, num_layers: int) -> dict | None:
        """The Optuna params under which ``sample`` gives exactly this config and length (for enqueueing), or
        None when the space cannot express it."""
        values = techniques.to_dict()
        params: dict = {}
        for knob in knobs():
            value = values[knob.name]
            if not _active(knob, values):
                if value != knob.default:
                    return None
                continue
            choices = self.knob_choices(knob, values)
            if knob.split_by and len(choices) <= 1:
                if value != (choices[0] if choices else knob.default):
                    return None
                continue
            if ALL_LAYERS in choices and value == num_layers:
                value = ALL_LAYERS
            if value not in choices:
                return None
            params[param_name(knob, values)] = value
        unit = split_unit(techniques.ulysses_degree, techniques.ring_degree)
        lengths = [s for s in self.seq_lens if s % unit == 0]
        if seq_len in lengths:
            params["seq_len"] = seq_len
            return params
        below = [s for s in lengths if s < seq_len]
        if not below or seq_len % unit:
            return None  # between two grid lengths, or above the grid
        params["seq_len"] = below[-1]
        params[WALL_PARAM] = seq_len
        return params

    def on_grid(self, seq_len: int) -> bool:
        return seq_len in self.seq_lens

    def memory_steps(self, techniques: Techniques, num_layers: int) -> list[Techniques]:
        """The configs one knob away that should need less memory (each knob's ``less_memory``, in declaration
        order; only choices of this space): a bool knob on, the next larger choice (``larger``), the next
        smaller one where off counts as the largest (``smaller``). Knobs that depend on the changed one go back
        to what ``sample`` gives them."""
        values = techniques.to_dict()
        steps = []
        for knob in knobs():
            if knob.less_memory is None or not _active(knob, values):
                continue
            current = values[knob.name]
            choices = [num_layers if c == ALL_LAYERS else c for c in self.knob_choices(knob, values)]
            if knob.less_memory == "on":
                new = True if not current and True in choices else None
            elif knob.less_memory == "larger":
                larger = [c for c in choices if c > current]
                new = min(larger) if larger else None
            else:  # smaller; off (0 / None) is the largest
                smaller = [c for c in choices if not knob.is_off(c) and (knob.is_off(current) or c < current)]
                new = max(smaller) if smaller else None
            if new is None:
                continue
            changed = dict(values, **{knob.name: new})
            for dependent in knobs():  # knobs that hang on the changed one restart from their sampled value
                if dependent.parent == knob.name or (dependent.split_by and dependent.split_by[0] == knob.name):
                    changed[dependent.name] = self._restart(dependent, changed)
            steps.append(Techniques(**changed))
        return steps

    def neighbours(self, techniques: Techniques, num_layers: int, faster_only: bool = False) -> list[Techniques]:
        """The configs of this space one knob away, either way (``autotune.search.polish`` compares a front point
        with them at its length): a bool knob flipped; another attention kernel; a numeric knob's next choice
        either side in memory order (``memory_rank``: off next to the largest tile or chunk), and a technique under
        another (``requires``: the activation offload) off.
        A changed Ulysses degree keeps Ulysses x ring where the ring's choices allow; other knobs that hang on
        the changed one go back to what ``sample`` gives them. ``faster_only``: of a knob that trades speed for
        memory (a ``less_memory`` without ``speed_either_way``), only the change that needs more memory, the one
        that can run faster."""
        values = techniques.to_dict()
        found: list[Techniques] = []
        for knob in knobs():
            if not _active(knob, values):
                continue
            current = values[knob.name]
            choices = [num_layers if c == ALL_LAYERS else c for c in self.knob_choices(knob, values)]
            if knob.less_memory is None or knob.kind == "bool":
                others = [c for c in choices if c != current]
            else:
                ordered = sorted(set(choices) | {current}, key=lambda c: memory_rank(knob, c))
                at = ordered.index(current)
                others = [ordered[i] for i in (at - 1, at + 1) if 0 <= i < len(ordered)]
                if knob.requires and not knob.is_off(current) and knob.default in choices:
                    others.append(knob.default)  # a technique under another (the activation offload) off
            if faster_only and knob.less_memory is not None and not knob.speed_either_way:
                others = [c for c in others if memory_rank(knob, c) < memory_rank(knob, current)]
            for new in dict.fromkeys(others):
                changed = dict(values, **{knob.name: new})
                for dependent in knobs():
                    if dependent.parent == knob.name or (dependent.split_by and dependent.split_by[0] == knob.name):
                        changed[dependent.name] = self._restart(dependent, changed)
                if knob.name == "ulysses_degree":  # the same context-parallel world where the ring allows it
                    ring = current * values["ring_degree"] // new
                    if ring * new == current * values["ring_degree"] and ring in self.knob_choices(
                        _TABLE["ring_degree"], changed
                    ):
                        changed["ring_degree"] = ring
                neighbour = Techniques(**changed)
                if neighbour != techniques and neighbour not in found:
                    found.append(neighbour)
        return found

    def _restart(self, knob: Knob, values: dict):
        """A dependent knob's value when its parent changes: off, or (split knobs) off if the space offers it,
        else the first choice."""
        if knob.split_by:
            choices = self.knob_choices(knob, values)
            return knob.default if knob.default in choices else choices[0]
        return knob.default


def queued_params(trial) -> dict:
    """The params ``study.enqueue_trial`` handed a running ``optuna.Trial``: the system attribute ``fixed_params``
    of its ``FrozenTrial`` in the study. Empty for a trial the sampler proposes, and for a trial without a study
    (a ``FixedTrial``: ``point_of`` passes its params to ``sample``)."""
    if not isinstance(trial, optuna.Trial):
        return {}
    for frozen in trial.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if frozen.number == trial.number:
            return frozen.system_attrs.get("fixed_params", {})
    return {}


def load_space(
    path: str | Path | None,
    model_config: dict,
    gpus: int,
    target: int,
    trainer: Trainer = AUTOTUNE,
    on_gpu: bool = True,
    kernels: Sequence[str] | None = None,
    compute_capability_major: int | None = None,
    documents: DocumentsSpec = ONE,
) -> SearchSpace:
    """Read and validate a space file, then drop choices this model and node cannot run, and those ``trainer``
    does not run (``restrict_to_trainer``; a choice the trainer cannot run in the user's own file is bad input).

    ``kernels``: the attention kernels the hardware runs (``Hardware.kernels``; a local search, those this node
    runs; CPU trials: ``["sdpa"]``), what the choice ``hardware`` stands for; other kernels are dropped. None: every
    kernel the knob takes. ``compute_capability_major``: the GPUs' generation, whose limits a kernel declares (head
    dims, softcaps); None: unknown. ``documents``: the documents each sequence packs; a ring splits each into 2 x
    ring chunks: where ``trainer`` pads them to that (``Trainer.pads_ring_documents``) every ring stays, else rings
    that do not divide every document's length are dropped (``trials.stack.rules.ring_documents_problem``; offered
    in the user's own file, bad input)."""
    user_file = path is not None
    path = Path(path) if path else DEFAULT_SPACE
    if not path.is_file():
        raise UserError(f"search space {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(
            f"search space {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"search space {str(path)!r} must be a YAML mapping")
    unknown = sorted(set(data) - {"schema", "seq_len", "knobs"})
    if unknown:
        raise UserError(f"search space {str(path)!r}: unknown top-level key {unknown[0]!r}")
    if data.get("schema", SPACE_SCHEMA) != SPACE_SCHEMA:
        raise UserError(f"search space {str(path)!r}: schema {data.get('schema')!r} is not {SPACE_SCHEMA!r}")
    given = data.get("knobs") or {}
    if not isinstance(given, dict):
        raise UserError(f"search space {str(path)!r}: knobs must be a mapping of knob -> list of choices")
    for name in given:
        if name not in KNOBS:
            raise UserError(f"search space {str(path)!r}: unknown knob {name!r}; known: {', '.join(KNOBS)}")
    defaults = Techniques()
    choices: dict[str, list] = {}
    for name in KNOBS:
        raw = given.get(name, [getattr(defaults, name)])
        if not isinstance(raw, list):
            raw = [raw]
        if not raw:
            raise UserError(f"search space {str(path)!r}: knob {name!r} has an empty choice list")
        if name == "attention":
            raw = _hardware_kernels(raw, kernels)
        choices[name] = [_coerce(path, name, value, model_config) for value in raw]
    choices = _filter(choices, model_config, gpus, path, on_gpu, kernels, compute_capability_major)
    windowed = "window" in attention_features(model_config)
    for ring in sorted(choices["ring_degree"], reverse=True):
        # a ring runs no sliding window and splits each packed document: a ring that cannot is dropped (the user's
        # own choice: refused)
        split = None if trainer.pads_ring_documents else ring_documents_problem(ring, documents.lengths)
        problem = ring_degree_problem(ring, 1, ring, windowed) or split
        if problem:
            if user_file and "ring_degree" in given:
                raise UserError(f"search space {str(path)!r}: {problem}")
            choices["ring_degree"] = [r for r in choices["ring_degree"] if r != ring]
    choices = restrict_to_trainer(choices, trainer, model_config, gpus, target, path if user_file else None)
    return SearchSpace(
        choices=choices,
        seq_lens=_seq_grid(path, data.get("seq_len") or {}, target, choices),
        split_choices={
            k.name: {v: _fitting(k, choices[k.name], v, model_config, gpus) for v in choices[k.split_by[0]]}
            for k in knobs()
            if k.split_by
        },
        trainer=trainer,
        model_config=model_config,
        gpus=gpus,
    )


def restrict_to_trainer(
    choices: dict, trainer: Trainer, model_config: dict, gpus: int, target: int, user_file: Path | None
) -> dict:
    """The choices ``trainer`` runs (its ``expresses``): a knob it has no technique for keeps only its default
    (in the user's own space file, offering another value is bad input: one line naming the knob and the
    trainer); a knob it runs its own way keeps one choice per value it runs (ArcticTraining's MLP tiles are the
    hidden size whatever is asked: off and one tile remain)."""
    layers = model_config["num_hidden_layers"]
    probes = [
        ExportJob("", model_config, gpus, target, Techniques(ulysses_degree=d, activation_checkpointing=True))
        for d in choices["ulysses_degree"]
    ]
    kept = dict(choices)
    for knob in knobs():
        expression, values = trainer.expresses[knob.name], choices[knob.name]
        if expression.off:
            others = [v for v in values if v != knob.default]
            if others and user_file is not None:
                why = expression.how.removeprefix("not expressible: ")
                raise UserError(
                    f"search space {str(user_file)!r}: --trainer {trainer.name} cannot run {knob.name} "
                    f"{_choice_words(others)} ({why}); offer only {_choice_words([knob.default])} or drop --trainer"
                )
            kept[knob.name] = [knob.default]
        elif not expression.as_asked:
            runs: dict[tuple, Any] = {}
            for value in values:
                asked = layers if value == ALL_LAYERS else value
                runs.setdefault(tuple(expression.runs(asked, probe) for probe in probes), value)
            kept[knob.name] = list(runs.values())
    return kept


def _choice_words(values: list) -> str:
    return (
        "["
        + ", ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in values)
        + "]"
    )


def _hardware_kernels(raw: list, kernels: Sequence[str] | None) -> list:
    """``attention``'s choices with the word ``hardware`` replaced by the kernels the hardware runs that the knob
    takes (``kernels``; None: every kernel the knob takes), in the hardware preset's order."""
    takes = _TABLE["attention"].choices
    expanded = []
    for value in raw:
        if value == HARDWARE_KERNELS:
            expanded += [k for k in (takes if kernels is None else kernels) if k in takes]
        else:
            expanded.append(value)
    return expanded


def _coerce(path: Path, name: str, value: Any, model_config: dict):
    """One YAML choice of knob ``name``, checked and converted as its declaration says."""
    knob = _TABLE[name]
    where = f"search space {str(path)!r}: knob {name!r}"
    if knob.kind == "bool":
        if not isinstance(value, bool):
            raise UserError(f"{where}: choice {value!r} is not true/false")
        return value
    if knob.kind == "choice":
        if value not in knob.choices:
            raise UserError(f"{where}: choice {value!r} is not one of {', '.join(knob.choices)}")
        return value
    if knob.kind == "tokens":
        if value == 0:
            return 0
        try:
            return parse_tokens(value, what=f"{name} choice")
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    if knob.nullable and value in (None, "null"):
        return None
    if isinstance(value, str) and value in knob.words:
        word = knob.words[value]
        return word  # "all" stays a word until a trial knows the layer count
    if isinstance(value, bool) or not isinstance(value, int) or value < (knob.minimum or 0):
        if ALL_LAYERS in knob.words.values():
            what = "a layer count, " + " or ".join(repr(w) for w in knob.words)
        else:
            what = "a positive integer" + (" or null" if knob.nullable else "")
        raise UserError(f"{where}: choice {value!r} is not {what}")
    if ALL_LAYERS in knob.words.values():
        return min(value, model_config["num_hidden_layers"])
    return value


def _filter(
    choices: dict,
    model_config: dict,
    gpus: int,
    path: Path,
    on_gpu: bool,
    kernels: Sequence[str] | None = None,
    compute_capability_major: int | None = None,
) -> dict:
    heads, kv_heads = model_config["num_attention_heads"], model_config["num_key_value_heads"]
    degrees = [
        d for d in dict.fromkeys(choices["ulysses_degree"]) if ulysses_degree_problem(d, gpus, heads, kv_heads) is None
    ]
    if not degrees:
        raise UserError(
            f"search space {str(path)!r}: no ulysses_degree in {choices['ulysses_degree']} divides "
            f"both --gpus {gpus} and the model's {heads} heads"
        )
    attention = [a for a in choices["attention"] if kernels is None or a in kernels] or ["sdpa"]
    features = attention_features(model_config)  # a window, softcap or head dim some kernels cannot run here
    problems = {a: attention_kernel_problem(a, features, on_gpu, compute_capability_major) for a in attention}
    runnable = [a for a in attention if problems[a] is None]
    if not runnable:
        raise UserError(f"no attention kernel in {attention} runs this model here: {problems[attention[0]]}")
    attention = runnable
    return {
        name: list(dict.fromkeys(values))
        for name, values in {**choices, "ulysses_degree": degrees, "attention": attention}.items()
    }


def _fitting(knob: Knob, choices: list, value: Any, model_config: dict, gpus: int) -> list:
    """The choices of a ``split_by`` knob its rule lets run with the other knob at ``value`` (none: the default)."""
    rule = knob.split_by[2]
    return [c for c in choices if rule(c, value, model_config, gpus) is None] or [knob.default]


def _seq_grid(path: Path, spec: dict, target: int, choices: dict) -> list[int]:
    if not isinstance(spec, dict):
        raise UserError(f"search space {str(path)!r}: seq_len must be a mapping")
    unknown = sorted(set(spec) - set(_SEQ_KEYS))
    if unknown:
        raise UserError(f"search space {str(path)!r}: unknown seq_len key {unknown[0]!r}")
    values = {**_SEQ_KEYS, **spec}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"search space {str(path)!r}: seq_len.{key} must be a positive number, got {value!r}")
    if values["min_fraction"] > 1 or values["max_fraction"] < 1:
        raise UserError(f"search space {str(path)!r}: seq_len must span the target (min_fraction <= 1 <= max_fraction)")
    units = [split_unit(u, r) for u in choices["ulysses_degree"] for r in choices["ring_degree"] if r >= 1]
    multiple = math.lcm(int(values["multiple_of"]), *choices["ulysses_degree"], *units)
    step = 1.0 / values["points_per_doubling"]
    low, high = math.log2(values["min_fraction"]), math.log2(values["max_fraction"])
    exponents = [k * step for k in range(math.floor(low / step), math.ceil(high / step) + 1)]
    grid = {
        max(multiple, round(target * 2**e / multiple) * multiple) for e in exponents if low - 1e-9 <= e <= high + 1e-9
    }
    grid.add(max(multiple, -(-target // multiple) * multiple))  # the target itself, rounded up
    return sorted(grid)
