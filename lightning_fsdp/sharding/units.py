"""The walk that picks FSDP units: one post-order pass over the module tree for every policy form."""

from __future__ import annotations

import logging
import warnings

from torch import nn

from lightning_fsdp.sharding.policy import AUTO, WrapPolicy, resolve_policy

log = logging.getLogger(__name__)


def select_units(model: nn.Module, policy: WrapPolicy, *, arg_name: str = "auto_wrap_policy") -> list[str]:
    """Names of the submodules that become FSDP units, deepest first (the root is not included).

    A module whose parameters are shared with a module outside it (tied weights) is skipped: its parameters
    must live in one unit with every user, which the enclosing unit (ultimately the root) provides.
    Containers without a ``forward`` (``ModuleList``) cannot be units. Modules already sharded by the user
    (``fully_shard`` in ``configure_model``) are kept as they are, and nothing inside them is visited.
    """
    from torch.distributed.fsdp import FSDPModule

    unit_policy = resolve_policy(policy, model, arg_name=arg_name)
    if unit_policy is None:
        if policy == AUTO:
            warnings.warn(
                f"{arg_name}='auto' found no repeated blocks in {type(model).__name__}; the whole model is one FSDP"
                " unit, so every rank gathers all parameters during forward. Name the block classes to shard finer.",
                stacklevel=2,
            )
        return []
    owners = _shared_parameter_owners(model)
    already = {n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)}
    chosen: list[str] = []
    skipped_tied: list[str] = []

    def visit(name: str, module: nn.Module) -> int:
        """Post-order: returns how many of ``module``'s parameters are not inside a chosen unit."""
        if name in already:
            return 0
        unwrapped = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            unwrapped += visit(f"{name}.{child_name}" if name else child_name, child)
        if not name or not _runs_forward(module) or not _has_parameters(module):
            return unwrapped
        if not unit_policy.matches(module, unwrapped):
            return unwrapped
        if _shares_params_outside(module, name, owners):
            skipped_tied.append(name)
            return unwrapped
        chosen.append(name)
        return 0

    visit("", model)
    if skipped_tied:
        log.info("Not wrapping %s separately: parameters tied to modules outside them.", skipped_tied)
    if not chosen and not already and not unit_policy.auto:
        classes = sorted({type(m).__name__ for n, m in model.named_modules() if n})
        raise ValueError(
            f"`{arg_name}={policy!r}` matched no module in {type(model).__name__}"
            + (f" (tied-weight modules skipped: {skipped_tied})" if skipped_tied else "")
            + f". Module classes present: {classes[:20]}."
            " Name one of those classes, use 'auto', or pass None to shard the model as a single unit."
        )
    # deepest first (stable), so nested units are sharded before the modules that contain them
    return sorted(chosen, key=lambda n: n.count("."), reverse=True)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every name of a tied parameter → the first name it has (``lm_head.weight`` → ``model.embed_tokens.weight``).

    State dicts hold a separate detached tensor per name, so ties are read from the module tree itself, which
    keeps one ``Parameter`` (after ``fully_shard`` too: FSDP2 shares one ``DTensor`` between the modules)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _runs_forward(module: nn.Module) -> bool:
    """FSDP2 hooks a unit's ``forward``; containers without one (``ModuleList``, ``ModuleDict``) cannot be units."""
    return type(module).forward is not nn.Module.forward


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shared_parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """Parameter id → names of every module that holds it directly (several for tied weights)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _is_inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _shares_params_outside(module: nn.Module, name: str, owners: dict[int, set[str]]) -> bool:
    return any(not _is_inside(owner, name) for p in module.parameters() for owner in owners.get(id(p), ()))
