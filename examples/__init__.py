"""Example agent apps written against the public jitflow SDK (``import jitflow``).

* :mod:`examples.deep_research` -- a deep-research agent (generate_query -> parallel
  web_research -> reflection loop -> finalize_answer) over an offline BM25 search tool.
* :mod:`examples.tree_of_thoughts` -- Tree-of-Thoughts for the Game of 24 (propose k
  thoughts per state, evaluate them in parallel, keep the best b, depth 3).

Run them from the repository root, e.g. ``python -m examples.deep_research "question"
--deadline 60 --server http://127.0.0.1:8000``. See ``examples/README.md``.
"""
