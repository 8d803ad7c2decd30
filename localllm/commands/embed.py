"""`localllm embed MODEL TEXT...`: one embedding vector per text, printed as JSON.

The texts are embedded as /api/embed does it (generation/embed.py): tokenized as raw text
([CLS] ... [SEP] for a BERT vocabulary), pooled as the GGUF asks (`{arch}.pooling_type`,
else mean; `--pooling` overrides) and L2-normalised unless `--no-normalize`. A text longer
than the context keeps its start (Ollama's `truncate`), or is an error with `--no-truncate`.
`-` as a text reads one text from standard input. Output, one JSON object:
`{"model": ..., "embeddings": [[...], ...], "prompt_eval_count": N}`.
"""

from __future__ import annotations

import argparse
import json
import sys

from localllm.commands.options import add_model_opts, engine_options
from localllm.errors import InvalidValueError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embedding vectors of texts, as JSON")
    p.add_argument("model", metavar="MODEL", help="model path or name")
    p.add_argument("texts", nargs="+", metavar="TEXT",
                   help="texts to embed, one vector each ('-': read one from stdin)")
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                   help="pooling over the tokens (default: the model's, else mean)")
    p.add_argument("--no-normalize", action="store_true",
                   help="print the pooled vectors as they are (default: unit L2 norm)")
    p.add_argument("--no-truncate", action="store_true",
                   help="a text longer than the context is an error (default: keep its start)")
    add_model_opts(p)
    p.set_defaults(func=cmd_embed)


def cmd_embed(ns: argparse.Namespace) -> int:
    from localllm.engine import Engine
    from localllm.generation.embed import InputTooLongError, embed_tokens, encode_inputs
    from localllm.store.default import resolve_model

    texts = [sys.stdin.read() if t == "-" else t for t in ns.texts]
    if ns.texts.count("-") > 1:
        raise InvalidValueError("'-' (standard input) can be given once")
    path = resolve_model(ns.model)
    opts = engine_options(ns)
    if opts["device"] == "auto":
        opts["device"] = "cpu"  # one-off vectors: not worth a GPU upload
    engine = Engine(path, **opts)
    try:
        ids = encode_inputs(engine, texts, truncate=not ns.no_truncate)
    except InputTooLongError as e:  # its own words are the server's: say it in the CLI's
        raise InvalidValueError(
            f"text {e.index + 1} is {e.n_tokens} tokens but the context holds {e.n_ctx} "
            "(without --no-truncate only its start is embedded)") from None
    vecs = embed_tokens(engine, ids, ns.pooling, normalize=not ns.no_normalize)
    out = {"model": str(ns.model), "embeddings": vecs.tolist(),
           "prompt_eval_count": sum(len(t) for t in ids)}
    print(json.dumps(out))
    sys.stdout.flush()
    return 0
