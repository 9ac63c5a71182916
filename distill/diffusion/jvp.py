"""The time derivative of a network along a direction, d/dh F(primals + h tangents) at h = 0: a Jacobian-vector
product by forward-mode AD (``torch.func.jvp``), or a central finite difference where a layer or kernel has no
forward-mode rule (sCM and MeanFlow both need it: Lu & Song 2024 sec. 4, Geng et al. 2025, the MeanFlow identity).

Attention: PyTorch's fused SDPA kernels have no forward-mode AD (on CPU ``_scaled_dot_product_flash_attention_for_cpu``
raises NotImplementedError), so the JVP runs under ``sdpa_kernel(SDPBackend.MATH)``, the decomposed attention that
forward AD differentiates; an attention processor that calls a fused kernel itself (xFormers, a pinned flash kernel)
is refused, naming it and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

JVP_MODES = ("autograd", "finite_difference")


def attention_processors(networks: Sequence[torch.nn.Module]) -> list[str]:
    """The attention processor classes of diffusers models among ``networks`` (sorted, distinct)."""
    names = set()
    for net in networks:
        processors = getattr(net, "attn_processors", None)
        if isinstance(processors, dict):
            names.update(type(p).__name__ for p in processors.values())
    return sorted(names)


def time_derivative(fn: Callable[..., torch.Tensor], primals: tuple[torch.Tensor, ...],
                    tangents: tuple[torch.Tensor, ...], mode: str = "autograd", step: float = 1e-3,
                    networks: Sequence[torch.nn.Module] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(fn(*primals), its derivative along ``tangents``): ``torch.func.jvp`` with the math attention backend
    (``mode="autograd"``), or (fn(p + h d) - fn(p - h d)) / 2h with h = ``step`` (``mode="finite_difference"``: one
    more network pass, O(h^2) error). ``networks``: the diffusers models inside ``fn``, named in the refusal of an
    attention processor without forward-mode AD."""
    if mode not in JVP_MODES:
        raise ValueError(f"method.jvp={mode!r}; use one of {list(JVP_MODES)}")
    if mode == "finite_difference":
        out = fn(*primals)
        plus = fn(*(p + step * d for p, d in zip(primals, tangents)))
        minus = fn(*(p - step * d for p, d in zip(primals, tangents)))
        return out, (plus - minus) / (2 * step)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(fn, primals, tangents)
    except NotImplementedError as error:
        if "forward AD" not in str(error):
            raise
        processors = attention_processors(networks)
        raise ValueError(
            f"method.jvp=autograd: the network's time derivative needs forward-mode AD through every layer, and "
            f"{str(error).splitlines()[0]} (attention processors here: {processors or 'none'}). Use an attention "
            "processor that calls torch's scaled_dot_product_attention (diffusers' AttnProcessor2_0, run with the math "
            "backend for the JVP, or AttnProcessor): network.set_attn_processor(AttnProcessor2_0()); or set "
            "method.jvp=finite_difference") from error
