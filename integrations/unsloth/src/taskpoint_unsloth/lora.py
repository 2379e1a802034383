"""Record a model's LoRA configuration next to each checkpoint, and refuse a mismatched resume.

A checkpoint holds only the LoRA adapter weights (plus optimizer, scheduler and Trainer
state), so resuming needs the same base model and the same LoRA configuration rebuilt in
code. :func:`check_lora_config` compares what a checkpoint was trained with against the
freshly built model and names every difference before training starts::

    from taskpoint_unsloth import check_lora_config, lora_signature

    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, ...)
    check_lora_config("out/checkpoint-300", model)   # LoraConfigMismatchError if it differs
    lora_signature(model).r                           # 16
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from taskpoint import CheckpointError

__all__ = [
    "ADAPTER_CONFIG",
    "LORA_RECORD",
    "LoraConfigMismatchError",
    "LoraSignature",
    "base_config_hash",
    "check_lora_config",
    "lora_signature",
    "read_lora_record",
    "write_lora_record",
]

log = logging.getLogger(__name__)

LORA_RECORD = "taskpoint-lora.json"
"""The file :func:`write_lora_record` adds to a ``checkpoint-N`` directory."""
ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's own adapter config in ``checkpoint-N``; read when no :data:`LORA_RECORD` is there."""

_RECORD_FORMAT = 1
# Config keys that describe how a base model was loaded or saved, not what it is.
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "name_or_path", "torch_dtype", "dtype", "quantization_config",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "attn_implementation", "pretraining_tp",
})


@dataclass(frozen=True)
class LoraSignature:
    """What must match between a LoRA checkpoint and the model that resumes from it.

    Attributes:
        base_model: the base model's name or path (PEFT's ``base_model_name_or_path``).
        base_config_hash: a hash of the base model's architecture config (loading details
            such as dtype and quantization excluded); ``None`` when unknown.
        r: the LoRA rank.
        lora_alpha: the LoRA scaling numerator.
        target_modules: the adapted modules, sorted (or PEFT's pattern string).
        use_rslora: whether rank-stabilised scaling is on.
        use_dora: whether DoRA is on.
        bias: which biases are trained (``"none"``, ``"all"``, ``"lora_only"``).
        modules_to_save: modules trained in full besides the adapters, sorted.
    """

    base_model: str | None
    base_config_hash: str | None
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, tuple):
                data[key] = list(value)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSignature:
        """Build one from :meth:`to_dict`'s output or a PEFT ``adapter_config.json``.

        Raises:
            ValueError: a required key (``r``, ``lora_alpha``, ``target_modules``) is missing.
        """
        missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in data]
        if missing:
            raise ValueError(f"a LoRA config needs {missing} but has only {sorted(data)}")
        return cls(
            base_model=data.get("base_model", data.get("base_model_name_or_path")),
            base_config_hash=data.get("base_config_hash"),
            r=int(data["r"]),
            lora_alpha=data["lora_alpha"],
            target_modules=_modules(data["target_modules"]),
            use_rslora=bool(data.get("use_rslora", False)),
            use_dora=bool(data.get("use_dora", False)),
            bias=str(data.get("bias", "none")),
            modules_to_save=tuple(sorted(data.get("modules_to_save") or ())),
        )

    def differences(
        self, other: LoraSignature, *, ignore: Iterable[str] = ()
    ) -> list[tuple[str, Any, Any]]:
        """``(field, self's value, other's value)`` for each field that differs.

        A field unknown (``None``) on either side is not compared, nor any in ``ignore``.
        """
        skip = set(ignore)
        found = []
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if item.name in skip or mine is None or theirs is None:
                continue
            if mine != theirs:
                found.append((item.name, mine, theirs))
        return found


class LoraConfigMismatchError(CheckpointError, ValueError):
    """A checkpoint was trained with a different LoRA config or base model than the model.

    Attributes:
        checkpoint_dir: the ``checkpoint-N`` directory.
        mismatches: ``(field, checkpoint's value, model's value)`` for each difference.
    """

    def __init__(
        self, message: str, checkpoint_dir: Path, mismatches: list[tuple[str, Any, Any]]
    ) -> None:
        super().__init__(message)
        self.checkpoint_dir = checkpoint_dir
        self.mismatches = mismatches


def _modules(value: Any) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    return tuple(sorted(str(name) for name in value))


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return repr(list(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return repr(value)


def _peft_config(model: Any) -> tuple[Any, str]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        raise TypeError(
            f"{type(model).__name__} has no LoRA adapters (no peft_config): build it with "
            "FastLanguageModel.get_peft_model(model, r=..., ...) before checking a checkpoint"
        )
    name = getattr(model, "active_adapter", None)
    if not isinstance(name, str) or name not in configs:
        name = next(iter(configs))
    return configs[name], name


def base_config_hash(config: Any) -> str | None:
    """A short hash of a transformers config's architecture fields, or ``None`` without one."""
    if config is None or not hasattr(config, "to_dict"):
        return None
    data = {
        key: value
        for key, value in config.to_dict().items()
        if key not in _VOLATILE_CONFIG_KEYS
        and not key.startswith("_")
        and not key.lower().startswith("unsloth")
    }
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def lora_signature(model: Any) -> LoraSignature:
    """The :class:`LoraSignature` of a PEFT (Unsloth ``get_peft_model``) model's active adapter.

    Raises:
        TypeError: the model has no LoRA adapters.
    """
    config, name = _peft_config(model)
    if str(getattr(config, "peft_type", "LORA")).rsplit(".", 1)[-1] != "LORA":
        raise TypeError(
            f"adapter {name!r} of {type(model).__name__} is {config.peft_type}, not LoRA; "
            "taskpoint-unsloth checks LoRA adapters only"
        )
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return LoraSignature(
        base_model=getattr(config, "base_model_name_or_path", None),
        base_config_hash=base_config_hash(getattr(base, "config", None)),
        r=int(config.r),
        lora_alpha=config.lora_alpha,
        target_modules=_modules(config.target_modules or ()),
        use_rslora=bool(getattr(config, "use_rslora", False)),
        use_dora=bool(getattr(config, "use_dora", False)),
        bias=str(getattr(config, "bias", "none")),
        modules_to_save=tuple(sorted(getattr(config, "modules_to_save", None) or ())),
    )


def write_lora_record(checkpoint_dir: str | os.PathLike[str], model: Any) -> Path:
    """Write the model's :class:`LoraSignature` to ``checkpoint_dir/taskpoint-lora.json``.

    Returns:
        The file written.

    Raises:
        TypeError: the model has no LoRA adapters.
        FileNotFoundError: ``checkpoint_dir`` does not exist.
    """
    folder = Path(os.fspath(checkpoint_dir))
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot record the LoRA config: {folder} is not a directory")
    record = {"format": _RECORD_FORMAT, **lora_signature(model).to_dict()}
    path = folder / LORA_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    log.debug("recorded LoRA config in %s", path)
    return path


def read_lora_record(checkpoint_dir: str | os.PathLike[str]) -> LoraSignature | None:
    """The LoRA config a ``checkpoint-N`` was trained with, or ``None`` when it has no adapter.

    Reads :data:`LORA_RECORD`, else PEFT's :data:`ADAPTER_CONFIG` (which lacks the base
    config hash).

    Raises:
        CheckpointError: the file exists but cannot be read.
    """
    folder = Path(os.fspath(checkpoint_dir))
    for name in (LORA_RECORD, ADAPTER_CONFIG):
        path = folder / name
        if not path.is_file():
            continue
        try:
            return LoraSignature.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot read the LoRA config in {path}: {exc}") from exc
    return None


def check_lora_config(
    checkpoint_dir: str | os.PathLike[str], model: Any, *, ignore: Iterable[str] = ()
) -> LoraSignature:
    """Check that ``model`` has the LoRA config and base model ``checkpoint_dir`` was trained with.

    Args:
        checkpoint_dir: a Trainer ``checkpoint-N`` directory.
        model: the freshly built PEFT model (after ``FastLanguageModel.get_peft_model``).
        ignore: :class:`LoraSignature` field names not to compare (``"base_model"`` when
            the same base model is loaded from a different path).

    Returns:
        The model's signature (equal to the checkpoint's on the compared fields).

    Raises:
        LoraConfigMismatchError: a compared field differs, or the checkpoint holds no LoRA
            adapter; the message names each difference.
        TypeError: the model has no LoRA adapters, or ``ignore`` names an unknown field.
    """
    ignored = set(ignore)
    unknown = ignored - {item.name for item in fields(LoraSignature)}
    if unknown:
        raise TypeError(
            f"ignore names unknown fields {sorted(unknown)}; LoraSignature has "
            f"{[item.name for item in fields(LoraSignature)]}"
        )
    folder = Path(os.fspath(checkpoint_dir))
    mine = lora_signature(model)
    saved = read_lora_record(folder)
    if saved is None:
        raise LoraConfigMismatchError(
            f"{folder} holds no LoRA adapter (neither {LORA_RECORD} nor {ADAPTER_CONFIG}), "
            f"but the model has LoRA r={mine.r}: the checkpoint is from a different kind of run; "
            "resume it with the model it was trained with, or use a fresh checkpoint location",
            folder,
            [],
        )
    mismatches = saved.differences(mine, ignore=ignored)
    if mismatches:
        was = ", ".join(f"{name}={_show(old)}" for name, old, _ in mismatches)
        has = ", ".join(f"{name}={_show(new)}" for name, _, new in mismatches)
        raise LoraConfigMismatchError(
            f"{folder} was trained with LoRA {was}, but the model has {has}; rebuild the "
            "model with the checkpoint's base model and get_peft_model arguments, or start "
            "over in a fresh checkpoint location",
            folder,
            mismatches,
        )
    return mine
