"""Tree-of-Thoughts Game-of-24 example on the jitflow SDK (see :mod:`examples.tree_of_thoughts.agent`).

Run: ``python -m examples.tree_of_thoughts --numbers 4 9 10 13 --deadline 60 --server URL``.
"""

from examples.tree_of_thoughts.agent import APP, ToTConfig, ToTResult, run_tot
from examples.tree_of_thoughts.game24 import initial_state, legal_moves, solve

__all__ = ["APP", "ToTConfig", "ToTResult", "run_tot", "initial_state", "legal_moves", "solve"]
