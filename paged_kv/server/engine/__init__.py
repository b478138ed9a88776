"""The engine's host: the engine core, its clients, and the processes of ``paged-kv serve``."""
