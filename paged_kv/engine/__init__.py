"""Serving on the paged cache: an embedded model, a continuous-batching engine, metrics.

Needs the ``serve`` extra (prometheus-client, tqdm).
"""

from .config import EngineConfig
from .engine import Engine
from .errors import EngineDeadError
from .model import TinyLlama, TinyLlamaConfig
from .outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from .request import Request, Sequence, Status
from .sampling import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "EngineDeadError", "EngineStats",
           "Request", "RequestOutput", "SamplingParams", "Sequence", "Status", "StepOutput",
           "TinyLlama", "TinyLlamaConfig"]
