"""`localllm serve`: Ollama's API and OpenAI's /v1 over the continuous-batching scheduler.

- common.py: a loaded model (`ServerState`), request validation, options, prompts, and the
  bridge from the engine thread's events to asyncio (`Stream`);
- models.py: which models are loaded (`ModelManager`): names, loading on first request,
  keep_alive, unloading least recently used within --max-loaded/--max-memory;
- ollama.py, openai_api.py, embeddings.py: the dialects, formatting events only;
- model_routes.py: tags, ps, pull, copy, delete, create, /health, /slots;
- access.py: the access log;
- app.py: the Starlette app, errors per dialect, and the `serve` command (uvicorn).
"""

from localllm.server.app import build_app
from localllm.server.common import ServerState

__all__ = ["ServerState", "build_app"]
