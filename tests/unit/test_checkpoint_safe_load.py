"""Loading never runs code from a checkpoint: DCP ``.metadata`` and ``meta.pt`` payloads are refused."""

from __future__ import annotations

import os
import pickle
import shlex

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_fsdp.checkpoint import CheckpointError
from lightning_fsdp.checkpoint.safe_load import load_metadata_bytes, read_metadata, safe_torch_load


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def test_the_payload_really_runs_code_with_a_plain_unpickler(tmp_path):
    """Guards the tests below: the same payload does run code when nothing stops it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_dcp_metadata_loads(tmp_path):
    dcp.save({"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = read_metadata(tmp_path)
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 4])
    assert metadata.state_dict_metadata["b"].properties.dtype is torch.bfloat16


def test_crafted_metadata_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(CheckpointError, match=r"Refusing to load .*posix.system is not allowed"):
        load_metadata_bytes(pickle.dumps(Payload(marker)), tmp_path / ".metadata")
    assert not marker.exists()


def test_metadata_hiding_the_payload_inside_allowed_classes_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "ran"
    crafted = Metadata(state_dict_metadata={"w": Payload(marker)})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="Refusing"):
        load_metadata_bytes(pickle.dumps(crafted), "x/.metadata")
    assert not marker.exists()


def test_metadata_that_is_not_metadata_is_rejected():
    with pytest.raises(CheckpointError, match="holds a dict, not checkpoint metadata"):
        load_metadata_bytes(pickle.dumps({"a": 1}), "x/.metadata")
    with pytest.raises(CheckpointError, match="not readable checkpoint metadata"):
        load_metadata_bytes(b"\x80\x04garbage", "x/.metadata")


def test_crafted_meta_pt_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"epoch": 1, "hyper_parameters": {"x": Payload(marker)}}, tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match=r"Refusing to load .*meta\.pt.*Nothing from it was executed"):
        safe_torch_load(tmp_path / "meta.pt")
    assert not marker.exists()


def test_truncated_torch_file_is_a_clear_error(tmp_path):
    torch.save({"w": torch.randn(100)}, tmp_path / "w.pt")
    data = (tmp_path / "w.pt").read_bytes()
    (tmp_path / "w.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        safe_torch_load(tmp_path / "w.pt")
