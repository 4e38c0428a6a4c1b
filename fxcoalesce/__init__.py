"""fxcoalesce: fewer, fused all_reduces for tensor-parallel inference, as a torch.compile pass.

    import fxcoalesce
    compiled = torch.compile(step, backend="fxcoalesce")        # or fxcoalesce.backend(cfg)
    compiled(x); print(fxcoalesce.reports()[-1].summary())
"""

from .analysis import Analysis, analyze
from .compiler import backend, inductor_pass
from .collectives import find_comm_blocks
from .config import Config, CostModel
from .pipeline import run_pipeline
from .report import Report, clear_reports, reports

__all__ = [
    "Analysis", "Config", "CostModel", "Report", "analyze", "backend", "clear_reports",
    "find_comm_blocks", "inductor_pass", "reports", "run_pipeline",
]
