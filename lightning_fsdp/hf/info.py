"""What a checkpoint records about the Hugging Face model inside a LightningModule, so it can be exported offline.

The entry (plain JSON-like data in ``meta.pt``) names the attribute path of the HF model (``model.`` or, under
PEFT, ``model.base_model.model.``), its class and ``config``, and every PEFT adapter's config. ``lightning-fsdp
consolidate --format hf|peft`` rebuilds the model's skeleton on the meta device from it; no GPU, no process group,
and no copy of the pretrained directory is needed (``--hf-config`` can still supply config and tokenizer files).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lightning_fsdp.checkpoint.schema import SCHEMA
from lightning_fsdp.hf.init_rules import pretrained_model_class

if TYPE_CHECKING:
    from lightning_fsdp.checkpoint.base_weights import BaseReference
    from lightning_fsdp.sharding.quantize import QuantizedBase


def _plain(value: Any) -> Any:
    """JSON-safe copy: sets become sorted lists, anything unusual its string."""
    return json.loads(json.dumps(value, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def describe_hf_model(module: nn.Module) -> Optional[dict[str, Any]]:
    """The description of the outermost ``transformers.PreTrainedModel`` in ``module`` (``None`` if there is none)."""
    pretrained = pretrained_model_class()
    if pretrained is None:
        return None
    found = next(((n, m) for n, m in module.named_modules() if isinstance(m, pretrained)), None)
    if found is None:
        return None
    name, model = found
    peft_name, adapters = None, {}
    for candidate_name, candidate in module.named_modules():
        configs = getattr(candidate, "peft_config", None)
        # the class's MRO, not the class: fully_shard swaps a unit's class for a subclass defined in torch
        from_peft = any(cls.__module__.startswith("peft.") for cls in type(candidate).__mro__)
        if isinstance(configs, dict) and configs and from_peft:
            peft_name = candidate_name
            adapters = {adapter: _plain(config.to_dict()) for adapter, config in configs.items()}
            break
    return {
        "prefix": f"{name}." if name else "",
        "class": type(model).__name__,
        "config": json.loads(model.config.to_json_string(use_diff=False)),
        "peft_prefix": None if peft_name is None else (f"{peft_name}." if peft_name else ""),
        "adapters": adapters,
    }


def annotate_checkpoint(
    checkpoint: dict[str, Any],
    module: Optional[nn.Module],
    base: Optional[BaseReference],
    sharded: bool,
    quantized: Optional[QuantizedBase] = None,
) -> None:
    """Before a save: describe the HF model (for export), and for a sharded save leave out the frozen base weights
    ``base`` (a :class:`~lightning_fsdp.checkpoint.base_weights.BaseReference`) supplied, recording where they come
    from, and the weights held ``quantized`` (a :class:`~lightning_fsdp.sharding.quantize.QuantizedBase`)."""
    if quantized is not None:
        from lightning_fsdp.checkpoint.base_weights import leave_out_quantized

        leave_out_quantized(checkpoint, quantized)
    if module is None:
        return
    description = describe_hf_model(module)
    if description is not None:
        if base is not None:
            description["source"] = base.identity.get("path")  # config and tokenizer files for export
        checkpoint[SCHEMA.hf_model] = description
    if sharded and base is not None:
        from lightning_fsdp.hf.base import leave_out_base

        leave_out_base(checkpoint, module, base)
