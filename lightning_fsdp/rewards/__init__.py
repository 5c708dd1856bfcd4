"""Rewards for reinforcement learning (GRPO): plain Python functions with TRL's signature, loaded by dotted path and
checked (:mod:`.functions`); code run outside the training process with limits (:mod:`.code`); and the checks of the
package's expression task (:mod:`.expressions`)."""

from lightning_fsdp.rewards.code import CodeRun, code_passes_tests, extract_code, run_python
from lightning_fsdp.rewards.expressions import concise, correct_value, stated_value
from lightning_fsdp.rewards.functions import RewardError, RewardFunctions, load_reward_function

__all__ = [
    "CodeRun", "RewardError", "RewardFunctions", "code_passes_tests", "concise", "correct_value", "extract_code",
    "load_reward_function", "run_python", "stated_value",
]
