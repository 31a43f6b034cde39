"""jitflow server: OpenAI-compatible SLO API, request analyzer, GMAX scheduler, engines.

Sub-packages are named for what they are in the JITServe paper:

- ``api``       HTTP API (OpenAI-compatible + ``slo`` extension)
- ``analyzer``  length upper bound (QRF), pattern graphs, matcher, sub-deadlines (φ(s))
- ``scheduler`` the pure policy core: GMAX and baselines (no vLLM import)
- ``engine``    embedded vLLM ``AsyncLLM``, the vLLM scheduler plug-in, the simulator
- ``tracker``   SLO tracker: measured TTFT/TBT/E2EL, step times, goodput
- ``store``     history store (SQLite)
- ``bench``     workloads, runners, goodput metrics, plots
"""

__version__ = "0.1.0"
