"""The Trainer callbacks, in one place.

=================================  ==================================================================================
``HeldOutAnswers``                 SFT: held-out loss, greedy answers scored by ROUGE-L and exact match, at step 0
                                   and at the end, a few side by side (:mod:`.held_out_answers`)
``HeldOutPreferences``             DPO/SimPO: held-out pair loss, reward accuracy and margin (:mod:`.held_out_preferences`)
``HeldOutRewards``                 GRPO: held-out prompts answered greedily and scored by the reward functions
                                   (:mod:`.held_out_rewards`)
``EvalHarness``                    lm-eval tasks on the sharded model at step 0, every N steps and at the end
                                   (:mod:`.eval_harness`)
``LossCurve``                      the logged curves drawn as a PNG after fit (:mod:`.loss_curve`)
``ShardedEMA``                     an exponential moving average of the sharded weights (:mod:`lightning_fsdp.trainer.averaging`)
``MemoryReport``                   each rank's bytes of parameters, gradients and optimizer state, and its peak
                                   (:mod:`lightning_fsdp.trainer.memory`)
=================================  ==================================================================================

The held-out callbacks share :mod:`.held_out`: one reducer over every rank's held-out batches and the start/end
protocol. ``ShardedEMA`` and ``MemoryReport`` live with the Trainer front end, whose sharded state they read.
"""

from lightning_fsdp.callbacks.eval_harness import EvalHarness
from lightning_fsdp.callbacks.held_out_answers import HeldOutAnswers
from lightning_fsdp.callbacks.held_out_preferences import HeldOutPreferences
from lightning_fsdp.callbacks.held_out_rewards import HeldOutRewards
from lightning_fsdp.callbacks.loss_curve import LossCurve
from lightning_fsdp.trainer.averaging import ShardedEMA
from lightning_fsdp.trainer.memory import MemoryReport

__all__ = ["EvalHarness", "HeldOutAnswers", "HeldOutPreferences", "HeldOutRewards", "LossCurve", "MemoryReport", "ShardedEMA"]
