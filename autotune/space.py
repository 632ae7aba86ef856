"""Search spaces from YAML (``search_spaces/*.yaml``): knob choices, the sequence-length grid, and the
constraints of the model and node applied before sampling.

Conditional knobs (define-by-run, so Optuna's TPE learns each branch):
    optimizer_offload       only with fsdp
    head_chunk              only when ulysses_degree > 1 (choices depend on the degree, so each degree
                            has its own parameter name ``head_chunk_u{degree}``)
    activation_offload_layers  only with activation_checkpointing
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.config import ATTENTION_KERNELS, Techniques
from autotune.errors import UserError
from autotune.sizes import parse_tokens

SPACE_SCHEMA = "autotune/space-v1"
DEFAULT_SPACE = Path(__file__).resolve().parent.parent / "search_spaces" / "default.yaml"
KNOBS = ("fsdp", "optimizer_offload", "ulysses_degree", "head_chunk", "activation_checkpointing",
         "activation_offload_layers", "mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens", "attention")
_SEQ_KEYS = {"min_fraction": 0.0625, "max_fraction": 4.0, "points_per_doubling": 2, "multiple_of": 1024}


@dataclass
class SearchSpace:
    """Choices per knob (already filtered for a model and node) and the sequence-length grid."""

    choices: dict[str, list]
    seq_lens: list[int]
    head_chunks_by_degree: dict[int, list]

    def sample(self, trial, num_layers: int) -> tuple[Techniques, int]:
        """Suggest one config and sequence length on an Optuna trial."""
        pick = trial.suggest_categorical
        fsdp = pick("fsdp", self.choices["fsdp"])
        offload_opt = pick("optimizer_offload", self.choices["optimizer_offload"]) if fsdp else False
        degree = pick("ulysses_degree", self.choices["ulysses_degree"])
        chunks = self.head_chunks(degree)
        head_chunk = pick(f"head_chunk_u{degree}", chunks) if degree > 1 and len(chunks) > 1 else (
            chunks[0] if degree > 1 and chunks else None)
        checkpointing = pick("activation_checkpointing", self.choices["activation_checkpointing"])
        offload_layers = 0
        if checkpointing:
            offload_layers = pick("activation_offload_layers", self.choices["activation_offload_layers"])
        values = {
            "fsdp": fsdp, "optimizer_offload": offload_opt, "ulysses_degree": degree, "head_chunk": head_chunk,
            "activation_checkpointing": checkpointing,
            "activation_offload_layers": num_layers if offload_layers == "all" else int(offload_layers),
            "mlp_tile_tokens": pick("mlp_tile_tokens", self.choices["mlp_tile_tokens"]),
            "loss_tile_tokens": pick("loss_tile_tokens", self.choices["loss_tile_tokens"]),
            "norm_tile_tokens": pick("norm_tile_tokens", self.choices["norm_tile_tokens"]),
            "attention": pick("attention", self.choices["attention"]),
        }
        seq_len = pick("seq_len", [s for s in self.seq_lens if s % degree == 0])
        return Techniques(**values), seq_len

    def head_chunks(self, degree: int) -> list:
        return self.head_chunks_by_degree.get(degree, [None])

    def params_for(self, techniques: Techniques, seq_len: int, num_layers: int) -> dict | None:
        """The Optuna params under which ``sample`` gives exactly this config and length (for enqueueing), or
        None when the space cannot express it."""
        t, c = techniques, self.choices
        params: dict = {"fsdp": t.fsdp, "ulysses_degree": t.ulysses_degree,
                        "activation_checkpointing": t.activation_checkpointing, "mlp_tile_tokens": t.mlp_tile_tokens,
                        "loss_tile_tokens": t.loss_tile_tokens, "norm_tile_tokens": t.norm_tile_tokens,
                        "attention": t.attention, "seq_len": seq_len}
        if t.fsdp:
            params["optimizer_offload"] = t.optimizer_offload
        elif t.optimizer_offload:
            return None
        chunks = self.head_chunks(t.ulysses_degree)
        if t.ulysses_degree > 1 and len(chunks) > 1:
            params[f"head_chunk_u{t.ulysses_degree}"] = t.head_chunk
        elif t.head_chunk != (chunks[0] if t.ulysses_degree > 1 and chunks else None):
            return None
        if t.activation_checkpointing:
            all_layers = "all" in c["activation_offload_layers"] and t.activation_offload_layers == num_layers
            params["activation_offload_layers"] = "all" if all_layers else t.activation_offload_layers
        elif t.activation_offload_layers:
            return None
        for name, value in params.items():
            if name == "seq_len":
                choices = [s for s in self.seq_lens if s % t.ulysses_degree == 0]
            elif name.startswith("head_chunk_u"):
                choices = chunks
            else:
                choices = c[name]
            if value not in choices:
                return None
        return params

    def memory_steps(self, techniques: Techniques, num_layers: int) -> list[Techniques]:
        """The configs one knob away that should need less memory: FSDP on, optimizer offload on, the next
        larger Ulysses degree, the next smaller head chunk, checkpointing on, the next larger count of
        offloaded layers, the next smaller (non-zero) MLP / loss / RMSNorm tile. Ordered as listed; only
        choices of this space."""
        t, c = techniques, self.choices
        steps = []

        def add(**change):
            steps.append(replace(t, **change))

        if not t.fsdp and True in c["fsdp"]:
            add(fsdp=True)
        if t.fsdp and not t.optimizer_offload and True in c["optimizer_offload"]:
            add(optimizer_offload=True)
        larger = [d for d in c["ulysses_degree"] if d > t.ulysses_degree]
        if larger:  # plain Ulysses at the new degree (None when the space has it, else its first chunk)
            degree = min(larger)
            chunks = self.head_chunks(degree)
            add(ulysses_degree=degree, head_chunk=None if None in chunks else chunks[0])
        if t.ulysses_degree > 1:
            chunks = [k for k in self.head_chunks(t.ulysses_degree) if k is not None]
            smaller = [k for k in chunks if t.head_chunk is None or k < t.head_chunk]
            if smaller:
                add(head_chunk=max(smaller))
        if not t.activation_checkpointing and True in c["activation_checkpointing"]:
            add(activation_checkpointing=True, activation_offload_layers=0)
        if t.activation_checkpointing:
            counts = sorted(num_layers if k == "all" else int(k) for k in c["activation_offload_layers"])
            more = [k for k in counts if k > t.activation_offload_layers]
            if more:
                add(activation_offload_layers=min(more))
        for knob in ("mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens"):
            current = getattr(t, knob)
            smaller = [k for k in c[knob] if k and (current == 0 or k < current)]
            if smaller:
                add(**{knob: max(smaller)})
        return steps


def load_space(path: str | Path | None, model_config: dict, gpus: int, target: int,
               flash_ok: bool = True) -> SearchSpace:
    """Read and validate a space file, then drop choices this model and node cannot run."""
    path = Path(path) if path else DEFAULT_SPACE
    if not path.is_file():
        raise UserError(f"search space {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"search space {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise UserError(f"search space {str(path)!r} must be a YAML mapping")
    unknown = sorted(set(data) - {"schema", "seq_len", "knobs"})
    if unknown:
        raise UserError(f"search space {str(path)!r}: unknown top-level key {unknown[0]!r}")
    if data.get("schema", SPACE_SCHEMA) != SPACE_SCHEMA:
        raise UserError(f"search space {str(path)!r}: schema {data.get('schema')!r} is not {SPACE_SCHEMA!r}")
    knobs = data.get("knobs") or {}
    if not isinstance(knobs, dict):
        raise UserError(f"search space {str(path)!r}: knobs must be a mapping of knob -> list of choices")
    for name in knobs:
        if name not in KNOBS:
            raise UserError(f"search space {str(path)!r}: unknown knob {name!r}; known: {', '.join(KNOBS)}")
    defaults = Techniques()
    choices: dict[str, list] = {}
    for name in KNOBS:
        raw = knobs.get(name, [getattr(defaults, name)])
        if not isinstance(raw, list):
            raw = [raw]
        if not raw:
            raise UserError(f"search space {str(path)!r}: knob {name!r} has an empty choice list")
        choices[name] = [_coerce(path, name, value, model_config) for value in raw]
    choices = _filter(choices, model_config, gpus, flash_ok, path)
    return SearchSpace(
        choices=choices, seq_lens=_seq_grid(path, data.get("seq_len") or {}, target, choices),
        head_chunks_by_degree={d: _chunks_for(choices["head_chunk"], model_config, d)
                               for d in choices["ulysses_degree"]},
    )


def _coerce(path: Path, name: str, value: Any, model_config: dict):
    where = f"search space {str(path)!r}: knob {name!r}"
    if name in ("fsdp", "optimizer_offload", "activation_checkpointing"):
        if not isinstance(value, bool):
            raise UserError(f"{where}: choice {value!r} is not true/false")
        return value
    if name == "attention":
        if value not in ATTENTION_KERNELS:
            raise UserError(f"{where}: choice {value!r} is not one of {', '.join(ATTENTION_KERNELS)}")
        return value
    if name == "head_chunk":
        if value is None or value == "null":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: choice {value!r} is not a positive integer or null")
        return value
    if name == "activation_offload_layers":
        if value in ("all", "none"):
            return value if value == "all" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{where}: choice {value!r} is not a layer count, 'none' or 'all'")
        return min(value, model_config["num_hidden_layers"])
    if name in ("mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens"):
        if value == 0:
            return 0
        try:
            return parse_tokens(value, what=f"{name} choice")
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    if name == "ulysses_degree":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: choice {value!r} is not a positive integer")
        return value
    raise AssertionError(name)


def _filter(choices: dict, model_config: dict, gpus: int, flash_ok: bool, path: Path) -> dict:
    heads, kv_heads = model_config["num_attention_heads"], model_config["num_key_value_heads"]
    degrees = [d for d in dict.fromkeys(choices["ulysses_degree"])
               if gpus % d == 0 and heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    if not degrees:
        raise UserError(
            f"search space {str(path)!r}: no ulysses_degree in {choices['ulysses_degree']} divides "
            f"both --gpus {gpus} and the model's {heads} heads"
        )
    attention = [a for a in choices["attention"] if flash_ok or a != "flash"] or ["sdpa"]
    return {name: list(dict.fromkeys(values)) for name, values in
            {**choices, "ulysses_degree": degrees, "attention": attention}.items()}


def _chunks_for(chunks: list, model_config: dict, degree: int) -> list:
    local = model_config["num_attention_heads"] // degree
    return [c for c in chunks if c is None or (c <= local and local % c == 0)] or [None]


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
    multiple = math.lcm(int(values["multiple_of"]), *choices["ulysses_degree"])
    step = 1.0 / values["points_per_doubling"]
    low, high = math.log2(values["min_fraction"]), math.log2(values["max_fraction"])
    exponents = [k * step for k in range(math.floor(low / step), math.ceil(high / step) + 1)]
    grid = {max(multiple, round(target * 2**e / multiple) * multiple) for e in exponents
            if low - 1e-9 <= e <= high + 1e-9}
    grid.add(max(multiple, -(-target // multiple) * multiple))  # the target itself, rounded up
    return sorted(grid)
