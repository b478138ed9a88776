"""`paged-kv serve`: an OpenAI-compatible HTTP server over the engine.

Needs the ``serve`` extra (fastapi, uvicorn, pyzmq, msgspec). Three layers, each knowing one
thing: the server knows requests, tenants and HTTP (`http/`); the engine core owns the
`Engine`, in a process of its own under ``paged-kv serve`` (`engine/engine_core`, reached
through `engine/core_client.CoreClient`) or on a thread of this one (`EngineLoop`); the
engine knows sequences and the cache blocks. Tenancy reaches the cache only as the salt of
each request.
"""

from .engine.inproc_client import EngineLoop
from .http.tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "EngineLoop", "HFTokenizer"]
