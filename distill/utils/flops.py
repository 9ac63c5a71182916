"""FLOPs of one call, counted by torch's flop counter: what the cost meter reports and what pruning targets."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _cpu_attention_formulas() -> dict:
    """Flop counter rules for the CPU attention kernel, which torch leaves uncounted (QK^T and AV at 0 FLOPs,
    4.7% of the embedded default teacher's forward), with the formulas torch uses for its CUDA kernels (2 B H Lq Lk D for
    QK^T plus 2 B H Lq Lk Dv for AV; backward: the gradients of both and the recomputed scores)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # arguments as shapes
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def count_flops(fn: Callable[[], object]) -> int:
    """Total FLOPs of one call of ``fn`` (torch.utils.flop_counter: matmuls, convolutions and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas()) as counter:
        fn()
    return counter.get_total_flops()
