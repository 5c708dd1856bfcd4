"""Loading a pretrained Hugging Face model into a sharded model: three ways side by side, in one run.

    python benchmarks/hf_load.py                  # a ~250 MB Llama at 2 and 4 ranks (CPU, gloo); writes results/hf_load.md
    python benchmarks/hf_load.py --quick          # a tiny Llama at 2 ranks (the smoke test)

Peers, each in fresh processes (``torchrun``), the model built on the meta device and sharded per decoder layer:

- ``sharded``: ``lightning_fsdp.hf.load_safetensors`` on the model directory: every rank reads only its rows;
- ``broadcast``: ``lightning_fsdp.checkpoint.load_pretrained`` on one ``model.safetensors``: rank 0 reads the whole
  file, the other ranks receive their shards tensor by tensor (what the package did before, and FSDP1's way);
- ``from_pretrained``: every rank calls ``AutoModelForCausalLM.from_pretrained`` and then shards the full copy
  (what users do without this package).

Per rank: the peak RSS added by loading (the kernel's high-water mark, reset right before the load; glibc's mmap
threshold is fixed so RSS follows live memory) and the wall time of the load (the slowest rank). Targets: each
rank's peak ≤ 1/N of the model + its largest tensor, and ``sharded`` no slower than ``broadcast``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import torchrun_json  # noqa: E402 - after the repository is on the path

LLAMA_250MB = dict(
    vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
)
LLAMA_TINY = dict(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
PEERS = ("sharded", "broadcast", "from_pretrained")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def worker(peer: str, model_dir: Path, out: Path) -> None:
    """One rank of one peer (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp.hf.init_rules import LIBRARY_RULES
    from lightning_fsdp.parallel.process_group import release_process_group
    from lightning_fsdp.sharding import DEFAULT_RULES, materialize_meta_module, parameters_on_meta

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model

    config = AutoConfig.from_pretrained(model_dir)
    if peer != "from_pretrained":
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config)
        shard(model)
        loaded = {k for k, _ in model.named_parameters()}  # every parameter comes from the files
        materialize_meta_module(model, torch.device("cpu"), mesh, LIBRARY_RULES + DEFAULT_RULES, loaded=loaded)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmHWM")
    start = time.perf_counter()
    if peer == "sharded":
        from lightning_fsdp.hf import load_safetensors

        load_safetensors(model, model_dir)
    elif peer == "broadcast":
        from lightning_fsdp.checkpoint import load_pretrained

        load_pretrained(model, model_dir / "single" / "model.safetensors", strict=True, dtype_mismatch="error")
    else:
        model = shard(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - before
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"peak": peak, "seconds": seconds})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    del model
    release_process_group()  # a gloo group left to interpreter exit can abort the process (see parallel/)


def prepare(model_dir: Path, config: dict) -> dict:
    """The model directory (several shards, as from the Hub) and the same weights in one file."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(model_dir, max_shard_size="50MB")
    (model_dir / "single").mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(model_dir / "single" / "model.safetensors"))
    return {
        "model_bytes": sum(v.numel() * v.element_size() for v in state.values()),
        "largest_tensor_bytes": max(v.numel() * v.element_size() for v in state.values()),
        "params": sum(v.numel() for v in state.values()),
    }


def run_peer(peer: str, world: int, model_dir: Path, tmp: Path) -> list[dict]:
    out = tmp / f"{peer}_{world}.json"
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    return torchrun_json(__file__, world, [peer, str(model_dir), str(out)], out, env, peer)


def report(meta: dict, results: dict) -> str:
    mib = 2**20
    lines = [
        f"Model: Llama-style, {meta['params'] / 1e6:.1f}M parameters, {meta['model_bytes'] / mib:.0f} MiB fp32 in"
        f" {meta['files']} safetensors shards; largest tensor {meta['largest_tensor_bytes'] / mib:.1f} MiB. CPU, gloo,"
        " one thread per rank; peak = RSS high-water mark added by the load, per rank.",
        "",
        "| ranks | peer | load s | × broadcast | peak per rank MiB | max peak / (model/N + largest tensor) |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for world, peers in results.items():
        bound = meta["model_bytes"] / world + meta["largest_tensor_bytes"]
        base = max(r["seconds"] for r in peers["broadcast"])
        for peer in PEERS:
            rows = peers[peer]
            seconds = max(r["seconds"] for r in rows)
            peaks = " / ".join(f"{r['peak'] / mib:.0f}" for r in rows)
            lines.append(
                f"| {world} | `{peer}` | {seconds:.2f} | {seconds / base:.2f}× | {peaks} |"
                f" {max(r['peak'] for r in rows) / bound:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model at 2 ranks (the smoke test)")
    parser.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--worker", nargs=3, metavar=("PEER", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), Path(args.worker[2]))
        return
    import tempfile

    worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "llama"
        meta = prepare(model_dir, LLAMA_TINY if args.quick else LLAMA_250MB)
        meta["files"] = len(list(model_dir.glob("model*.safetensors")))
        results = {w: {p: run_peer(p, w, model_dir, tmp) for p in PEERS} for w in worlds}
    text = report(meta, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "hf_load_quick" if args.quick else "hf_load"
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
