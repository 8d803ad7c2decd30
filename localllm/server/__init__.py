"""`localllm serve`: Ollama's API and OpenAI's /v1 over the continuous-batching scheduler.

- common.py: the loaded model (`ServerState`), request validation, options, prompts, and the
  bridge from the engine thread's events to asyncio (`Stream`);
- ollama.py, openai_api.py: the two dialects, formatting events only;
- app.py: the Starlette app, errors per dialect, and the `serve` command (uvicorn).
"""

from localllm.server.app import build_app
from localllm.server.common import ServerState

__all__ = ["ServerState", "build_app"]
