"""The package's layout keeps its promises: small modules, imports that only point down, torch internals fenced.

The layers (the docs' layout table): a module may import from its own layer's package and from any lower layer,
never from a higher one. Private torch names are used in ``_torch_compat/`` only, Lightning's in
``_lightning_compat.py`` only. ``lightning.pytorch`` is spoken by the Trainer front end (``trainer/``) and the apps
built on the Trainer, never below them; Fabric's strategy machinery by ``fabric/`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fsdp"
MAX_LINES = 400
#: a module this close to the limit is split by concern before a feature forces a hurried cut
HEADROOM = 20

#: lowest first; each entry is the top-level modules/packages of one layer
LAYERS: list[tuple[str, set[str]]] = [
    ("console", {"console"}),  # what the command line shows: standard library only, set before anything imports
    ("foundation", {"_torch_compat", "_version", "_warm_start", "cache", "formatting", "fixes"}),
    ("lightning internals", {"_lightning_compat"}),  # over torch's: the root-gather redirection
    ("parallel", {"parallel"}),
    ("precision", {"precision"}),
    ("loss", {"loss"}),  # the token-weighted loss: any module, either front end
    ("sharding", {"sharding"}),
    ("memory", {"memory"}),
    ("host heap", {"host_heap"}),  # the heap policy both front ends apply (release_host_memory)
    ("generation", {"generation"}),  # decoding on sharded models: held-out answers, chat, rollouts, lm-eval
    ("evaluation", {"evaluation"}),  # lm-eval's tasks scored on the sharded model
    ("checkpoint", {"checkpoint"}),
    ("resilience", {"resilience"}),
    ("integrations", {"hf"}),
    ("averaging", {"averaging"}),
    ("preparation", {"preparation"}),
    ("runtime", {"runtime"}),  # what both front ends hold: process group, prepared model, checkpoints, failures
    ("planner", {"planner"}),
    ("registry", {"registry"}),
    ("front ends", {"trainer", "fabric"}),  # the Trainer's and Fabric's: side by side, neither imports the other
    ("app", {"cli", "train", "train_config", "models", "data", "commands", "rewards", "callbacks", "__init__",
             "__main__"}),
]
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}

#: attributes of Lightning's strategy contract that subclasses set or override, as Lightning's own strategies do
STRATEGY_CONTRACT = {"_launcher", "_configure_launcher", "_precision_plugin", "_forward_redirection"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _top(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"


def _imports(tree: ast.AST, path: Path) -> list[tuple[str, int]]:
    """Top-level ``lightning_fsdp`` components imported by a module, with line numbers."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "lightning_fsdp":
                    found.append((parts[1] if len(parts) > 1 else "__init__", node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "lightning_fsdp":
                continue
            if len(parts) > 1:
                found.append((parts[1], node.lineno))
            else:
                found += [(a.name if a.name in LAYER_OF else "__init__", node.lineno) for a in node.names]
    return found


def test_every_module_is_in_a_layer():
    tops = {_top(p) for p in _modules()}
    assert tops - set(LAYER_OF) == set(), "add new top-level modules to LAYERS (and to the docs' layout table)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES - HEADROOM, (
        f"{path.name} has {lines} lines; split it by responsibility (limit {MAX_LINES}, kept {HEADROOM} lines clear)"
    )


def test_imports_only_point_down():
    wrong = []
    for path in _modules():
        own = _top(path)
        tree = ast.parse(path.read_text(), str(path))
        for imported, line in _imports(tree, path):
            if imported == own:
                continue
            if LAYER_OF[imported] >= LAYER_OF[own] and not (LAYERS[LAYER_OF[own]][0] == "app" == LAYERS[LAYER_OF[imported]][0]):
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({LAYERS[LAYER_OF[own]][0]}) imports {imported}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_within_a_package():
    """The layer rule above skips imports inside one package; cycles there are refused too (lazy and
    ``TYPE_CHECKING`` imports included: a cycle is a cycle of meaning, whenever it is resolved)."""
    modules = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            target = next((c for c in candidates if c in modules), None)
            package = name.rsplit(".", 1)[0]
            if target and target != name and target.rsplit(".", 1)[0] == package and target != package:
                targets.add(target)
        graph[name] = targets

    def cycle_from(start: str) -> list[str]:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return []

    cycles = {tuple(sorted(set(c))): c for m in graph if (c := cycle_from(m))}
    assert not cycles, "import cycles inside a package:\n" + "\n".join(" -> ".join(c) for c in cycles.values())


def _external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


#: where each half of Lightning may be imported (``_lightning_compat.py`` holds the private names of both)
TRAINER_FRONT_END = {"trainer"}
TRAINER_USERS = TRAINER_FRONT_END | {"registry", "cli", "train", "train_config", "models", "data", "commands", "callbacks",
                                     "__init__"}
FABRIC_FRONT_END = {"fabric"}
FABRIC_USERS = FABRIC_FRONT_END | {"registry", "commands"}  # `eval` shards its model through Fabric


def _speaks(name: str) -> str:
    """Which front end's half of Lightning an imported module belongs to ("" for the shared parts: Fabric's
    plugins, utilities and environments are the base both front ends build on)."""
    if name.split(".")[:2] in (["lightning", "pytorch"], ["pytorch_lightning"]) or name == "lightning.pytorch":
        return "trainer"
    if name.startswith(("lightning.fabric.strategies", "lightning.fabric.fabric", "lightning.fabric.connector")):
        return "fabric"
    return ""


def test_each_half_of_lightning_is_spoken_by_its_own_front_end_only():
    """Below the front ends the package is Trainer- and Fabric-free; neither front end imports the other's half."""
    allowed = {"trainer": TRAINER_USERS, "fabric": FABRIC_USERS}
    assert {_top(p) for p in _modules()} >= TRAINER_FRONT_END | FABRIC_FRONT_END, "a front end moved; update this test"
    wrong = []
    for path in _modules():
        if path.name == "_lightning_compat.py":
            continue
        for name in _external_imports(path):
            half = _speaks(name)
            if half and _top(path) not in allowed[half]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name} ({half} front end only)")
    assert not wrong, "\n".join(wrong)


def _compat_names_used(path: Path) -> set[str]:
    """Names a module takes from ``_lightning_compat``: imported from it, or read off the module object."""
    tree = ast.parse(path.read_text(), str(path))
    names, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_fsdp._lightning_compat":
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "lightning_fsdp":
            aliases.update(a.asname or a.name for a in node.names if a.name == "_lightning_compat")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names


def test_compat_names_of_each_half_are_used_by_its_front_end_only():
    """``_lightning_compat`` re-exports private names of both halves: each is used only where its half may be."""
    import lightning_fsdp._lightning_compat as compat

    def half_of(name: str) -> str:
        value = getattr(compat, name)
        module = getattr(value, "__module__", "") or ""
        if module == compat.__name__:  # defined there: by what it wraps
            source = ast.get_source_segment(Path(compat.__file__).read_text(), _definition(compat, name)) or ""
            return "trainer" if "pl." in source or "LightningOptimizer" in source or "ForwardRedirection" in source else ""
        return _speaks(module)

    allowed = {"trainer": TRAINER_USERS, "fabric": FABRIC_USERS}
    wrong = [f"{path.relative_to(PACKAGE)} uses _lightning_compat.{name} ({half_of(name)} front end only)"
             for path in _modules() if path.name != "_lightning_compat.py"
             for name in sorted(_compat_names_used(path)) if half_of(name) and _top(path) not in allowed[half_of(name)]]
    assert not wrong, "\n".join(wrong)


def _definition(module: object, name: str) -> ast.AST:
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    return next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Private names of torch/Lightning reached directly: imports of ``_x``, ``torch.x._y`` chains, and private
    attributes read from objects that are not ``self``/``cls``."""
    external_roots = {"torch", "lightning", "lightning_utilities", "pytorch_lightning"}
    bound: set[str] = set()  # local names bound to torch/Lightning modules or objects
    other_modules: set[str] = set()  # e.g. `os` (os._exit is public)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in external_roots:
                    other_modules.add((alias.asname or parts[0]).split(".")[0])
                if parts[0] in external_roots:
                    bound.add((alias.asname or parts[0]).split(".")[0])
                    if any(p.startswith("_") and not p.startswith("__") for p in parts):
                        found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in external_roots:
                continue
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(p.startswith("_") for p in parts) or (alias.name.startswith("_") and alias.name != "__version__"):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if node.attr.endswith("_") and not node.attr.endswith("__"):
            continue  # Hydra's config keys (`_target_`), not private names
        base = node.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls") and node.attr in STRATEGY_CONTRACT:
            continue
        if isinstance(base, ast.Name) and base.id in ("self", "cls") and isinstance(node.value, ast.Name):
            continue  # this class's own private attributes
        if isinstance(base, ast.Name) and base.id in other_modules:
            continue
        if isinstance(base, ast.Name) and (base.id in bound or base.id in external_roots):
            found.append((node.lineno, f"{base.id}...{node.attr}"))
        elif not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
            found.append((node.lineno, f"<object>.{node.attr}"))
    return found


def test_private_torch_and_lightning_names_only_in_the_compat_module():
    wrong = []
    for path in _modules():
        if "_torch_compat" in path.relative_to(PACKAGE).parts or path.name == "_lightning_compat.py":
            continue
        for line, name in _private_uses(ast.parse(path.read_text(), str(path))):
            wrong.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    assert not wrong, "move these into lightning_fsdp/_torch_compat/ or _lightning_compat.py:\n" + "\n".join(wrong)


def test_torch_compat_knows_no_lightning():
    """torch's internals and Lightning's are fenced separately: a Lightning upgrade never touches ``_torch_compat``."""
    names = [n for path in (PACKAGE / "_torch_compat").glob("*.py") for n in _external_imports(path)]
    assert not [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")], names


def test_every_fast_path_is_active_on_the_pinned_torch():
    from lightning_fsdp._torch_compat import fast_paths

    assert fast_paths() == {name: True for name in fast_paths()}


def test_lost_fast_path_warns_once_naming_what_is_lost(monkeypatch):
    import warnings

    from lightning_fsdp import _torch_compat as compat

    monkeypatch.setattr(compat.base, "WARNED", set())
    with pytest.warns(compat.FastPathLost, match=r"'root_gather' is unavailable.*all-gathered a second time"):
        assert compat.keep_root_gathered(object()) is False  # not an FSDP module: the layout is not recognised
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.keep_root_gathered(object()) is False  # said once only


def test_front_ends_delegate_the_shared_work_to_one_runtime():
    """Process-group start-up, model preparation, checkpoint annotation and base resolution, and the objects that
    hold failures and checkpoints are written once, in ``runtime.py``; the front ends only call it."""
    shared = ("prepare_model(", "init_dist_connection(", "build_device_mesh(", "annotate_checkpoint(", "resolve_base(",
              "Checkpointer(", "Resilience(", "ShardingPlan(")
    front_ends = [*(PACKAGE / "trainer").glob("*.py"), *(PACKAGE / "fabric").glob("*.py")]
    wrong = [f"{p.relative_to(PACKAGE)} calls {name}" for p in front_ends for name in shared if name in p.read_text()]
    assert not wrong, "move this into lightning_fsdp/runtime.py:\n" + "\n".join(wrong)


def test_test_files_have_unique_names():
    """pytest imports test files by basename (no packages under tests/): two files of one name in different folders
    collect apart on separate workers but fail together in one process, as CI may run them."""
    tests_root = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(tests_root.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(tests_root)} and {path.relative_to(tests_root)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"rename one of each pair: {clashes}"


def test_lost_foreach_kernels_and_comm_hooks_fall_back_and_say_what_is_lost(monkeypatch):
    from lightning_fsdp import _torch_compat as compat
    from lightning_fsdp.sharding import reuse_host_comm_buffers

    monkeypatch.setattr(compat.base, "WARNED", set())
    monkeypatch.delattr(torch, "_foreach_lerp_")
    targets, sources = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 4.0), torch.full((2,), 3.0)]
    with pytest.warns(compat.FastPathLost, match=r"'foreach_lerp' is unavailable.*one kernel per tensor"):
        compat.foreach_lerp_(targets, sources, 0.25)
    assert targets[0].tolist() == [1.0] * 3 and targets[1].tolist() == [1.5] * 2
    monkeypatch.setattr(compat.base, "fast_paths", lambda: {"comm_buffer_reuse": False})
    with pytest.warns(compat.FastPathLost, match=r"'comm_buffer_reuse' is unavailable.*allocated afresh"):
        assert reuse_host_comm_buffers([]) is None
