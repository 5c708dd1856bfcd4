"""Data modules: the user's own data for SFT, DPO and GRPO, and generated sets for the examples (nothing downloaded).

- :class:`TextCorpusDataModule`: byte-level LM text from the docstrings of Python's own standard library.
- :class:`ShapesDataModule`: generated images of four shapes, for the CNN.
- :class:`SFTDataModule`: the user's own fine-tuning data (chat, instruction, prompt/completion or text files)
  with the model's own tokenizer, packed or padded (:mod:`lightning_fsdp.data.sft`).
- :class:`PreferenceDataModule`: (prompt, chosen, rejected) pairs for DPO and SimPO, in TRL's formats.
- :class:`PromptDataModule`: prompts (and the columns their rewards read) for GRPO, in TRL's prompt-only format.

Every training loader yields the global order of :mod:`lightning_fsdp.data.order`, and resumes mid-epoch.
"""

from lightning_fsdp.data.order import GlobalOrderLoader, GlobalOrderSampler
from lightning_fsdp.data.preference import PreferenceDataModule
from lightning_fsdp.data.prompts import PromptDataModule
from lightning_fsdp.data.sft import SFTDataModule
from lightning_fsdp.data.shapes import ShapesDataModule
from lightning_fsdp.data.text import TextCorpusDataModule

# the DataModules and the loaders every one of them trains with; their helpers stay in their modules
__all__ = [
    "GlobalOrderLoader",
    "GlobalOrderSampler",
    "PreferenceDataModule",
    "PromptDataModule",
    "SFTDataModule",
    "ShapesDataModule",
    "TextCorpusDataModule",
]
