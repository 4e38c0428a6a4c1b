"""Kernels that make one collective cheaper (issue 15): a fused all_reduce + residual add +
RMSNorm op over symmetric memory, the symmetric-memory workspace and readiness check it
needs, and fake kernels for torch's own symm_mem ops where this torch lacks them.

Importing this package registers ``torch.ops.fxcoalesce.all_reduce_add_rms_norm`` and the
copy-in ``torch.ops.fxcoalesce.one_shot_all_reduce`` (the one-shot under CUDA graphs, on the
same workspace) and ``torch.ops.fxcoalesce.nccl_symm_all_reduce`` (NCCL's all_reduce on a
registered window: ``nccl_symm``); it needs
no GPU and no Triton (the Triton kernel is imported only where Triton is).

    from fxcoalesce.kernels import symm_mem_ready, ensure_symm_mem_fakes
    ok, why = symm_mem_ready(group_name)          # collective, cached; same on every rank
    normed, residual_out = torch.ops.fxcoalesce.all_reduce_add_rms_norm(
        x, residual, weight, eps, group_name)
"""

from . import nccl_symm  # noqa: F401  (registers fxcoalesce::nccl_symm_all_reduce)
from . import one_shot  # noqa: F401  (registers fxcoalesce::one_shot_all_reduce)
from . import tag_check  # noqa: F401  (registers fxcoalesce::tag_after)
from .fakes import ensure_symm_mem_fakes
from .ops import HAS_TRITON, kernel_supports, reference
from .symm import get_workspace, symm_mem_ready

__all__ = ["HAS_TRITON", "ensure_symm_mem_fakes", "get_workspace", "kernel_supports",
           "reference", "symm_mem_ready"]
