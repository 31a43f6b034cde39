"""Deep-research example agent on the jitflow SDK (see :mod:`examples.deep_research.agent`).

Run: ``python -m examples.deep_research "Why is the sky blue?" --deadline 60 --server URL``.
"""

from examples.deep_research.agent import APP, ResearchConfig, ResearchResult, run_research
from examples.deep_research.search import SearchIndex, default_index, web_search

__all__ = ["APP", "ResearchConfig", "ResearchResult", "run_research", "SearchIndex", "default_index",
           "web_search"]
