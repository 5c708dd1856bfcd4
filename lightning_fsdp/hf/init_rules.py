"""How Hugging Face and PEFT modules built on the meta device are initialised: the way their own library does it.

- PEFT adapters (``lora_A``/``lora_B`` of a ``LoraLayer``): PEFT's ``reset_lora_parameters`` with the adapter's own
  ``init_lora_weights`` — ``lora_B`` starts at zero, so the fine-tune starts from the pretrained model's outputs
  (``nn.Linear.reset_parameters`` would randomise it). Initialisations that need the base weights (PiSSA, OLoRA,
  LoftQ, EVA, DoRA's magnitudes) cannot run before those are loaded and are refused with the fix.
- any other module inside a ``transformers.PreTrainedModel``: the owning model's ``_init_weights`` (what
  ``from_config`` does); rotary ``inv_freq`` buffers are kept real while building (see
  :func:`~lightning_fsdp.sharding.parameters_on_meta`), and ``_init_weights`` recomputes them too.

Both rules only look at classes from modules already imported, so neither library is imported for other models.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_fsdp._torch_compat import hf_init_weights

if TYPE_CHECKING:
    from peft.tuners.lora.layer import LoraLayer
    from transformers import PreTrainedModel

_SIMPLE_LORA_INITS = (True, False, "gaussian")


def _peft_lora_layer_class() -> Optional[type[LoraLayer]]:
    module = sys.modules.get("peft.tuners.lora.layer")
    return getattr(module, "LoraLayer", None) if module is not None else None


def pretrained_model_class() -> Optional[type[PreTrainedModel]]:
    """``transformers.PreTrainedModel`` if transformers is imported already (never imports it)."""
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _parent(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    parent_name = name.rpartition(".")[0]
    return parent_name, model.get_submodule(parent_name) if parent_name else model


def _adapter_config(model: nn.Module, layer_name: str, adapter: str) -> Any:
    """The ``peft_config`` of the tuner that owns ``layer_name`` (its nearest ancestor with one)."""
    parts = layer_name.split(".")
    for i in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:i])) if i else model
        configs = getattr(owner, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return configs[adapter]
    return None


def _lora_owner(
    model: nn.Module, name: str, module: nn.Module, lora_layer: type[LoraLayer]
) -> Optional[tuple[str, LoraLayer, list[str]]]:
    """The ``LoraLayer`` an adapter module belongs to, its name and the adapter names: ``<layer>.lora_A.<adapter>``
    (a module in a ``ModuleDict``) or ``<layer>.lora_embedding_A`` (a ``ParameterDict`` of adapters)."""
    parent_name, parent = _parent(model, name)
    if isinstance(parent, lora_layer) and isinstance(module, nn.ParameterDict):
        return parent_name, parent, list(module.keys())
    if parent_name and isinstance(parent, nn.ModuleDict):
        layer_name, layer = _parent(model, parent_name)
        if isinstance(layer, lora_layer):
            return layer_name, layer, [name.rpartition(".")[2]]
    return None


def peft_adapter_rule(model: nn.Module, name: str, module: nn.Module) -> Optional[tuple[object, Callable[[], None]]]:
    """Adapter weights of a PEFT ``LoraLayer``: PEFT's own ``reset_lora_parameters``."""
    lora_layer = _peft_lora_layer_class()
    if lora_layer is None or not name:
        return None
    owner = _lora_owner(model, name, module, lora_layer)
    if owner is None:
        return None
    layer_name, layer, adapters = owner
    inits = {}
    for adapter in adapters:
        config = _adapter_config(model, layer_name, adapter)
        how = getattr(config, "init_lora_weights", True) if config is not None else True
        dora = bool(getattr(config, "use_dora", False))
        if dora or how not in _SIMPLE_LORA_INITS:
            raise TypeError(
                f"{layer_name}: adapter {adapter!r} uses init_lora_weights={how!r}{' with DoRA' if dora else ''},"
                " which needs the pretrained base weights; on the meta device they are not loaded yet. Build the"
                " PEFT model eagerly after loading the base, or use init_lora_weights=True / 'gaussian' without DoRA."
            )
        inits[adapter] = how

    def init() -> None:
        for adapter, how in inits.items():
            # as PEFT's eager `update_layer` does: the adapter's Linear layers draw torch's default init when they
            # are made, then PEFT re-initialises them; replaying both keeps the random stream, and so lora_A, equal
            # to an eager `get_peft_model` with the same seed
            for matrices in (layer.lora_A, layer.lora_B):
                reset = getattr(matrices[adapter], "reset_parameters", None) if adapter in matrices else None
                if callable(reset):
                    reset()
            layer.reset_lora_parameters(adapter, how)

    return (("peft", id(layer), tuple(adapters)), init)


def hf_init_weights_rule(model: nn.Module, name: str, module: nn.Module) -> Optional[tuple[object, Callable[[], None]]]:
    """The nearest enclosing ``PreTrainedModel``'s ``_init_weights(module)``."""
    pretrained = pretrained_model_class()
    if pretrained is None:
        return None
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:i])) if i else model
        if isinstance(owner, pretrained):
            return (id(module), lambda: hf_init_weights(owner, module))
    return None


#: tried before a module's own ``reset_parameters`` (see :data:`lightning_fsdp.sharding.DEFAULT_RULES`)
LIBRARY_RULES = (peft_adapter_rule, hf_init_weights_rule)
