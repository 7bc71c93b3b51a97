"""torchtitan's own trainer (``python -m torchtitan.train``), unchanged, on the CPU.

torchtitan 0.3.0 has no CPU mode; this adapter supplies what it lacks and then
runs ``torchtitan.train.main()`` with the command line it was given:

- the device: torch's available-device probe answers "cpu" (torchtitan falls
  back to CUDA), so its device module is ``torch.cpu`` (with the memory queries
  its metrics make, answered as a CPU can) and the backend gloo;
- attention: FlexAttention runs uncompiled, torch's reference implementation, whose
  backward runs on the CPU (the compiled kernel has none), and so does the block
  mask it builds;
- FSDP's gradient reduction is a plain SUM (gloo has no ``PREMUL_SUM``; torchtitan
  sets the divide factor to 1, so the sum is what it computes anyway);
- ``torch.distributed.set_timeout``, which torchtitan calls and torch 2.13 lacks, is
  torch's own per-group timeout setter.

Nothing about saving, loading or data is touched: checkpoints, the data loader and
its state are torchtitan's, as the command line configures them.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
from torch.distributed import distributed_c10d


class CpuDevice(types.ModuleType):
    """``torch.cpu`` with the memory queries torchtitan's metrics ask a device for.

    The CPU keeps no allocator statistics: its peaks read as absent (torchtitan's own
    default for a missing key), its capacity as the machine's memory.
    """

    def __init__(self) -> None:
        super().__init__("titan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        return 0  # an index, as a CUDA module answers (``torch.cpu`` answers "cpu")

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(total_memory=pages * size, name="cpu")

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def _on_the_cpu() -> None:
    device = CpuDevice()
    torch._utils._get_available_device_type = lambda: "cpu"
    device_module = torch._utils._get_device_module
    torch._utils._get_device_module = lambda kind: device if kind == "cpu" else device_module(kind)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def _eager_attention() -> None:
    """FlexAttention uncompiled: torch runs its reference implementation (the scores
    materialized), whose backward runs on the CPU too; torch refuses a CPU backward only
    because its compiled kernel has none."""
    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common import attention

    validate = flex._validate_device

    def validate_but_cpu(query: Any, key: Any, value: Any) -> None:
        if query.device.type != "cpu":
            validate(query, key, value)

    flex._validate_device = validate_but_cpu
    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask


def _sum_reduction() -> None:
    from torchtitan.distributed import fsdp

    divide = fsdp.disable_fsdp_gradient_division

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        divide(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_and_sum


def main() -> None:
    _on_the_cpu()
    _eager_attention()
    _sum_reduction()
    from torchtitan import train

    train.main()


if __name__ == "__main__":
    main()
