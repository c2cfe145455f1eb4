"""``bench/answers.py`` with one more row of ``ragbudget``: ``ragbudget_floor_off``, ``ask`` with the
evidence floor off (``evidence_floor=0``, what ``ask --evidence-floor 0`` runs), beside the default
``ask`` and the peers in the same run, on the same engine, model, documents and questions.

On product reviews the floor declines answerable questions that the model would have answered
(``bench/abstain_answers.py``: the floor's declines cost F1 there and the model declines almost
nothing by itself); this measures what a user who turns the floor off gets, against the peers, with
the paired intervals ``answers.py`` computes for every ragbudget row. Everything else — ground,
scores, caches, options, the raw file's form — is ``answers.py``'s: this only registers the row.

    python bench/answers_floor.py --split amazon --docs 40 --questions 40 --unanswerable 10 \\
        --budgets 256,2048 --systems ragbudget,ragbudget_floor_off,langchain,llamaindex \\
        --model qwen2.5-coder-0.5b-instruct --peers-python PEERS_VENV/bin/python \\
        --out bench/results/answers_amazon_0_5b_floor_off.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import answers  # noqa: E402

answers.RAGBUDGET_ROWS["ragbudget_floor_off"] = {"evidence_floor": 0.0}
answers.LABELS["ragbudget_floor_off"] = "`ragbudget ask --evidence-floor 0` (the floor off)"

if __name__ == "__main__":
    answers.main()
