"""Supervised fine-tuning on the user's own data: formats, chat-template masking, packing, the prepared cache."""

from lightning_fsdp.data.sft.encoding import RowEncoder, Status
from lightning_fsdp.data.sft.formats import FORMATS, detect_format, row_messages
from lightning_fsdp.data.sft.module import SFTDataModule, check_vocabulary, load_tokenizer
from lightning_fsdp.data.sft.packing import PackedRows, SampleRows, collate_rows, first_fit_decreasing

__all__ = [
    "FORMATS",
    "PackedRows",
    "RowEncoder",
    "SFTDataModule",
    "SampleRows",
    "Status",
    "check_vocabulary",
    "collate_rows",
    "detect_format",
    "first_fit_decreasing",
    "load_tokenizer",
    "row_messages",
]
