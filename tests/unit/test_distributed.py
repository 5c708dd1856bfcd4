import subprocess
import sys

import pytest

from lightning_fsdp.parallel.mesh import MeshShape, data_parallel_rank, resolve_mesh_shape
from lightning_fsdp.parallel.process_group import as_timedelta
from tests.helpers.launch import free_port


@pytest.mark.parametrize(
    ("replicate", "shard", "world", "nodes", "expected"),
    [
        (1, "auto", 4, 1, MeshShape(1, 4)),
        (2, "auto", 4, 1, MeshShape(2, 2)),
        ("auto", "auto", 8, 2, MeshShape(2, 4)),
        ("auto", 2, 8, 1, MeshShape(4, 2)),
        (-1, -1, 6, 3, MeshShape(3, 2)),
        (2, 3, 6, 1, MeshShape(2, 3)),
    ],
)
def test_resolve_mesh_shape(replicate, shard, world, nodes, expected):
    assert resolve_mesh_shape(replicate, shard, world, nodes) == expected


def test_hybrid_dims():
    assert MeshShape(1, 4).dim_names == ("dp_shard",) and MeshShape(1, 4).sizes == (4,)
    assert MeshShape(2, 2).dim_names == ("dp_replicate", "dp_shard") and MeshShape(2, 2).is_hybrid


def test_mesh_that_does_not_fit_shows_the_arithmetic():
    with pytest.raises(ValueError, match=r"replicate_size × shard_size = 2 × 3 = 6, but WORLD_SIZE = 4"):
        resolve_mesh_shape(2, 3, 4)
    with pytest.raises(ValueError, match="replicate_size=3 does not divide the world size 4"):
        resolve_mesh_shape(3, "auto", 4)
    with pytest.raises(ValueError, match="shard_size=3 does not divide the world size 4"):
        resolve_mesh_shape("auto", 3, 4)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "two", True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="replicate_size"):
        resolve_mesh_shape(bad, "auto", 4)


def test_timeout_forms():
    assert as_timedelta(30).total_seconds() == 30
    assert as_timedelta(None).total_seconds() == 1800
    with pytest.raises(ValueError, match="timeout"):
        as_timedelta(-1)


def test_data_parallel_rank_is_replica_major():
    class FakeMesh:  # only the rank arithmetic is under test here; real meshes are used in the distributed tests
        ndim = 2

        def get_local_rank(self, dim):
            return {"dp_replicate": 1, "dp_shard": 1}[dim]

        def size(self, dim):
            return 2

    assert data_parallel_rank(FakeMesh()) == 3


_EXIT_PROBE = """
import atexit, sys, tempfile, torch.distributed as dist
from lightning_fsdp.parallel.process_group import destroy_process_group_at_exit
# registered first, so it runs after the hook (atexit is last-in, first-out)
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
veto = sys.argv[1] == "veto"
destroy_process_group_at_exit(keep_if=lambda: veto)
destroy_process_group_at_exit(keep_if=lambda: veto)  # idempotent: still one hook
"""


@pytest.mark.parametrize(("mode", "expected"), [("destroy", "False"), ("veto", "True")])
def test_process_group_is_destroyed_at_exit_unless_vetoed(mode, expected):
    """A gloo group left to the interpreter's finalisation can abort a successful run (exit -6)."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"initialized at exit: {expected}"


def test_agree_keeps_the_failing_ranks_own_exception_and_traceback():
    from lightning_fsdp.parallel.collectives import agree

    def fails() -> None:
        raise ValueError("a shape does not match")

    with pytest.raises(RuntimeError, match=r"Saving failed: ValueError: a shape does not match\. fix it") as info:
        agree(fails, "Saving", hint="fix it")
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and cause.__traceback__ is not None  # where it failed, not just the text
    assert agree(lambda: 3, "Adding") == 3


_EARLY_STORE_PROBE = """
import os, sys, datetime, torch.distributed as dist
from lightning_fsdp.parallel import process_group
env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1], "WORLD_SIZE": "1"}
print("served:", process_group.serve_rendezvous_store(env))
# a rank that looks for the store before this one joins finds it at once
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=5))
client.set("early", "yes")
os.environ.update(env)
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)  # shares the server: no port clash
dist.barrier()
print("joined:", dist.is_initialized(), client.get("early").decode())
process_group.release_process_group()
print("released:", process_group._early_store is None, dist.is_initialized())
print("unserved:", process_group.serve_rendezvous_store({"MASTER_ADDR": "127.0.0.1"}))
"""


def test_rank_zero_serves_the_rendezvous_store_before_it_joins():
    """Ranks that arrive first connect at once instead of backing off; ``init_process_group`` shares the server."""
    proc = subprocess.run([sys.executable, "-c", _EARLY_STORE_PROBE, str(free_port())], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:4] == ["served: True", "joined: True yes", "released: True False",
                                          "unserved: False"]
