"""What a decoding loop needs besides the model, the same for the one-request
:class:`~ragbudget.generation.generate.Generator` and the continuous
:class:`~ragbudget.generation.batching.Batcher`: the sampling options checked and drawn from (a
seeded sampler per request), stop strings (found whole, held back while partial), a line repeated
past :data:`REPEATED_LINE_STOP` (a small model's loop), and the streamer that hands text on.

Split from :mod:`ragbudget.generation.generate` along that seam: nothing here loads a model or
knows about memory; ``torch`` is imported inside the functions that draw.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

__all__ = [
    "REPEATED_LINE_STOP",
    "CallbackStreamer",
    "draw",
    "first_stop",
    "line_repeats",
    "partial_stop",
    "sampling_kwargs",
    "sampling_wanted",
    "seeded_sampler",
    "stop_list",
    "stopping_criteria",
]


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list of non-empty strings (a bare string is one stop string)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        if not isinstance(s, str):
            raise ConfigError(f"stop must be a string or a list of strings; got an item {s!r}")
    return [s for s in items if s]


def sampling_wanted(
    do_sample: bool | None, temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None
) -> bool:
    """Validate the sampling options and decide whether to sample (see ``Generator.generate``)."""
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ConfigError(f"temperature must be a number >= 0 (0 is greedy); got {temperature!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 <= top_p <= 1):
        raise ConfigError(f"top_p must be in [0, 1]; got {top_p!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"top_k must be an integer >= 0 (0 keeps every token); got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"seed must be an integer; got {seed!r}")
    sample = bool(temperature) if do_sample is None else do_sample
    # Temperature 0 and top_p 0 are the limits of sampling where only the best token is left:
    # greedy decoding, which transformers would otherwise refuse (division by zero).
    return sample and temperature != 0 and top_p != 0


def draw(scores: Any, rng: Any, temperature: float | None, top_p: float | None, top_k: int | None) -> Any:
    """Sample one token per row of ``scores`` (temperature, top-k, top-p, in transformers'
    order) with the generator ``rng``; returns the chosen indices, shape ``[rows, 1]``."""
    import torch

    logits = scores.float()
    if temperature:
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        # Keep the smallest prefix reaching top_p; the best token is always kept.
        drop = probs.cumsum(-1) - probs >= top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(-1), 1, generator=rng)


def seeded_sampler(seed: int, temperature: float | None, top_p: float | None, top_k: int | None) -> Any:
    """A logits processor that samples the next token (:func:`draw`) with its own
    ``torch.Generator`` seeded by ``seed`` and leaves only that token possible; greedy decoding
    then takes it."""
    import torch
    from transformers import LogitsProcessor

    class _SeededSampler(LogitsProcessor):
        def __init__(self) -> None:
            self.rng: Any = None

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if self.rng is None:  # on the scores' device: multinomial needs a generator there
                self.rng = torch.Generator(device=scores.device)
                self.rng.manual_seed(seed % 2**64)
            choice = draw(scores, self.rng, temperature, top_p, top_k)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter(-1, choice, 0.0)

    return _SeededSampler()


class CallbackStreamer:
    """A transformers streamer that decodes incrementally and hands text pieces to a callback.

    It decodes the whole answer so far and emits the new suffix, holding back a trailing
    replacement character so a multi-byte character split over tokens is emitted whole. With
    ``stop`` strings it also holds back any tail that could be the start of one, and emits nothing
    from the first stop string on: a stream never shows text the final answer does not contain
    (transformers hands the streamer the token that completes a stop string before its stopping
    criteria end the generation). So it does for a line repeated in a row
    (:func:`line_repeats`): ``stopped`` is set at the third copy, which ends the answer.
    """

    def __init__(
        self, tokenizer: Any, callback: Callable[[str], None], n_prompt: int, stop: Sequence[str] = ()
    ) -> None:
        self.tok = tokenizer
        self.cb = callback
        self.ids: list[int] = []
        self.sent = 0
        self.skip = n_prompt  # transformers first puts the prompt itself
        self.stop = tuple(s for s in stop if s)
        self.stopped = False

    def _emit(self, text: str, final: bool) -> None:
        if self.stopped:
            return
        end = len(text)
        if self.stop:
            cut = first_stop(text, self.stop)
            if cut is not None:
                end, self.stopped = cut, True
            elif not final:
                end -= partial_stop(text, self.stop)
        # A line repeated in a row: its copies are held back until a different line starts, and
        # at the third the answer ends (line_repeats).
        repeat, safe = line_repeats(text[:end])
        if repeat is not None:
            end, self.stopped = repeat, True
        elif not final:
            end = min(end, safe)
        if end > self.sent:
            self.cb(text[self.sent : end])
            self.sent = end

    def put(self, value: Any) -> None:
        self.feed(value.reshape(-1).tolist())

    def feed(self, ids: list[int]) -> None:
        """New token ids (the prompt first, as transformers' streamers get it)."""
        if self.skip:
            n = min(self.skip, len(ids))
            ids, self.skip = ids[n:], self.skip - n
        if not ids:
            return
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self._emit(text, final=False)

    def end(self) -> None:
        self._emit(self.tok.decode(self.ids, skip_special_tokens=True), final=True)


#: An answer ends at the third time in a row one non-empty line is produced (blank lines between
#: them ignored). Twice can be meant — a refrain, two equal table rows — three times is a decoding
#: loop: the packaged SmolLM2 wrote one line ten times over in a 256-token answer (issue #30).
#: The answer keeps the line once; a stream never shows the copies (see :func:`line_repeats`).
REPEATED_LINE_STOP = 3


def line_repeats(text: str, times: int = REPEATED_LINE_STOP) -> tuple[int | None, int]:
    r"""Whether ``text`` (an answer so far) ends in one line repeated ``times`` times in a row.

    Returns ``(cut, safe)``. ``cut`` is where the answer ends when its last ``times`` complete
    non-empty lines are one line (compared without surrounding spaces; blank lines between
    ignored): the end of the first of them, so the line is kept once; ``None`` otherwise.
    ``safe`` is how much of ``text`` cannot become such a repetition any more, what a stream may
    show: up to the end of a line that its complete copies follow, or that the unfinished last
    line still begins like.

    >>> line_repeats("Intro\nSame line\nSame line\n  Same line\n")
    (15, 15)
    >>> line_repeats("Intro\nSame line\nSame li")  # the copy being written is held back
    (None, 15)
    >>> line_repeats("Intro\nSame line\nSame line\nOther")  # twice is kept: all of it is safe
    (None, 31)
    """
    lines: list[tuple[int, str]] = []  # (end offset, stripped text) of complete non-empty lines
    start = 0
    while True:
        nl = text.find("\n", start)
        if nl < 0:
            break
        line = text[start:nl].strip()
        if line:
            lines.append((nl, line))
        start = nl + 1
    if not lines:
        return None, len(text)
    last = lines[-1][1]
    first = len(lines) - 1  # the first line of the run of copies of the last one
    while first > 0 and lines[first - 1][1] == last:
        first -= 1
    end_of_first = lines[first][0]
    if len(lines) - first >= times:
        return end_of_first, end_of_first
    partial = text[start:].strip()
    if partial and not last.startswith(partial):
        return None, len(text)  # the next line differs: this run ends short of the stop
    return None, end_of_first


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in ``text`` (None if none occurs)."""
    found = [pos for pos in (text.find(s) for s in stop if s) if pos >= 0]
    return min(found) if found else None


def partial_stop(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string: text a
    streamer must hold back until the next token says whether the stop string completes."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def sampling_kwargs(
    do_sample: bool, temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None
) -> dict[str, Any]:
    """transformers ``generate`` keywords for greedy decoding or sampling (seeded or not)."""
    if do_sample and seed is not None:
        from transformers import LogitsProcessorList

        # Sample in a logits processor with a generator private to this call, then let
        # greedy decoding pick the one token left: reproducible per seed even while other
        # threads sample (torch.manual_seed would reseed the process-wide RNG they share).
        sampler = seeded_sampler(seed, temperature, top_p, top_k)
        return {
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "logits_processor": LogitsProcessorList([sampler]),
        }
    if do_sample:
        return {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    # The model's generation_config may ship sampling defaults; greedy must not warn.
    return {"temperature": None, "top_p": None, "top_k": None}


def stopping_criteria(n_prompt: int, tok: Any, cancel: threading.Event | None) -> Any:
    """The criteria that end a local generation early: ``cancel`` set, or a repeated line
    (:data:`REPEATED_LINE_STOP` times in a row)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    criteria: list[Any] = []
    if cancel is not None:

        class _Cancel(StoppingCriteria):
            def __init__(self, event: threading.Event) -> None:
                self.event = event

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                done = self.event.is_set()
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        criteria.append(_Cancel(cancel))

    class _RepeatedLine(StoppingCriteria):
        """Ends the answer at a line produced REPEATED_LINE_STOP times in a row. A line ends
        only at a newline: the answer is decoded again only when a token holds one."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            new = input_ids[0, n_prompt:].tolist()
            done = bool(new) and "\n" in tok.decode(new[-1:]) and line_repeats(tok.decode(new))[0] is not None
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    criteria.append(_RepeatedLine())
    return StoppingCriteriaList(criteria)
