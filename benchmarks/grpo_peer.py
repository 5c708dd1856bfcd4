"""The GRPO row of ``benchmarks/peers.py``: ``experiment=grpo`` against TRL's ``GRPOTrainer`` (transformers' own
``generate``, no vLLM) under accelerate's FSDP2, and transformers' ``generate`` alone as the rollout's yardstick.

Both trainers run the same real model (SmolLM2-135M-Instruct) with LoRA r=8 on q/k/v/o, on the same prompts (the
demo's expression prompts), the same reward (``lightning_fsdp.rewards.correct_value``), ``num_generations``,
completion length, temperature, learning rate, clipping, fp32, on 2 CPU processes with one thread each. What each
reports per step: the step time, the rollout's generated tokens per second (decoding only) and the training's
completion tokens per second (forward and backward of the sampled completions, after the rollout).

``python benchmarks/grpo_peer.py generate`` measures transformers' ``generate`` on the unsharded model in one process
with as many threads as the ranks have together, on the same prompts and sampling: the engine's rollout tokens/s in
gather-once mode is compared against it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GRPO = {"prompts_per_rank": 2, "num_generations": 4, "completion_length": 32, "temperature": 0.8, "lr": 2e-4,
        "max_prompt_length": 128}
REWARD = "lightning_fsdp.rewards.correct_value"


def prepare_prompts(work: Path) -> Path:
    from lightning_fsdp.data.expressions import write_expression_prompts

    return Path(write_expression_prompts(work / "expression_prompts")) / "train.jsonl"


def ours_command(model_dir: Path, train: Path, steps: int, out: Path, world: int, lora: dict[str, Any],
                 rollout_mode: str = "gather_once") -> list[str]:
    return [
        sys.executable, "-m", "lightning_fsdp", "train", "experiment=grpo",
        f"model.model_dir={model_dir}", f"data.path={train}", "data.val_path=null", "data.val_fraction=0.0",
        f"data.batch_size={GRPO['prompts_per_rank']}", f"data.cache_dir={out.parent / 'prompt_cache'}",
        f"model.num_generations={GRPO['num_generations']}", f"model.max_completion_length={GRPO['completion_length']}",
        f"model.temperature={GRPO['temperature']}", f"model.lr={GRPO['lr']}", f"model.lora.r={lora['r']}",
        f"model.lora.lora_alpha={lora['lora_alpha']}", f"model.rollout_mode={rollout_mode}",
        f"trainer.devices={world}", f"trainer.max_steps={steps}", "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false", "trainer.enable_model_summary=false",
        "callbacks.held_out_rewards=null", "callbacks.reward_curve=null", "callbacks.model_checkpoint=null",
        "export.formats=[]", f"paths.output_dir={out}", f"paths.log_dir={out}",
        "+callbacks.peer_clock._target_=benchmarks.peers.step_clock",
    ]


def trl_worker(spec: dict[str, Any], record: Any, accelerate_fsdp_on_cpu: Any, lora: dict[str, Any]) -> None:
    """An accelerate-launched ``GRPOTrainer`` with a clock: step ends, and the rollout's share of each step."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_fsdp.rewards import correct_value

    if spec.get("sharded", True):
        accelerate_fsdp_on_cpu()

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if spec.get("sharded", True) and record.first_step_start is None:  # not accelerate's DDP fallback
                from torch.distributed.tensor import DTensor

                if not any(isinstance(p, DTensor) for p in kwargs["model"].parameters()):
                    raise RuntimeError(f"TRL's model is not FSDP2-sharded: {type(kwargs['model']).__name__}")
            record.step_start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.step_ends.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                record.losses.append(float(logs.get("reward", float("nan"))))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.write(int(os.environ.get("RANK", 0)))

    class Timed(GRPOTrainer):
        """Times the decoding (``_generate_single_turn``) and the whole rollout (decoding, rewards, log-probs)."""

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            record.rollout.append({"decode_s": time.perf_counter() - started,
                                   "tokens": sum(len(c) for c in completion_ids)})
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            record.rollout[-1]["rollout_s"] = time.perf_counter() - started
            record.rollout[-1]["trained_tokens"] = int(out["completion_mask"].sum())
            return out

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    data = load_dataset("json", data_files=spec["train"], split="train")
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"],
        per_device_train_batch_size=GRPO["prompts_per_rank"] * GRPO["num_generations"],
        num_generations=GRPO["num_generations"], max_completion_length=GRPO["completion_length"],
        temperature=GRPO["temperature"], learning_rate=GRPO["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no",
        gradient_checkpointing=False,  # TRL's GRPO default is True; neither peer checkpoints here
        report_to=[], bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = Timed(model=model, reward_funcs=[correct_value], args=config, train_dataset=data,
                    processing_class=tokenizer, peft_config=LoraConfig(task_type="CAUSAL_LM", **lora),
                    callbacks=[Clock()])
    state = trainer.accelerator.state
    if spec.get("sharded", True) and state.fsdp_plugin is not None and state.distributed_type.name == "MULTI_CPU":
        from accelerate.utils import DistributedType

        state.distributed_type = DistributedType.FSDP  # the state kept accelerate's CPU choice (DDP) for its plugin
    trainer.train()


def generate_baseline(model_dir: Path, train: Path, world: int, steps: int = 3) -> dict[str, float]:
    """transformers' ``generate`` on the unsharded model in this process, ``world`` threads, on one step's prompts of
    every rank (``world × prompts_per_rank`` prompts, ``num_generations`` samples each)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(world)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    per_step = world * GRPO["prompts_per_rank"]
    seconds = tokens = 0.0
    for step in range(steps + 1):
        prompts = [r["prompt"] for r in rows[step * per_step:(step + 1) * per_step]]
        tokenizer.padding_side = "left"
        batch = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_dict=True, padding=True,
                                              return_tensors="pt")
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=True, temperature=GRPO["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=GRPO["completion_length"], num_return_sequences=GRPO["num_generations"],
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        elapsed = time.perf_counter() - started
        new = out[:, batch["input_ids"].shape[1]:]
        ended = (new == tokenizer.eos_token_id).int()
        lengths = torch.where(ended.any(1), ended.argmax(1) + 1, torch.full_like(ended[:, 0], new.shape[1]))
        if step:  # the first is a warm-up
            seconds, tokens = seconds + elapsed, tokens + float(lengths.sum())
    return {"tokens_per_s": tokens / seconds, "threads": float(world), "steps": float(steps)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["generate"]:
        from lightning_fsdp.hf.gguf import resolve_model_source
        from lightning_fsdp.hf.packaged import packaged_model_path

        import tempfile

        work = Path(tempfile.mkdtemp(prefix="grpo-generate-"))
        print(json.dumps(generate_baseline(Path(resolve_model_source(packaged_model_path("SmolLM2-135M-Instruct"))),
                                           prepare_prompts(work), int(sys.argv[2]) if len(sys.argv) > 2 else 2)))
