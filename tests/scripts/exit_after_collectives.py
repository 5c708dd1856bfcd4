"""Run collectives on a gloo group that something else still refers to, then exit at once.

``torchrun --nproc-per-node=2 exit_after_collectives.py``. The last collective's gloo worker thread releases its
work just as the interpreter starts to finalise; unless the exit hook hands it the GIL first, the process can
abort ("terminate called without an active exception") although everything succeeded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from lightning_fsdp.parallel.process_group import destroy_process_group_at_exit

dist.init_process_group("gloo")
HOLDER = [dist.group.WORLD]  # like FSDP state or a device mesh: the group outlives destroy_process_group
destroy_process_group_at_exit()
value = torch.full((3,), float(dist.get_rank()))
for _ in range(20):
    gathered = dist_fn.all_gather(value)  # outputs created in Python: the worker's release needs the GIL
assert torch.stack(gathered)[:, 0].tolist() == [float(r) for r in range(dist.get_world_size())]
