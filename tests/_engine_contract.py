"""The engine contract's checks, run alike on every built-in engine kind (tests/test_engines.py)
and on a plugin installed as a wheel and written only against the public names of
``ragbudget.generation.engines`` (tests/test_engine_plugins.py): what the pipeline, chat and the
server ask of any backend (the ``Backend`` protocol), on a replay engine at ``url``."""

from __future__ import annotations

from typing import Any

QUESTION = "How is the Project Leader elected?"


def check_engine(backend: Any, *, kind: str, url: str) -> dict[str, Any]:
    """Assert the contract on ``backend`` (connected to the engine at ``url``); what it saw."""
    from ragbudget.generation.backend import Backend, Capacity, RenderedPrompt

    assert isinstance(backend, Backend), f"{type(backend).__name__} misses a member of the Backend protocol"
    assert backend.kind == kind and backend.url == url.rstrip("/")
    backend.warm_up()
    cap = backend.capacity()
    assert isinstance(cap, Capacity) and cap.engine_kind == kind and cap.url == backend.url
    assert cap.plan is None  # an engine holds its own memory: no plan of ragbudget's
    assert cap.max_context_tokens and cap.max_context_tokens > 0 and cap.max_context_source
    with backend.probing():  # a quick look, as the server's health check takes
        fresh = backend.capacity(fresh=True)
    assert fresh.measured_at >= cap.measured_at
    counts = backend.count(["one two three", "one two three four five six"])
    assert len(counts) == 2 and 0 < counts[0] < counts[1]
    msgs = [{"role": "user", "content": QUESTION}]
    rendered = backend.render(msgs)
    assert isinstance(rendered, RenderedPrompt) and rendered.n_tokens > 0
    assert backend.template_overhead() >= 0
    backend.prefetch(["seven eight"], [msgs])
    builder = backend.prompt_builder("Be brief.")
    assert builder.count("seven eight") == backend.count(["seven eight"])[0]
    before = sum(backend.requests_sent().values())
    pieces: list[str] = []
    gen = backend.generate(msgs, max_new_tokens=8, on_text=pieces.append)
    assert gen.text and "".join(pieces) == gen.text and gen.finish_reason in ("stop", "length")
    sent = backend.requests_sent()  # by route; the answer was one more request at least
    assert sent and all(n > 0 for n in sent.values()) and sum(sent.values()) > before, sent
    backend.close()
    return {"text": gen.text, "sent": dict(sent), "window": cap.max_context_tokens}
