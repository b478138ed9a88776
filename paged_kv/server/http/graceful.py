"""uvicorn's server with the exit code a supervisor expects after a clean SIGTERM."""

from __future__ import annotations

import logging
import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but a SIGTERM ends it as any clean shutdown does: exit 0, after
    uvicorn's own drain (uvicorn re-raises the signal once it has shut down: exit 143).
    ``paged-kv serve`` and ``paged-kv route`` both run on it."""

    logger = logging.getLogger("paged_kv.server")
    sigterm_message = "SIGTERM: shutting down"

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self.logger.info(self.sigterm_message)
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]
