"""The config file ``autotune/config-v1``: which techniques, for which model, node and sequence length.

``Techniques`` is the knob set of DESIGN.md; ``validate`` refuses unknown keys and impossible combinations
with the reason, before anything runs. The same JSON is ``best.json`` and the input of estimate/trial.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autotune.errors import UserError

SCHEMA = "autotune/config-v1"
ATTENTION_KERNELS = ("flash", "sdpa")


@dataclass(frozen=True)
class Techniques:
    """The memory techniques of one training configuration (see DESIGN.md's table)."""

    fsdp: bool = False
    optimizer_offload: bool = False
    ulysses_degree: int = 1
    head_chunk: int | None = None
    activation_checkpointing: bool = False
    activation_offload_layers: int = 0
    mlp_tile_tokens: int = 0
    loss_tile_tokens: int = 0
    norm_tile_tokens: int = 0
    attention: str = "sdpa"

    @classmethod
    def from_dict(cls, data: dict[str, Any], num_layers: int | None = None) -> "Techniques":
        if not isinstance(data, dict):
            raise UserError(f"techniques must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown technique key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = dict(data)
        offload = values.get("activation_offload_layers", 0)
        if offload in (None, "none"):
            values["activation_offload_layers"] = 0
        elif offload == "all":
            if num_layers is None:
                raise UserError("activation_offload_layers 'all' needs the model's layer count")
            values["activation_offload_layers"] = num_layers
        for name in ("fsdp", "optimizer_offload", "activation_checkpointing"):
            if name in values and not isinstance(values[name], bool):
                raise UserError(f"{name} must be true or false, got {values[name]!r}")
        for name in ("ulysses_degree", "activation_offload_layers", "mlp_tile_tokens", "loss_tile_tokens",
                     "norm_tile_tokens"):
            if name in values and (isinstance(values[name], bool) or not isinstance(values[name], int)):
                raise UserError(f"{name} must be an integer, got {values[name]!r}")
        chunk = values.get("head_chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
            raise UserError(f"head_chunk must be an integer or null, got {chunk!r}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self, model_config: dict, gpus: int, seq_len: int | None = None) -> "Techniques":
        """Refuse combinations that cannot run; returns self so calls chain."""
        heads = model_config["num_attention_heads"]
        kv_heads = model_config["num_key_value_heads"]
        layers = model_config["num_hidden_layers"]
        degree = self.ulysses_degree
        if gpus < 1:
            raise UserError(f"gpus must be at least 1, got {gpus}")
        if degree < 1:
            raise UserError(f"ulysses_degree must be at least 1, got {degree}")
        if gpus % degree:
            raise UserError(f"ulysses_degree {degree} does not divide the GPU count {gpus}")
        if heads % degree:
            raise UserError(f"ulysses_degree {degree} does not divide the {heads} query heads")
        if kv_heads % degree and degree % kv_heads:
            raise UserError(
                f"ulysses_degree {degree} and the {kv_heads} kv heads must divide one another"
            )
        local_heads = heads // degree
        if self.head_chunk is not None:
            if not 1 <= self.head_chunk <= local_heads:
                raise UserError(
                    f"head_chunk {self.head_chunk} must be between 1 and heads/ulysses_degree = {local_heads}"
                )
            if local_heads % self.head_chunk:
                raise UserError(
                    f"head_chunk {self.head_chunk} does not divide the {local_heads} heads per rank"
                )
        if not 0 <= self.activation_offload_layers <= layers:
            raise UserError(
                f"activation_offload_layers {self.activation_offload_layers} must be between 0 and {layers}"
            )
        if self.activation_offload_layers and not self.activation_checkpointing:
            raise UserError("activation_offload_layers needs activation_checkpointing (it offloads checkpointed inputs)")
        if self.optimizer_offload and not self.fsdp:
            raise UserError("optimizer_offload needs fsdp (the host keeps the sharded optimizer states)")
        for name in ("mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if self.attention not in ATTENTION_KERNELS:
            raise UserError(f"attention {self.attention!r} must be one of {', '.join(ATTENTION_KERNELS)}")
        if seq_len is not None and seq_len % degree:
            raise UserError(f"seq_len {seq_len:,} is not divisible by ulysses_degree {degree}")
        return self


BASELINE = Techniques()


@dataclass
class TrialConfig:
    """One ``autotune/config-v1`` file."""

    model: str
    techniques: Techniques
    hardware: str = "h100-sxm"
    gpus: int = 8
    seq_len: int | None = None
    predicted: dict | None = None
    measured: dict | None = None
    schema: str = SCHEMA
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema, "model": self.model, "hardware": self.hardware, "gpus": self.gpus,
            "seq_len": self.seq_len, "techniques": self.techniques.to_dict(),
            "predicted": self.predicted, "measured": self.measured,
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


_CONFIG_KEYS = {"schema", "model", "hardware", "gpus", "seq_len", "techniques", "predicted", "measured"}


def parse_config(data: Any, source: str = "config") -> TrialConfig:
    if not isinstance(data, dict):
        raise UserError(f"{source}: a config file must be a JSON object")
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise UserError(f"{source}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_CONFIG_KEYS))}")
    if data.get("schema") != SCHEMA:
        raise UserError(f"{source}: schema {data.get('schema')!r} is not {SCHEMA!r}")
    from autotune.presets import load_model_config

    model = data.get("model")
    if not isinstance(model, str):
        raise UserError(f"{source}: model must be a preset name or a config.json path")
    layers = load_model_config(model)["num_hidden_layers"]
    gpus = data.get("gpus", 8)
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise UserError(f"{source}: gpus must be an integer, got {gpus!r}")
    seq_len = data.get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise UserError(f"{source}: seq_len must be an integer, got {seq_len!r}")
    return TrialConfig(
        model=model, techniques=Techniques.from_dict(data.get("techniques", {}), layers),
        hardware=data.get("hardware", "h100-sxm"), gpus=gpus, seq_len=seq_len,
        predicted=data.get("predicted"), measured=data.get("measured"),
    )


def load_techniques(spec: str, num_layers: int | None = None) -> Techniques:
    """``--config`` value: the literal ``baseline`` or a config-v1 file's techniques."""
    return load_config_file(spec).techniques if spec != "baseline" else BASELINE


def load_config_file(path: str | Path) -> TrialConfig:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config file {str(path)!r} is not valid JSON ({exc})") from None
    return parse_config(data, source=str(path))
