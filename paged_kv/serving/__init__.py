"""Serving on the paged cache: an embedded model, a continuous-batching engine, metrics.

Needs the ``serve`` extra (prometheus-client, tqdm).
"""

from .engine import CompletionOutput, Engine, RequestOutput, StepOutput
from .errors import EngineDeadError
from .model import TinyLlama, TinyLlamaConfig
from .sampling import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineDeadError", "RequestOutput", "SamplingParams",
           "StepOutput", "TinyLlama", "TinyLlamaConfig"]
