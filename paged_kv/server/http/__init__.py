"""The HTTP room: the FastAPI app (`app`), its declared routes (`routes`), OpenAI's request
shapes and limits (`protocol`), response bodies and streams (`responses`), the server's
logic without HTTP (`service.OpenAIService`), one request's generation (`generation`) and
the tokenizers (`tokenizer`). It reaches the engine only through `engine.EngineClient`."""
