"""OpenAI chat-completions answers as ``ragbudget serve`` shapes them: :class:`Completion` makes an
answer a ``chat.completion`` object or ``chat.completion.chunk`` server-sent events (:func:`sse`),
the ``/v1/retrieve`` and ``/v1/models`` bodies; :func:`public_report` and :func:`public_paths`
keep host memory figures and absolute paths out of what clients see.

>>> public_paths({"sources": [{"path": "/home/ann/docs/a.md", "page": 2}]})
{'sources': [{'path': 'a.md', 'page': 2}]}
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any  # Any: JSON values (what json.loads gives, json.dumps takes)

if TYPE_CHECKING:
    from ...packing.select import Selection
    from ...pipeline import Answer
    from ...types import Hit

__all__ = [
    "Completion",
    "finish_reason_of",
    "hits_body",
    "models_body",
    "public_paths",
    "public_report",
    "selection_body",
    "sse",
    "usage_of",
]

# What of an answer's report a client sees without ``expose_plan``: the budget figures of the
# request itself (tokens allowed, used, reserved), never the host's (GPU name, free/total/usable
# bytes, weights, KV capacity and bytes per token: together they describe the machine).
_PUBLIC_BUDGET = (
    "max_context_tokens",
    "max_prompt_tokens",
    "context_tokens_allowed",
    "context_tokens_used",
    "context_tokens_cap",
    "fixed_prompt_tokens",
    "prompt_tokens",
    "max_new_tokens",
    "new_tokens",
    "kv_tokens_reserved",
    "limited_by",
    "fill",
)
# An OOM step's "reason" is the allocator's message (total, free and reserved bytes of the GPU).
_PUBLIC_OOM_STEP = ("action", "prompt_tokens_before", "prompt_tokens_after", "cache", "use_cache")
# "index": the generation of the index the answer's chunks come from (no host figure);
# "follow_up": what a follow-up was searched by (the client's own words, rewritten).
_PUBLIC_REPORT = ("selection", "dropped", "timings", "memory", "history_summary", "index", "evidence", "follow_up")


def public_report(report: dict[str, Any], *, expose_plan: bool) -> dict[str, Any]:
    """The ``ragbudget`` field of a response: the whole report with ``expose_plan``, otherwise
    only the figures describing the request (a whitelist: a field added to the report later stays
    private until it is added here). Paths are made relative either way (:func:`public_paths`)."""
    shown: dict[str, Any]  # public_paths keeps a dict a dict
    if expose_plan:
        shown = public_paths(report)
        return shown
    out: dict[str, Any] = {k: report[k] for k in _PUBLIC_REPORT if k in report}
    budget = report.get("budget")
    if isinstance(budget, dict):
        out["budget"] = {k: budget[k] for k in _PUBLIC_BUDGET if k in budget}
    steps = report.get("oom_steps")
    if isinstance(steps, (list, tuple)):
        out["oom_steps"] = [
            {k: v for k, v in step.items() if k in _PUBLIC_OOM_STEP} if isinstance(step, dict) else {} for step in steps
        ]
    shown = public_paths(out)
    return shown


def _public_path(path: str) -> str:
    """``path`` as a client may see it: unchanged when relative (the index stores display paths,
    below a root's label); an absolute one (an index built with absolute paths) becomes its file
    name. The server never tells a client where its files live."""
    if not (os.path.isabs(path) or (len(path) > 2 and path[1] == ":" and path[2] in "/\\")):
        return path
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


# Keys whose string values are filesystem paths in ragbudget's records.
_PATH_KEYS = {"path", "file", "index_dir", "source_path"}


def public_paths(obj: Any) -> Any:
    """A copy of a JSON-ready ``obj`` with every path-valued field made public (:func:`_public_path`)."""
    if isinstance(obj, dict):
        return {
            k: _public_path(v) if k in _PATH_KEYS and isinstance(v, str) else public_paths(v) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [public_paths(v) for v in obj]
    return obj


def usage_of(answer: Answer) -> dict[str, int]:
    budget = answer.report["budget"]
    prompt, completion = int(budget["prompt_tokens"]), int(budget["new_tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason_of(answer: Answer) -> str:
    # OpenAI knows stop/length/content_filter/tool_calls; ragbudget's "cancelled" maps to stop.
    return "length" if answer.finish_reason == "length" else "stop"


def sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def hits_body(query: str, hits: Sequence[Hit]) -> dict[str, Any]:
    """The ``/v1/retrieve`` answer for ``k``: the hits, best first."""
    return {"object": "list", "query": query, "data": public_paths([h.to_dict() for h in hits])}


def selection_body(query: str, selection: Selection) -> dict[str, Any]:
    """The ``/v1/retrieve`` answer without ``k``: the chunks that fit, and those dropped."""
    return {
        "object": "list",
        "query": query,
        "data": public_paths([c.to_dict() for c in selection.chunks]),
        "tokens_used": selection.tokens_used,
        "tokens_allowed": selection.tokens_allowed,
        "dropped": public_paths([d.to_dict() for d in selection.dropped]),
    }


def models_body(models: Sequence[str], created: int) -> dict[str, Any]:
    """The ``/v1/models`` answer: every name the server accepts as ``model``."""
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": created, "owned_by": "ragbudget"} for m in models],
    }


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One chat completion's identity, shared by all its frames: ``id``, ``created`` (Unix
    seconds) and the ``model`` name the client sent. ``expose_plan`` keeps the whole budget report
    (host memory figures) in the ``ragbudget`` field (see :func:`public_report`).

    >>> frame = Completion(id="chatcmpl-1", created=0, model="m").chunk({"content": "Hi"})
    >>> frame[:6], frame[-2:]
    (b'data: ', b'\\n\\n')
    >>> json.loads(frame[6:])["choices"]
    [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None, 'logprobs': None}]
    """

    id: str
    created: int
    model: str
    expose_plan: bool = False

    @classmethod
    def new(cls, model: str, *, expose_plan: bool = False) -> Completion:
        """A fresh id, created now."""
        return cls(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, expose_plan=expose_plan)

    def body(self, answer: Answer) -> dict[str, Any]:
        """The ``chat.completion`` object of a whole answer, with its ``sources`` and the
        ``ragbudget`` report as extra top-level fields."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer.text},
                    "finish_reason": finish_reason_of(answer),
                    "logprobs": None,
                }
            ],
            "usage": usage_of(answer),
            "sources": public_paths(answer.sources),
            "ragbudget": public_report(answer.report, expose_plan=self.expose_plan),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        """One ``chat.completion.chunk`` event carrying ``delta``; ``extra`` adds top-level fields."""
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **extra,
            }
        )

    def last_chunk(self, answer: Answer, *, include_usage: bool) -> bytes:
        """The chunk that ends a streamed answer: its finish reason, ``sources`` and ``ragbudget``
        report, and ``usage`` when the client asked (``stream_options.include_usage``)."""
        extra: dict[str, Any] = {
            "sources": public_paths(answer.sources),
            "ragbudget": public_report(answer.report, expose_plan=self.expose_plan),
        }
        if include_usage:
            extra["usage"] = usage_of(answer)
        return self.chunk({}, finish_reason_of(answer), **extra)
