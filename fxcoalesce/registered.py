"""The backend registered as ``"fxcoalesce"`` (entry point ``torch_dynamo_backends``).

``torch.compile(fn, backend="fxcoalesce")`` loads this module as it resolves the name, before
Dynamo sees a frame. Loading it does what ``fxcoalesce.backend()`` does when it is made: it
says where this rank runs and hears what Dynamo makes of every frame, so a frame that Dynamo
skips before any graph compiles is heard too (a peer waiting for a graph this rank will not
compile stops waiting; fuzz seed 550111: a print inside a loop on rank 0 only, the peer
waited half the group's timeout).
"""

from __future__ import annotations

from .compiler import fxcoalesce_backend as backend
from .ranks.agreement import announce
from .ranks.hooks import watch_dynamo

announce()
watch_dynamo()

__all__ = ["backend"]
