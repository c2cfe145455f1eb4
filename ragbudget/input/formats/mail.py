"""Mail: single messages (``.eml``) and mbox archives (``.mbox``), stdlib :mod:`email` only.

Each message becomes one page: ``From``/``Date``/``Subject`` lines, then the text part (the HTML
part through the HTML reader when there is no plain text). Quoted replies stay in the text: the
index's near-duplicate stage already folds a quoted passage into the message it quotes.
"""

from __future__ import annotations

import email
import email.policy
import re
from email.message import EmailMessage

from ...errors import LoadError
from ..html import html_to_text
from ._base import Loaded, LoadOptions

__all__ = ["read_eml", "read_mbox"]

# mbox separators: a line starting "From " (the envelope line) at the start of the file or after
# a blank line. Lines in bodies that start with "From " are escaped (">From ") by mbox writers.
_MBOX_SPLIT = re.compile(rb"(?:^|\n\n|\r\n\r\n)From [^\n]*\n")


def _header(msg: EmailMessage, name: str) -> str:
    try:
        value = msg.get(name)
    except Exception:  # email's header parser raises assorted errors on hostile headers
        return ""
    return " ".join(str(value).split()) if value is not None else ""


def _message_text(msg: EmailMessage, path: str) -> str:
    """The readable body of one message: text/plain preferred, else HTML converted."""
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    content = part.get_content()
    if isinstance(content, bytes):
        content = content.decode("utf-8", "replace")
    if part.get_content_subtype() == "html":
        content, _ = html_to_text(content, path)
    return "\n".join(line.rstrip() for line in content.strip().splitlines())


def _render(raw: bytes, path: str) -> tuple[str, str]:
    """``(label, page)`` for one message's bytes; raises on a message that cannot be read."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    if not isinstance(msg, EmailMessage) or not msg.keys():
        raise ValueError("no headers")
    body = _message_text(msg, path)
    head = [f"{name}: {value}" for name in ("From", "Date", "Subject") if (value := _header(msg, name))]
    if not body.strip():
        raise LoadError(f"{path}: the message has no text part (attachments only?)", path=path, reason="empty")
    mid = _header(msg, "Message-ID")
    return mid, "\n".join(head) + "\n\n" + body


def read_eml(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One message, one page labelled ``message <id>``."""
    try:
        mid, page = _render(data, path)
    except LoadError:
        raise
    except Exception as exc:  # the email package raises many types on damaged input
        raise LoadError(
            f"{path}: cannot read the message ({type(exc).__name__}: {exc})"[:300], path=path, reason="malformed"
        ) from exc
    return Loaded([page], [f"message {mid}" if mid else "message 1"], meta={"messages": 1}, clean=False)


def read_mbox(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One page per message in file order, labelled ``message <Message-ID>`` (``message #N``
    without one). A message that cannot be read is skipped and reported in one warning line; the
    rest of the archive is still indexed. The page furniture detector is not run: messages are
    records whose From/Date lines differ only in digits, which it would take for running heads."""
    starts = [m.end() for m in _MBOX_SPLIT.finditer(data)]
    if not starts:
        raise LoadError(f"{path}: not an mbox (no 'From ' separator line)", path=path, reason="malformed")
    bounds = [m.start() for m in _MBOX_SPLIT.finditer(data)][1:] + [len(data)]
    pages: list[str] = []
    labels: list[str] = []
    broken: list[str] = []
    for n, (a, b) in enumerate(zip(starts, bounds, strict=True), 1):
        raw = re.sub(rb"(?m)^>(>*From )", rb"\1", data[a:b])  # undo mboxrd "From " quoting
        try:
            mid, page = _render(raw, path)
        except LoadError:
            broken.append(f"#{n} (no text part)")
            continue
        except Exception as exc:  # one bad message must not lose the archive (see docstring)
            broken.append(f"#{n} ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        pages.append(page)
        labels.append(f"message {mid}" if mid else f"message #{n}")
    if not pages:
        raise LoadError(
            f"{path}: none of the {len(starts)} messages could be read ({broken[0]})", path=path, reason="malformed"
        )
    warnings = (
        [
            f"{len(broken)} of {len(starts)} messages could not be read and were skipped: "
            + ", ".join(broken[:3])
            + (" ..." if len(broken) > 3 else "")
        ]
        if broken
        else []
    )
    return Loaded(pages, labels, meta={"messages": len(starts), "messages_skipped": len(broken)}, warnings=warnings)
