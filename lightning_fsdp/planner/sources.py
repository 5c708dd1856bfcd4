"""Where a planned model's shapes come from: a Hydra config (built on the meta device), a checkpoint, or a module."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from lightning_fsdp.planner.geometry import GPTDims, ModelSpec, Param, Unit, gpt_model_spec

_GPT_KEYS = {
    "n_layer": ("n_layer", "n_layers", "num_layers", "layers", "depth"),
    "d_model": ("d_model", "n_embd", "hidden_size", "width", "dim", "embed_dim"),
    "n_head": ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads"),
    "vocab_size": ("vocab_size", "vocab", "n_vocab"),
    "seq_len": ("seq_len", "block_size", "max_seq_len", "context_length", "n_positions", "seq"),
    "mlp_ratio": ("mlp_ratio",),
    "tie_weights": ("tie_weights", "tied", "tie_word_embeddings"),
    "bias": ("bias",),
    "norm_bias": ("norm_bias",),
    "learned_pos": ("learned_pos",),
    "rotary": ("rotary",),
}


_REQUIRED_GPT_KEYS = ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")


def gpt_dims_from_mapping(cfg: Any) -> Optional[GPTDims]:
    """GPT dimensions from a config mapping under its usual names, or ``None`` if it is not GPT-shaped."""
    found: dict[str, Any] = {}
    for key, aliases in _GPT_KEYS.items():
        for alias in aliases:
            if alias in cfg and cfg[alias] is not None:
                found[key] = cfg[alias]
                break
    if not all(k in found for k in _REQUIRED_GPT_KEYS):
        return None
    kwargs: dict[str, Any] = {k: int(found[k]) for k in _REQUIRED_GPT_KEYS}
    if "mlp_ratio" in found:
        kwargs["mlp_ratio"] = float(found["mlp_ratio"])
    kwargs.update({k: bool(found[k]) for k in ("tie_weights", "bias", "norm_bias", "learned_pos", "rotary") if k in found})
    return GPTDims(**kwargs)


def spec_from_module(model: Any, name: str = "model", gpt: Optional[GPTDims] = None, policy: Any = "auto") -> ModelSpec:
    """Exact units of an ``nn.Module`` (typically built on the meta device) under the strategy's wrap policy."""
    import warnings

    from lightning_fsdp.sharding import select_units

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unit_names = select_units(model, policy)
    import torch

    modules = dict(model.named_modules())
    linear_weights = {id(m.weight) for m in modules.values() if isinstance(m, torch.nn.Linear)}
    taken: set[int] = set()
    units: list[Unit] = []
    for unit_name in unit_names:  # deepest first, like fully_shard
        params = []
        for pname, p in modules[unit_name].named_parameters():
            if id(p) not in taken:
                taken.add(id(p))
                params.append(Param(f"{unit_name}.{pname}", tuple(p.shape), p.requires_grad, id(p) in linear_weights))
        units.append(Unit(unit_name, tuple(params)))
    root = []
    for pname, p in model.named_parameters():
        if id(p) not in taken:
            taken.add(id(p))
            root.append(Param(pname, tuple(p.shape), p.requires_grad))
    units.append(Unit("", tuple(root)))
    return ModelSpec(name, tuple(units), _refine_gpt(model, gpt) if gpt is not None else None)


def _refine_gpt(model: Any, gpt: GPTDims) -> GPTDims:
    """What a config's numbers do not say but the built module shows: biases, position embedding kind."""
    from torch import nn

    modules = list(model.modules())
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    norms = [m for m in modules if isinstance(m, nn.LayerNorm)]
    return replace(
        gpt,
        bias=any(m.bias is not None for m in linears) if linears else gpt.bias,
        norm_bias=any(m.bias is not None for m in norms) if norms else gpt.norm_bias,
        rotary=any("rotary" in type(m).__name__.lower() for m in modules),
        learned_pos=any("pos" in n and p.ndim == 2 for n, p in model.named_parameters()),
    )


def spec_from_shapes(shapes: dict[str, tuple[int, ...]], name: str = "checkpoint", gpt: Optional[GPTDims] = None) -> ModelSpec:
    """Units from parameter names and shapes (a checkpoint): ``<...>.<index>.<...>`` prefixes of repeated
    numbered children become units, the rest is the root."""
    groups: dict[str, list[Param]] = {}
    root: list[Param] = []
    pattern = re.compile(r"^(.*?\.\d+)\.")
    for key, shape in shapes.items():
        m = pattern.match(key)
        (groups.setdefault(m.group(1), []) if m else root).append(Param(key, tuple(shape)))
    units = [Unit(k, tuple(v)) for k, v in groups.items()]
    return ModelSpec(name, (*units, Unit("", tuple(root))), gpt)


def load_config(source: str) -> Any:
    """A model config from a YAML path or ``group=option`` of the packaged Hydra configs (``model=gpt_5m``)."""
    from omegaconf import OmegaConf

    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"--config {source}: no such YAML file.")
        return OmegaConf.load(path)
    if "=" not in source:
        raise ValueError(f"--config {source!r}: give a YAML path or a Hydra `group=option` such as model=gpt_5m.")
    from hydra import compose, initialize_config_module

    group, option = source.split("=", 1)
    # the option within the groups' own defaults: the default experiment would merge its own model keys into it
    base = [] if group == "experiment" else ["experiment=null"]
    with initialize_config_module(config_module="lightning_fsdp.configs", version_base="1.3"):
        try:  # within the main config, so interpolations such as ${data.seq_len} resolve
            cfg = compose(config_name="train", overrides=[f"{group}={option}", *base])
        except Exception:  # noqa: BLE001 - no main config, or the group is not in its defaults
            cfg = compose(config_name=None, overrides=[f"+{group}={option}"])
    return cfg[group]


def spec_from_config(cfg: Any, name: str = "config", instantiate: bool = True) -> ModelSpec:
    """Exact shapes by building the configured model on the meta device; falls back to the GPT formula."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, DictConfig):
        try:
            plain = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException:  # a lone YAML file that interpolates other groups: keep what is literal
            raw = OmegaConf.to_container(cfg, resolve=False)
            assert isinstance(raw, dict)  # a DictConfig's container
            plain = {k: v for k, v in raw.items() if not (isinstance(v, str) and "${" in v)}
            cfg = OmegaConf.create(plain)
        assert isinstance(plain, dict)
    else:
        plain = dict(cfg)
    gpt = gpt_dims_from_mapping(plain)
    if instantiate and "_target_" in plain:
        try:
            return spec_from_module(_build_on_meta(cfg), name, gpt)
        except Exception as err:  # noqa: BLE001 - report and fall back to the formula when possible
            if gpt is None:
                raise ValueError(f"Could not build the model in config {name!r} on the meta device: {err}") from err
    if gpt is None:
        raise ValueError(
            f"Config {name!r} has no `_target_` to build and no GPT dimensions"
            f" ({', '.join(_REQUIRED_GPT_KEYS)})."
        )
    return gpt_model_spec(gpt, name)


def _build_on_meta(cfg: Any) -> Any:
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        model = instantiate(cfg)
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    return model


def shapes_from_checkpoint(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter shapes from a sharded checkpoint directory (DCP ``.metadata``) or a file holding a state dict.

    Only model weights are kept: ``state_dict.`` keys of a Lightning checkpoint (optimizer entries are dropped).
    """
    path = Path(path)
    if path.is_dir():
        meta = path / ".metadata"
        if not meta.is_file():
            raise FileNotFoundError(f"{path} has no DCP `.metadata`: not a sharded checkpoint directory.")
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from lightning_fsdp.checkpoint.safe_load import read_metadata

        metadata = read_metadata(path)  # a restricted unpickler: a crafted .metadata cannot run code
        shapes = {
            k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
    elif path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    else:
        import torch

        from lightning_fsdp.checkpoint.schema import SCHEMA

        obj = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        sd = obj.get(SCHEMA.model, obj) if isinstance(obj, dict) else obj
        shapes = {k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}
    model = {
        _strip_prefix(k): v for k, v in shapes.items() if not k.startswith(("optimizer", "optim", "lr_scheduler"))
    }
    if not model:
        raise ValueError(f"No parameter shapes found in {path}.")
    return model


def checkpoint_hparams(path: str | Path) -> dict[str, Any]:
    """The LightningModule's saved hyper-parameters (``hyper_parameters``), or ``{}``: read without running code."""
    path = Path(path)
    try:
        if path.is_dir():
            if not (path / "meta.pt").is_file():
                return {}
            from lightning_fsdp.checkpoint.safe_load import safe_torch_load

            obj = safe_torch_load(path / "meta.pt")
        elif path.suffix in (".ckpt", ".pt", ".pth"):
            import torch

            obj = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        else:
            return {}
    except Exception:  # noqa: BLE001 - hyper-parameters are optional; shapes alone still give the state bytes
        return {}
    hparams = obj.get("hyper_parameters") if isinstance(obj, dict) else None
    return dict(hparams) if isinstance(hparams, dict) else {}


def spec_from_checkpoint(path: str | Path, n_head: Optional[int] = None, seq_len: Optional[int] = None) -> ModelSpec:
    """Shapes from the checkpoint, GPT dimensions from its hyper-parameters (or from the shapes and ``n_head``).

    A state dict names a tied embedding/head twice; when the hyper-parameters say the weights are tied, the head
    (same shape as the embedding) is counted once.
    """
    shapes = shapes_from_checkpoint(path)
    hparams = checkpoint_hparams(path)
    if seq_len is not None:
        hparams = {**hparams, "seq_len": seq_len}
    gpt = gpt_dims_from_mapping(hparams) if hparams else None
    if gpt is None and n_head:
        gpt = infer_gpt_from_shapes(shapes, n_head, seq_len)
    if gpt is not None:
        gpt = replace(
            gpt,
            learned_pos=any("pos" in k and len(s) == 2 for k, s in shapes.items()),
            bias=any(re.search(r"\.\d+\..*(proj|fc|qkv|out|attn|mlp).*\.bias$", k) for k in shapes),
        )
        gpt = replace(gpt, rotary=not gpt.learned_pos)
        if gpt.tie_weights:
            emb = [s for k, s in shapes.items() if len(s) == 2 and ("emb" in k or "wte" in k)]
            shapes = {k: s for k, s in shapes.items() if not (k.endswith("head.weight") and emb and s == emb[0])}
    return spec_from_shapes(shapes, Path(path).name, gpt)


def _strip_prefix(key: str) -> str:
    """``state_dict/net.x`` (this package's sharded format) or ``state_dict.net.x`` (plain DCP) → ``net.x``."""
    for prefix in ("state_dict/", "state_dict.", "model/", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def infer_gpt_from_shapes(shapes: dict[str, tuple[int, ...]], n_head: int, seq_len: Optional[int]) -> Optional[GPTDims]:
    """GPT dimensions from a checkpoint's shapes (embedding = vocab × width, count numbered blocks)."""
    emb = [s for k, s in shapes.items() if len(s) == 2 and ("emb" in k or "wte" in k)]
    if not emb:
        return None
    vocab, d = max(emb, key=lambda s: s[0])
    layers = {m.group(1) for k in shapes if (m := re.match(r"^(.*?\.\d+)\.", k))}
    pos = [s[0] for k, s in shapes.items() if len(s) == 2 and ("pos" in k or "wpe" in k)]
    seq = seq_len or (pos[0] if pos else None)
    if not layers or seq is None or d % n_head:
        return None
    return GPTDims(n_layer=len(layers), d_model=d, n_head=n_head, vocab_size=vocab, seq_len=seq)
