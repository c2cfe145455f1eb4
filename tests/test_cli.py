"""The CLI contract: commands, JSON keys, exit codes (0 ok, 1 user error, 2 usage error)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _fakes import make_pdf
from click.testing import CliRunner

from ragbudget.cli.commands import cli


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_help_lists_the_contract_commands(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in ("index", "search", "budget", "ask", "stats", "verify"):
        assert command in result.output


def test_no_help_text_shows_a_doubled_percent_sign(runner: CliRunner) -> None:
    """click prints help strings as written (no %-formatting): a "%%" would show as is."""
    for name in cli.commands:  # type: ignore[attr-defined]
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "%%" not in result.output, name


def test_budget_json_offline_for_a_shipped_model(runner: CliRunner) -> None:
    result = runner.invoke(
        cli, ["budget", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "RTX 4090", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    for key in (
        "kv_bytes_per_token",
        "weights_bytes",
        "activation_bytes",
        "gpu_bytes",
        "kv_capacity_tokens",
        "max_context_tokens",
        "max_concurrency",
        "limited_by",
    ):
        assert key in plan, key
    # Llama 3.1 8B: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16).
    assert plan["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert plan["gpu_bytes"] == 24 * 1024**3
    assert plan["limited_by"] in ("memory", "model")
    assert 0 < plan["max_context_tokens"] <= 131072


def test_budget_concurrency_divides_the_capacity(runner: CliRunner) -> None:
    args = ["budget", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "24GiB", "--json"]
    one = json.loads(runner.invoke(cli, args).stdout)
    four = json.loads(runner.invoke(cli, [*args, "--concurrency", "4"]).stdout)
    assert one["limited_by"] == "model" and one["max_context_tokens"] == 32768
    assert four["limited_by"] == "memory"
    # Four requests share the same KV memory: each may hold at most a quarter of it.
    assert 4 * four["max_context_tokens"] <= one["kv_capacity_tokens"]
    assert four["max_context_tokens"] < one["max_context_tokens"]


def test_budget_plot_writes_a_png(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    result = runner.invoke(
        cli, ["budget", "--model", "meta-llama/Llama-3.2-1B-Instruct", "--gpu", "8GiB", "--plot", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_user_error_is_one_line_exit_1(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["budget", "--gpu", "RTX 9999"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    assert "RTX 4090" in result.output  # says what would have worked


def test_model_that_does_not_fit_is_a_user_error(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["budget", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "RTX 4090"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output


def test_budget_plans_quantized_storage_and_several_gpus(runner: CliRunner) -> None:
    # issue #30 §4: the errors said "pass weight_dtype" and the CLI had no such flag; "2xH100"
    # was an unknown GPU.
    base = ["budget", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--max-new-tokens", "64", "--json"]
    refused = runner.invoke(cli, [*base[:-1], "--gpu", "H100"])
    assert refused.exit_code == 1 and "--weight-dtype int4" in refused.output and "--gpu 2x" in refused.output
    int4 = json.loads(runner.invoke(cli, [*base, "--gpu", "H100", "--weight-dtype", "int4"]).output)
    assert int4["weights_bytes"] == 39_767_785_472 and int4["weight_format"].startswith("int4")
    two = runner.invoke(cli, [*base, "--gpu", "2xH100"])
    assert two.exit_code == 0, two.output
    plan = json.loads(two.output)
    assert (plan["tensor_parallel"], plan["weights_bytes"], plan["kv_bytes_per_token"]) == (2, 70_555_025_408, 163_840)
    flag = json.loads(runner.invoke(cli, [*base, "--gpu", "H100", "--tensor-parallel", "2"]).output)
    assert flag == plan
    table = runner.invoke(cli, base[:-1] + ["--gpu", "2xH100"]).output
    assert "2 × H100 80GB (table), tensor parallel" in table and "usable per GPU" in table
    assert runner.invoke(cli, [*base, "--weight-dtype", "int3"]).exit_code == 2


def test_a_bare_gpu_number_is_refused_not_read_as_bytes(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["budget", "--gpu", "24"])
    assert result.exit_code == 1 and "pass '24GiB'" in result.output and "Traceback" not in result.output


def test_usage_error_exits_2(runner: CliRunner) -> None:
    assert runner.invoke(cli, ["budget", "--no-such-option"]).exit_code == 2
    assert runner.invoke(cli, ["budget", "--concurrency", "0"]).exit_code == 2


def test_search_without_an_index_is_a_user_error(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(cli, ["search", "anything", "--index-dir", str(tmp_path / "none")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output


def _hostile_folder(root: Path) -> Path:
    """Good files next to ones every loader must refuse without stopping the run."""
    import gzip
    import os

    docs = root / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("# Title\n\nThe quick brown fox jumps over the lazy dog.\n" * 20)
    (docs / "good.txt.gz").write_bytes(gzip.compress(b"Compressed text about lighthouses.\n" * 30))
    (docs / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (docs / "empty.txt").write_text("")
    (docs / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 20)
    (docs / "truncated.pdf").write_bytes(b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog")
    (docs / "secret.pdf").write_bytes(make_pdf(["Classified lighthouse keeper notes"], password="pw"))
    (docs / "manual.pdf").write_bytes(make_pdf(["Chapter one about harbours", "Chapter two about tides"]))
    (docs / "huge.txt").write_bytes(b"word " * 300_000)  # 1.5 MB, over the --max-file-mb 1 below
    (docs / "locked.txt").write_text("a file nobody may read\n" * 10)
    (docs / "unknown.xyz").write_text("not a supported type")
    os.symlink(docs, docs / "loop")
    os.symlink("/etc", docs / "outside")
    os.mkfifo(docs / "fifo.txt")
    return docs


def test_index_survives_a_hostile_folder(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import os
    import time

    docs = _hostile_folder(tmp_path)
    os.chmod(docs / "locked.txt", 0)
    # Tests run as root, which reads a chmod 000 file anyway: refuse it the way the kernel refuses
    # an ordinary user, so the loader's handling of EACCES is what is exercised.
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(file).endswith("locked.txt"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    index_dir = tmp_path / "idx"
    t0 = time.monotonic()
    result = runner.invoke(
        cli,
        ["index", str(docs), "--index-dir", str(index_dir), "--embedder", "hash:64", "--max-file-mb", "1", "--json"],
    )
    assert time.monotonic() - t0 < 120  # bounded: nothing blocks on the FIFO or the loop
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["files_indexed"] == 4  # good.md, good.txt.gz, latin1.txt, manual.pdf
    reasons = {Path(s["path"]).name: s["reason"] for s in summary["skipped"]}
    assert reasons.get("binary.txt") == "binary"
    assert reasons.get("empty.txt") == "empty"
    assert reasons.get("truncated.pdf") == "malformed"
    assert reasons.get("unknown.xyz") == "unsupported"
    assert reasons.get("secret.pdf") == "encrypted"
    assert reasons.get("huge.txt") == "too_large"
    assert reasons.get("locked.txt") == "unreadable"
    assert reasons.get("loop") == "symlink_loop"
    assert reasons.get("outside") == "outside_root"
    assert "fifo.txt" in reasons
    # The search and verify commands work on what was indexed.
    hits = json.loads(
        runner.invoke(cli, ["search", "lighthouses", "--index-dir", str(index_dir), "-k", "1", "--json"]).stdout
    )
    assert hits[0]["sources"][0]["path"].endswith("good.txt.gz")
    assert runner.invoke(cli, ["verify", "--index-dir", str(index_dir)]).exit_code == 0
    # Human-readable summary names every skip with its reason.
    again = runner.invoke(cli, ["index", str(docs), "--index-dir", str(index_dir), "--embedder", "hash:64"])
    assert again.exit_code == 0, again.output
    assert "skipped" in again.output and "binary" in again.output


@pytest.mark.model
def test_demo_path_with_the_embedded_models(
    runner: CliRunner, tmp_path: Path, repo_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make demo`: index data/ with MiniLM, answer with the default model (Qwen2.5-Coder-0.5B;
    the suite's tiny stand-in is set aside here), cite the right article."""
    from ragbudget.memory.models import DEFAULT_GENERATOR, MODEL_ENV

    monkeypatch.delenv(MODEL_ENV, raising=False)
    index_dir = str(tmp_path / "idx")
    result = runner.invoke(cli, ["index", str(repo_data), "--index-dir", index_dir, "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        cli,
        [
            "ask",
            "What was Maria Curie the first female recipient of?",
            "--index-dir",
            index_dir,
            "--max-new-tokens",
            "48",
            "--context-tokens",
            "1024",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert "nobel" in doc["answer"].lower()
    assert doc["sources"][0]["path"].endswith("Warsaw.md")
    assert doc["report"]["plan"]["model"].lower().startswith(DEFAULT_GENERATOR)
    b = doc["budget"]
    # An explicit --context-tokens pins the context whatever the time cap, never past what memory
    # and the window allow (the plan keeps that figure apart when it is capped for time).
    plan = doc["report"]["plan"]
    limit = plan["memory_max_context_tokens"] or plan["max_context_tokens"]
    assert b["prompt_tokens"] + b["max_new_tokens"] <= limit
    assert b["context_tokens_used"] <= b["context_tokens_allowed"]
    assert b["context_tokens_allowed"] <= 1024
    # With no cap given, the defaults decide: the relevance floor stops the context early, and
    # on a CPU the measured prefill speed caps it for time (issue #19: the full 7.8k-token
    # allowance was filled down to a fused score of -0.005 and answered wrongly).
    result = runner.invoke(
        cli,
        [
            "ask",
            "What was Maria Curie the first female recipient of?",
            "--index-dir",
            index_dir,
            "--max-new-tokens",
            "48",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert "nobel" in doc["answer"].lower()
    assert any(d["reason"] == "below_relevance_floor" for d in doc["dropped"])
    b = doc["budget"]
    if doc["report"]["plan"]["gpu_source"] == "host RAM (no GPU)":
        assert b["context_limit"]["limit"] == "time"
        assert b["context_tokens_allowed"] <= b["context_limit"]["tokens"]


FAQ = (
    "How do I share global variables across modules?\n\nThe canonical way to share information across "
    "modules within a single program is to create a special module (often called config or cfg). Just "
    "import the config module in all modules of your application; the module then becomes available "
    "as a global name.\n"
)


@pytest.mark.model
def test_ask_exits_0_when_the_answer_ends_by_itself(tmp_path: Path) -> None:
    """The real command in its own process (issue #42): an answer that ends on its own — here at a
    stop string the answer reaches, while the batching loop still runs — exits 0, not 134 with
    "terminate called without an active exception" when the process tears down the running loop."""
    import subprocess
    import sys

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "faq.md").write_text(FAQ, encoding="utf-8")
    index_dir = str(tmp_path / "idx")
    run = [sys.executable, "-m", "ragbudget"]
    built = subprocess.run([*run, "index", str(docs), "--index-dir", index_dir, "--embedder", "hash:64"], timeout=300)
    assert built.returncode == 0
    question = "How do I share global variables across modules?"
    for stop in (["--stop", "module"], []):  # ended at a stop string; then at EOS or the cap
        done = subprocess.run(
            [*run, "ask", question, "--index-dir", index_dir, "--json", *stop],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (stop, done.returncode, done.stderr[-2000:])
        answer = json.loads(done.stdout)
        if stop:
            assert answer["finish_reason"] == "stop", answer


def test_search_retrieval_options(runner: CliRunner, tmp_path: Path) -> None:
    """`--retrieval dense` is the embedding search alone; the default fuses BM25 in; `--fusion`
    and `--lexical-weight` reach the pipeline."""
    from ragbudget import Pipeline

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"n{i}.txt").write_text(f"Note {i} about harbours, tides and ships. " * 30)
    (docs / "zebra.txt").write_text("The quagga was a subspecies of zebra. " * 30)
    index_dir = str(tmp_path / "idx")
    assert runner.invoke(cli, ["index", str(docs), "--index-dir", index_dir, "--embedder", "hash:64"]).exit_code == 0
    args = ["search", "quagga", "--index-dir", index_dir, "-k", "3", "--json"]
    dense = runner.invoke(cli, [*args, "--retrieval", "dense"])
    hybrid = runner.invoke(cli, args)
    rrf = runner.invoke(cli, [*args, "--fusion", "rrf", "--lexical-weight", "0.7"])
    assert dense.exit_code == hybrid.exit_code == rrf.exit_code == 0, dense.output + hybrid.output

    def ranked(out: Any) -> list[tuple[int, float]]:
        return [(h["chunk_id"], round(h["score"], 5)) for h in json.loads(out.stdout)]

    def expected(**kw: Any) -> list[tuple[int, float]]:
        return [(h.chunk_id, round(h.score, 5)) for h in Pipeline(index_dir, **kw).search("quagga", k=3)]

    assert ranked(dense) == expected(hybrid=False)
    assert ranked(hybrid) == expected()  # hybrid is the default
    assert ranked(rrf) == expected(fusion="rrf", lexical_weight=0.7)
    assert ranked(dense) != ranked(hybrid) != ranked(rrf)  # each option changes the scores
    assert json.loads(hybrid.stdout)[0]["sources"][0]["path"].endswith("zebra.txt")
    bad = runner.invoke(cli, [*args, "--fusion", "sum"])
    assert bad.exit_code == 2


def test_index_no_sentence_vectors(runner: CliRunner, tmp_path: Path) -> None:
    """`--no-sentence-vectors` leaves every chunk's sentence vectors out (and drops them from an
    index that has them); `--sentence-vectors` stores them, also for chunks indexed while it was
    off; with neither, an index keeps what it has (a new one stores none)."""
    from ragbudget.retrieval.index import Index

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"n{i}.txt").write_text(f"Note {i} is about harbours. Tides move ships. " * 40)
    index_dir = str(tmp_path / "idx")
    base = ["index", str(docs), "--index-dir", index_dir, "--embedder", "hash:64", "--json"]

    def stored() -> tuple[bool, int]:
        ix = Index.open(index_dir)
        return ix.has_sentence_vectors, int(ix.stats()["sentence_vectors"])

    off = runner.invoke(cli, [*base, "--no-sentence-vectors"])
    assert off.exit_code == 0, off.output
    assert json.loads(off.stdout)["sentences_embedded"] == 0 and stored() == (False, 0)
    kept = runner.invoke(cli, base)  # not told otherwise: the index keeps them out
    assert kept.exit_code == 0, kept.output
    assert json.loads(kept.stdout)["sentences_embedded"] == 0 and stored() == (False, 0)
    on = runner.invoke(cli, [*base, "--sentence-vectors"])  # stored, for every chunk, no file changed
    assert on.exit_code == 0, on.output
    chunks = int(Index.open(index_dir).stats()["chunks"])
    assert json.loads(on.stdout)["sentences_embedded"] > 0 and stored() == (True, chunks) and chunks > 0
    kept = runner.invoke(cli, base)  # neither flag: the index keeps them
    assert kept.exit_code == 0 and not json.loads(kept.stdout)["committed"] and stored() == (True, chunks)
    assert runner.invoke(cli, [*base, "--no-sentence-vectors"]).exit_code == 0
    assert stored() == (False, 0)
    assert runner.invoke(cli, base).exit_code == 0 and stored() == (False, 0)  # ... and keeps none
    fresh = runner.invoke(cli, ["index", str(docs), "--index-dir", str(tmp_path / "new"), "--embedder", "hash:64"])
    assert fresh.exit_code == 0 and not Index.open(tmp_path / "new").has_sentence_vectors  # a new one: none
    assert "--no-sentence-vectors" in runner.invoke(cli, ["index", "--help"]).output


# --- index: a typo never empties an index; runs add; removal is scoped, guarded, explicit ----------


def _notes(root: Path, name: str, n: int, word: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"{word}{i}.txt").write_text(f"Note {i} about {word}s and their {word}ly habits. " * 30)
    return folder


def _index(runner: CliRunner, index_dir: Path, *args: str) -> Any:
    return runner.invoke(cli, ["index", *args, "--index-dir", str(index_dir), "--embedder", "hash:64"])


def _stats(runner: CliRunner, index_dir: Path) -> dict[str, Any]:
    result = runner.invoke(cli, ["stats", "--index-dir", str(index_dir), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_index_never_reads_its_own_folder(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`index . --index-dir idx` (the index inside the tree it indexes): its manifest, SQLite, lock
    and temp files are neither indexed nor listed as skipped, and a re-run changes nothing; the
    same for the default `.ragbudget`; the index folder given as a path is refused; another index
    met in the tree is skipped whole."""
    for index_dir in ("idx", ".ragbudget"):
        monkeypatch.chdir(_notes(tmp_path / index_dir, "corpus", 3, "otter"))
        args = [".", "--json"] + (["--index-dir", index_dir] if index_dir == "idx" else [])
        runs = [runner.invoke(cli, ["index", *args, "--embedder", "hash:64"]) for _ in range(3)]
        assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
        first, *again = (json.loads(r.stdout) for r in runs)
        assert first["files_added"] == 3 and first["skipped"] == []
        for out in again:  # nothing of the index itself is new, changed or skipped on a re-run
            assert (out["files_added"], out["files_updated"], out["chunks_embedded"]) == (0, 0, 0)
            assert out["files_unchanged"] == 3 and out["skipped"] == [] and not out["committed"]
        listed = runner.invoke(cli, ["sources", "--all", "--json", "--index-dir", index_dir])
        assert sorted(f["path"] for f in json.loads(listed.stdout)) == [f"corpus/otter{i}.txt" for i in range(3)]
    inside = runner.invoke(cli, ["index", ".ragbudget", "--embedder", "hash:64"])  # the default folder
    assert inside.exit_code == 1 and "index's own folder" in inside.output and inside.output.count("\n") == 1
    # A second index of a tree reads none of the first one's files either (they are skipped as
    # another index's folder, like a .ragbudget).
    monkeypatch.chdir(tmp_path / "idx" / "corpus")
    other = runner.invoke(cli, ["index", ".", "--json", "--index-dir", "other", "--embedder", "hash:64"])
    assert other.exit_code == 0, other.output
    out = json.loads(other.stdout)
    assert out["files_added"] == 3 and [(s["path"], s["reason"]) for s in out["skipped"]] == [("corpus/idx", "ignored")]


def test_index_typo_is_exit_1_and_leaves_the_index_alone(runner: CliRunner, tmp_path: Path) -> None:
    corpus = _notes(tmp_path, "corpus", 5, "otter")
    idx = tmp_path / "idx"
    assert _index(runner, idx, str(corpus)).exit_code == 0
    before = _stats(runner, idx)
    result = _index(runner, idx, str(tmp_path / "corpuz"))
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert "corpuz" in result.output and "Traceback" not in result.output
    after = _stats(runner, idx)
    assert after["chunks"] == before["chunks"] > 0 and after["generation"] == before["generation"]


def test_index_missing_path_into_a_new_folder_creates_nothing(runner: CliRunner, tmp_path: Path) -> None:
    idx = tmp_path / "fresh"
    result = _index(runner, idx, str(tmp_path / "does-not-exist"))
    assert result.exit_code == 1 and "no index was created" in result.output
    assert not idx.exists()
    assert runner.invoke(cli, ["stats", "--index-dir", str(idx)]).exit_code == 1


def test_index_a_then_b_keeps_both(runner: CliRunner, tmp_path: Path) -> None:
    a = _notes(tmp_path, "a", 2, "otter")
    b = _notes(tmp_path, "b", 3, "heron")
    idx = tmp_path / "idx"
    assert _index(runner, idx, str(a)).exit_code == 0
    result = _index(runner, idx, str(b))
    assert result.exit_code == 0, result.output
    assert "files: 3 added, 0 updated, 0 removed" in result.output
    assert "2 under other roots kept" in result.output
    listing = runner.invoke(cli, ["sources", "--index-dir", str(idx), "--json"])
    assert listing.exit_code == 0, listing.output
    assert sorted(f["path"] for f in json.loads(listing.stdout)) == [
        "a/otter0.txt",
        "a/otter1.txt",
        "b/heron0.txt",
        "b/heron1.txt",
        "b/heron2.txt",
    ]
    # A vanished file under the other root is kept until that root is indexed again.
    (a / "otter1.txt").unlink()
    assert "0 removed" in _index(runner, idx, str(b)).output
    result = _index(runner, idx, str(a))
    assert result.exit_code == 0 and "1 removed" in result.output


def test_index_mass_removal_needs_a_flag_and_prune_mirrors(runner: CliRunner, tmp_path: Path) -> None:
    a = _notes(tmp_path, "a", 10, "otter")
    b = _notes(tmp_path, "b", 2, "heron")
    idx = tmp_path / "idx"
    assert _index(runner, idx, str(a)).exit_code == 0
    assert _index(runner, idx, str(b)).exit_code == 0
    for i in range(6):  # 6 of 12 files: more than 5 and more than 20 %
        (a / f"otter{i}.txt").unlink()
    before = _stats(runner, idx)
    refused = _index(runner, idx, str(a))
    assert refused.exit_code == 1 and "remove 6 of the 12 indexed file(s)" in refused.output
    assert _stats(runner, idx)["generation"] == before["generation"]
    allowed = _index(runner, idx, str(a), "--allow-removal")
    assert allowed.exit_code == 0 and "6 removed" in allowed.output, allowed.output
    # --prune mirrors the given paths: b's files go too (and it is explicit, so no guard).
    pruned = _index(runner, idx, str(a), "--prune")
    assert pruned.exit_code == 0 and "2 removed" in pruned.output, pruned.output
    listing = json.loads(runner.invoke(cli, ["sources", "--index-dir", str(idx), "--json"]).stdout)
    assert sorted(f["path"] for f in listing) == [f"a/otter{i}.txt" for i in range(6, 10)]


def test_index_emptied_folder_is_refused_without_allow_removal(runner: CliRunner, tmp_path: Path) -> None:
    corpus = _notes(tmp_path, "mnt", 3, "otter")
    idx = tmp_path / "idx"
    assert _index(runner, idx, str(corpus)).exit_code == 0
    for p in corpus.iterdir():
        p.unlink()
    before = _stats(runner, idx)
    result = _index(runner, idx, str(corpus))
    assert result.exit_code == 1 and "remove all 3 indexed file(s)" in result.output
    assert "--allow-removal" in result.output and result.output.count("\n") == 1
    assert _stats(runner, idx)["chunks"] == before["chunks"]
    allowed = _index(runner, idx, str(corpus), "--allow-removal")
    assert allowed.exit_code == 0 and "3 removed" in allowed.output


def test_sources_lists_files_with_chunks_and_skips(runner: CliRunner, tmp_path: Path) -> None:
    corpus = _notes(tmp_path, "corpus", 2, "otter")
    (corpus / "blob.bin").write_bytes(b"\x00" * 10)
    (corpus / ".hidden.txt").write_text("secret")
    (corpus / "old.txt").write_bytes(("Un café naïve à Zürich. " * 20).encode("cp1252"))
    idx = tmp_path / "idx"
    summary = _index(runner, idx, str(corpus))
    assert summary.exit_code == 0
    assert "warning corpus/old.txt: not UTF-8: decoded as cp1252" in summary.output
    result = runner.invoke(cli, ["sources", "--index-dir", str(idx)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["chunks", "pages", "status", "path"]
    row = next(line for line in lines if line.endswith("corpus/otter0.txt"))
    assert row.split()[0].isdigit() and int(row.split()[0]) >= 1 and "indexed" in row
    assert any("skipped: unsupported" in line and "corpus/blob.bin" in line for line in lines)
    assert not any(".hidden.txt" in line for line in lines)
    assert lines[-1].startswith("3 file(s) indexed, 2 skipped") and "--all" in lines[-1]
    assert str(tmp_path) not in result.output
    every = runner.invoke(cli, ["sources", "--index-dir", str(idx), "--all"])
    assert ".hidden.txt" in every.output


def test_search_paths_are_relative_unless_asked(runner: CliRunner, tmp_path: Path) -> None:
    corpus = _notes(tmp_path / "home" / "me", "notes", 2, "otter")
    idx = tmp_path / "idx"
    assert _index(runner, idx, str(corpus)).exit_code == 0
    args = ["search", "otters", "--index-dir", str(idx), "-k", "1"]
    as_json = runner.invoke(cli, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert str(tmp_path) not in as_json.stdout
    assert json.loads(as_json.stdout)[0]["sources"][0]["path"].startswith("notes/otter")
    text = runner.invoke(cli, args)
    assert "notes/otter" in text.output and str(tmp_path) not in text.output
    absolute = runner.invoke(cli, [*args, "--json", "--absolute-paths"])
    path = json.loads(absolute.stdout)[0]["sources"][0]["path"]
    assert path.startswith(str(corpus.resolve())) and Path(path).is_file()
    assert str(corpus.resolve()) in runner.invoke(cli, [*args, "--absolute-paths"]).output


# -- hostile cases: honest errors and sensible defaults (issue #19, section 4) --------------------


class _CutGenerator:
    """Stands in for ragbudget.generation.generate.Generator in the CLI: a word tokenizer, no model, and an
    answer cut at max_new_tokens (finish_reason "length")."""

    def __init__(self, model: Any = None) -> None:
        from _fakes import WordTokenizer

        self.tokenizer = WordTokenizer()
        self.loaded = False
        self.model = None
        self.config = None
        self.device = ""  # neither CPU nor GPU: no time cap in these tests

    def generate(self, prompt: Any, *, max_new_tokens: int, on_text: Any = None, **_: Any) -> Any:
        from types import SimpleNamespace

        text = "The Nobel Prize in Physics, which she shared with her husband and"
        if on_text:
            on_text(text)
        return SimpleNamespace(
            text=text,
            prompt_tokens=prompt.n_tokens,
            new_tokens=max_new_tokens,
            max_new_tokens=max_new_tokens,
            finish_reason="length",
            oom_steps=(),
            measurement=None,  # no CUDA peak measured
            prompt=prompt,
        )


@pytest.fixture()
def small_index(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    import ragbudget.generation.generate

    monkeypatch.setattr(ragbudget.generation.generate, "Generator", _CutGenerator)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "curie.txt").write_text("Maria Curie was the first female recipient of the Nobel Prize. " * 40)
    (docs / "tides.txt").write_text("Tides rise and fall twice a day along the harbour walls. " * 40)
    index_dir = str(tmp_path / "idx")
    result = runner.invoke(cli, ["index", str(docs), "--index-dir", index_dir, "--embedder", "hash:64"])
    assert result.exit_code == 0, result.output
    return index_dir


def test_ask_long_question_and_huge_max_new_tokens_blame_the_window(runner: CliRunner, small_index: str) -> None:
    question = "why " * 12_500  # 50,000 characters
    args = ["ask", question, "--index-dir", small_index, "--gpu", "24GiB"]
    for extra, says in (
        (["--max-new-tokens", "100000"], "max_new_tokens 100,000"),
        ([], "model window is 8,192 tokens"),
    ):
        result = runner.invoke(cli, [*args, *extra])
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: ") and "Traceback" not in result.output
        assert says in result.output and "8,192" in result.output
        # Not memory: a bigger GPU or a quantized cache would not help.
        assert "GPU" not in result.output and "fp8" not in result.output


def test_ask_and_search_on_an_empty_index_say_so(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    index_dir = str(tmp_path / "idx")
    assert (
        runner.invoke(
            cli, ["index", str(tmp_path / "empty"), "--index-dir", index_dir, "--embedder", "hash:64"]
        ).exit_code
        == 0
    )
    for args in (["ask", "anything"], ["search", "anything"]):
        result = runner.invoke(cli, [*args, "--index-dir", index_dir])
        assert result.exit_code == 1, result.output
        assert "has no chunks" in result.output and "ragbudget index" in result.output
    # The index run itself said that the folder held nothing (issue #42 §7).
    again = runner.invoke(cli, ["index", str(tmp_path / "empty"), "--index-dir", index_dir])
    assert "warning" in again.output and "no files found here: nothing to index" in again.output


def _ask_curie(index_dir: str) -> list[str]:
    """``ask`` of the Curie question on ``small_index``, its answer cut at 12 tokens."""
    return [
        "ask",
        "What was Maria Curie the first female recipient of?",
        "--index-dir",
        index_dir,
        "--gpu",
        "24GiB",
        "--max-new-tokens",
        "12",
    ]


def test_ask_marks_an_answer_cut_at_max_new_tokens(runner: CliRunner, small_index: str) -> None:
    args = _ask_curie(small_index)
    for extra in ([], ["--no-stream"]):
        result = runner.invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
        assert "her husband and […]" in result.output
        assert "(answer cut at max_new_tokens=12; raise --max-new-tokens)" in result.output
    doc = json.loads(runner.invoke(cli, [*args, "--json"]).stdout)
    assert doc["finish_reason"] == "length" and "[…]" not in doc["answer"]


def test_ask_paths_are_relative_unless_asked(runner: CliRunner, small_index: str, tmp_path: Path) -> None:
    args = _ask_curie(small_index)
    text = runner.invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert "docs/curie.txt" in text.output and str(tmp_path) not in text.output
    doc = json.loads(runner.invoke(cli, [*args, "--json"]).stdout)
    assert doc["sources"][0]["path"] == "docs/curie.txt" and str(tmp_path) not in json.dumps(doc)
    absolute = json.loads(runner.invoke(cli, [*args, "--json", "--absolute-paths"]).stdout)
    path = Path(absolute["sources"][0]["path"])
    assert path.is_absolute() and path == (tmp_path / "docs" / "curie.txt").resolve()
    assert str(path) in runner.invoke(cli, [*args, "--absolute-paths"]).output


def test_source_scopes_ask_search_and_explain(runner: CliRunner, small_index: str) -> None:
    args = _ask_curie(small_index)
    doc = json.loads(runner.invoke(cli, [*args, "--json", "--source", "tides.txt", "--evidence-floor", "0"]).stdout)
    assert {s["path"] for s in doc["sources"]} == {"docs/tides.txt"}
    assert doc["report"]["index"]["sources"] == ["tides.txt"] and doc["report"]["index"]["chunks_in_scope"] >= 1
    explained = runner.invoke(cli, [*args, "--explain", "--source", "docs/tides*", "--evidence-floor", "0"])
    assert explained.exit_code == 0, explained.output
    assert re.search(r"searched only docs/tides\*: \d+ chunk\(s\)", explained.output)
    hits = runner.invoke(cli, ["search", "Curie", "--index-dir", small_index, "--source", "tides.txt", "--json"])
    assert hits.exit_code == 0 and {h["sources"][0]["path"] for h in json.loads(hits.stdout)} == {"docs/tides.txt"}
    both = runner.invoke(
        cli, ["search", "Curie", "--index-dir", small_index, "--source", "tides.txt", "--source", "curie.txt"]
    )
    assert "docs/curie.txt" in both.output and "docs/tides.txt" in both.output
    for command in (["search", "Curie"], args):
        bad = runner.invoke(cli, [*command, "--index-dir", small_index, "--source", "nothere.txt"])
        assert bad.exit_code == 1 and "Traceback" not in bad.output, bad.output
        (line,) = [x for x in bad.output.splitlines() if x.strip()]
        assert line.startswith("Error: no indexed file matches the source 'nothere.txt' (2 files, roots: docs)")


def test_ask_prints_one_budget_line_from_the_memory_plan(runner: CliRunner, small_index: str) -> None:
    # The same line as on a served engine (test_pipeline_engines), led by the memory plan's KV
    # bytes a token.
    result = runner.invoke(cli, ["ask", "Maria Curie Nobel Prize", "--index-dir", small_index, "--gpu", "24GiB"])
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith("budget: ")]
    assert len(line) == 1 and re.match(r"budget: \d+ KV bytes/token, context \d+/\d+ tokens \(limited by \w+", line[0])
    assert line[0].endswith("--explain for every figure and its source")


def test_ask_relevance_floor_option(runner: CliRunner, small_index: str) -> None:
    args = ["ask", "Maria Curie Nobel Prize", "--index-dir", small_index, "--gpu", "24GiB", "--json"]
    off = json.loads(runner.invoke(cli, [*args, "--relevance-floor", "0"]).stdout)
    assert not [d for d in off["dropped"] if d["reason"] == "below_relevance_floor"]
    assert runner.invoke(cli, [*args, "--relevance-floor", "2"]).exit_code == 2


@pytest.mark.parametrize(
    "gpu,says,not_says",
    [
        ("A100", ["'A100 40GB'", "'A100 80GB'"], "unknown GPU"),
        ("-5GiB", ["memory size must be positive", "-5GiB"], "unknown GPU"),
        ("0GB", ["memory size must be positive"], "unknown GPU"),
    ],
)
def test_budget_hostile_gpu_values(runner: CliRunner, gpu: str, says: list[str], not_says: str) -> None:
    result = runner.invoke(cli, ["budget", "--gpu", gpu])
    assert result.exit_code == 1, result.output
    assert all(s in result.output for s in says) and not_says not in result.output


def test_budget_text_says_what_fits_for_llama_8b(runner: CliRunner) -> None:
    result = runner.invoke(
        cli, ["budget", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "RTX 4090", "--concurrency", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "sliding" not in result.output  # Llama 3.1 has no sliding-window layers
    assert "max 0" not in result.output
    assert "4 request(s) of 7,084 tokens each; one request of 131,072 tokens does not fit" in result.output


@pytest.mark.parametrize(
    "module, args, extra",
    [
        ("fastapi", ["serve", "--port", "0"], "serve"),
        ("matplotlib", ["budget", "--gpu", "24GiB", "--plot", "plan.png"], "plot"),
    ],
)
def test_a_missing_optional_package_names_its_extra(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, args: list[str], extra: str
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Tides rise and fall twice a day along the harbour walls. " * 40)
    index_dir = str(tmp_path / "idx")
    assert runner.invoke(cli, ["index", str(docs), "--index-dir", index_dir, "--embedder", "hash:64"]).exit_code == 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, module, None)  # importing it now fails
    if args[0] == "serve":
        args = [*args, "--index-dir", index_dir]
    result = runner.invoke(cli, args)
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("Error: ") and "Traceback" not in line
    assert f"optional package {module!r}" in line and f"pip install 'ragbudget[{extra}]'" in line
