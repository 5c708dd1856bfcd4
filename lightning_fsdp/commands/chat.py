"""``lightning-fsdp chat MODEL``: talk to a model, to see what a fine-tune learned without writing serving code.

MODEL is a Hugging Face model directory (what ``consolidate --format hf`` writes, or a download), a ``.gguf``
file (converted once into a cached directory, see :mod:`lightning_fsdp.hf.gguf`) or a sharded checkpoint directory
written by training: its model is rebuilt in memory as ``consolidate --format hf`` would write it (LoRA adapters
merged into the frozen base the checkpoint recorded, or ``--base``), so no export is needed to try it. The prompt
goes through the tokenizer's chat template and the answer is streamed as the package's generation engine makes it
(:mod:`lightning_fsdp.generation`, the one that answers held-out questions and rolls out GRPO): greedy by default
(``--temperature 0``, reproducible and scriptable), sampled above 0. ``--prompt`` answers once and exits; without
it a prompt reads lines from stdin and keeps the conversation (``/reset`` forgets it, ``/exit`` or Ctrl-D quits).
One process, no process group, the CPU unless ``--device`` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union, cast

from lightning_fsdp.commands import arguments, command_parser, fail, model_source_kind

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.generation.streamers import BaseStreamer

Message = dict[str, str]
USER_PROMPT = "you> "
ASSISTANT_PREFIX = "assistant> "
RESET, EXIT = "/reset", "/exit"


class ChatError(ValueError):
    """A model source ``chat`` cannot talk to; the message names the problem and the fix."""


def load_tokenizer(directory: Path, chat_template: Optional[Union[str, Path]] = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``directory``, with ``chat_template`` (a Jinja file) instead of its own if given; refused
    without any chat template, since the prompt could not be formatted the way the model was tuned."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise ChatError(f"{directory} holds no tokenizer transformers can read ({err}).") from None
    if chat_template is not None:
        template = Path(chat_template)
        if not template.is_file():
            raise ChatError(f"--chat-template {template}: no such file.")
        tokenizer.chat_template = template.read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"The tokenizer in {directory} has no chat template, so a conversation cannot be formatted"
                        " for the model. Pass one with `--chat-template FILE` (a Jinja template, e.g. the one the"
                        " model was fine-tuned with).")
    return tokenizer


def load_chat_model(
    source: Union[str, Path],
    base: Optional[Union[str, Path]] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    chat_template: Optional[Union[str, Path]] = None,
    device: str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (eval mode, ``dtype``, fp32 by default) and tokenizer behind ``source``: a HF directory, a
    ``.gguf`` file or a sharded checkpoint (its HF model rebuilt in memory; ``base``: its pretrained directory
    if it moved, which also holds the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_fsdp.precision import parse_dtype

    path = Path(source)
    target = parse_dtype(dtype if dtype is not None else torch.float32, "--dtype")
    kind = model_source_kind(path)
    if kind == "checkpoint":
        from lightning_fsdp.hf.checkpoint_model import load_hf_model

        model, side_dir = load_hf_model(path, base=base, dtype=target)
        tokenizer_dir = Path(base) if base is not None else side_dir
        if tokenizer_dir is None:
            raise ChatError(f"{path} names no pretrained directory to take the tokenizer from; pass `--base DIR`"
                            " with the directory it was fine-tuned from.")
        tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    else:
        if kind == "gguf":
            from lightning_fsdp.hf.gguf import resolve_model_source

            path = Path(resolve_model_source(path))
        tokenizer = load_tokenizer(path, chat_template)  # before the weights: a missing template fails fast
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=target)
    cast(torch.nn.Module, model).to(device)
    return model.eval(), tokenizer


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Where an answer ends: the tokenizer's EOS and the model's generation config's (chat models often end a turn
    with a token the base model's config does not name, and the other way round)."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


def reply(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: Optional[int] = None,
    streamer: Optional[BaseStreamer] = None,
) -> str:
    """The assistant's next message after ``messages`` (chat-templated with a generation prompt), from the
    package's generation engine: greedy at ``temperature`` 0, sampled (from ``seed`` if given) above; new tokens
    go to ``streamer`` as they come. Tokens the model's generation config suppresses are never chosen."""
    import random

    import torch

    from lightning_fsdp.generation import Sampling, generate

    if temperature < 0:
        raise ChatError(f"--temperature must be 0 (greedy) or more, got {temperature}.")
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt_ids = list(encoded["input_ids"])
    stops = stop_token_ids(model, tokenizer)
    suppressed = getattr(model.generation_config, "suppress_tokens", None) or ()
    if seed is None and temperature > 0:
        seed = random.SystemRandom().randrange(2**31)
    sampling = Sampling(max_new_tokens, temperature=temperature, stop_ids=tuple(stops), seed=seed or 0,
                        suppress_ids=tuple(suppressed))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    def on_tokens(rows: list[int], tokens: list[int]) -> None:
        assert streamer is not None
        streamer.put(torch.tensor(tokens))

    if streamer is not None:
        streamer.put(torch.tensor([prompt_ids]))  # the prompt first: a streamer that skips it expects it
    with torch.inference_mode():
        done = generate(cast(torch.nn.Module, model), [prompt_ids], sampling, pad_id=int(pad), device=model.device,
                        on_tokens=on_tokens if streamer is not None else None)
    if streamer is not None:
        streamer.end()
    return str(tokenizer.decode(done.ids[0], skip_special_tokens=True))


def _streamer(tokenizer: PreTrainedTokenizerBase) -> BaseStreamer:
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def repl(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> int:
    """Read a line, answer it with the whole conversation so far as context; ``/reset``, ``/exit``, Ctrl-D."""
    start: list[Message] = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(start)
    print(f"Chatting with {args.model}. {RESET} forgets the conversation, {EXIT} or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input(USER_PROMPT)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # an abandoned line, as in a shell
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text == EXIT:
            return 0
        if text == RESET:
            messages = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        print(ASSISTANT_PREFIX, end="", flush=True)
        try:
            answer = reply(model, tokenizer, messages, args.max_new_tokens, args.temperature, seed=args.seed,
                           streamer=_streamer(tokenizer))
        except KeyboardInterrupt:  # stop this answer, keep the conversation as it was before the question
            messages.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer})


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("chat", __doc__)
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face model directory, a .gguf file or a sharded checkpoint directory")
    parser.add_argument("--prompt", metavar="TEXT", help="answer TEXT once, print the answer and exit")
    parser.add_argument("--system", metavar="TEXT", help="a system message (default: the chat template's own)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="longest answer in tokens (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, the same answer every time (default); above 0: sample")
    parser.add_argument("--seed", type=int, help="random seed for sampling (--temperature above 0)")
    parser.add_argument("--base", metavar="DIR", help="a checkpoint's pretrained base directory, if it moved")
    parser.add_argument("--dtype", help="compute dtype, e.g. bf16 (default: float32)")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda (default: cpu)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template to use instead of the tokenizer's (or when it has none)")
    return parser


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Keep the terminal to the conversation: no loading progress bars or advisory logs from transformers, and no
    log line per GPU-only library torchao cannot load (transformers imports it with its model code when installed).
    Restored afterwards, for callers that run :func:`main` in their own process."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:
            log.setLevel(logging.ERROR)
        import transformers.modeling_utils  # noqa: F401  (imports torchao, if installed)
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def main(argv: Optional[list[str]] = None) -> int:
    """Exit 0 after the answer or the conversation; 1, with the reason on stderr, for a model it cannot load."""
    args = arguments(build_parser(), argv)
    from lightning_fsdp.checkpoint.errors import CheckpointError

    if args.max_new_tokens < 1:
        return fail("chat", ChatError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}."))
    if args.temperature < 0:
        return fail("chat", ChatError(f"--temperature must be 0 (greedy) or more, got {args.temperature}."))
    try:
        with quiet_transformers():
            return _chat(args)
    except (CheckpointError, ValueError, OSError) as err:
        return fail("chat", err)


def _chat(args: argparse.Namespace) -> int:
    """Load the model, then answer ``--prompt`` once or hold a conversation."""
    model, tokenizer = load_chat_model(args.model, args.base, args.dtype, args.chat_template, args.device)
    if args.prompt is None:
        return repl(model, tokenizer, args)
    messages: list[Message] = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": args.prompt})
    reply(model, tokenizer, messages, args.max_new_tokens, args.temperature, seed=args.seed,
          streamer=_streamer(tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
