"""Meta-device initialisation: the initialisers torch and transformers keep private, and the dispatch mode that
sees every ATen op."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional, cast

import torch

from lightning_fsdp._torch_compat.base import requirement

if TYPE_CHECKING:
    from torch import nn


# -- Hugging Face -----------------------------------------------------------------------------------------------------
def hf_init_weights(owner: nn.Module, module: nn.Module) -> None:
    """``PreTrainedModel._init_weights(module)``: how transformers initialises one module of ``owner``."""
    cast(Any, owner)._init_weights(module)  # nn.Module's attribute typing knows tensors and modules only


# -- meta-device initialisation ---------------------------------------------------------------------------------------
def private_reset_parameters(module: nn.Module) -> Optional[Callable[[], None]]:
    """``module._reset_parameters``: how ``nn.MultiheadAttention`` (its own weights) and ``nn.Transformer`` (every
    matrix below it) initialise, called from their ``__init__`` instead of a public ``reset_parameters()``."""
    reset = getattr(module, "_reset_parameters", None)
    if not callable(reset) or any(p.default is p.empty for p in inspect.signature(reset).parameters.values()):
        return None  # not an initialiser that runs on its own
    return reset


#: ``handler(op, args, kwargs)`` → the op's result, or ``NotImplemented`` to run the op as usual
DispatchHandler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def intercept_dispatch(handler: DispatchHandler) -> AbstractContextManager[Any]:
    """A context in which every ATen op call (below autograd, above tensor subclasses such as DTensor) is offered to
    ``handler`` first: a ``TorchDispatchMode``. A function mode would not do: ``torch.nn.init.*`` hand themselves to
    function modes whole, so the ``Tensor.uniform_`` inside them never reaches one."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as err:
        raise requirement(
            "torch.utils._python_dispatch.TorchDispatchMode", "meta-device initialisation of a sharded model", err
        ) from err

    class Intercept(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
        ) -> Any:
            kwargs = kwargs or {}
            result = handler(func, args, kwargs)
            return func(*args, **kwargs) if result is NotImplemented else result

    return Intercept()


def swaps_on_conversion(tensor: torch.Tensor) -> bool:
    """Whether ``Module._apply`` (``to_empty``, ``.to``) swaps a parameter's contents in place rather than replacing
    it: for tensor subclasses that wrap others (DTensor, torchao's NF4) or when torch's future flag asks for it."""
    try:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:  # what it checks: a subclass that flattens into inner tensors
        return bool(torch.__future__.get_swap_module_params_on_conversion() or hasattr(tensor, "__tensor_flatten__"))
    return bool(torch.__future__.get_swap_module_params_on_conversion() or is_traceable_wrapper_subclass(tensor))


def spectral_norm_vectors(parametrization: nn.Module, weight: torch.Tensor) -> bool:
    """Re-derive ``spectral_norm``'s power-iteration vectors ``_u``/``_v`` (buffers) from ``weight`` as its
    ``__init__`` does: random unit vectors, then 15 power iterations. ``False`` if it is not torch's spectral norm."""
    import torch.nn.functional as F

    try:
        from torch.nn.utils.parametrizations import _SpectralNorm
    except ImportError:  # then its buffers count as not re-derived, and materialisation says so
        return False
    if not isinstance(parametrization, _SpectralNorm):
        return False
    if weight.ndim > 1:
        mat = parametrization._reshape_weight_to_matrix(weight)
        u = mat.new_empty(mat.shape[0]).normal_(0, 1)
        v = mat.new_empty(mat.shape[1]).normal_(0, 1)
        parametrization._u.copy_(F.normalize(u, dim=0, eps=parametrization.eps))
        parametrization._v.copy_(F.normalize(v, dim=0, eps=parametrization.eps))
        parametrization._power_method(mat, 15)
    return True
