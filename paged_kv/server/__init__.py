"""`paged-kv serve`: an OpenAI-compatible HTTP server over the engine.

Needs the ``serve`` extra (fastapi, uvicorn, pyzmq, msgspec). The HTTP floor, over the
engine's (`paged_kv.engine.process` hosts the `Engine` in a process of its own under
``paged-kv serve`` — `engine_core.EngineCoreProc`, reached through `core_client.CoreClient`
— or on a thread of this one, `inproc_client.InprocClient`; both clients meet the
`EngineClient` protocol this floor talks to):

- `http/`: requests, tenants, tokenizers and HTTP (the FastAPI app, its routes, OpenAI's
  request and response shapes, one request's generation);
- `serve.py`: ``paged-kv serve``, the engine-core process and the API server processes.

The engine knows sequences and the cache blocks. Tenancy reaches the cache only as the salt
of each request.
"""

from ..engine.process.inproc_client import InprocClient
from .http.tokenizer import ByteTokenizer, HFTokenizer

# the in-process client's name before the server was split into rooms (README, user code)
EngineLoop = InprocClient

__all__ = ["ByteTokenizer", "EngineLoop", "HFTokenizer", "InprocClient"]
