"""Every config group option composes and instantiates; bad configs fail before anything starts (no process group)."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_fsdp import FSDPCustomStrategy
from lightning_fsdp.checkpoint.pretrained import read_weights
from lightning_fsdp.cli import COMMANDS
from lightning_fsdp.cli import main as cli_main
from lightning_fsdp.trainer.memory import MemoryReport
from lightning_fsdp.models import GPTLightningModule, HFCausalLM, count_params
from lightning_fsdp.models.hf_causal_lm import write_random_model
from lightning_fsdp.planner.llama import llama_dims, llama_model_spec
from lightning_fsdp.sharding import parameters_on_meta
from lightning_fsdp.train import (
    ConfigError,
    compose_config,
    ensure_demo_data,
    ensure_pretrained,
    external_global_rank,
    instantiate_group,
    is_launched_rank,
    validate_config,
    world_size_of,
)
from tests.helpers.hf import TINY_LLAMA

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("trainer", "strategy", "model", "data", "callbacks", "logger", "experiment", "debug")
#: arguments Lightning's connector passes to every strategy; not part of a strategy YAML
LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose(tmp_path: Path, *overrides: str):
    """The job config as `lightning-fsdp train` would see it, writing under ``tmp_path`` (nothing is created); the
    groups' own defaults (the GPT of ``experiment=gpt_pretrain``) unless an experiment is named."""
    experiment = [] if any(o.startswith("experiment=") for o in overrides) else ["experiment=gpt_pretrain"]
    return compose_config([f"paths.log_dir={tmp_path}", *experiment, *overrides])


def test_every_group_has_options_and_the_layout_is_complete():
    for group in GROUPS:
        assert options(group), group
    assert set(options("strategy")) == {"fsdp_custom", "fsdp_custom_offload", "fsdp_custom_hybrid", "fsdp_custom_qlora", "ddp"}
    assert {"gpt_medium_offload", "finetune_pretrained", "hsdp", "cnn_shapes", "finetune_hf_lora", "finetune_hf_qlora"} <= set(
        options("experiment")
    )
    for path in (CONFIGS / "experiment").glob("*.yaml"):
        assert path.read_text().startswith("# @package _global_"), path.name


def test_default_config_is_the_real_fine_tune(tmp_path):
    """No overrides: the packaged SmolLM2 GGUF, LoRA, the docstring data, evaluation, the loss curve, exports."""
    from tests.helpers.real_model import smollm2_gguf

    cfg = compose_config([f"paths.log_dir={tmp_path}"])
    validate_config(cfg)
    assert cfg.task_name == "assistant" and cfg.strategy._target_ == "lightning_fsdp.FSDPCustomStrategy"
    assert cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu"
    assert Path(cfg.model.model_dir) == smollm2_gguf() == Path(cfg.strategy.pretrained_weights) == Path(cfg.data.tokenizer)
    assert cfg.model.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.demo_data._target_.endswith("write_docstring_chat") and cfg.data.path.startswith(cfg.demo_data.dir)
    assert {"held_out_answers", "loss_curve", "progress_bar"} <= set(cfg.callbacks)
    assert list(cfg.export.formats) == ["hf", "peft", "gguf"]
    assert not list(tmp_path.iterdir())  # composing creates no folder


def test_gpt_pretrain_is_the_groups_own_defaults(tmp_path):
    cfg = compose(tmp_path)
    validate_config(cfg)
    assert cfg.task_name == "gpt_pretrain" and cfg.model._target_.endswith("GPTLightningModule")
    assert cfg.model.seq_len == cfg.data.seq_len and cfg.sample.prompt
    assert cfg.paths.output_dir.startswith(str(tmp_path))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_options_instantiate(tmp_path, option):
    cfg = compose(tmp_path, f"strategy={option}")
    validate_config(cfg)
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, Strategy)
    if option == "ddp":
        assert isinstance(strategy, DDPStrategy)
        return
    assert isinstance(strategy, FSDPCustomStrategy)
    assert strategy.cpu_offload is (option == "fsdp_custom_offload")
    assert strategy.replicate_size == ("auto" if option == "fsdp_custom_hybrid" else 1)
    assert strategy.quantize_base == ("nf4" if option == "fsdp_custom_qlora" else None)


@pytest.mark.parametrize("option", [o for o in options("strategy") if o != "ddp"])
def test_strategy_yaml_keys_equal_the_constructor_arguments(tmp_path, option):
    cfg = compose(tmp_path, f"strategy={option}")
    arguments = set(inspect.signature(FSDPCustomStrategy).parameters) - LIGHTNING_PLUMBING
    assert {k for k in cfg.strategy if not k.startswith("_")} == arguments


@pytest.mark.parametrize("option", options("model"))
def test_model_options_instantiate_and_build(tmp_path, option):
    cfg = compose(tmp_path, f"model={option}")
    validate_config(cfg)
    model = instantiate(cfg.model, _convert_="all")
    assert isinstance(model, L.LightningModule)
    if isinstance(model, GPTLightningModule):
        with torch.device("meta"):  # as under the sharded strategy; sizes only
            model.configure_model()
        assert sum(p.numel() for p in model.parameters()) == count_params(model.config)
    elif isinstance(model, HFCausalLM):
        pytest.importorskip("transformers")
        write_random_model(model.hparams.model_dir, {**TINY_LLAMA, "model_type": "llama"})
        with parameters_on_meta():
            model.configure_model()
        assert all(p.is_meta for p in model.parameters())  # as under the sharded strategy: shapes only
        expected = llama_model_spec(llama_dims(TINY_LLAMA)).numel
        assert sum(p.numel() for p in model.parameters()) == expected
    else:
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 4)


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate_and_load(tmp_path, option):
    if option == "sft":  # the demo's generated chat data and the model directory holding its tokenizer
        cfg = compose(tmp_path, "experiment=finetune_hf_chat", "data.seq_len=128")
        ensure_demo_data(cfg)
        ensure_pretrained(cfg)
    elif option == "preference":  # the DPO demo's docstring pairs, through the real model's tokenizer
        cfg = compose(tmp_path, "experiment=dpo", "data.batch_size=2")
        ensure_demo_data(cfg)
    elif option == "prompts":  # the GRPO demo's expression prompts, through the real model's chat template
        cfg = compose(tmp_path, "experiment=grpo", "data.batch_size=2")
        ensure_demo_data(cfg)
    elif "text" in option:
        cfg = compose(tmp_path, f"data={option}", "data.max_bytes=60000")
    else:
        cfg = compose(tmp_path, "model=cnn", f"data={option}", "data.num_train=64", "data.num_val=16")
    validate_config(cfg)
    datamodule = instantiate(cfg.data, _convert_="all")
    assert isinstance(datamodule, L.LightningDataModule)
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    if option == "preference":  # 2 pairs per rank: the chosen rows, then the rejected ones
        assert set(batch) == {"input_ids", "attention_mask", "labels", "pair_mask"} and batch["input_ids"].shape[0] == 4
        return
    if option == "prompts":  # a rollout window: 2 prompts with the columns the reward reads
        assert batch["part"] == 0 and len(batch["window"]) == 2
        assert {"answer", "expression"} <= set(batch["window"][0]["columns"])
        return
    if option == "sft":
        assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape[1] <= 128
        batch = (batch["input_ids"], batch["labels"])
    x, y = batch
    assert x.shape[0] == cfg.data.batch_size and y.shape[0] == cfg.data.batch_size


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options_instantiate(tmp_path, option):
    cfg = compose(tmp_path, f"trainer={option}")
    validate_config(cfg)
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        assert cfg.trainer.precision == "bf16-mixed"
        pytest.skip("no GPU here: composed and validated only")
    strategy = instantiate(cfg.strategy, _convert_="all")
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=False, _convert_="all")  # no process starts here
    assert isinstance(trainer, L.Trainer) and trainer.strategy is strategy
    assert trainer.world_size == 2 and strategy.mesh_shape.shard == 2


@pytest.mark.parametrize("option", options("callbacks"))
def test_callbacks_options_instantiate(tmp_path, option):
    cfg = compose(tmp_path, f"callbacks={option}")
    validate_config(cfg)
    callbacks = instantiate_group(cfg.callbacks, "callbacks")
    assert all(isinstance(c, Callback) for c in callbacks)
    if option == "default":
        types = {type(c) for c in callbacks}
        assert {ModelCheckpoint, MemoryReport} <= types
        checkpoint = next(c for c in callbacks if isinstance(c, ModelCheckpoint))
        assert checkpoint.save_last and checkpoint.dirpath.startswith(str(tmp_path))


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options_instantiate(tmp_path, option):
    cfg = compose(tmp_path, f"logger={option}")
    validate_config(cfg)
    loggers = instantiate_group(cfg.logger, "logger")
    names = sorted(type(lg).__name__ for lg in loggers)
    expected = {"csv": ["CSVLogger"], "tensorboard": ["TensorBoardLogger"], "none": [],
                "default": ["CSVLogger", "TensorBoardLogger"]}[option]
    assert names == expected  # tensorboard is installed in the dev environment


@pytest.mark.parametrize("option", options("experiment"))
def test_experiments_compose_validate_and_instantiate(tmp_path, option):
    cfg = compose(tmp_path, f"experiment={option}")
    validate_config(cfg)
    assert cfg.task_name == option
    strategy = instantiate(cfg.strategy, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    assert isinstance(strategy, Strategy) and isinstance(model, L.LightningModule)
    if option == "hsdp":
        assert (strategy.replicate_size, strategy.shard_size, cfg.trainer.devices) == (2, 2, 4)
    if option == "gpt_medium_offload":
        assert strategy.cpu_offload and strategy.activation_checkpointing_policy == ["TransformerBlock"]
    if option == "finetune_pretrained":
        assert strategy.pretrained_weights.endswith(".pt") and cfg.pretrained_if_missing == "init"
    if option == "finetune_hf_chat":
        assert cfg.data._target_.endswith("SFTDataModule") and cfg.data.tokenizer == model.hparams.model_dir
        assert cfg.pretrained_init.tokenizer.startswith(cfg.demo_data) and "held_out_answers" in cfg.callbacks
    if option == "finetune_hf_lora":
        assert strategy.pretrained_weights == model.hparams.model_dir and model.hparams.lora["r"] == 8
        assert cfg.pretrained_init.model_type == "llama" and list(cfg.export.formats) == ["hf", "peft"]


@pytest.mark.parametrize("option", options("debug"))
@pytest.mark.parametrize("experiment", [None, "cnn_shapes"])
def test_debug_options_compose_with_experiments(tmp_path, option, experiment):
    cfg = compose(tmp_path, f"debug={option}", *([f"experiment={experiment}"] if experiment else []))
    validate_config(cfg)
    assert cfg.trainer.get("fast_dev_run") or cfg.trainer.max_steps <= 10


# -- bad overrides: errors that name the problem, raised before any process or process group ----------------------
def test_unknown_group_option_is_hydras_error(tmp_path):
    with pytest.raises(MissingConfigException, match="gpt_5m"):  # lists the available options
        compose(tmp_path, "model=gpt_huge")


def test_unknown_strategy_key_without_plus_is_hydras_error(tmp_path):
    with pytest.raises(ConfigCompositionException, match="cpu_ofload"):
        compose(tmp_path, "strategy.cpu_ofload=true")


def test_unknown_strategy_argument_names_the_valid_ones(tmp_path):
    cfg = compose(tmp_path, "+strategy.cpu_ofload=true")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    assert "cpu_ofload" in message and "did you mean 'cpu_offload'" in message
    assert "Valid arguments:" in message and "replicate_size" in message


def test_unknown_model_and_trainer_arguments_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="n_layers"):
        validate_config(compose(tmp_path, "+model.n_layers=3"))
    with pytest.raises(ConfigError, match="max_step"):
        validate_config(compose(tmp_path, "+trainer.max_step=3"))


@pytest.mark.parametrize(
    "overrides",
    [
        ("experiment=hsdp", "trainer.devices=3"),
        ("strategy=fsdp_custom_hybrid", "strategy.replicate_size=3"),
        ("strategy.shard_size=4",),
        ("strategy.context_parallel=3",),
    ],
)
def test_devices_that_do_not_fit_the_mesh_are_rejected(tmp_path, overrides):
    with pytest.raises(ConfigError, match="do not fit"):
        validate_config(compose(tmp_path, *overrides))


def test_world_size_of():
    assert world_size_of({"devices": 2, "num_nodes": 3}) == 6
    assert world_size_of({"devices": [0, 1]}) == 2
    assert world_size_of({"devices": "4"}) == 4
    assert world_size_of({"devices": "auto"}) is None and world_size_of({"devices": -1}) is None


def test_which_process_composes_the_config():
    assert external_global_rank({}) == 0
    assert external_global_rank({"RANK": "3", "LOCAL_RANK": "1"}) == 3
    assert external_global_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}) == 2
    assert external_global_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == 0
    assert external_global_rank({"NODE_RANK": "1"}) == 1
    assert not is_launched_rank({"LOCAL_RANK": "1"})  # torchrun: no handed-over config
    assert not is_launched_rank({"LIGHTNING_FSDP_RANK_CONFIG": "a: 1", "LOCAL_RANK": "0"})
    assert is_launched_rank({"LIGHTNING_FSDP_RANK_CONFIG": "a: 1", "LOCAL_RANK": "1"})


def test_ensure_pretrained_writes_initial_weights_or_refuses(tmp_path):
    path = tmp_path / "pretrained" / "tiny.pt"
    cfg = compose(tmp_path, "model=gpt_tiny", f"strategy.pretrained_weights={path}")
    with pytest.raises(ConfigError, match="consolidate"):
        ensure_pretrained(cfg)
    assert not path.exists()
    cfg = compose(tmp_path, "model=gpt_tiny", f"strategy.pretrained_weights={path}", "pretrained_if_missing=init")
    assert ensure_pretrained(cfg) == path
    weights = read_weights(path)  # the format the strategy's loader reads
    model = GPTLightningModule(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    model.configure_model()
    assert weights.keys() == model.state_dict().keys()
    before = path.stat().st_mtime_ns
    assert ensure_pretrained(cfg) == path and path.stat().st_mtime_ns == before  # an existing file is kept


def test_cli_dispatch_and_usage(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert cli_main([]) == 2
    assert cli_main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


def test_the_dpo_experiment_aligns_the_real_model_with_lora_and_its_disabled_adapters(tmp_path):
    cfg = compose(tmp_path, "experiment=dpo")
    validate_config(cfg)
    assert cfg.task_name == "dpo" and cfg.model._target_ == "lightning_fsdp.models.HFPreferenceLM"
    assert cfg.model.loss == "dpo" and cfg.model.lora.r == 8 and cfg.data._target_.endswith("PreferenceDataModule")
    assert cfg.demo_data._target_.endswith("write_docstring_preferences") and cfg.data.path.startswith(cfg.demo_data.dir)
    assert "held_out_preferences" in cfg.callbacks and list(cfg.export.formats) == ["hf", "peft"]
    simpo = compose(tmp_path, "experiment=dpo", "model.loss=simpo", "model.lora=null")
    validate_config(simpo)
    assert not list(tmp_path.iterdir())
