"""Every ``torch.nn`` module class that owns parameters, built with small arguments: the meta-init tests' list.

The class list is computed: every class in ``vars(torch.nn)`` that subclasses ``nn.Module``. Arguments come from
:data:`SMALL` by parameter *name* (never by class); a class is skipped, with the reason, when it needs an argument
that has no small value, fails to build, is lazy, or owns no parameters when built so. :data:`EXTRAS` adds the
variants torch's initialisers branch on (parametrizations, attention with separate k/v projections).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations

#: a small value for each constructor argument name (optional ones too, to keep defaults like d_model=512 small)
SMALL: dict[str, Any] = {
    "in_features": 12, "out_features": 10, "in1_features": 6, "in2_features": 5, "num_features": 6,
    "num_channels": 6, "num_groups": 3, "in_channels": 4, "out_channels": 6, "kernel_size": 3,
    "num_embeddings": 20, "embedding_dim": 8, "padding_idx": 1, "embed_dim": 8, "num_heads": 2, "d_model": 8,
    "nhead": 2, "dim_feedforward": 16, "num_encoder_layers": 2, "num_decoder_layers": 2, "num_layers": 2,
    "input_size": 6, "hidden_size": 8, "normalized_shape": 8, "n_classes": 12, "cutoffs": [4, 8], "num_classes": 7,
    "mode": "LSTM", "bias": True, "num_chunks": 4, "output_size": 2, "padding": 1, "value": 0.0, "groups": 1,
    "size": 2, "norm_type": 2.0, "upscale_factor": 2, "downscale_factor": 2, "threshold": 0.1, "dim": 1,
    "unflattened_size": (2, 2), "dropout": 0.0, "affine": True,
    "encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
    "decoder_layer": lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0),
}

#: variants beyond one instance per class: what torch's private initialisers and parametrizations branch on
EXTRAS: dict[str, Callable[[], nn.Module]] = {
    "MultiheadAttention[kdim,vdim,bias_kv]": lambda: nn.MultiheadAttention(8, 2, kdim=6, vdim=5, add_bias_kv=True),
    "weight_norm(Linear)": lambda: parametrizations.weight_norm(nn.Linear(12, 10)),
    "weight_norm(Conv1d)": lambda: parametrizations.weight_norm(nn.Conv1d(4, 6, 3)),
    "spectral_norm(Linear)": lambda: parametrizations.spectral_norm(nn.Linear(12, 10)),
    "orthogonal(Linear 12->10)": lambda: parametrizations.orthogonal(nn.Linear(12, 10)),
    "TransformerEncoderLayer[weight_norm(linear1)]": lambda: _weight_normed_layer(),
}


def _weight_normed_layer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    parametrizations.weight_norm(layer.linear1)
    return layer


def torch_nn_classes() -> list[type[nn.Module]]:
    """Every ``nn.Module`` subclass ``torch.nn`` exports, by name."""
    found = {v for v in vars(nn).values() if isinstance(v, type) and issubclass(v, nn.Module)}
    return sorted(found, key=lambda c: c.__name__)


def _small(value: Any) -> Any:
    return value() if callable(value) else value


def _signature(cls: type) -> list[inspect.Parameter]:
    """The named constructor arguments; a ``*args, **kwargs`` constructor takes its base's (``RNN``: ``RNNBase``)."""
    for klass in cls.__mro__:
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named or klass is nn.Module:
            return named
    return []


def build(cls: type[nn.Module]) -> nn.Module:
    """``cls`` with :data:`SMALL` arguments: every required one, and each optional one whose default has the same
    type (or is ``None``); ``LookupError`` naming a required argument without a small value."""
    params = _signature(cls)
    missing = [p.name for p in params if p.default is p.empty and p.name not in SMALL]
    if missing:
        raise LookupError(f"needs {missing} (no small value by that name)")
    kwargs = {
        p.name: _small(SMALL[p.name])
        for p in params
        if p.name in SMALL and (p.default is p.empty or p.default is None or isinstance(SMALL[p.name], type(p.default)))
    }
    for _ in range(3):  # a subclass that passes one of its base's arguments itself (RNN's `mode`)
        try:
            return cls(**kwargs)
        except TypeError as err:
            twice = re.search(r"multiple values for (?:keyword )?argument '(\w+)'", str(err))
            if not twice:
                raise
            kwargs.pop(twice.group(1))
    raise TypeError(f"cannot build {cls.__name__}")


def zoo() -> tuple[dict[str, Callable[[], nn.Module]], dict[str, str]]:
    """(builders by name of every class covered, plus :data:`EXTRAS`; skipped class → why)."""
    builders: dict[str, Callable[[], nn.Module]] = {}
    skipped: dict[str, str] = {}
    for cls in torch_nn_classes():
        try:
            module = build(cls)
        except Exception as err:
            skipped[cls.__name__] = f"cannot be built with small arguments: {type(err).__name__}: {err}"
            continue
        params = list(module.parameters())
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
            skipped[cls.__name__] = "lazy: its parameters get a shape only in the first forward"
        elif not params:
            skipped[cls.__name__] = "owns no parameters when built with default arguments"
        else:
            builders[cls.__name__] = lambda cls=cls: build(cls)
    return {**builders, **EXTRAS}, skipped


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather of a DTensor; one with no elements cannot be gathered: torch 2.13)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (a collective on a sharded module: all ranks call it)."""
    return {name: full(t) for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def exact_problems(eager: dict[str, torch.Tensor], meta: dict[str, torch.Tensor]) -> list[str]:
    if eager.keys() != meta.keys():
        return [f"keys {sorted(eager.keys() ^ meta.keys())}"]
    return [name for name in eager if not torch.equal(eager[name], meta[name])]


def distribution_problems(eager: dict[str, torch.Tensor], meta: dict[str, torch.Tensor]) -> list[str]:
    """Per tensor: zeros exactly where eager has them, constants equal, the random rest from the same distribution
    (mean within 6 standard errors, spread and range close)."""
    if eager.keys() != meta.keys():
        return [f"keys {sorted(eager.keys() ^ meta.keys())}"]
    problems = []
    for name, e in eager.items():
        m = meta[name]
        if e.shape != m.shape or e.dtype != m.dtype:
            problems.append(f"{name}: {tuple(m.shape)} {m.dtype}, eager {tuple(e.shape)} {e.dtype}")
        elif not e.is_floating_point():
            if not torch.equal(e, m):
                problems.append(f"{name}: integer values differ")
        elif not torch.isfinite(m).all():
            problems.append(f"{name}: not finite")
        elif not torch.equal(e == 0, m == 0):
            problems.append(f"{name}: zeros in other places ({int((e == 0).sum())} eager, {int((m == 0).sum())})")
        else:
            problems += [f"{name}: {p}" for p in _same_distribution(e[e != 0].double(), m[m != 0].double())]
    return problems


def _same_distribution(e: torch.Tensor, m: torch.Tensor) -> list[str]:
    if e.numel() == 0:
        return []
    if bool((e == e[0]).all()):
        return [] if bool((m == e[0]).all()) else [f"eager is constant {float(e[0])}, materialised is not"]
    if bool((m == m[0]).all()):
        return ["materialised is constant, eager is random"]
    n = e.numel()
    out = []
    spread = max(float(e.std()), float(m.std()))
    if abs(float(e.mean() - m.mean())) > 6 * spread / math.sqrt(n) + 1e-6:
        out.append(f"mean {float(m.mean()):.4g}, eager {float(e.mean()):.4g} (n={n})")
    if abs(math.log(float(m.std()) / float(e.std()))) > max(0.2, 4 / math.sqrt(n)):
        out.append(f"std {float(m.std()):.4g}, eager {float(e.std()):.4g} (n={n})")
    width = float(e.max() - e.min())
    if n >= 32 and (float(m.min()) < float(e.min()) - 0.3 * width or float(m.max()) > float(e.max()) + 0.3 * width):
        out.append(f"range [{float(m.min()):.4g}, {float(m.max()):.4g}], eager [{float(e.min()):.4g}, {float(e.max()):.4g}]")
    return out
