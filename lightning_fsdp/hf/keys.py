"""Which key of a Hugging Face file a model parameter is: key layouts as data, detected with zero configuration.

A LightningModule holds the HF model under an attribute (``self.model`` → keys ``model.model.layers.0...`` for the
file's ``model.layers.0...``), and PEFT wraps it (``model.base_model.model.model.layers.0.self_attn.q_proj
.base_layer.weight``). A :class:`KeyLayout` is a prefix to drop plus path components to remove; adapter parameters
(LoRA's ``lora_A``/``lora_B``, ...) are not in the base model's files and are initialised by PEFT instead.

:func:`detect_layout` tries every module prefix of the model and keeps the one that matches the most file keys; an
explicit ``key_map`` (``{"net.": ""}``: model-key prefix → file-key prefix) replaces detection for other layouts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.formatting import short_list

#: path components of PEFT's adapter parameters: never in a base model's files
ADAPTER_PARTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "lora_bias"}
)
#: path components PEFT inserts between a layer and its original parameters
WRAPPER_PARTS = ("base_layer",)


@dataclass(frozen=True)
class KeyLayout:
    """Model key → file key: drop ``prefix`` (or apply ``key_map``), remove ``wrapper_parts``; adapters map to
    ``None``."""

    prefix: str = ""
    key_map: Mapping[str, str] = field(default_factory=dict)
    wrapper_parts: tuple[str, ...] = WRAPPER_PARTS

    def file_key(self, model_key: str) -> Optional[str]:
        parts = model_key.split(".")
        if ADAPTER_PARTS.intersection(parts):
            return None
        key = ".".join(p for p in parts if p not in self.wrapper_parts)
        if self.key_map:
            for old, new in self.key_map.items():
                if key.startswith(old):
                    return new + key[len(old) :]
            return key
        return key[len(self.prefix) :] if key.startswith(self.prefix) else None

    def describe(self) -> str:
        return f"key_map {dict(self.key_map)}" if self.key_map else f"model prefix {self.prefix!r}"


def is_adapter_key(model_key: str) -> bool:
    return bool(ADAPTER_PARTS.intersection(model_key.split(".")))


def _prefixes(model_keys: Iterable[str]) -> list[str]:
    """Every dotted prefix of the model's keys (``""``, ``"model."``, ``"model.base_model.model."``, ...)."""
    found = {""}
    for key in model_keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            found.add(".".join(parts[:i]) + ".")
    return sorted(found, key=len)


def detect_layout(
    model_keys: Collection[str], file_keys: Collection[str], key_map: Optional[Mapping[str, str]] = None
) -> KeyLayout:
    """The layout under which the most model keys are found in the files (shortest prefix on ties)."""
    if key_map:
        return KeyLayout(key_map=dict(key_map))
    files = set(file_keys)
    candidates = set(_prefixes(model_keys))
    # hits per prefix, counted from the keys' own suffixes: each key is split once per depth, rather than every
    # key mapped under every prefix of the model (thousands of prefixes for a LoRA-wrapped decoder)
    hits: dict[str, int] = dict.fromkeys(candidates, 0)
    plain = KeyLayout("")
    for key in model_keys:
        normalised = plain.file_key(key)
        if normalised is None:
            continue
        parts = normalised.split(".")
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth]) + "." if depth else ""
            if prefix in candidates and ".".join(parts[depth:]) in files:
                hits[prefix] += 1
    best_hits = max(hits.values(), default=0)
    best = KeyLayout(min((p for p, n in hits.items() if n == best_hits), key=lambda p: (len(p), p)))
    if best_hits <= 0:
        sample_model = sorted(k for k in model_keys if not is_adapter_key(k))[:3]
        raise CheckpointError(
            f"No parameter of the model matches a tensor of the pretrained files under any layout: model keys look"
            f" like {short_list(sample_model)}, file keys like {short_list(sorted(files)[:3])}. Pass"
            " `pretrained_key_map={'<model prefix>': '<file prefix>'}` to say how they correspond."
        )
    return best
