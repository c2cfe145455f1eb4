"""bench/answers_chat.py: which CoQA follow-ups are asked (with the gold conversation before each),
and the peers' chat answers kept apart from their single-question ones, so that a rerun asks them
only what is missing. No model, no engine, no peers' environment: the peers' process is faked."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

chat = load_bench("answers_chat.py", "bench_answers_chat", shadowed=("_llama",))

STORY = {
    "source": "mctest",
    "id": "3abcdefghijklmnop",
    "story": "Anna has a red ball. She plays in the park every morning with Tom.",
    "questions": [
        {"turn_id": 1, "input_text": "Who has a ball?"},
        {"turn_id": 2, "input_text": "What color is it?"},
        {"turn_id": 3, "input_text": "Does she play with it?"},
        {"turn_id": 4, "input_text": "Where?"},
        {"turn_id": 5, "input_text": "With whom?"},
    ],
    "answers": [
        {"turn_id": 1, "input_text": "Anna"},
        {"turn_id": 2, "input_text": "red"},
        {"turn_id": 3, "input_text": "yes"},
        {"turn_id": 4, "input_text": "in the garden"},
        {"turn_id": 5, "input_text": "Tom"},
    ],
    "additional_answers": {"0": [{"turn_id": 4, "input_text": "the park"}]},
}


def test_the_follow_ups_asked_carry_the_gold_conversation_before_them() -> None:
    qs = chat.chat_questions([STORY], turns=2)
    # Turn 1 stands alone (answers.py asks such questions); turn 3's answer is "yes"; turn 4's
    # main answer is not in the story, its additional one is.
    assert [q["turn"] for q in qs] == [2, 4]
    assert qs[0]["qid"] == "3abcdefghijklmnop:2" and qs[0]["story"] == "mctest_3abcdefghi.md"
    assert qs[0]["answers"] == ["red"] and qs[1]["answers"] == ["the park"]
    assert qs[0]["history"] == [
        {"role": "user", "content": "Who has a ball?"},
        {"role": "assistant", "content": "Anna"},
    ]
    assert len(qs[1]["history"]) == 6 and qs[1]["history"][-1] == {"role": "assistant", "content": "yes"}
    assert all(q["answerable"] for q in qs)
    assert [q["turn"] for q in chat.chat_questions([STORY], turns=5)] == [2, 4, 5]
    assert len(chat.chat_questions([STORY], turns=5, limit=1)) == 1


class _Sink(io.StringIO):
    def __init__(self, proc: FakePeers) -> None:
        super().__init__()
        self.proc = proc

    def close(self) -> None:
        self.proc.read_job(self.getvalue())
        super().close()


class FakePeers:
    """``subprocess.Popen`` of answers_peers.py: reads the job, answers every cell it asks."""

    jobs: list[dict[str, Any]] = []

    def __init__(self, cmd: list[str], **kwargs: Any) -> None:
        self.stdin = _Sink(self)
        self.stdout = self._lines()  # read once the job is written
        self.returncode = 0

    def read_job(self, text: str) -> None:
        self.job = json.loads(text)
        FakePeers.jobs.append(self.job)

    def _lines(self) -> Any:
        job = self.job
        for q in job["questions"]:
            for s, b in job["cells"]:
                if f"{s}@{b}@{q['qid']}" in job["known"]:
                    continue
                cell = {"system": s, "budget": b, "qid": q["qid"], "answer": q["answers"][0], "contexts": []}
                yield json.dumps(cell) + "\n"

    def wait(self) -> int:
        return 0


def _faked_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The peers' process faked, its cache in ``tmp_path``; the stories' folder."""
    monkeypatch.setattr(chat.H, "OUT", tmp_path / "out")
    monkeypatch.setattr(chat.A.subprocess, "Popen", FakePeers)
    FakePeers.jobs = []
    docs = tmp_path / "docs"
    chat.write_stories([STORY], docs)
    return docs


def _args(systems: list[str], *, leave: str) -> argparse.Namespace:
    return argparse.Namespace(
        systems=systems,
        peers_python="python",
        fresh_peers=False,
        peers_from=None,
        max_new_tokens=64,
        timeout=60,
        leave=leave,
    )


def test_the_peers_chat_answers_are_kept_apart_and_asked_only_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _faked_peers(tmp_path, monkeypatch)
    args = _args(["ragbudget", "langchain", "llamaindex"], leave="")
    qs = chat.chat_questions([STORY], turns=5)

    def cells(questions: list[dict[str, Any]], *, chat_mode: bool = True) -> list[dict[str, Any]]:
        return chat.A.peer_cells(args, "http://x", docs, "/m/model.gguf", questions, [256], chat=chat_mode)

    assert len(cells(qs[:2])) == 4
    (job,) = FakePeers.jobs
    assert job["chat"] is True and job["cells"] == [["langchain", 256], ["llamaindex", 256]]
    assert [q["history"] for q in job["questions"]] == [q["history"] for q in qs[:2]]
    # A larger sample asks only its new question; the same sample asks nothing.
    got = cells(qs)
    assert len(got) == 6 and {c["qid"] for c in got} == {q["qid"] for q in qs}
    assert [q["qid"] for q in FakePeers.jobs[-1]["questions"]] == [qs[2]["qid"]]
    assert len(cells(qs)) == 6 and len(FakePeers.jobs) == 2
    # The same questions asked one at a time (answers.py's path) are not taken from the chat cache.
    cells(qs, chat_mode=False)
    assert len(FakePeers.jobs) == 3 and FakePeers.jobs[-1]["chat"] is False
    assert len(list((tmp_path / "out").glob("answers_peers_*.jsonl"))) == 2


def test_cells_left_out_are_not_asked_and_known_cells_are_not_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _faked_peers(tmp_path, monkeypatch)
    args = _args(["langchain", "llamaindex"], leave="llamaindex@256")
    qs = chat.chat_questions([STORY], turns=5)
    got = chat.A.peer_cells(args, "http://x", docs, "/m/model.gguf", qs[:1], [256, 2048], chat=True)
    assert sorted((c["system"], c["budget"]) for c in got) == [
        ("langchain", 256),
        ("langchain", 2048),
        ("llamaindex", 2048),
    ]
    assert FakePeers.jobs[-1]["known"] == []
    # A new budget for one peer: the known cells of that question are named, not asked again.
    args.leave = "llamaindex@256,llamaindex@512"
    got = chat.A.peer_cells(args, "http://x", docs, "/m/model.gguf", qs[:1], [256, 512, 2048], chat=True)
    job = FakePeers.jobs[-1]
    assert job["cells"] == [["langchain", 512]]
    assert len(got) == 4 and job["known"] == sorted(
        f"{s}@{b}@{qs[0]['qid']}" for s, b in (("langchain", 256), ("langchain", 2048), ("llamaindex", 2048))
    )
    args.leave = "llamaindex"
    with pytest.raises(SystemExit, match="want SYSTEM@BUDGET"):
        chat.A.peer_cells(args, "http://x", docs, "/m/model.gguf", qs[:1], [256], chat=True)


def test_seconds_per_question_is_each_rows_mean() -> None:
    summary: dict[str, dict[str, Any]] = {"ragbudget@256": {}, "langchain@256": {}}
    cells = [
        {"system": "ragbudget", "budget": 256, "seconds": 2.0},
        {"system": "ragbudget", "budget": 256, "seconds": 4.0},
        {"system": "ragbudget", "budget": 2048, "seconds": 9.0},
    ]
    chat.seconds_per_question(cells, summary)
    assert summary["ragbudget@256"]["seconds_per_question"] == 3.0
    assert summary["langchain@256"]["seconds_per_question"] is None


def test_ragbudget_cells_are_kept_by_the_code_that_answered_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cut run keeps what ragbudget answered (bench/out/), under a key of everything an answer
    # depends on; nothing is kept while ragbudget/ has uncommitted changes.
    A = chat.A
    monkeypatch.setattr(A.H, "OUT", tmp_path / "out")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    git = {"rev-parse": "tree1", "status": ""}

    def run(cmd: list[str], **kwargs: Any) -> Any:
        return argparse.Namespace(stdout=git[cmd[1]])

    monkeypatch.setattr(A.subprocess, "run", run)
    args = argparse.Namespace(
        split="squad-test", model=str(model), max_new_tokens=64, threads=2, slots=1, timeout=600.0
    )
    cache = A.ragbudget_cache(args, ["Warsaw"], None)
    assert cache is not None and cache.parent == tmp_path / "out"
    assert A.ragbudget_cache(args, ["Warsaw"], None) == cache  # the same run, the same place
    for change in ({"threads": 1}, {"max_new_tokens": 32}, {"split": "amazon"}):
        assert A.ragbudget_cache(argparse.Namespace(**{**vars(args), **change}), ["Warsaw"], None) != cache
    assert A.ragbudget_cache(args, ["Paris"], None) != cache
    git["rev-parse"] = "tree2"  # other library code
    assert A.ragbudget_cache(args, ["Warsaw"], None) != cache
    git["status"] = " M ragbudget/pipeline.py"  # uncommitted: no key names it
    assert A.ragbudget_cache(args, ["Warsaw"], None) is None

    cache.parent.mkdir(parents=True)
    cells = [
        {"system": "ragbudget", "budget": 256, "qid": "q1", "answer": "old"},
        {"system": "ragbudget", "budget": 256, "qid": "q1", "answer": "new"},
        {"system": "ragbudget", "budget": 256, "qid": "q2", "error": "EngineTimeoutError: slow"},
        {"system": "ragbudget", "budget": 512, "qid": "q1", "answer": "x"},
        {"system": "ragbudget", "budget": 256, "qid": "q3", "answer": "y"},
    ]
    cache.write_text("".join(json.dumps(c) + "\n" for c in cells), encoding="utf-8")
    questions = [{"qid": "q1"}, {"qid": "q2"}, {"qid": "q3"}]
    kept = A.kept_cells(cache, ["ragbudget"], [256], questions, {("ragbudget", 256, "q3")})
    # Each wanted cell once (the last kept), a failed one asked again, one already done not taken.
    assert kept == [cells[1]]
    assert A.kept_cells(None, ["ragbudget"], [256], questions, set()) == []
