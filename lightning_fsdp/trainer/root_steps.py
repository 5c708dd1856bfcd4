"""The Trainer's step hooks under FSDP2: every step runs through the root module's own call, and no evaluation loop
leaves the root gathered.

Lightning calls ``LightningModule.training_step`` directly; FSDP2's root hooks (the root unit's all-gather, the cast
of inputs) fire only around the root's ``__call__``, so each step is redirected through it (Lightning's forward
redirection). Gradient accumulation skips the reduce-scatter until the last micro-batch. Under context parallelism
each step's batch is cut along the sequence here, and its attention attends across the group's ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.generation import reshard_gathered
from lightning_fsdp.parallel.sequence import SequenceSplit, splitting
from lightning_fsdp.resilience import collective
from lightning_fsdp.runtime import ShardedRuntime
from lightning_fsdp.sharding.activation_offload import ActivationOffload

__all__ = ["RootForwardSteps"]


def _step_hook(method: str, precision_context: str) -> Callable[..., Any]:
    """Lightning's ``<method>`` hook: the precision plugin's ``<precision_context>`` around :meth:`~RootForwardSteps._step`."""

    def hook(self: "RootForwardSteps", *args: Any, **kwargs: Any) -> Any:
        with getattr(self.precision_plugin, precision_context)():
            return self._step(method, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = method
    return override(hook)


class RootForwardSteps(ParallelStrategy):
    """Step hooks for a strategy whose ``model`` is an FSDP2 root (mixed in before Lightning's strategy classes).

    Under context parallelism each step's batch is split along the sequence first (``runtime.split_sequence``)."""

    runtime: ShardedRuntime
    _step_split: Optional[SequenceSplit] = None
    #: saved activations to pinned host memory during the training step (CUDA; inert on CPU)
    offload_activations: bool = False
    _activation_offload: Optional[ActivationOffload] = None

    @collective("{method} (FSDP parameter all-gathers in forward, or a collective in the step)", gate=False)
    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``LightningModule.<method>`` through the root's ``__call__`` so FSDP2's root hooks fire: the root's
        pre-forward hook gathers its own parameters and casts inputs; Lightning would otherwise bypass it."""
        assert self.model is not None and self.lightning_module is not None
        split = None
        if args:  # context parallelism: this rank's chunks of the batch, and attention across the group's ranks
            batch, split = self.runtime.split_sequence(args[0])
            args = (batch, *args[1:])
        self._step_split = split  # a checkpointed block recomputed in backward attends the same way
        offloading: Any = nullcontext()
        if self.offload_activations and method == "training_step" and self.root_device.type == "cuda":
            if self._activation_offload is None:
                self._activation_offload = ActivationOffload()  # one side stream for the whole run
            offloading = self._activation_offload
        with splitting(split), offloading:
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        with splitting(self._step_split, expect_attention=False):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    training_step = _step_hook("training_step", "train_step_context")
    validation_step = _step_hook("validation_step", "val_step_context")
    test_step = _step_hook("test_step", "test_step_context")
    predict_step = _step_hook("predict_step", "predict_step_context")

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally: no reduce-scatter until the last micro-batch (FSDP2 has no ``no_sync``)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @override
    def on_validation_end(self) -> None:
        """FSDP2 keeps the root unit's parameters gathered after a forward, for the backward that follows; after an
        evaluation loop none follows, and training would carry the full root (the tied embedding and head: half the
        embedding more per rank at 2 ranks, the memory report's state / ideal 1.2 on SmolLM2) into its next step."""
        if self.model is not None:
            reshard_gathered(self.model)

    on_test_end = on_predict_end = on_validation_end
