"""The launch both front ends' script launchers run (Lightning's, plus): a rank's exception reaches every rank
before any hook runs, rank 0 reaps the ranks it spawned, and they watch it (each side names the other if it dies
without a traceback). Used under torchrun/SLURM too (then it spawns nothing and nobody's parent is a rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lightning_fsdp._lightning_compat import set_num_threads_if_needed, start_local_ranks
from lightning_fsdp.parallel.process_group import serve_rendezvous_store
from lightning_fsdp.resilience.parent import launching
from lightning_fsdp.resilience.relay import FailureRelay

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment


class RelayedLaunch:
    """Mixed in before a Lightning script launcher (the Trainer's or Fabric's, which share their constructor and
    child start-up): ``relay`` is told about an exception first, then it propagates as usual."""

    cluster_environment: ClusterEnvironment
    num_processes: int
    num_nodes: int

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, relay: FailureRelay
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)  # type: ignore[call-arg]  # the launcher's
        self._relay = relay

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Lightning's launch (``trainer`` is the Trainer's keyword; Fabric passes none), with the relay."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        env = self.cluster_environment
        rank = env.node_rank() * self.num_processes + env.local_rank()
        if not env.creates_processes_externally:
            with launching(rank):
                children = start_local_ranks(self, started=serve_rendezvous_store if rank == 0 else None)
            self._relay.watch_children(children, rank)
        else:
            self._relay.watch_parent(rank)
        set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as exc:
            self._relay.on_exception(exc)
            raise
