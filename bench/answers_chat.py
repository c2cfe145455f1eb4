"""What a user gets in a conversation: CoQA follow-up questions answered by ragbudget's
:class:`~ragbudget.chat.Conversation` against LangChain's conversational RAG chain and LlamaIndex's
``condense_plus_context`` chat engine, at the same context budgets, on one real engine and model
(#43 §2, "CoQA follow-ups through chat"): the conversational counterpart of ``bench/answers.py``.

Ground (each system as its users run it, on the same documents, engine, model and answer cap):

* **Documents**: ``--stories`` CoQA stories (the seeded sample ``bench/coqa_chat.py`` draws), one
  file per story, all in one folder that each system indexes its own way.
* **Questions**: the follow-ups (turn ≥ 2) of those stories, up to ``--turns`` per story and
  ``--questions`` in all, whose gold answer is not yes/no/unknown and occurs in the story
  (``coqa_chat.follow_ups``). Each is asked once per system and budget with the **gold
  conversation** before it as history (CoQA's own evaluation conditions on gold history), so an
  error does not carry into the next turn.
* **ragbudget**: ``Conversation.from_messages(Pipeline(index, engine=URL), history,
  context_tokens=B, max_new_tokens=N).ask(question)``: the index built with every default, the
  conversation with its defaults (history capped at 0.3 of the prompt room, the last 2 turns
  verbatim, older ones folded into a summary the same model writes, follow-ups expanded for
  retrieval), the pipeline's span packing and prompt; ``context_tokens`` caps the context at B.
  No summary cache is shared between questions (the constructor's default): every cell stands alone.
* **peers** (``bench/answers_peers.py`` with ``"chat": true``, in their own virtual environment:
  ``--peers-python``): ``langchain`` (``create_history_aware_retriever`` + ``create_retrieval_chain``
  + ``create_stuff_documents_chain`` over the 400-token splitter, MiniLM, FAISS, top 4 of
  ``answers.py``, the retrieved text cut to B tokens) and ``llamaindex``
  (``index.as_chat_engine(chat_mode="condense_plus_context")`` over the same ``VectorStoreIndex``,
  ``chat(question, chat_history=history)``, its window set so that it packs B tokens of context).
  Both rewrite the follow-up into a standalone question with the model first (one more request).
* **Engine**: one ``llama-server`` serving ``--model``, greedy, at most ``--max-new-tokens`` new
  tokens, one request at a time unless ``--slots`` says otherwise; its window per slot is the
  largest budget + 1,024 (templates, question) + :data:`HISTORY_ROOM` + the answer cap, which also
  sets the prompt room ragbudget's history share is taken from.

Scores as ``bench/answers.py`` (its ``summarize``): SQuAD v1.1 EM and token F1 (max over gold
answers, ``[n]`` citation markers removed), paired bootstrap 95% intervals of ragbudget minus each
peer, the answer in the context a system was given (a gold answer inside it), the wrongly-declined
rate, ragbudget's citation precision, failed requests; and seconds per question.

    python bench/answers_chat.py --stories 60 --skip-stories 30 --turns 4 --budgets 256,2048 \\
        --model qwen2.5-coder-0.5b-instruct --peers-python /path/to/peers-venv/bin/python

``--skip-stories 30`` asks only the stories the chat policy was not built on (``bench/coqa_chat.py``
chose its defaults on the first 30 of the same seeded sample; all 60 are indexed, as there).

Writes ``bench/results/answers_coqa_<model>.json`` with every answer (and, per cell, what each
system searched for). The peers' answers are kept in ``bench/out/`` (a cache of their own,
keyed by the documents, model and cap): a rerun asks only what is missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import answers as A  # noqa: E402
import numpy as np  # noqa: E402
from _llama import llama_server  # noqa: E402
from coqa_chat import follow_ups, load_stories  # noqa: E402

SPLIT = "coqa"
#: ragbudget's rows: the conversation's options (its defaults for ``ragbudget``); the rewrite of
#: follow-ups was chosen between the two others on the tuning stories.
CONVERSATION_ROWS: dict[str, dict[str, Any]] = {
    "ragbudget": {},
    "ragbudget_terms": {"rewrite_with_model": False},
    "ragbudget_rewrite": {"rewrite_with_model": True},
}
for _row in CONVERSATION_ROWS:
    A.RAGBUDGET_ROWS.setdefault(_row, {})  # the same pipeline for each
SYSTEMS = (*CONVERSATION_ROWS, "langchain", "llamaindex")
#: Tokens of the engine's window per slot set aside for the conversation's history.
HISTORY_ROOM = 1024
LABELS = {
    "ragbudget": "ragbudget `Conversation` (span packing, its history policy)",
    "ragbudget_terms": "ragbudget `Conversation`, follow-ups expanded by terms",
    "ragbudget_rewrite": "ragbudget `Conversation`, follow-ups rewritten by the model",
    "langchain": "LangChain conversational RAG (history-aware retriever, stuff chain)",
    "llamaindex": "LlamaIndex chat engine (`condense_plus_context`)",
}
PEER_PACKAGES = (
    "langchain-classic",
    "langchain-core",
    "langchain-community",
    "langchain-openai",
    "llama-index-core",
    "llama-index-llms-openai-like",
    "faiss-cpu",
    "sentence-transformers",
)


def story_file(story: dict[str, Any]) -> str:
    return f"{story['source']}_{story['id'][:10]}.md"


def chat_questions(stories: list[dict[str, Any]], turns: int, limit: int = 0) -> list[dict[str, Any]]:
    """The follow-ups of ``stories`` (at most ``turns`` each, ``limit`` in all; 0: no limit), in
    story order: ``answers.py``'s question records, with the story's file, the turn and the gold
    ``history`` before it (OpenAI-style messages)."""
    out = [
        {
            "qid": f"{s['id']}:{turn}",
            "story": story_file(s),
            "turn": turn,
            "text": text,
            "answers": list(answers),
            "answerable": True,
            "history": history,
        }
        for s in stories
        for turn, text, answers, history in follow_ups(s, turns)
    ]
    return out[:limit] if limit else out


def write_stories(stories: list[dict[str, Any]], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for s in stories:
        (folder / story_file(s)).write_text(s["story"].strip() + "\n", encoding="utf-8")


def ask_in_conversation(
    pipe: Any, q: dict[str, Any], budget: int, max_new_tokens: int, files: dict[str, str], row: str
) -> dict[str, Any]:
    """ragbudget's cell: a conversation loaded from the gold history, asked the follow-up (with
    ``row``'s options, :data:`CONVERSATION_ROWS`)."""
    from ragbudget.chat import Conversation

    conv = Conversation.from_messages(
        pipe, q["history"], context_tokens=budget, max_new_tokens=max_new_tokens, **CONVERSATION_ROWS[row]
    )
    turn = conv.ask(q["text"])
    return {
        **A.answer_fields(turn.answer, files),
        "retrieval_query": turn.retrieval_query,
        "follow_up": turn.answer.report.get("follow_up"),
        "memory": turn.budget.to_dict(),
    }


def seconds_per_question(cells: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Each summary cell's mean seconds per question (every request of the question: rewriting,
    summarizing, answering), beside its scores."""
    for key, cell in summary.items():
        s, b = key.rsplit("@", 1)
        took = [c["seconds"] for c in cells if c["system"] == s and c["budget"] == int(b) and "seconds" in c]
        cell["seconds_per_question"] = float(np.mean(took)) if took else None


def peer_versions(python: str) -> dict[str, str | None]:
    """The peers' package versions, as their environment has them."""
    code = (
        "import json, importlib.metadata as m\n"
        "def v(p):\n"
        "    try: return m.version(p)\n"
        "    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{p: v(p) for p in {list(PEER_PACKAGES)!r}}}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-300:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stories", type=int, default=30, help="CoQA stories indexed (seeded sample)")
    ap.add_argument(
        "--skip-stories",
        type=int,
        default=0,
        help="ask no follow-up of the first N stories (all are indexed): the held-out stories of "
        "bench/coqa_chat.py are --stories 60 --skip-stories 30, the first 30 having built the chat policy",
    )
    ap.add_argument(
        "--ask-stories",
        type=int,
        default=0,
        help="ask the follow-ups of only N stories after the skipped ones (0: all): the tuning stories are "
        "--stories 60 --ask-stories 30",
    )
    ap.add_argument("--turns", type=int, default=4, help="follow-up questions per story (at most)")
    ap.add_argument("--questions", type=int, default=0, help="follow-up questions in all (0: every one)")
    A.add_run_options(ap, systems="ragbudget,langchain,llamaindex")
    ap.add_argument("--table", type=Path, metavar="RAW", help="print a raw result's table; nothing is run")
    args = ap.parse_args()
    if args.table:
        print(A.table(json.loads(args.table.read_text(encoding="utf-8")), labels=LABELS))
        return
    args.split = SPLIT  # what answers.reused_cells compares
    budgets = [int(b) for b in args.budgets.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)} (one of {', '.join(SYSTEMS)})")
    gguf = A.gguf_path(args.model)
    t_start = time.time()

    stories = load_stories(args.stories, args.seed)
    asked_stories = stories[args.skip_stories :][: args.ask_stories or None]
    questions = chat_questions(asked_stories, args.turns, args.questions)
    files = [story_file(s) for s in stories]
    asked = sorted({q["story"] for q in questions})
    print(f"{SPLIT}: {len(stories)} stories indexed, {len(questions)} follow-ups of {len(asked)} of them")
    with tempfile.TemporaryDirectory(prefix="answers-chat-") as tmp:
        docs = Path(tmp) / "docs"
        write_stories(stories, docs)
        slot = max(budgets) + 1024 + HISTORY_ROOM + args.max_new_tokens
        with llama_server(Path(tmp), model=gguf, slots=args.slots, slot_tokens=slot, threads=args.threads) as url:
            print(f"llama-server at {url} ({Path(gguf).name}, {slot} tokens a slot)", flush=True)
            ours = [s for s in args.systems if s in A.RAGBUDGET_ROWS]
            cells = A.ragbudget_cells(args, url, docs, files, questions, budgets, ours, ask=ask_in_conversation)
            H.OUT.mkdir(parents=True, exist_ok=True)
            (H.OUT / "answers_chat_last_ragbudget.json").write_text(json.dumps(cells), encoding="utf-8")
            cells += A.peer_cells(args, url, docs, gguf, questions, budgets, chat=True)
    summary, diffs = A.summarize(cells, questions, args.systems, budgets)
    seconds_per_question(cells, summary)
    A.print_summary(summary, diffs)
    from _results import write

    model_name = Path(gguf).stem.lower().replace("-", "_").replace(".", "_")
    result = {
        "split": SPLIT,
        "mode": "chat: CoQA follow-ups (turn >= 2), the gold conversation before each as history",
        "chat": True,
        "documents_indexed": files,
        "stories_asked": asked,
        "questions_answerable": len(questions),
        "questions_unanswerable": 0,
        "budgets": budgets,
        "systems": args.systems,
        "model": Path(gguf).name,
        "engine": {"server": "llama.cpp llama-server", "slots": args.slots, "threads": args.threads, "slot": slot},
        "max_new_tokens": args.max_new_tokens,
        "peer_versions": peer_versions(args.peers_python) if args.peers_python else None,
        "summary": summary,
        "paired_f1_differences": diffs,
        "questions": questions,
        "cells": cells,
        "seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    out = args.out or (H.ROOT / "bench" / "results" / f"answers_{SPLIT}_{model_name}.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers"))


if __name__ == "__main__":
    main()
