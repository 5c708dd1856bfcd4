"""The Hydra configs of ``lightning-fsdp train``; importing them registers the resolvers they use.

``${packaged_model:NAME}``: the file of a real model shipped in a package (:mod:`lightning_fsdp.hf.packaged`), e.g.
``${packaged_model:SmolLM2-135M-Instruct}``; a missing package is an error naming its install command.
"""

from omegaconf import OmegaConf


def _packaged_model(name: str) -> str:
    from lightning_fsdp.hf.packaged import packaged_model_path

    return str(packaged_model_path(name))


if not OmegaConf.has_resolver("packaged_model"):
    OmegaConf.register_new_resolver("packaged_model", _packaged_model)
