"""ragbudget.server.openai_api.answers: answers shaped as OpenAI's objects and stream frames,
carrying what clients read and no host figure or absolute path (tests/test_server.py checks the
same over HTTP).
"""

from __future__ import annotations

import json

from ragbudget.pipeline import Answer
from ragbudget.prompt.select import Dropped, SelectedChunk, Selection
from ragbudget.server.openai_api.answers import (
    Completion,
    hits_body,
    models_body,
    public_paths,
    public_report,
    selection_body,
    sse,
)
from ragbudget.types import Hit, Source

MODELS = ["fake/model", "ragbudget"]


# --- responses ------------------------------------------------------------------------------------


REPORT = {
    "budget": {
        "prompt_tokens": 300,
        "new_tokens": 12,
        "max_new_tokens": 64,
        "gpu": "RTX 4090",
        "free_bytes": 21 << 30,
        "kv_bytes_per_token": 131072,
    },
    "plan": {"gpu": "RTX 4090", "usable_bytes": 20 << 30},
    "selection": {"chunks": [{"path": "/home/ann/corpus/docs/kv.md"}]},
    "oom_steps": [{"action": "halve_context", "reason": "CUDA out of memory; 21.6 GiB total", "cache": "dynamic"}],
    "timings": {"total_s": 0.5},
}


def answer(finish_reason: str = "stop") -> Answer:
    return Answer(
        text="KV is [1].",
        sources=[
            {"path": "/home/ann/corpus/docs/kv.md", "start": 0, "end": 9},
            {"path": "docs/rel.md", "start": 3, "end": 4},
        ],
        report=REPORT,
        finish_reason=finish_reason,
    )


def test_completion_body() -> None:
    body = Completion(id="chatcmpl-1", created=1700000000, model="fake/model").body(answer())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["model"] == "fake/model"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "KV is [1]."},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 12, "total_tokens": 312}
    assert [s["path"] for s in body["sources"]] == ["kv.md", "docs/rel.md"]  # no absolute path
    shown = json.dumps(body["ragbudget"])
    assert "RTX" not in shown and "free_bytes" not in shown and "GiB" not in shown and "plan" not in body["ragbudget"]
    assert body["ragbudget"]["budget"] == {"prompt_tokens": 300, "new_tokens": 12, "max_new_tokens": 64}
    assert body["ragbudget"]["oom_steps"] == [{"action": "halve_context", "cache": "dynamic"}]
    assert body["ragbudget"]["selection"] == {"chunks": [{"path": "kv.md"}]}
    # OpenAI's finish reasons: "length" stays, ragbudget's "cancelled" is a stop.
    assert Completion(id="c", created=0, model="m").body(answer("length"))["choices"][0]["finish_reason"] == "length"
    assert Completion(id="c", created=0, model="m").body(answer("cancelled"))["choices"][0]["finish_reason"] == "stop"


def test_expose_plan_sends_the_whole_report_but_no_absolute_path() -> None:
    report = Completion(id="c", created=0, model="m", expose_plan=True).body(answer())["ragbudget"]
    assert report["budget"]["gpu"] == "RTX 4090" and report["plan"]["usable_bytes"] == 20 << 30
    assert report["selection"] == {"chunks": [{"path": "kv.md"}]}
    assert public_report(REPORT, expose_plan=False)["budget"]["prompt_tokens"] == 300


def test_stream_frames() -> None:
    c = Completion.new("fake/model")
    assert c.id.startswith("chatcmpl-") and len(c.id) > len("chatcmpl-") + 16 and c.created > 1_600_000_000
    assert Completion.new("m").id != c.id
    frame = c.chunk({"content": "é"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and "é".encode() in frame  # UTF-8, not \\u
    event = json.loads(frame[len(b"data: ") :])
    assert event["object"] == "chat.completion.chunk" and event["id"] == c.id
    assert event["choices"] == [{"index": 0, "delta": {"content": "é"}, "finish_reason": None, "logprobs": None}]
    last = json.loads(c.last_chunk(answer("length"), include_usage=True)[6:])
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert last["usage"]["total_tokens"] == 312 and last["sources"][0]["path"] == "kv.md"
    assert "RTX" not in json.dumps(last["ragbudget"])
    assert "usage" not in json.loads(c.last_chunk(answer(), include_usage=False)[6:])
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_public_paths() -> None:
    doc = {
        "path": "/srv/idx/a/b.md",
        "file": "C:\\corpus\\c.pdf",
        "index_dir": "/srv/idx/",
        "source_path": "rel/d.md",
        "text": "/etc/passwd is quoted text, not a path field",
        "nested": [{"path": "/x/y/z.txt"}, ("tuple", {"path": "/q.md"})],
    }
    assert public_paths(doc) == {
        "path": "b.md",
        "file": "c.pdf",
        "index_dir": "idx",
        "source_path": "rel/d.md",
        "text": "/etc/passwd is quoted text, not a path field",
        "nested": [{"path": "z.txt"}, ["tuple", {"path": "q.md"}]],
    }


def test_retrieve_and_models_bodies() -> None:
    src = Source(path="/home/ann/corpus/kv.md", start=0, end=40, page_start=2, page_end=2)
    hits = [Hit(chunk_id=7, score=0.91234567, text="KV cache", n_tokens=3, sources=(src,))]
    body = hits_body("kv", hits)
    assert body["object"] == "list" and body["query"] == "kv"
    assert body["data"][0]["chunk_id"] == 7 and body["data"][0]["sources"][0]["path"] == "kv.md"
    selection = Selection(
        chunks=(SelectedChunk(chunk_ids=(7,), text="KV cache", score=0.9, n_tokens=3, cost=5, sources=(src,)),),
        tokens_used=5,
        tokens_allowed=100,
        dropped=(Dropped(chunk_id=8, reason="over_budget", score=0.2, n_tokens=90),),
    )
    body = selection_body("kv", selection)
    assert (body["tokens_used"], body["tokens_allowed"]) == (5, 100)
    assert body["data"][0]["sources"][0]["path"] == "kv.md"
    assert body["dropped"] == [{"chunk_id": 8, "reason": "over_budget", "score": 0.2, "n_tokens": 90}]
    assert models_body(MODELS, 5) == {
        "object": "list",
        "data": [
            {"id": "fake/model", "object": "model", "created": 5, "owned_by": "ragbudget"},
            {"id": "ragbudget", "object": "model", "created": 5, "owned_by": "ragbudget"},
        ],
    }
