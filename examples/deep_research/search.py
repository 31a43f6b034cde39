"""Offline "web search" for the deep-research example: BM25 over a shipped document collection.

``corpus.jsonl`` (next to this file) holds ~40 short documents written for the project (LLM
serving, agents, general science and history), one JSON object per line:
``{"id": str, "title": str, "text": str}``. Ranking uses ``rank_bm25.BM25Okapi`` (Robertson &
Zaragoza's Okapi BM25, k1=1.5, b=0.75).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import anyio

import jitflow

__all__ = ["Document", "SearchHit", "SearchIndex", "CORPUS_PATH", "default_index", "web_search", "tokenize"]

CORPUS_PATH = Path(__file__).with_name("corpus.jsonl")

_STOP = frozenset(
    "a an and are as at be by for from has how in is it its of on or that the this to was what when where "
    "which who why will with does do did can".split()
)


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric terms of ``text`` minus a few English stop words."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOP]


@dataclass(frozen=True)
class Document:
    """One document of the collection."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class SearchHit:
    """A ranked search result: the document and its BM25 score (higher is better)."""

    doc: Document
    score: float


class SearchIndex:
    """BM25 index over a JSONL document collection.

    Args:
        path: JSONL file with ``id``, ``title``, ``text`` per line.

    Raises:
        FileNotFoundError: missing file.
        ValueError: a line is not a JSON object with string ``id``/``title``/``text``, or the file
            has no documents.
        ImportError: ``rank_bm25`` is not installed (``pip install rank-bm25``).
    """

    def __init__(self, path: str | Path = CORPUS_PATH) -> None:
        from rank_bm25 import BM25Okapi

        docs: list[Document] = []
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    doc = Document(str(d["id"]), str(d["title"]), str(d["text"]))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: not a document record: {e!r}") from e
                docs.append(doc)
        if not docs:
            raise ValueError(f"{path}: no documents")
        self.docs = docs
        self._bm25 = BM25Okapi([tokenize(d.title + " " + d.text) for d in docs])

    def __len__(self) -> int:
        return len(self.docs)

    def search(self, query: str, k: int = 3) -> list[SearchHit]:
        """The ``k`` best documents for ``query`` with a positive BM25 score, best first.

        Raises:
            ValueError: ``k < 1``.
        """
        if k < 1:
            raise ValueError("k must be >= 1")
        terms = tokenize(query)
        if not terms:
            return []
        scores = self._bm25.get_scores(terms)
        order = sorted(range(len(self.docs)), key=lambda i: (-scores[i], i))
        return [SearchHit(self.docs[i], float(scores[i])) for i in order[:k] if scores[i] > 0]


@lru_cache(maxsize=1)
def default_index() -> SearchIndex:
    """The index over the shipped ``corpus.jsonl`` (built once per process)."""
    return SearchIndex(CORPUS_PATH)


@jitflow.tool(name="web_search")
async def web_search(query: str, k: int = 3, latency: float = 0.0) -> list[SearchHit]:
    """Search the offline collection (a ``web_search`` tool node in the task's pattern graph).

    Args:
        query: search text.
        k: number of results.
        latency: simulated network latency of a web search API (seconds, >= 0) so that tool
            nodes have realistic execution times; 0 for none.

    Raises:
        ValueError: ``k < 1`` or negative ``latency``.
    """
    if latency < 0:
        raise ValueError("latency must be >= 0")
    hits = default_index().search(query, k)
    if latency:
        await anyio.sleep(latency)
    return hits
