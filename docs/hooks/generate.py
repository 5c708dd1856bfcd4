"""Pages of the docs site that are generated at build time, so that they cannot drift from the code.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``); nothing here is a plugin package. It adds:

- ``reference/configs.md``: every config group of ``configs/``, each option, each key with its default, read from
  the YAML files themselves (comments included);
- ``reference/cli.md``: every ``lightning-fsdp`` command and flag, from the argparse parsers the commands build
  (``train``: Hydra's own parser, its arguments being overrides);
- ``reference/api/*.md``: one mkdocstrings page per public package, listing what its ``__all__`` exports;
- ``benchmarks/method.md`` and ``benchmarks/results/**``: ``benchmarks/README.md`` and every results file (tables
  and plots) included as they are in the repository;
- ``examples/**``: the runnable examples, their code included.

Hand-written pages pull generated parts in with HTML comments, which render as nothing elsewhere:
``<!-- include: benchmarks/results/qlora.md -->`` includes a repository file (its headings demoted, its relative
links pointed at the site's pages), and ``<!-- generated: layout -->`` inserts the package layout table.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_fsdp"
CONFIGS = ROOT / "configs"
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLES = ROOT / "examples"

#: public packages whose ``__all__`` gets an API page, in the order of the site's navigation
API_PACKAGES = {
    "lightning_fsdp": "The top-level names: strategies, checkpoints, callbacks, mesh and registry",
    "lightning_fsdp.models": "Models: Hugging Face causal LMs for SFT, DPO/SimPO and GRPO, the GPT and CNN examples",
    "lightning_fsdp.data": "Data modules: your SFT files, preference pairs, prompts, the example corpora",
    "lightning_fsdp.loss": "Losses that do not depend on the batch split, and the chunked loss",
    "lightning_fsdp.callbacks": "Callbacks: held-out answers, preferences and rewards, lm-eval tasks, the loss curve, EMA, the memory report",
    "lightning_fsdp.evaluation.harness": "lm-evaluation-harness tasks on the sharded model",
    "lightning_fsdp.trainer": "The Trainer front end's pieces: precision plugin, EMA, memory report, safe checkpoint on exception",
    "lightning_fsdp.rewards": "Reward functions for GRPO, and code run with limits",
    "lightning_fsdp.planner": "The memory planner behind `lightning-fsdp estimate`",
}

#: repository files that have a page of their own on the site (besides those generated below)
PAGE_OF = {
    "README.md": "index.md",
    "configs/README.md": "howto/hydra.md",
    "examples/multinode.md": "tutorials/multinode.md",
    "examples/slurm/README.md": "tutorials/multinode.md",
    "examples/slurm": "examples/slurm/train.md",
    "examples/slurm/": "examples/slurm/train.md",
    "benchmarks/README.md": "benchmarks/method.md",
    "docs/tutorials/grpo.md": "tutorials/grpo.md",
}

EXAMPLE_SUFFIXES = {".py": "python", ".sh": "bash", ".sbatch": "bash"}
DIRECTIVE = re.compile(r"^<!-- (include|generated): (\S+) -->[ \t]*$", re.MULTILINE)
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


# -- hooks -----------------------------------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files: Files, config: Any) -> Files:
    pages = {
        "reference/configs.md": config_reference(),
        "reference/cli.md": cli_reference(),
        "reference/api/index.md": api_index(),
        "benchmarks/method.md": include_file("benchmarks/README.md", "benchmarks/method.md", demote=0),
    }
    for package in API_PACKAGES:
        pages[f"reference/api/{package}.md"] = api_page(package)
    for path in sorted(RESULTS.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix == ".md":
            pages[rel] = results_page(rel)
        elif path.suffix in (".png", ".svg"):
            files.append(File.generated(config, rel, content=path.read_bytes()))
    pages["benchmarks/results/index.md"] = results_index()
    for path in example_files():
        rel = path.relative_to(ROOT).as_posix()
        pages[example_page(rel)] = example_code_page(rel)
    pages["examples/index.md"] = include_file("examples/README.md", "examples/index.md", demote=0) + examples_list()
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def replace(match: re.Match[str]) -> str:
        kind, arg = match.groups()
        if kind == "include":
            return include_file(arg, page.file.src_uri)
        if arg == "layout":
            return layout_table()
        raise ValueError(f"{page.file.src_uri}: unknown generated block {arg!r}")

    return DIRECTIVE.sub(replace, markdown)


# -- including repository files --------------------------------------------------------------------------------------
def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.suffix in EXAMPLE_SUFFIXES and "__pycache__" not in p.parts)


def example_page(rel: str) -> str:
    """``examples/slurm/train.sbatch`` → ``examples/slurm/train.md``."""
    return posixpath.splitext(rel)[0] + ".md"


def page_of(repo_path: str) -> Optional[str]:
    """The site page that stands for a repository file, if there is one."""
    repo_path = repo_path.rstrip("/") if repo_path not in PAGE_OF else repo_path
    if repo_path in PAGE_OF:
        return PAGE_OF[repo_path]
    if repo_path.startswith("benchmarks/results/") and (ROOT / repo_path).is_file():
        return repo_path
    if repo_path.startswith("examples/") and Path(repo_path).suffix in EXAMPLE_SUFFIXES:
        return example_page(repo_path)
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    return None


def relink(text: str, source: str, page: str) -> str:
    """Point the relative links of repository file ``source`` at the site's pages, as seen from ``page``.

    A link to a file the site has no page for keeps its text and names the file in the repository instead.
    """

    def fix(match: re.Match[str]) -> str:
        label, target = match.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if path.endswith("/"):
            repo_path += "/"
        site = page_of(repo_path)
        if site is None:
            return f"{label[1:-1] if not label.startswith('!') else label[2:-1]} (`{repo_path}` in the repository)"
        rel = posixpath.relpath(site, posixpath.dirname(page) or ".")
        return f"{label}({rel}{'#' + anchor if anchor else ''})"

    return LINK.sub(fix, text)


def demote_headings(text: str, levels: int) -> str:
    if levels <= 0:
        return text
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"^#{1,5} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out) + "\n"


def include_file(rel: str, page: str, demote: int = 2) -> str:
    """A repository file's Markdown, as it is in the repository, for inclusion in ``page``."""
    path = ROOT / rel
    if not path.is_file():
        raise FileNotFoundError(f"{page}: included file {rel} does not exist")
    return demote_headings(relink(path.read_text(encoding="utf-8"), rel, page), demote)


def results_page(rel: str) -> str:
    body = include_file(rel, rel, demote=1)
    return f"# `{rel}`\n\nWritten by the benchmark scripts; included here as it is in the repository.\n\n{body}"


def results_index() -> str:
    lines = [
        "# Benchmark results",
        "",
        "Every results file in `benchmarks/results/`, as the benchmark scripts wrote it. How each was measured:",
        "[method](../method.md); what they show: [overview](../../benchmarks.md).",
        "",
        "| file | first line |",
        "|---|---|",
    ]
    for path in sorted(RESULTS.rglob("*.md")):
        rel = path.relative_to(ROOT).as_posix()
        first = next((ln.strip("# -") for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()), "")
        first = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", first).replace("|", "\\|")
        lines.append(f"| [`{path.relative_to(RESULTS).as_posix()}`]({posixpath.relpath(rel, 'benchmarks/results')}) | {first} |")
    return "\n".join(lines) + "\n"


def examples_list() -> str:
    lines = ["", "## Every example file", "", "| file | page |", "|---|---|"]
    for path in example_files():
        rel = path.relative_to(ROOT).as_posix()
        lines.append(f"| `{rel}` | [{posixpath.basename(example_page(rel))[:-3]}]"
                     f"({posixpath.relpath(example_page(rel), 'examples')}) |")
    return "\n".join(lines) + "\n"


def example_code_page(rel: str) -> str:
    path = ROOT / rel
    text = path.read_text(encoding="utf-8")
    doc = ""
    if path.suffix == ".py":
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
    lines = [f"# `{rel}`", ""]
    if doc:
        lines += [doc.split("\n\n")[0].replace("``", "`"), ""]
    lines += [f"```{EXAMPLE_SUFFIXES[path.suffix]}", text.rstrip("\n"), "```", ""]
    return "\n".join(lines)


# -- the config reference ----------------------------------------------------------------------------------------------
def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def prose_cell(text: str) -> str:
    """A table cell of plain text: ``<run>`` stays text, not an HTML tag."""
    return cell(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def key_comments(text: str) -> dict[str, str]:
    """Dotted key → the comment on its line or in the lines just above it."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            if not stripped.startswith("# @package"):
                pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^(\s*)([^\s:#-][^:#]*?):(\s.*|)$", line)
        if not match:
            pending = []
            continue
        indent, key, rest = len(match.group(1)), match.group(2).strip(), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        inline = re.split(r"\s#\s?", rest, maxsplit=1)
        note = inline[1].strip() if len(inline) == 2 and not rest.strip().startswith(("'", '"')) else ""
        dotted = ".".join(k for _, k in stack)
        comments[dotted] = " ".join([*pending, note]).strip()
        pending = []
    return comments


def header_comment(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# @package"):
            continue
        lines.append(line[1:].strip())
    return lines


def default_entry(entry: Any) -> str:
    if isinstance(entry, dict):
        return ", ".join(f"{key}: {yaml_value(value)}" for key, value in entry.items())
    return yaml_value(entry)


def flatten(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def group_defaults() -> dict[str, Optional[str]]:
    """Each group's option in ``train.yaml``'s defaults list."""
    data = yaml.safe_load((CONFIGS / "train.yaml").read_text(encoding="utf-8"))
    out: dict[str, Optional[str]] = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            out.update(entry)
    return out


def option_section(path: Path, package: str, heading: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    global_package = "# @package _global_" in text
    prefix = "" if global_package or not package else package
    comments = key_comments(text)
    lines = [heading, ""]
    header = header_comment(text)
    if header:
        lines += ["```text", *header, "```", ""]
    rel = path.relative_to(ROOT).as_posix()
    facts = [f"file `{rel}`"]
    if global_package:
        facts.append("keys at the top level (`# @package _global_`)")
    defaults = data.pop("defaults", None) if isinstance(data, dict) else None
    if defaults:
        facts.append("defaults list: " + ", ".join(f"`{default_entry(d)}`" for d in defaults))
    target = data.get("_target_") if isinstance(data, dict) else None
    if target:
        facts.append(f"builds `{target}`")
    lines += ["; ".join(facts) + ".", ""]
    rows = [(key, value) for key, value in flatten(data, "") if key != "_target_"]
    if rows:
        lines += ["| key | default | note |", "|---|---|---|"]
        for key, value in rows:
            dotted = ".".join(part for part in (prefix, key) if part)
            note = comments.get(key, "")
            lines.append(f"| `{cell(dotted)}` | `{cell(yaml_value(value))}` | {prose_cell(note)} |")
        lines.append("")
    return lines


def config_reference() -> str:
    defaults = group_defaults()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the YAML files in `configs/` each time the site is built: every config group, every option,",
        "every key with its default. `lightning-fsdp train` composes them with Hydra; any key can be overridden on the",
        "command line (`strategy.cpu_offload=true`), an option chosen per group (`strategy=fsdp_custom_offload`). How",
        "the groups fit together: [Experiments with Hydra](../howto/hydra.md). `${...}` values are interpolations,",
        "resolved when the job starts; `???` must be given.",
        "",
        "| group | options | default option |",
        "|---|---|---|",
    ]
    groups = sorted(p for p in CONFIGS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    for group in groups:
        options = sorted(p.stem for p in group.glob("*.yaml"))
        default = defaults.get(group.name)
        lines.append(f"| [`{group.name}/`](#{group.name}) | {', '.join(f'`{o}`' for o in options)} | "
                     f"{f'`{default}`' if default else '—'} |")
    lines += ["", "## `train.yaml`: the top level", ""]
    lines += option_section(CONFIGS / "train.yaml", "", "### Keys")[2:]
    for group in groups:
        default = defaults.get(group.name)
        lines += [f"## `{group.name}/` {{ #{group.name} }}", ""]
        if default:
            lines += [f"Default option: `{default}`. Choose another with `{group.name}=OPTION`.", ""]
        else:
            lines += [f"No default option: add one with `{group.name}=OPTION`.", ""]
        for path in sorted(group.glob("*.yaml")):
            lines += option_section(path, group.name, f"### `{group.name}={path.stem}` {{ #{group.name}-{path.stem} }}")
    return "\n".join(lines) + "\n"


# -- the command-line reference ----------------------------------------------------------------------------------------
class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _capture_parse() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]


def command_parser(name: str, module_name: str) -> Optional[argparse.ArgumentParser]:
    """The parser a ``lightning-fsdp`` subcommand builds: its ``build_parser``, or the one its ``main`` parses with."""
    if name == "train":
        from hydra._internal.utils import get_args_parser

        parser = get_args_parser()
        parser.prog = "lightning-fsdp train"
        return parser
    module = importlib.import_module(module_name)
    for attr in ("build_parser", "_build_parser"):
        builder = getattr(module, attr, None)
        if callable(builder):
            return builder()
    with _capture_parse(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            module.main([])
        except _Captured as captured:
            return captured.parser
    return None


def argument_name(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    return action.metavar if isinstance(action.metavar, str) else action.dest


def argument_value(action: argparse.Action) -> str:
    if not action.option_strings and not action.choices:
        return {"?": "optional", "*": "any number", "+": "one or more"}.get(str(action.nargs), "")
    if action.nargs == 0:
        return "flag"
    if action.choices:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    kind = getattr(action.type, "__name__", "") if action.type else ""
    more = {"?": " (optional)", "*": " …", "+": " …"}.get(str(action.nargs), "")
    return f"`{metavar}`" + (f" ({kind})" if kind and kind != "str" else "") + more


def argument_default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def parser_section(parser: argparse.ArgumentParser, docstring: str = "") -> list[str]:
    formatter = parser._get_formatter()
    lines = ["```text", parser.format_usage().strip(), "```", ""]
    description = parser.description if parser.description != "Hydra" else None
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    if description and paragraph.startswith(" ".join(description.split())):
        description = paragraph  # the parser shows the docstring's first line: here, its whole first paragraph
    if description:
        lines += [description.replace("``", "`"), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        if not actions:
            continue
        title = group.title or "arguments"
        lines += [f"**{title[0].upper() + title[1:]}**", "", "| argument | value | default | meaning |",
                  "|---|---|---|---|"]
        for action in actions:
            help_text = ""
            if action.help:
                argv0, sys.argv[0] = sys.argv[0], parser.prog  # help that names the program reads sys.argv[0]
                try:
                    help_text = formatter._expand_help(action)
                except (TypeError, ValueError, KeyError):  # a help object of its own (Hydra's lazy completion help)
                    help_text = str(action.help)
                finally:
                    sys.argv[0] = argv0
                help_text = " ".join(help_text.split())
            lines.append(f"| `{cell(argument_name(action))}` | {argument_value(action)} | "
                         f"{cell(argument_default(action))} | {prose_cell(help_text)} |")
        lines.append("")
    return lines


def cli_reference() -> str:
    from lightning_fsdp.cli import COMMANDS, usage

    lines = [
        "# Command-line reference",
        "",
        "Generated from the argument parsers of the `lightning-fsdp` commands each time the site is built.",
        "`python -m lightning_fsdp COMMAND ...` is the same command.",
        "",
        "```text",
        usage(),
        "```",
        "",
    ]
    for name, (module_name, description) in COMMANDS.items():
        lines += [f"## `lightning-fsdp {name}`", "", description[0].upper() + description[1:] + ".", ""]
        if name == "train":
            lines += [
                "The arguments are Hydra overrides (`group=option`, `key=value`, `+key=value`, `~key`): every group,",
                "option and key is in the [configuration reference](configs.md), and how they combine in",
                "[Experiments with Hydra](../howto/hydra.md). The flags are Hydra's own:",
                "",
            ]
        parser = command_parser(name, module_name)
        if parser is None:
            lines += ["(This command parses no flags.)", ""]
            continue
        module = sys.modules.get(module_name)
        lines += parser_section(parser, (module.__doc__ or "") if module is not None and name != "train" else "")
    return "\n".join(lines) + "\n"


# -- the API reference -------------------------------------------------------------------------------------------------
def public_names(package: str) -> list[str]:
    """A package's (or module's) ``__all__``, read without importing it."""
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    if not init.is_file():
        init = (ROOT / Path(*package.split("."))).with_suffix(".py")
    tree = ast.parse(init.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return [n for n in ast.literal_eval(node.value) if not n.startswith("__")]
    return []


def api_page(package: str) -> str:
    names = public_names(package)
    lines = [f"# `{package}`", "", API_PACKAGES[package] + ".", "",
             f"Generated from `{package}.__all__`; import the names from `{package}`.", ""]
    for name in sorted(names, key=lambda n: (not n[0].isupper() or n.isupper(), n.lower())):
        lines += [f"::: {package}.{name}", ""]
    return "\n".join(lines)


def api_index() -> str:
    lines = ["# API reference", "", "Generated from each public package's `__all__`, with the docstrings of the code.",
             "Import names from these packages, not from the modules that define them: modules move, these names",
             "stay.", "", "| package | what it holds | names |", "|---|---|---:|"]
    for package, what in API_PACKAGES.items():
        lines.append(f"| [`{package}`]({package}.md) | {what} | {len(public_names(package))} |")
    return "\n".join(lines) + "\n"


# -- the layout table --------------------------------------------------------------------------------------------------
def _layers() -> list[tuple[str, list[str]]]:
    """The layers as ``tests/unit/test_layout.py`` enforces them (its ``LAYERS``, read without importing it)."""
    tree = ast.parse((ROOT / "tests" / "unit" / "test_layout.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "LAYERS" and node.value is not None:
            return [(name, sorted(members)) for name, members in ast.literal_eval(node.value)]
    raise ValueError("tests/unit/test_layout.py defines no LAYERS")


def _summary(path: Path) -> str:
    init = path / "__init__.py" if path.is_dir() else path
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) if init.is_file() else None
    first = (doc or "").split("\n\n")[0].replace("\n", " ")
    return re.sub(r":\w+:`\.?([^`]+)`", r"`\1`", first).replace("``", "`")


def layout_table() -> str:
    rows = ["| layer | path | what it is for (from its docstring) |", "|---|---|---|"]
    seen: set[str] = set()
    for layer, members in reversed(_layers()):
        first = True
        for name in members:
            path = PACKAGE / name if (PACKAGE / name).is_dir() else PACKAGE / f"{name}.py"
            if not path.exists():
                continue
            seen.add(name)
            shown = f"`{name}/`" if path.is_dir() else f"`{name}.py`"
            rows.append(f"| {layer if first else ''} | {shown} | {cell(_summary(path))} |")
            first = False
    rest = sorted(
        p for p in PACKAGE.iterdir()
        if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py") and p.name.removesuffix(".py") not in seen
    )
    for index, path in enumerate(rest):
        shown = f"`{path.name}/`" if path.is_dir() else f"`{path.name}`"
        rows.append(f"| {'(not in a layer yet)' if index == 0 else ''} | {shown} | {cell(_summary(path))} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # print a generated page: python docs/hooks/generate.py reference/cli.md
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    wanted = sys.argv[1] if len(sys.argv) > 1 else "reference/configs.md"
    print({"reference/configs.md": config_reference, "reference/cli.md": cli_reference, "layout": layout_table}[wanted]())
