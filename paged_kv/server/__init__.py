"""`paged-kv serve`: an OpenAI-compatible HTTP server over the engine.

Needs the ``serve`` extra (fastapi, uvicorn). Three layers, each knowing one thing: the
server knows requests, tenants and HTTP (`app`); `EngineLoop` owns the `Engine` on a thread
of its own; the engine knows sequences and the cache blocks. Tenancy reaches the cache
only as the salt of each request.
"""

from .loop import EngineLoop
from .tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "EngineLoop", "HFTokenizer"]
