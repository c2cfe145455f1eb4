"""Presentation: the text tables and the plot the CLI prints for the records the library returns.

Library modules return records (:class:`~ragbudget.memory.budget.BudgetPlan`, an answer's ``report``
dict, :class:`~ragbudget.chat.ChatTurn`); turning them into lines for a person happens here, at the
edge, so the CLI and any other face format them the same way and no stage carries printing code.
Pure functions of their arguments, apart from :func:`plot_plan` (which writes a PNG) and
:func:`chat_banner` (which reads the pipeline's plan).

>>> from ragbudget.memory.budget import plan_budget
>>> table = format_plan(plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090"))
>>> table.splitlines()[6]
'kv per token  128.0 KiB'
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any  # Any: the JSON-ready report dicts records give (to_dict)

from ..errors import ConfigError, RagBudgetError
from ..gpus import GiB

if TYPE_CHECKING:
    from ..chat import ChatTurn, Conversation
    from ..memory.budget import BudgetPlan

__all__ = [
    "budget_line",
    "chat_banner",
    "format_index_summary",
    "format_models",
    "format_plan",
    "format_report",
    "format_sources",
    "format_turn",
    "plot_plan",
]

MiB = 1 << 20


# --- a budget plan (``ragbudget plan``) ------------------------------------------------------------


def _h(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _concurrency_line(plan: BudgetPlan) -> str:
    if plan.max_concurrency >= 1:
        return (
            f"{plan.concurrency} (max {plan.max_concurrency:,} requests of {plan.concurrency_context_tokens:,} tokens)"
        )
    # Not even one request of the target length fits: say what does instead of "max 0".
    return (
        f"{plan.concurrency} request(s) of {plan.max_context_tokens:,} tokens each; one "
        f"request of {plan.concurrency_context_tokens:,} tokens does not fit (memory holds "
        f"{plan.kv_capacity_tokens:,} tokens for one request)"
    )


def format_plan(plan: BudgetPlan) -> str:
    """A readable table of a plan (for the CLI)."""
    gpu = plan.gpu_source if plan.gpu_source.startswith(plan.gpu_name) else f"{plan.gpu_name} ({plan.gpu_source})"
    memory = f"{_h(plan.gpu_bytes)} × {plan.utilization:.2f} = {_h(plan.usable_bytes)} usable"
    if plan.tensor_parallel > 1:
        gpu = f"{plan.tensor_parallel} × {gpu}, tensor parallel"
        memory = (
            f"{_h(plan.gpu_bytes)} × {plan.utilization:.2f} − {_h(plan.comm_reserve_bytes)} NCCL/all-reduce "
            f"= {_h(plan.usable_bytes)} usable per GPU"
        )
    rows = [
        ("model", plan.model),
        ("gpu", gpu),
        ("memory", memory),
        ("weights", f"{_h(plan.weights_bytes)} ({plan.weights_source})"),
        ("activations", f"{_h(plan.activation_bytes)} ({plan.activation_source})"),
        ("kv cache", f"{plan.cache}, {plan.kv_dtype}, {plan.backend}"),
        # The second figure only exists for models with sliding-window layers.
        (
            "kv per token",
            _h(plan.kv_bytes_per_token)
            if plan.kv_bytes_per_token_peak == plan.kv_bytes_per_token
            else (f"{_h(plan.kv_bytes_per_token)} (below sliding windows: {_h(plan.kv_bytes_per_token_peak)})"),
        ),
        ("kv at max", (f"{_h(plan.kv_bytes_at_max)} for {plan.concurrency} × {plan.max_context_tokens:,} tokens")),
        ("kv capacity", f"{plan.kv_capacity_tokens:,} tokens (one sequence)"),
        (
            "max context",
            (
                f"{plan.max_context_tokens:,} tokens per request (limited by "
                f"{plan.limited_by}; model max {plan.model_max_tokens:,})"
            ),
        ),
        ("max prompt", f"{plan.max_prompt_tokens:,} tokens + {plan.max_new_tokens} new"),
        ("concurrency", _concurrency_line(plan)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if plan.concurrency_curve:
        lines.append(
            "tokens per request by concurrency: " + ", ".join(f"{n}→{t:,}" for n, t in plan.concurrency_curve[:8])
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plot_plan(plan: BudgetPlan, path: str | os.PathLike[str]) -> str:
    """Save a two-panel PNG: memory split (weights / activations / KV / free) and tokens allowed
    per request against concurrency. Needs matplotlib (``pip install ragbudget[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(
            "plotting needs the optional package 'matplotlib', which is not installed: pip install 'ragbudget[plot]'"
        ) from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    parts = [
        ("weights", plan.weights_bytes),
        ("activations", plan.activation_bytes),
        ("KV", plan.kv_bytes_at_max),
        ("free", plan.free_bytes_at_max),
    ]
    bottom = 0.0
    for label, v in parts:
        a.bar([0], [v / GiB], bottom=[bottom], label=f"{label} {v / GiB:.1f} GiB")
        bottom += v / GiB
    a.axhline(plan.usable_bytes / GiB, color="k", ls="--", lw=1, label="usable")
    a.set_xticks([])
    a.set_ylabel("GiB")
    a.set_title(f"{plan.gpu_name}: {plan.usable_bytes / GiB:.1f} GiB usable")
    a.legend(fontsize=8)
    if plan.concurrency_curve:
        xs, ys = zip(*plan.concurrency_curve, strict=True)
        b.plot(xs, ys, marker="o")
        b.set_xscale("log", base=2)
    b.set_xlabel("concurrent requests")
    b.set_ylabel("max tokens per request")
    b.set_title(plan.model[:40])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# --- an answer's report (``ragbudget ask --explain``) -----------------------------------------


def _where(plan: dict[str, Any]) -> str:
    """``RTX 4090 (table)``, ``host RAM (no GPU)``: the name, and where it came from if that adds."""
    name, source = str(plan.get("gpu_name", "")), str(plan.get("gpu_source", ""))
    return source if source.startswith(name) else f"{name} ({source})" if source else name


def budget_line(budget: dict[str, Any]) -> str:
    """The one line ``ask`` prints under an answer without ``--explain``
    (``Answer.report["budget"]``): the same line whether a memory plan or a served engine set
    the allowance (``planned_by`` says which).

    >>> line = budget_line({"planned_by": "llama.cpp at http://127.0.0.1:8080", "context_tokens_used": 250,
    ...     "context_tokens_allowed": 256, "limited_by": "window", "prompt_tokens": 380, "max_new_tokens": 64})
    >>> print(line)  # doctest: +NORMALIZE_WHITESPACE
    budget: llama.cpp at http://127.0.0.1:8080, context 250/256 tokens (limited by window),
    prompt 380 tokens, max_new_tokens 64; --explain for every figure and its source
    """
    limit = budget.get("context_limit") or {}
    capped = (
        f", capped for time: {limit['ttft_target_s']:g} s to the first token on {limit.get('device', 'cpu')}"
        " (--context-tokens or --ttft-target to change)"
        if limit.get("limit") == "time"
        else ""
    )
    return (
        f"budget: {budget['planned_by']}, context {budget['context_tokens_used']}/{budget['context_tokens_allowed']} "
        f"tokens (limited by {budget['limited_by']}){capped}, prompt {budget['prompt_tokens']} tokens, "
        f"max_new_tokens {budget['max_new_tokens']}; --explain for every figure and its source"
    )


def format_evidence(evidence: dict[str, Any]) -> str:
    """One line on how well the documents answer the question (``Answer.report["evidence"]``).

    >>> format_evidence({"score": 0.31, "floor": 0.45, "floor_source": "measured", "declined": True})[:72]
    'declined without generating: the best retrieved sentence scores 0.31, un'
    """
    score, floor = evidence.get("score"), evidence.get("floor")
    if evidence.get("declined"):
        return (
            f"declined without generating: the best retrieved sentence scores {score:.2f}, under the "
            f"evidence floor {floor:g} ({evidence.get('floor_source')}); --evidence-floor 0 always generates"
        )
    where = f"the floor {floor:g}" if floor is not None else f"no floor ({evidence.get('floor_source')})"
    return f"evidence: the best retrieved sentence scores {score:.2f}, against {where}"


def format_report(report: dict[str, Any]) -> str:
    """The ``ask --explain`` table: the plan, the budget arithmetic, and every selection decision
    (a declined question: the evidence against its floor, since nothing was planned)."""
    b = report.get("budget", {})
    p = report.get("plan", {})
    evidence = report.get("evidence") or {}
    if evidence.get("declined"):
        return "\n".join(["Evidence", f"  {format_evidence(evidence)}", *_scope_lines(report)])

    def n(x: Any) -> str:
        return f"{x:,}" if isinstance(x, int) else str(x)

    gib = 1024**3
    engine = report.get("engine")
    if engine:
        lines = ["Engine", *(f"  {line}" for line in engine.get("lines", []))]
        rows = [
            ("reserved output", f"{n(b.get('max_new_tokens'))} tokens (sent as max_tokens)"),
            ("prompt allowed", f"{n(b.get('max_prompt_tokens'))} tokens"),
            ("fixed prompt", f"{n(b.get('fixed_prompt_tokens'))} tokens (template, system, question)"),
            (
                "context",
                f"{n(b.get('context_tokens_used'))} / {n(b.get('context_tokens_allowed'))} "
                f"tokens ({100 * float(b.get('fill', 0)):.1f}% filled)",
            ),
            (
                "prompt used",
                f"{n(b.get('prompt_tokens'))} tokens (engine counted "
                f"{n(b.get('engine_prompt_tokens'))}); generated {n(b.get('new_tokens'))}",
            ),
        ]
        return _report_tail(report, lines, rows)
    rows = [
        ("model", p.get("model", "")),
        ("memory", f"{_where(p)}: {p.get('gpu_bytes', 0) / gib:.2f} GiB × {p.get('utilization', 0.9)}"),
        ("weights", f"{p.get('weights_bytes', 0) / gib:.3f} GiB ({p.get('weights_source', '')})"),
        ("activations", f"{p.get('activation_bytes', 0) / gib:.3f} GiB ({p.get('activation_source', '')})"),
        ("KV bytes/token", f"{n(b.get('kv_bytes_per_token'))} ({p.get('cache', '')}, {p.get('kv_dtype', '')})"),
        ("KV capacity", f"{n(b.get('kv_capacity_tokens'))} tokens"),
        (
            "per request",
            f"{n(b.get('max_context_tokens'))} tokens (limited by {b.get('limited_by')}, "
            f"concurrency {p.get('concurrency', 1)})",
        ),
        ("reserved output", f"{n(b.get('max_new_tokens'))} tokens"),
        ("prompt allowed", f"{n(b.get('max_prompt_tokens'))} tokens"),
        ("fixed prompt", f"{n(b.get('fixed_prompt_tokens'))} tokens (template, system, question)"),
        (
            "context",
            f"{n(b.get('context_tokens_used'))} / {n(b.get('context_tokens_allowed'))} tokens "
            f"({100 * float(b.get('fill', 0)):.1f}% filled)",
        ),
        ("prompt used", f"{n(b.get('prompt_tokens'))} tokens; generated {n(b.get('new_tokens'))}"),
    ]
    limit = b.get("context_limit")
    if limit:
        why = (
            f"time: {limit.get('ttft_target_s', 0):g} s to the first token at the prefill speed "
            f"measured on {limit.get('device', '?')} (ttft_target; --context-tokens overrides)"
            if limit.get("limit") == "time"
            else "asked for (context_tokens)"
        )
        rows.insert(-2, ("context cap", f"{n(limit.get('tokens'))} tokens, limit {why}"))
    return _report_tail(report, [], rows)


def _span_line(sp: dict[str, Any]) -> str:
    """One span of ``--explain``: where it is, what it cost, why it went in, how it starts."""
    src = sp.get("source") or {}
    where = f"{src.get('start')}:{src.get('end')}" if src else f"{sp.get('start')}:{sp.get('end')}"
    page = f" p.{src['page']}" if src.get("page") else ""
    text = " ".join(str(sp.get("text") or "").split())
    preview = f"  {text[:60]!r}{'…' if len(text) > 60 else ''}" if text else ""
    return (
        f"      [{where}]{page}  {sp.get('n_tokens', 0)} tokens  {sp.get('why', '')}  "
        f"score {float(sp.get('score', 0)):.2f}{preview}"
    )


def _scope_lines(report: dict[str, Any]) -> list[str]:
    """The files the question was scoped to (``ask --source``), if it was."""
    index = report.get("index") or {}
    if not index.get("sources"):
        return []
    return [f"  searched only {', '.join(index['sources'])}: {index.get('chunks_in_scope', '?')} chunk(s)"]


def _report_tail(report: dict[str, Any], lines: list[str], rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [*lines, "Budget", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
    sel = report.get("selection", [])
    vectors = report.get("sentence_vectors")
    if vectors == "stored":
        how = "; sentence vectors: stored in the index (embedded at build time)"
    elif vectors:
        how = (
            f"; sentence vectors: {vectors} (once per sentence, kept in the cache beside the "
            "index; `ragbudget index --sentence-vectors` embeds them all at build time)"
        )
    else:
        how = ""
    lines.append(f"Context: {len(sel)} passage(s){how}")
    lines += _scope_lines(report)
    for i, s in enumerate(sel, 1):
        src = (s.get("sources") or [{}])[0]
        page = f" ({src['label']})" if src.get("label") else f" p.{src.get('page')}" if src.get("page") else ""
        lines.append(
            f"  [{i}] {src.get('path', '?')}{page}  score {s.get('score', 0):.3f}  "
            f"{s.get('cost', 0)} tokens{'  (truncated)' if s.get('truncated') else ''}"
        )
        spans = s.get("spans") or []
        if spans:
            label = s.get("cost", 0) - s.get("n_tokens", 0)
            lines.append(
                f"      chunk {', '.join(map(str, s.get('chunk_ids', [])))}: "
                f"{len(spans)} span(s), {s.get('n_tokens', 0)} tokens of text + "
                f"{label} label"
            )
            lines += [_span_line(sp) for sp in spans]
    dropped = report.get("dropped", [])
    if dropped:
        counts: dict[str, int] = {}
        for d in dropped:
            counts[d["reason"]] = counts.get(d["reason"], 0) + 1
        lines.append("Dropped: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    left = report.get("spans_dropped", [])
    if left:
        per: dict[tuple[Any, str], list[int]] = {}
        for sp in left:
            per.setdefault((sp["chunk_id"], sp["why"]), []).append(int(sp["n_tokens"]))
        lines.append(f"Spans left out: {len(left)} sentence(s), {sum(int(sp['n_tokens']) for sp in left):,} tokens")
        lines += [f"  chunk {cid}: {len(ns)} {why} ({sum(ns):,} tokens)" for (cid, why), ns in per.items()]
    for step in report.get("oom_steps", []):
        lines.append(f"OOM step: {step}")
    t = report.get("timings", {})
    if t:
        lines.append("Timings: " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in t.items()))
    return "\n".join(lines)


# --- a chat turn (``ragbudget chat``) -----------------------------------------------------------


#: Said above a list of several sources: their numbers are the prompt's order, not a ranking.
SOURCES_ORDER = "(numbered in prompt order, as the answer cites them; not sorted by score)"


def format_sources(sources: Sequence[dict[str, Any]], show_path: Callable[[str], str] = str) -> str:
    """The ``Sources:`` block of an answer (``[n]`` as the answer cites them); ``show_path`` turns
    a stored path into the one printed. The order is the prompt's, which the numbers must keep,
    so the header says the scores are not what orders the list."""
    lines = [f"Sources: {SOURCES_ORDER}" if len(sources) > 1 else "Sources:"]
    for i, src in enumerate(sources, 1):
        page = f", {src['label']}" if src.get("label") else f", page {src['page']}" if src.get("page") else ""
        score = src.get("score")
        score_text = f" score {score:.3f}" if isinstance(score, (int, float)) else ""
        path = show_path(str(src.get("path")))
        lines.append(f"  [{i}] {path}{page} [{src.get('start')}:{src.get('end')}]{score_text}")
    return "\n".join(lines)


def format_turn(turn: ChatTurn, show_path: Callable[[str], str] = str) -> str:
    """A turn's sources and memory accounting as the ``ragbudget chat`` command prints them."""
    lines = [format_sources(turn.sources, show_path)] if turn.sources else []
    b = turn.budget
    lines.append(
        f"memory: summary {b.summary}, recent {b.recent} ({b.turns_verbatim} turn(s)), context "
        f"{b.context_used}/{b.context_allowed}, output {b.output} tokens; prompt {b.prompt}+{b.output}"
        f"/{b.total}; {b.turns_summarized} turn(s) summarized"
        + ("; summary updated" if b.summary_updated else "")
        + (f"; retrieval query: {turn.retrieval_query!r}" if turn.retrieval_query != turn.question else "")
    )
    return "\n".join(lines)


def chat_banner(conversation: Conversation) -> str:
    """One line saying which model answers and what one turn may hold, e.g.
    ``ragbudget chat · SmolLM2-135M-Instruct · 8192 tokens/turn (answer 256, history ≤ 30%) · KV
    46080 B/token · /help for commands``: the tokens one turn may hold (prompt and answer), the
    answer's reserve, history's share of the rest. Reads the pipeline's plan (no model load; on
    a served engine, its figures)."""
    pipe = conversation.pipeline
    parts = ["ragbudget chat"]
    model, kv = pipe.model, None
    try:
        # The plan each turn is fitted to (Conversation.ask reads the same), so the banner agrees.
        plan = pipe.request_plan(conversation.max_new_tokens)
        total, output = plan.max_context_tokens, plan.max_new_tokens
        model, kv = plan.model, plan.kv_bytes_per_token
    except RagBudgetError:  # the banner says what it can; the first question gets the error
        total = output = 0
    if model:
        # A local file or folder is named by its last part; a hub id is kept whole.
        parts.append(model.rstrip("/\\").rsplit("/", 1)[-1] if model.startswith(("/", ".", "~")) else model)
    if total:
        share = round(conversation.history_share * 100)
        turn = f"{total} tokens/turn (answer {output}, history ≤ {share}%"
        if conversation.context_tokens is not None:
            turn += f", context ≤ {conversation.context_tokens}"
        parts.append(turn + ")")
    if kv:
        parts.append(f"KV {kv} B/token")
    parts.append("/help for commands")
    return " · ".join(parts)


# --- an index run (``ragbudget index``) -----------------------------------------------------------


def format_index_summary(s: dict[str, Any]) -> str:
    """What ``ragbudget index`` prints of an index run's summary (``IndexSummary.to_dict()``): the
    files and chunks it changed, what it removed, what it could not read and why."""
    quiet = {"hidden", "ignored", "excluded"}  # what the user asked to leave out
    n_skipped = sum(1 for skip in s.get("skipped", []) if skip.get("reason") not in quiet)
    kept = s.get("files_kept", 0)
    resumed = s.get("chunks_resumed", 0)
    lines = [
        f"files: {s.get('files_added', 0)} added, {s.get('files_updated', 0)} updated, "
        f"{s.get('files_removed', 0)} removed, {s.get('files_unchanged', 0)} unchanged, "
        f"{n_skipped} skipped" + (f"; {kept} under other roots kept" if kept else ""),
        f"chunks: {s.get('chunks_total', 0)} in index, {s.get('chunks_added', 0)} added, "
        f"{s.get('chunks_removed', 0)} removed, {s.get('chunks_embedded', 0)} embedded "
        f"({s.get('windows_pooled', 0)} over-long chunks pooled over windows"
        + (f"; {resumed} taken from an interrupted run" if resumed else "")
        + ")",
        f"duplicates removed: {s.get('exact_duplicates', 0)} exact, {s.get('near_duplicates', 0)} near",
        f"header/footer lines removed: {s.get('furniture_lines_removed', 0)}"
        + (f"; contents/index lines: {s['contents_lines_removed']}" if s.get("contents_lines_removed") else ""),
        f"time: {s.get('seconds', 0.0):.1f} s",
    ]
    if s.get("rebuilt"):
        lines.append(f"rebuilt from scratch: {s.get('rebuild_reason') or s.get('rebuilt')}")
    # What the user asked to leave out is counted; everything else that could not be indexed is
    # listed with its reason.
    left_out = 0
    for skip in s.get("skipped", []):
        path, reason, detail = skip.get("path"), skip.get("reason"), skip.get("detail", "")
        if reason in quiet:
            left_out += 1
            continue
        lines.append(f"  skipped {path}: {reason}" + (f" ({detail})" if detail else ""))
    if left_out:
        lines.append(f"  ({left_out} hidden, VCS or excluded path(s) left out)")
    for warning in s.get("warnings", []):
        lines.append(f"  warning {warning.get('path')}: {warning.get('message')}")
    if not s.get("committed", True):
        lines.append("nothing changed: the index is as it was")
    return "\n".join(lines)


# --- the packaged models (``ragbudget models list``) ---------------------------------------------


def format_models(models: Sequence[dict[str, Any]]) -> str:
    """``ragbudget models list``: one row a packaged model (``ModelStatus.to_dict()``), its name,
    size, quantization, license, state and file, then what a missing one lacks and the command
    that fetches it.

    >>> print(format_models([{"name": "tiny", "size": 98_362_432, "quantization": "Q4_1", "license": "MIT",
    ...     "state": "missing", "path": "/c/tiny.gguf", "problems": ["tiny-part1 0.1 is not installed"]}]))
    name  size    quant  license  state    path
    tiny  98.4 MB  Q4_1   MIT      missing  /c/tiny.gguf
      tiny: tiny-part1 0.1 is not installed; `ragbudget models fetch tiny` gets it
    """
    header = ("name", "size", "quant", "license", "state", "path")
    rows = [
        (m["name"], _mb(int(m["size"])), m["quantization"], m["license"], m["state"], str(m["path"])) for m in models
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    # The path, last, is left ragged: padding it would only add trailing spaces.
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in [header, *rows]]
    for m in models:
        problems = m.get("problems") or []
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            lines.append(f"  {m['name']}: {problems[0]}{more}; `ragbudget models fetch {m['name']}` gets it")
    return "\n".join(lines)


def _mb(n: int) -> str:
    """Decimal megabytes and gigabytes, as pip and PyPI print a download's size."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
