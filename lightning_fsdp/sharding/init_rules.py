"""How each module of a meta-device model is initialised: the :data:`InitRule` protocol and torch's own rules.

:func:`~lightning_fsdp.sharding.materialize_meta_module` asks the rules, in order, for every module that owns meta
tensors (children before parents, as ``__init__`` initialises them); the first that claims a module initialises it.

- :func:`parametrization_rule`: a module under ``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``,
  ``orthogonal``, your own) — the plain module is initialised, then ``parametrizations.<name>.original*`` are
  re-derived from the fresh weight as registering the parametrization does (:mod:`.parametrized`).
- :func:`reset_parameters_rule`: the module's own ``reset_parameters()`` (torch's layers, most hand-written ones).
- :func:`private_reset_parameters_rule`: torch's private ``_reset_parameters()`` (``nn.MultiheadAttention``, and
  ``nn.Transformer``, whose own initialiser re-initialises every matrix below it after its layers' own).

Integrations put theirs in front (Hugging Face's ``_init_weights``, PEFT's adapters: :mod:`lightning_fsdp.hf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from torch import nn

from lightning_fsdp._torch_compat import private_reset_parameters
from lightning_fsdp.sharding.parametrized import parametrization_rule

#: ``rule(model, name, module)`` → ``(key, init)`` if the rule initialises ``module``, else ``None``. Modules that
#: return the same ``key`` are initialised by one call (e.g. an adapter's A and B matrices).
InitRule = Callable[[nn.Module, str, nn.Module], Optional[tuple[object, Callable[[], None]]]]


def reset_parameters_rule(model: nn.Module, name: str, module: nn.Module) -> Optional[tuple[object, Callable[[], None]]]:
    """The module's own ``reset_parameters()`` (torch's layers and most hand-written modules)."""
    reset = getattr(module, "reset_parameters", None)
    return (id(module), reset) if callable(reset) else None


def private_reset_parameters_rule(
    model: nn.Module, name: str, module: nn.Module
) -> Optional[tuple[object, Callable[[], None]]]:
    """torch's private ``_reset_parameters()``: ``nn.MultiheadAttention`` (``in_proj`` Xavier-uniform, biases zero,
    after ``out_proj``'s own init) and ``nn.Transformer`` (Xavier-uniform over every matrix, after its layers)."""
    reset = private_reset_parameters(module)
    return (id(module), reset) if reset is not None else None


#: the package's rules, after any integration's (see :data:`lightning_fsdp.hf.init_rules.LIBRARY_RULES`)
DEFAULT_RULES: tuple[InitRule, ...] = (parametrization_rule, reset_parameters_rule, private_reset_parameters_rule)
