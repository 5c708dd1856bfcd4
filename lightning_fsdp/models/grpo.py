"""Reinforcement learning from verifiable rewards (GRPO) on a sharded Hugging Face causal LM: :class:`HFGRPOLM`.

Each optimizer step: the step's prompts (a rollout window, :class:`~lightning_fsdp.data.PromptDataModule`) are
completed ``num_generations`` times each *on the sharded model itself* (:mod:`lightning_fsdp.generation`: no second
copy, no weight sync; every unit gathered once for the rollout, or streamed when the model does not fit), the
completions are scored by plain-Python reward functions, each completion's advantage is its reward relative to its
group, and the clipped surrogate is trained on them, micro-batch by micro-batch, through the one
:class:`~lightning_fsdp.loss.TokenWeightedLoss` (:mod:`lightning_fsdp.loss.grpo`). Sampling is seeded per prompt
(the run's seed, the prompt's place in the global order, the sample number), so the same seed gives the same
completions, rewards and step at any world size and accumulation.

The reference of the KL term (``beta`` > 0) costs no copy under LoRA/QLoRA (the base with the adapters off) and 1/N
of the model per rank for a full fine-tune (a frozen sharded copy); with ``beta=0`` (TRL's default) there is none.
Hyperparameters carry TRL's ``GRPOConfig`` names and meanings; the defaults are TRL 1.16's.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fsdp.generation import (
    ROLLOUT_MODES,
    Sampling,
    check_cache_fits,
    free_device_bytes,
    generate,
    in_root_forward,
    kv_cache_bytes,
    resolve_rollout_mode,
    rollout_gathering,
)
from lightning_fsdp.loss import DEFAULT_CHUNK_TOKENS
from lightning_fsdp.loss.chunked import token_log_probs
from lightning_fsdp.loss.grpo import LOSS_TYPES, SCALE_REWARDS, aggregate, group_advantages, token_losses
from lightning_fsdp.models.hf_causal_lm import HFCausalLM
from lightning_fsdp.models.reference import ReferenceModel, frozen_copy
from lightning_fsdp.models.rollout import (
    Rollout,
    RolloutPart,
    build_part,
    collect_metric,
    reward_arguments,
    rollout_metrics,
)
from lightning_fsdp.parallel.collectives import all_gather_object
from lightning_fsdp.rewards import RewardFunctions

__all__ = ["GRPO_REFERENCES", "HFGRPOLM"]

#: how the KL term's reference is made (``precomputed`` has no meaning for completions sampled online)
GRPO_REFERENCES = ("adapters_off", "copy")
#: the per-step sums whose global means are logged (:meth:`HFGRPOLM.on_before_optimizer_step`)
_STEP_SUMS = ("tokens", "entropy", "kl", "clip_low", "clip_high")


class HFGRPOLM(HFCausalLM):
    """Train the causal LM in ``model_dir`` on rewards of its own completions.

    Args:
        model_dir, lora, from_pretrained, lr, weight_decay, betas, tokenizer, loss_chunk: as
            :class:`~lightning_fsdp.models.HFCausalLM` (``lr`` defaults to TRL's 1e-6).
        reward_funcs: reward functions by dotted path (or callables) with TRL's signature.
        reward_weights: one weight per function (default 1 each); the reward is their weighted sum.
        num_generations: completions per prompt (a group).
        max_completion_length: the longest completion in tokens.
        temperature, top_p, top_k: sampling (``top_k=0``: off); log-probabilities use the same temperature.
        beta: the KL coefficient (0: no reference model at all).
        epsilon, epsilon_high: the clipping range ``[1 - epsilon, 1 + epsilon_high]`` (``None``: ``epsilon``).
        num_iterations: optimizer steps per rollout (μ); above 1 the policy's log-probabilities at sampling time
            are kept as the old ones.
        loss_type: ``dapo``, ``grpo``, ``dr_grpo`` or ``bnpo`` (:mod:`lightning_fsdp.loss.grpo`).
        scale_rewards: ``group``, ``batch`` or ``none``.
        mask_truncated_completions: leave completions cut at ``max_completion_length`` out of the loss.
        reference: ``adapters_off`` (LoRA) or ``copy``; ``None``: ``adapters_off`` with LoRA, else ``copy``.
        rollout_mode: ``auto``, ``gather_once`` or ``stream`` (:mod:`lightning_fsdp.generation.fsdp`).
        generation_batch_size: completions decoded at once (a multiple of ``num_generations``; default: all of a
            window's).
        seed: the sampling seed (default: the run's, ``PL_GLOBAL_SEED``).
    """

    def __init__(
        self,
        model_dir: Union[str, Path],
        reward_funcs: list[Union[str, Callable[..., Any]]],
        reward_weights: Optional[list[float]] = None,
        lora: Optional[dict[str, Any]] = None,
        num_generations: int = 8,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        num_iterations: int = 1,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        reference: Optional[str] = None,
        rollout_mode: str = "auto",
        generation_batch_size: Optional[int] = None,
        seed: Optional[int] = None,
        from_pretrained: bool = False,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        tokenizer: Optional[Union[str, Path]] = None,
        loss_chunk: Optional[int] = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        _check_settings(num_generations, max_completion_length, temperature, loss_type, scale_rewards, epsilon,
                        num_iterations, beta, reference, lora, rollout_mode, generation_batch_size)
        from lightning_fsdp.hf.gguf import resolve_model_source

        model_dir = resolve_model_source(model_dir)
        self.rewards = RewardFunctions(reward_funcs, reward_weights)  # an unimportable function fails here
        super().__init__(model_dir, lora=lora, from_pretrained=from_pretrained, lr=lr, weight_decay=weight_decay,
                         betas=betas, tokenizer=tokenizer, loss_chunk=loss_chunk)
        self.hparams["reward_funcs"] = [f if isinstance(f, str) else f"{f.__module__}.{f.__qualname__}"
                                        for f in reward_funcs]  # names: what a checkpoint can hold
        self._rollout: Optional[Rollout] = None
        self._step_sums = torch.zeros(len(_STEP_SUMS), dtype=torch.float64)
        self._train_clock = 0.0  # when this step's training (after its rollout) began

    @property
    def num_iterations(self) -> int:
        """Optimizer steps per rollout: the data module replays a window this many times."""
        return int(self.hparams["num_iterations"])

    @property
    def reference_mode(self) -> Optional[str]:
        h = self.hparams
        if h["beta"] == 0.0:
            return None
        return h.get("reference") or ("adapters_off" if h["lora"] else "copy")

    @property
    def sampling_seed(self) -> int:
        seed = self.hparams.get("seed")
        return int(seed) if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0") or 0)

    def sampling(self, stop_ids: tuple[int, ...], greedy: bool = False) -> Sampling:
        h = self.hparams
        return Sampling(int(h["max_completion_length"]), temperature=0.0 if greedy else float(h["temperature"]),
                        top_k=int(h["top_k"]), top_p=float(h["top_p"]), stop_ids=stop_ids, seed=self.sampling_seed)

    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the tokenizer's EOS and the generation config's."""
        tokenizer = self._data().tokenizer
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids |= {configured} if isinstance(configured, int) else set(configured or ())
        return tuple(sorted(ids))

    def _data(self) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "pad_id"):
            raise ValueError("HFGRPOLM trains on prompts: fit it with a PromptDataModule (data=prompts).")
        return datamodule

    # -- before training ---------------------------------------------------------------------------------------------
    @override
    def on_fit_start(self) -> None:
        h, data = self.hparams, self._data()
        if self.reference_mode == "copy":
            self._frozen_reference()
        _check_checkpoint_steps(self.trainer, self.num_iterations)
        rows = h["generation_batch_size"] or data.batch_size * int(h["num_generations"]) * self.trainer.accumulate_grad_batches
        tokens = int(data.max_prompt_length) + int(h["max_completion_length"])
        assert self.model is not None
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and tokens > int(positions):
            raise ValueError(f"data.max_prompt_length={data.max_prompt_length} + max_completion_length="
                             f"{h['max_completion_length']} = {tokens} tokens is more than the model's"
                             f" max_position_embeddings={positions}: lower one of them.")
        cache = kv_cache_bytes(self.model.config, rows, tokens, torch.get_default_dtype().itemsize)
        check_cache_fits(cache, free_device_bytes(self.trainer.strategy.root_device),
                         f"{rows} completions of up to {tokens} tokens")

    def _frozen_reference(self) -> ReferenceModel:
        """The frozen sharded copy (``reference="copy"``), outside the module tree: no optimizer, checkpoint or
        export sees it."""
        reference = self.__dict__.get("_reference_copy")
        if reference is None:
            chunk = self.hparams.get("loss_chunk") or DEFAULT_CHUNK_TOKENS
            reference = frozen_copy(self.hparams["model_dir"], chunk, self.trainer.strategy)
            self.__dict__["_reference_copy"] = reference
        return reference

    # -- the rollout -------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch["iteration"] == 0 and batch["part"] == 0:
            self._rollout = self.roll_out(batch["window"], batch["parts"], batch["window_id"])
            self.log_dict(self._rollout.metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        elif self._rollout is None or self._rollout.window_id != batch["window_id"]:
            raise RuntimeError("This micro-batch belongs to a rollout window that was not sampled here (a resume in"
                               " the middle of a window); resume from a checkpoint at a multiple of num_iterations.")
        if batch["part"] == 0:
            self._train_clock = time.perf_counter()

    def roll_out(self, rows: list[dict[str, Any]], parts: int, window_id: Any) -> Rollout:
        """Sample, score and prepare every completion of a window's ``rows`` (this rank's prompts)."""
        h, data, device = self.hparams, self._data(), self.trainer.strategy.root_device
        group = int(h["num_generations"])
        mode = resolve_rollout_mode(h["rollout_mode"], self, device)
        prompts = [row["prompt_ids"] for row in rows]
        per_batch = (int(h["generation_batch_size"]) // group) if h["generation_batch_size"] else None
        model = self.model
        assert model is not None

        def sample() -> Any:
            with rollout_gathering(self, mode) as gathering:
                return generate(model, prompts, self.sampling(self.stop_ids()), pad_id=data.pad_id, repeats=group,
                                keys=[row["position"] for row in rows], batch_size=per_batch, device=device,
                                synchronized=gathering.synchronized)

        done = in_root_forward(self, sample)
        texts = [data.decode(ids) for ids in done.ids]
        logged: dict[str, float] = {}
        arguments = reward_arguments(rows, texts, done.ids, group)
        columns: dict[str, Any] = {**arguments[3], "log_metric": collect_metric(logged)}  # TRL's hook for reward metrics
        scores = self.rewards.score(*arguments[:3], columns)
        everyone = all_gather_object((scores, [len(c) for c in done.ids], done.stopped, done.tokens, done.seconds))
        every_score = torch.cat([s for s, *_ in everyone])
        advantages, zero_std = group_advantages(self.rewards.total(every_score), group, h["scale_rewards"])
        start = sum(len(s) for s, *_ in everyone[: self.global_rank])
        local_advantages = advantages[start:start + len(scores)]
        per_part = len(rows) // parts
        built = []
        for j in range(parts):
            window = slice(j * per_part * group, (j + 1) * per_part * group)
            part = build_part(prompts[j * per_part:(j + 1) * per_part], done.ids[window], done.stopped[window],
                              local_advantages[window], pad_id=data.pad_id, num_generations=group,
                              mask_truncated=bool(h["mask_truncated_completions"])).to(device)
            built.append(self._score_part(part))
        metrics = rollout_metrics(self.rewards, every_score, zero_std, everyone, logged)
        return Rollout(window_id, built, metrics, done)

    @torch.no_grad()
    def _score_part(self, part: RolloutPart) -> RolloutPart:
        """The part with the old policy's log-probabilities (``num_iterations`` > 1) and the reference's (``beta``
        > 0), each in a forward without gradients."""
        if self.num_iterations > 1:
            part.old_logps = in_root_forward(self, lambda: self.completion_log_probs(part)[0])
        mode = self.reference_mode
        if mode == "adapters_off":
            part.ref_logps = in_root_forward(self, lambda: self.completion_log_probs(part, reference=True)[0])
        elif mode == "copy":
            batch = {"input_ids": part.input_ids, "attention_mask": part.attention_mask, "labels": part.labels,
                     "position_ids": part.position_ids}
            dense = self._frozen_reference().score(batch, temperature=float(self.hparams["temperature"]))
            part.ref_logps = dense[:, part.prompt_width:]
        return part

    def completion_log_probs(self, part: RolloutPart, *, reference: bool = False) -> tuple[Tensor, Tensor]:
        """Per completion token ``(log p, entropy)`` under the policy (or, ``reference=True``, the base with the
        adapters off), at the sampling temperature, ``(rows, completion_width)``."""
        chunk = self.hparams.get("loss_chunk")
        temperature = float(self.hparams["temperature"])
        inputs = {"attention_mask": part.attention_mask, "position_ids": part.position_ids}
        with self._adapters_off() if reference else nullcontext():
            if chunk:
                hidden, head = self._hidden_states(part.input_ids, **inputs)
            else:  # the whole logits (a model whose head cannot be split off)
                assert self.model is not None
                hidden = self.model(input_ids=part.input_ids, use_cache=False, **inputs).logits
                head, chunk = torch.nn.Identity(), hidden.shape[0] * hidden.shape[1]
            logps, entropy = token_log_probs(hidden, head, part.labels, chunk_tokens=chunk, temperature=temperature)
        return logps[:, part.prompt_width:], entropy[:, part.prompt_width:]

    def _adapters_off(self) -> Any:
        stack = ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(self.model.disable_adapter())  # type: ignore[union-attr,operator]
        return stack

    # -- training ----------------------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self._rollout is not None
        h = self.hparams
        part = self._rollout.parts[batch["part"]]
        logps, entropy = self.completion_log_probs(part)
        terms = token_losses(logps, part.advantages, old_logps=part.old_logps, ref_logps=part.ref_logps,
                             epsilon=float(h["epsilon"]), epsilon_high=h["epsilon_high"], beta=float(h["beta"]))
        total, count = aggregate(terms.losses, part.completion_mask, h["loss_type"], int(h["max_completion_length"]))
        mask = part.completion_mask.to(logps.dtype)
        kl = (terms.kl.detach() * mask).sum() if terms.kl is not None else mask.new_zeros(())
        sums = torch.stack([mask.sum(), (entropy * mask).sum(), kl, (terms.clipped_low * mask).sum(),
                            (terms.clipped_high * mask).sum()])
        self._step_sums += sums.double().cpu()
        return self.token_loss.add(total, count)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # the token-weighted step and train_loss
        strategy = self.trainer.strategy
        seconds = torch.tensor([time.perf_counter() - self._train_clock], dtype=torch.float64)
        sums = strategy.reduce(torch.cat([self._step_sums, seconds]).to(strategy.root_device), reduce_op="sum")
        self._step_sums.zero_()
        tokens = float(sums[0].clamp(min=1))
        values = {"entropy": float(sums[1]) / tokens, "clip_ratio/low_mean": float(sums[3]) / tokens,
                  "clip_ratio/high_mean": float(sums[4]) / tokens,
                  "clip_ratio/region_mean": float(sums[3] + sums[4]) / tokens,
                  "train/tokens_per_second": float(sums[0]) / max(float(sums[5]) / self.trainer.world_size, 1e-9)}
        if self.hparams["beta"]:
            values["kl"] = float(sums[2]) / tokens
        self.log_dict(values, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Held-out prompts are scored by :class:`~lightning_fsdp.callbacks.HeldOutRewards` (generation, not loss)."""


def _check_settings(num_generations: int, max_completion_length: int, temperature: float, loss_type: str,
                    scale_rewards: str, epsilon: float, num_iterations: int, beta: float, reference: Optional[str],
                    lora: Optional[dict[str, Any]], rollout_mode: str, generation_batch_size: Optional[int]) -> None:
    """Every setting checked before a process starts, each error naming the fix."""
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations={num_generations!r}: GRPO compares each completion with its group, so"
                         " it needs at least 2 completions per prompt.")
    if max_completion_length < 1 or num_iterations < 1 or epsilon <= 0 or beta < 0:
        raise ValueError(f"max_completion_length ≥ 1, num_iterations ≥ 1, epsilon > 0 and beta ≥ 0 are needed; got"
                         f" {max_completion_length}, {num_iterations}, {epsilon}, {beta}.")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: GRPO samples its completions; a group of greedy completions"
                         " is one completion repeated, with no advantage to learn from. Use a temperature above 0.")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}.")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}.")
    if rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode={rollout_mode!r} is not one of {ROLLOUT_MODES}.")
    if reference is not None and reference not in GRPO_REFERENCES:
        raise ValueError(f"reference={reference!r} is not one of {GRPO_REFERENCES} (completions are sampled online,"
                         " so a reference cannot be precomputed).")
    if reference == "adapters_off" and not lora:
        raise ValueError("reference='adapters_off' is the base with the LoRA adapters switched off: pass lora={...},"
                         " or reference='copy' for a full fine-tune.")
    if generation_batch_size is not None and (generation_batch_size < 1 or generation_batch_size % num_generations):
        raise ValueError(f"generation_batch_size={generation_batch_size} completions must be whole groups: a multiple"
                         f" of num_generations={num_generations}.")


def _check_checkpoint_steps(trainer: Any, num_iterations: int) -> None:
    """With ``num_iterations`` > 1 a rollout spans that many steps and is not saved: checkpoints must fall between
    windows, so a resume starts a fresh one."""
    if num_iterations == 1:
        return
    from lightning_fsdp._lightning_compat import checkpoint_every_n_train_steps

    for callback in getattr(trainer, "checkpoint_callbacks", []):
        every = checkpoint_every_n_train_steps(callback)
        if every and every % num_iterations:
            raise ValueError(f"ModelCheckpoint(every_n_train_steps={every}) saves inside a rollout window of"
                             f" num_iterations={num_iterations} steps, which the checkpoint cannot hold: save every"
                             f" multiple of {num_iterations} steps.")
