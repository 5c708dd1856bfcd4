"""GGUF export (``consolidate --format gguf``), checked by reading the files back with transformers' own GGUF reader.

Tiny Llama, Mistral and Qwen2 models with real trained tokenizers (byte-level BPE with three different pre-tokenizers,
and a SentencePiece-style BPE with byte fallback) are written as f32, f16, bf16 and q8_0 files; transformers undoes
llama.cpp's q/k row order and the tensor names, so equal logits mean the layout is the one llama.cpp reads. Logit
bounds are the measured differences (largest over the families) with some headroom.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from lightning_fsdp.commands.consolidate import main as consolidate  # noqa: E402
from lightning_fsdp.hf.gguf import GGUFError  # noqa: E402
from lightning_fsdp.hf.gguf_export import export_gguf, export_gguf_from_hf_dir  # noqa: E402
from tests.helpers.sft import make_tokenizer, sentence, write_chat_llama  # noqa: E402

#: largest |logit difference| vs the original model; f32 is exact up to fp32 rounding (torch.testing's defaults).
#: Measured over the three families (logits up to ~1 in size): f16 3.3e-4, bf16 2.2e-3, q8_0 7.0e-3
BOUNDS = {"f16": 5e-4, "bf16": 3e-3, "q8_0": 1e-2}
PROMPTS = ["alpha beta gamma river stone", "seven eleven north south quiet loud bright dark small large window"]
CORPUS = [*PROMPTS, " leading space", "two  spaces\n\nnewlines\tand tab", "ünïcode ✓ zebra 12345 1,000.5",
          "it's we'll THEY'RE", ""]


def bpe_tokenizer(split: str) -> Any:
    """A byte-level BPE trained here whose text splitting is GPT-2's (``split="gpt2"``) or a Llama-3 / Qwen2 regex."""
    from tokenizers import Regex, pre_tokenizers

    from lightning_fsdp.data.sft.demo import train_tokenizer
    from lightning_fsdp.hf.gguf_vocab import PRE_TOKENIZERS

    if split == "gpt2":
        return make_tokenizer("llama3")  # BOS/EOS, a Llama-3 template
    wanted = {"llama3": "llama-bpe"}.get(split, split)
    pattern = next(key[0][1] for key, name in PRE_TOKENIZERS.items() if name == wanted)
    rng = random.Random(1)
    tokenizer = train_tokenizer([sentence(rng) for _ in range(300)] + ["system user assistant 12 345\n"] * 20, 320)
    # the regex split the trained merges were learned under is re-applied before byte-level encoding
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                           use_regex=False)])
    return tokenizer


def spm_tokenizer() -> Any:
    """A SentencePiece-style BPE (``▁`` word starts, byte fallback, ``<s>`` added) as Llama 2 and Mistral have."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    rng = random.Random(2)
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    backend.train_from_iterator([sentence(rng) for _ in range(300)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    model = json.loads(backend.to_str())["model"]
    tokenizer = LlamaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], add_bos_token=True)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    return tokenizer


#: name → (tokenizer, config overrides); head dims and row lengths are multiples of 32 (q8_0), but Mistral's MLP
#: (150) is not, so its down projection falls back to f16; Mistral's head_dim is not hidden / heads; llama_spm's
#: embedding has 5 rows more than its tokenizer has tokens (padded vocabularies are common)
MODELS = {
    "llama": ("gpt2", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)),
    "qwen2": ("qwen2", dict(model_type="qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=96, tie_word_embeddings=True)),
    "mistral": ("llama3", dict(model_type="mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, intermediate_size=150, tie_word_embeddings=True)),
    "llama_spm": ("spm", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                              extra_vocab=5)),
}


def write_model(path: Path, name: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    split, overrides = MODELS[name]
    tokenizer = spm_tokenizer() if split == "spm" else bpe_tokenizer(split)
    settings = dict(overrides)
    if "extra_vocab" in settings:
        settings["vocab_size"] = len(tokenizer) + settings.pop("extra_vocab")
    if settings.get("model_type", "llama") == "llama":
        return write_chat_llama(path, tokenizer, seed=3, **settings)
    config = AutoConfig.for_model(settings.pop("model_type"), vocab_size=len(tokenizer), num_hidden_layers=2,
                                  max_position_embeddings=128, **settings)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    if config.model_type == "qwen2":  # biases start at zero: give them values so their layout is checked too
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[dict[str, Path], dict[tuple[str, str], Path]]:
    """Every model's directory, and the model exported as every type (the llama_spm model, there for its tokenizer,
    as f32 only) into a directory of its own, so that reading it back sees the GGUF file alone."""
    root = tmp_path_factory.mktemp("gguf")
    dirs, files = {}, {}
    for name in MODELS:
        dirs[name] = write_model(root / f"tiny-{name}", name)  # a general.name of just "mistral" trips transformers
        for gguf_type in ("f32",) if name == "llama_spm" else ("f32", "f16", "bf16", "q8_0"):
            files[name, gguf_type] = export_gguf_from_hf_dir(dirs[name], root / f"{name}-{gguf_type}" / "model.gguf",
                                                             gguf_type=gguf_type)
    return dirs, files


def read_back(file: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def original(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def logits(model: Any, tokenizer: Any) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(tokenizer(p, return_tensors="pt").input_ids).logits[0] for p in PROMPTS]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_logits_read_back_match_the_original_per_type(exported, name):
    dirs, files = exported
    model, tokenizer = original(dirs[name])
    expected = logits(model, tokenizer)
    for gguf_type in ("f32", "f16", "bf16", "q8_0"):
        back, _ = read_back(files[name, gguf_type])
        assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
        got = logits(back, tokenizer)
        for e, g in zip(expected, got):
            if gguf_type == "f32":
                torch.testing.assert_close(g, e)
            else:
                assert (g - e).abs().max().item() < BOUNDS[gguf_type], gguf_type


@pytest.mark.parametrize("name", list(MODELS))
def test_tokenizer_read_back_encodes_like_the_original(exported, name):
    dirs, files = exported
    _, tokenizer = original(dirs[name])
    _, back = read_back(files[name, "f32"])
    specials = " ".join(t for t in (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) if t)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[0]},
            {"role": "assistant", "content": PROMPTS[1]}, {"role": "user", "content": "and now?"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert back.chat_template == tokenizer.chat_template
    assert back.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == rendered
    for text in [*CORPUS, f"x {specials} y", rendered]:
        assert back(text).input_ids == tokenizer(text).input_ids, text
        assert back.decode(back(text).input_ids) == tokenizer.decode(tokenizer(text).input_ids)
    assert (back.bos_token_id, back.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_the_file_says_what_llama_cpp_reads(exported):
    """Tied heads are left out (llama.cpp reuses token_embd), 1-D tensors stay f32, q8_0 falls back to f16 on rows
    that are not whole blocks, and the hyperparameters and tokenizer keys are there."""
    from gguf import GGMLQuantizationType as Q

    def tensors(file: Path) -> dict[str, Any]:
        return {t.name: t for t in gguf.GGUFReader(str(file)).tensors}

    files = exported[1]
    untied, tied = tensors(files["llama", "q8_0"]), tensors(files["mistral", "q8_0"])
    assert "output.weight" in untied and "output.weight" not in tied and "token_embd.weight" in tied
    assert {t.tensor_type for n, t in untied.items() if len(t.shape) == 1} == {Q.F32}
    assert {t.tensor_type for n, t in untied.items() if len(t.shape) == 2} == {Q.Q8_0}
    assert tied["blk.0.ffn_down.weight"].tensor_type == Q.F16  # its rows are 150 long
    assert tied["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0
    qwen = tensors(files["qwen2", "f16"])
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(qwen)
    reader = gguf.GGUFReader(str(files["mistral", "bf16"]))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == 32
    assert fields["llama.attention.key_length"] == 32 and fields["llama.rope.dimension_count"] == 32
    assert fields["llama.embedding_length"] == 64 and fields["llama.attention.head_count_kv"] == 2
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert gguf.GGUFReader(str(files["qwen2", "f32"])).fields["tokenizer.ggml.pre"].contents() == "qwen2"
    spm = gguf.GGUFReader(str(files["llama_spm", "f32"])).fields
    assert spm["tokenizer.ggml.model"].contents() == "llama" and spm["tokenizer.ggml.add_bos_token"].contents() is True
    types = spm["tokenizer.ggml.token_type"].contents()
    assert len(types) == spm["llama.vocab_size"].contents() and types[-5:] == [gguf.TokenType.UNUSED] * 5
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]  # <unk> <s> </s>
    assert types.count(gguf.TokenType.BYTE) == 256


def test_rope_scaling_is_written_or_refused(exported, tmp_path):
    from transformers import LlamaForCausalLM

    model, tokenizer = original(exported[0]["llama"])
    config = model.config
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}
    fields = gguf.GGUFReader(str(export_gguf(model, tokenizer, tmp_path / "linear.gguf"))).fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0 and fields["llama.rope.freq_base"].contents() == 5e5
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 1e4}
    fields = gguf.GGUFReader(str(export_gguf(model, tokenizer, tmp_path / "yarn.gguf"))).fields
    assert (fields["llama.rope.scaling.type"].contents(), fields["llama.rope.scaling.original_context_length"]
            .contents()) == ("yarn", 32)
    # Llama 3.1's scaling: llama.cpp divides each frequency by rope_freqs; HF's scaled inv_freq says by how much
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16, "rope_theta": 5e5}
    config.rope_parameters = llama3
    scaled = LlamaForCausalLM(config).model.rotary_emb
    file = export_gguf(model, tokenizer, tmp_path / "llama3.gguf")
    freqs = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == "rope_freqs.weight")
    unscaled = 1.0 / 5e5 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    expected = unscaled / scaled.inv_freq.double()
    assert not torch.allclose(expected, torch.ones_like(expected))
    torch.testing.assert_close(torch.from_numpy(freqs.data.copy()), expected.float())  # 1 … 8
    for refused in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7}):
        config.rope_parameters = {**refused, "rope_theta": 1e4}
        with pytest.raises(GGUFError, match="cannot be expressed"):
            export_gguf(model, tokenizer, tmp_path / "refused.gguf")
    assert not list(tmp_path.glob(".*"))  # nothing half-written left behind


def test_refusals(exported, tmp_path):
    from tokenizers import pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tokenizer = original(exported[0]["llama"])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer)))
    with pytest.raises(GGUFError, match=r"model_type 'gpt2'.*supported: llama, mistral, qwen2"):
        export_gguf(gpt2, tokenizer, tmp_path / "gpt2.gguf")
    dst = tmp_path / "model.gguf"
    dst.write_bytes(b"keep")
    with pytest.raises(GGUFError, match="--force"):
        export_gguf(model, tokenizer, dst)
    assert dst.read_bytes() == b"keep"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # llama.cpp has no such split
    with pytest.raises(GGUFError, match="pre-tokenizer"):
        export_gguf(model, tokenizer, dst, force=True)
    assert dst.read_bytes() == b"keep" and sorted(os.listdir(tmp_path)) == ["model.gguf"]
    _, tokenizer = original(exported[0]["llama"])
    assert export_gguf(model, tokenizer, dst, "q8_0", force=True) == dst and dst.read_bytes()[:4] == b"GGUF"


def test_consolidate_writes_a_lora_checkpoint_as_gguf(tmp_path, capsys):
    """A real sharded LoRA checkpoint: ``--format gguf`` reads back with the logits of ``--format hf``'s export, and
    the command converts that HF export too."""
    from tests.helpers.hf import LORA
    from tests.scripts.ckpt_jobs import job

    model_dir = write_chat_llama(tmp_path / "base", make_tokenizer("chatml"), tie_word_embeddings=True,
                                 hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
    spec = {"devices": 1, "max_steps": 2, "batch_size": 4, "data": {"n": 8}, "save_path": str(tmp_path / "lora.ckpt"),
            "hf": {"model_dir": str(model_dir), "lora": LORA, "lr": 0.05},
            "strategy_kwargs": {"pretrained_weights": str(model_dir)}}
    job(spec, tmp_path, "lora", timeout=240)
    ckpt, out = str(tmp_path / "lora.ckpt"), tmp_path / "out"
    assert consolidate([ckpt, str(out / "hf"), "--format", "hf", "--no-progress"]) == 0
    assert consolidate([ckpt, str(out / "model.gguf"), "--format", "gguf", "--gguf-type", "f32"]) == 0
    assert re.search(r"wrote .*model\.gguf \(\d+\.\d MiB, f32, 20 tensors\)", capsys.readouterr().err)
    assert consolidate([ckpt, str(out / "model.gguf"), "--format", "gguf"]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert consolidate([str(out / "hf"), str(out / "from_hf.gguf"), "--format", "gguf", "--gguf-type", "f32"]) == 0
    # the main job's `export.formats: [gguf]`, twice: a second run replaces its earlier export as the others do
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from lightning_fsdp.train import export_last_checkpoint

    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(last_model_path=ckpt))
    for _ in range(2):
        written = export_last_checkpoint(trainer, OmegaConf.create({"dir": str(out / "job"), "formats": ["gguf"]}))
        assert written == {"gguf": str(out / "job" / "model.gguf")}
    assert "f16, 20 tensors" in capsys.readouterr().err
    exported, tokenizer = original(out / "hf")
    base, _ = original(model_dir)
    expected = logits(exported, tokenizer)
    assert not all(torch.equal(e, b) for e, b in zip(expected, logits(base, tokenizer))), "the adapters did nothing"
    for name in ("model.gguf", "from_hf.gguf"):
        back, back_tokenizer = read_back(out / name)
        for e, g in zip(expected, logits(back, back_tokenizer)):
            torch.testing.assert_close(g, e)


@pytest.mark.slow
def test_the_real_model_answers_alike_through_its_gguf(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct (a converted HF directory): its f16 GGUF, read back, gives the directory's greedy chat
    answers token for token; q8_0's logits stay within the measured bound. File sizes go to the captured output."""
    from tests.helpers.real_model import TEST_CACHE, smollm2_dir

    monkeypatch.setenv("LIGHTNING_FSDP_CACHE", str(TEST_CACHE))
    src = smollm2_dir()
    model, tokenizer = original(src)
    files = {t: export_gguf_from_hf_dir(src, tmp_path / t / "model.gguf", gguf_type=t) for t in ("f32", *BOUNDS)}
    safetensors = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print("sizes (MiB):", {"safetensors": round(safetensors / 2**20, 1),
                           **{t: round(f.stat().st_size / 2**20, 1) for t, f in files.items()}})
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]

    def answers(m: Any, tok: Any) -> list[list[int]]:
        out = []
        for prompt in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_dict=True, return_tensors="pt")["input_ids"]
            generated = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            out.append(generated[0, ids.shape[1]:].tolist())
        return out

    expected = answers(model, tokenizer)
    back, back_tokenizer = read_back(files["f16"])
    print("answers:", [tokenizer.decode(a) for a in expected])
    assert answers(back, back_tokenizer) == expected
    quantized, _ = read_back(files["q8_0"])
    ids = tokenizer(prompts[0], return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (quantized(ids).logits - model(ids).logits).abs().max().item()
    same = [a == e for a, e in zip(answers(quantized, back_tokenizer), expected)]
    print(f"q8_0: max |logit difference| {diff:.3g} (logits up to {model(ids).logits.abs().max().item():.3g}); "
          f"greedy answers equal: {same}")
    assert diff < 1.0  # measured: 0.54
