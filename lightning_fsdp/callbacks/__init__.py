"""Callbacks that measure what a fine-tune changed, in the terms a user judges it by."""

from lightning_fsdp.callbacks.held_out_rewards import HeldOutRewards

__all__ = ["HeldOutRewards"]
