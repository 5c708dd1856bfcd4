"""``lightning-fsdp eval MODEL --tasks ...``: lm-evaluation-harness tasks scored on the model sharded over the ranks.

MODEL is a Hugging Face model directory (a download, or what ``consolidate --format hf`` writes), a ``.gguf`` file
(converted once into a cached directory) or a sharded checkpoint directory written by training. It is built on the
meta device and sharded over the ranks this command runs on (``-n N`` local processes, or every rank of
torchrun/SLURM), each rank keeping only its shards of the weights: a model directory's are read as the rows each
rank owns; a checkpoint's model is the one ``consolidate --format hf`` would write (LoRA merged into the base it
recorded, or ``--base``), rank 0 reading its tensors a batch at a time and each rank keeping its rows. The tasks run
through :class:`~lightning_fsdp.evaluation.harness.ShardedLM`, the requests split over the ranks. The arguments
carry lm-eval's names (``--tasks``, ``--include_path``, ``--num_fewshot``, ``--limit``, ``--apply_chat_template``,
``--output_path``), and ``--output_path`` receives lm-eval's own results JSON, so the tools that read lm-eval's
files read these. Everything that can be checked (the tasks exist, a chat template exists when asked for, the model
source) is checked before the model is loaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.commands import arguments, command_parser, fail, model_source_kind


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("eval", __doc__)
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face model directory, a .gguf file or a sharded checkpoint directory")
    parser.add_argument("--base", metavar="DIR", help="a checkpoint's pretrained directory (its frozen base and"
                        " tokenizer), if it moved or the checkpoint names none")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include_path", metavar="DIR", help="a folder of extra lm-eval task YAML files")
    parser.add_argument("--num_fewshot", type=int, help="examples in each prompt (default: each task's own)")
    parser.add_argument("--limit", type=float, help="at most this many examples per task (a fraction below 1)")
    parser.add_argument("--apply_chat_template", action="store_true",
                        help="render each prompt through the tokenizer's chat template")
    parser.add_argument("--output_path", metavar="PATH", help="where lm-eval's results JSON is written")
    parser.add_argument("--log_samples", action="store_true", help="also write every example's inputs and outputs")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward and per rank (default 8)")
    parser.add_argument("--bootstrap_iters", type=int, default=0,
                        help="bootstrap resamples for standard errors (lm-eval's default is 100000; 0 skips them)")
    parser.add_argument("-n", "--devices", type=int, default=1, metavar="N",
                        help="local processes to shard over (ignored under torchrun/SLURM, which start the ranks)")
    parser.add_argument("--rollout-mode", default="auto", choices=("auto", "gather_once", "stream"),
                        help="gather every shard once per request type, or unit by unit (default: auto, by memory)")
    parser.add_argument("--precision", default="32-true", help="Fabric precision, e.g. bf16-true (default 32-true)")
    return parser


def check_inputs(args: argparse.Namespace) -> tuple[list[str], Any]:
    """The task list and the tokenizer, or a ValueError naming what is wrong: before any model is loaded."""
    from lightning_fsdp.evaluation import require_lm_eval

    require_lm_eval()
    from transformers import AutoTokenizer

    from lightning_fsdp.evaluation.harness import check_offline, check_task_folder, check_tasks, task_manager
    from lightning_fsdp.hf.gguf import resolve_model_source

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks names no task; pass e.g. --tasks python_docs,python_docstring_choice.")
    if args.include_path:
        check_task_folder(args.include_path)
    manager = task_manager(args.include_path, tasks)
    check_tasks(tasks, manager)
    check_offline(tasks, manager)
    args.checkpoint = None
    kind = model_source_kind(Path(args.model))
    if kind == "checkpoint":
        from lightning_fsdp.hf.checkpoint_model import CheckpointModel

        args.checkpoint = CheckpointModel(args.model, base=args.base)  # the base verified, the model described
        source = args.checkpoint.side_dir
        if source is None:
            raise ValueError(f"{args.model} names no pretrained directory to take the tokenizer from; pass"
                             " `--base DIR` with the directory it was fine-tuned from.")
    else:
        source = Path(resolve_model_source(args.model))
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if args.apply_chat_template and not tokenizer.chat_template:
        raise ValueError(f"--apply_chat_template: {args.model} has no chat template; evaluate without it.")
    args.source = source
    return tasks, tokenizer


def main(argv: Optional[list[str]] = None) -> int:
    """Exit 0 with the scores printed (and written to ``--output_path``); 1, naming the problem, for bad input."""
    args = arguments(build_parser(), argv)
    try:
        tasks, tokenizer = check_inputs(args)
    except (ImportError, ValueError, OSError, CheckpointError) as err:
        return fail("eval", err)
    return _evaluate(args, tasks, tokenizer)


def _evaluate(args: argparse.Namespace, tasks: list[str], tokenizer: Any) -> int:
    import lightning as L
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp.evaluation.harness import evaluate_tasks
    from lightning_fsdp.fabric import FSDPCustomFabricStrategy

    checkpoint = args.checkpoint
    weights = None if checkpoint is not None else args.source
    fabric = L.Fabric(accelerator="auto", devices=args.devices, precision=args.precision,
                      strategy=FSDPCustomFabricStrategy(pretrained_weights=weights))
    fabric.launch()
    if checkpoint is not None:
        with checkpoint:
            model = fabric.setup_module(checkpoint.skeleton()).module
            checkpoint.fill(model)
    else:
        with fabric.init_module(empty_init=True):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(args.source)))
        model = fabric.setup_module(model).module  # the FSDP root: the model itself, each rank holding its shards
    limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
    results = evaluate_tasks(model, model, tokenizer, tasks, num_fewshot=args.num_fewshot, limit=limit,
                             apply_chat_template=args.apply_chat_template, include_path=args.include_path,
                             batch_size=args.batch_size, rollout_mode=args.rollout_mode,
                             bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples)
    if fabric.global_rank == 0:
        from lm_eval.utils import make_table

        print(make_table(results))
        if args.output_path:
            print(f"wrote {write_results(results, args.output_path, str(args.model))}")
    return 0


def write_results(results: dict[str, Any], output_path: str, model_name: str) -> Path:
    """lm-eval's own results file (and samples, when logged), through its ``EvaluationTracker``."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=output_path)
    tracker.general_config_tracker.model_name_sanitized = Path(model_name).name or "model"
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples:
        for task, rows in samples.items():
            tracker.save_results_samples(task_name=task, samples=rows)
    written = sorted(Path(output_path).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return written[-1] if written else Path(output_path)


if __name__ == "__main__":
    sys.exit(main())
