"""Talk to `ragbudget serve` with the official OpenAI client (start the server first):

    ragbudget index data/ && ragbudget serve --port 8000 &
    python examples/openai_client.py "How is the Project Leader elected?" [--base-url URL] [--api-key KEY]

Answers stream as server-sent events; the retrieved sources arrive in the last chunk's extra
``sources`` field. A server at capacity answers 429 with Retry-After, which the client retries.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("question", nargs="?", default="How is the Project Leader elected?")
    ap.add_argument("--base-url", default=os.environ.get("RAGBUDGET_BASE_URL", "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("RAGBUDGET_API_KEY", "unused-unless---api-key"))
    args = ap.parse_args()
    question = args.question
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    stream = client.chat.completions.create(
        model="ragbudget",
        messages=[{"role": "user", "content": question}],
        max_tokens=128,
        stream=True,
    )
    sources = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        sources = (chunk.model_extra or {}).get("sources") or sources
    print()
    for i, src in enumerate(sources, 1):
        print(f"[{i}] {src.get('path')} page {src.get('page')} score {src.get('score')}")


if __name__ == "__main__":
    main()
