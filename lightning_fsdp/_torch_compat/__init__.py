"""Every private torch internal the package relies on (and transformers' few), in one place, checked against the
versions it was written for. Lightning's internals live beside it, in ``_lightning_compat.py``.

Outside this package and that module the package uses public names only (a test greps for it). Each internal is:

- a **fast path**: an optimisation. If a torch upgrade moves it, behaviour stays correct but something is lost;
  :func:`~.base.warn_lost` says so once, loudly, naming what is lost and the tested versions. :func:`fast_paths`
  reports which fast paths work on the installed versions (a test asserts all of them on the pinned torch).
- a **requirement**: a feature cannot work without it; using the feature raises an ``ImportError`` that names the
  internal and the versions this package was tested with.

One module per concern: :mod:`.fsdp` (FSDP2), :mod:`.checkpoint` (the store and DCP), :mod:`.kernels` (fused
updates, compile, hooks), :mod:`.init` (meta-device initialisation); :mod:`.base` holds the shared machinery.
"""

from lightning_fsdp._torch_compat.base import TESTED_TORCH, FastPathLost, fast_paths, warn_lost
from lightning_fsdp._torch_compat.checkpoint import (
    dcp_metadata_path,
    dcp_set_element,
    dcp_unpickle_allowlist,
    default_store,
    hf_storage_info,
    load_in_place,
    use_file_system,
)
from lightning_fsdp._torch_compat.fsdp import (
    composable_checkpoint,
    fsdp_default_comms,
    hold_gathered,
    keep_root_gathered,
    reset_sharded_params,
    storage_holders,
)
from lightning_fsdp._torch_compat.init import (
    DispatchHandler,
    hf_init_weights,
    intercept_dispatch,
    private_reset_parameters,
    spectral_norm_vectors,
    swaps_on_conversion,
)
from lightning_fsdp._torch_compat.kernels import (
    compile_errors,
    compiled_graph_count,
    flash_attention_blocks,
    foreach_copy_,
    foreach_lerp_,
    foreach_mul_,
    has_forward_hooks,
    view_base,
)

__all__ = [
    "TESTED_TORCH", "DispatchHandler", "FastPathLost", "compile_errors", "compiled_graph_count", "composable_checkpoint",
    "dcp_metadata_path", "dcp_set_element", "dcp_unpickle_allowlist", "default_store", "fast_paths", "flash_attention_blocks", "foreach_copy_",
    "foreach_lerp_", "foreach_mul_", "fsdp_default_comms", "has_forward_hooks", "hf_init_weights", "hf_storage_info",
    "hold_gathered", "intercept_dispatch", "keep_root_gathered", "load_in_place", "private_reset_parameters",
    "reset_sharded_params", "spectral_norm_vectors", "storage_holders", "swaps_on_conversion", "use_file_system", "view_base",
    "warn_lost",
]
