"""Standard benchmarks scored on the sharded model in memory, through EleutherAI's lm-evaluation-harness.

:class:`~.harness.ShardedLM` is an lm-eval ``LM`` over a model that FSDP2 sharded: lm-eval's own Hugging Face
backend (tokenization, batching by length, scoring) with the model's forward run on the shards, the requests split
over the data-parallel ranks, and ``generate_until`` through the package's generation engine.
:func:`~.harness.evaluate_tasks` scores tasks with it; the package's own tasks (``python_docs``,
``python_docstring_choice``: local rows, no network) live in ``tasks/``. lm-eval is optional
(``pip install 'lightning-fsdp[eval]'``): importing this package does not import it; its names do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShardedLM", "check_tasks", "evaluate_tasks", "require_lm_eval", "task_manager"]

INSTALL = "pip install 'lightning-fsdp[eval]'"


def require_lm_eval() -> None:
    """lm-evaluation-harness is importable, else an ImportError naming the install command."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise ImportError(f"Scoring lm-eval tasks needs EleutherAI's lm-evaluation-harness: {INSTALL}"
                          " (or pip install lm-eval).") from error


def __getattr__(name: str) -> Any:
    if name in ("ShardedLM", "check_tasks", "evaluate_tasks", "task_manager"):
        require_lm_eval()
        from lightning_fsdp.evaluation import harness

        return getattr(harness, name)
    raise AttributeError(name)
