"""What goes in: the candidates' whole chunks (:mod:`~ragbudget.packing.select`) or the
question's sentences inside the best of them (:mod:`~ragbudget.packing.spans`), packed into the
context allowance at their exact cost. One stage of a question's way: after the search, before
the prompt is rendered (:mod:`ragbudget.prompt` renders and counts, and never selects).
"""
