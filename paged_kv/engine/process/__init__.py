"""The engine's host, in vLLM's words: the `EngineClient` protocol the HTTP room talks to
(`engine_client`); `EngineCore` (`engine_core`), which steps the `Engine` and fails its
requests when a step fails, and `EngineCoreProc`, the same core serving API server
processes over a Unix socket (`core_socket`); the clients, `CoreClient` (`core_client`, an
API server process's handle on that process) and `InprocClient` (`inproc_client`, the core
on a thread of this process); the messages between the processes (`messages`, framed by
`frames`) and starting and stopping them (`processes`)."""
