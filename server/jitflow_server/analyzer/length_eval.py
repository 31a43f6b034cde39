"""Evaluation of the length upper bound (``jitflow analyzer eval-length``; JITServe §4.1).

Two splits of the test responses:

- ``new_prompts``: prompts are assigned to folds by a stable hash and every test response is bounded by
  models trained only on other folds (cross-fitting): no prompt of a test response was seen, by any model.
- ``known_prompts`` (only for test generators absent from the training files): the model is trained on
  every training response and bounds a held-out generator's responses to prompts that other models
  answered in training: a new model behind a known application.

Methods on each split: ``qrf`` (the served predictor: prompt memory, request features, spread-scaled
calibration), ``qrf_v1`` (the previous model: text features only, plain log-offset calibration) and
``empirical`` (the global q-quantile of training lengths still running at k), and on ``known_prompts`` the
reference :data:`SEEN_MODEL` (the served predictor with the held-out model's answers to the other half of
the prompts in training: how tight the features allow once a model is known). Each is reported
uncalibrated (the forest's bound with its fit-time conformal factor) and calibrated (the online
calibrator of the server, one stream per test generator in file order, every bound scored before its
length is revealed, counted after a warm-up). Per k in :data:`EVAL_KS`: coverage, median and P90 of
bound/true, and KV over-reservation ``Σ (bound − true)⁺ / Σ true``. A text-representation table compares
candidate prompt features at k = 0, and ``stages=`` adds the compound-stage bounds of a deep-research trace
(:func:`~jitflow_server.analyzer.stage_length.evaluate_stage_bounds`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

EVAL_KS: tuple[int, ...] = (0, 100, 400)
METHODS = ("qrf", "qrf_v1", "empirical")
#: Reference method of the known-prompts split: not a predictor a new model gets, a measure of how tight
#: the features can be at all (the held-out model's own responses to the other prompts are in training).
SEEN_MODEL = "qrf_seen_model"
NAMES = {"qrf": "QRF + prompt memory (served)", "qrf_v1": "QRF, text features only (previous model)",
         "empirical": "global empirical q-quantile",
         SEEN_MODEL: "served QRF, the model's other responses in training (reference)"}


def prompt_fold(key: str, seed: int, folds: int) -> int:
    """The fold (``0 .. folds-1``) of a prompt key: a stable hash, so a prompt's responses share a fold."""
    return int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest()[:8], 16) % folds


def summarize(y: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Coverage, median / P90 of bound/true and over-reservation of bounds ``b`` for lengths ``y`` (tokens)."""
    y = np.asarray(y, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if len(y) == 0:
        return {"n": 0}
    r = b / np.maximum(y, 1.0)
    return {"n": int(len(y)), "coverage": float(np.mean(y <= b)), "median_ratio": float(np.median(r)),
            "p90_ratio": float(np.percentile(r, 90)),
            "over_reservation": float(np.sum(np.maximum(b - y, 0.0)) / max(float(np.sum(y)), 1.0))}


def _stream(rows_by_gen: dict[str, list[int]], raw: np.ndarray, spread: np.ndarray, ks: np.ndarray, y: np.ndarray,
            ex_of: np.ndarray, quantile: float, step: float, warmup: int) -> dict[str, np.ndarray]:
    """Calibrated bounds: one online calibrator per generator stream (file order). Returns ``{"bound",
    "counted"}`` per row (``counted``: issued after the warm-up)."""
    from jitflow_server.analyzer.length_calibration import OnlineCalibrator, finalize_bound

    out = np.full(len(y), np.nan)
    counted = np.zeros(len(y), dtype=bool)
    for gen, rows in rows_by_gen.items():
        cal = OnlineCalibrator(quantile, step=step)
        by_ex: dict[int, list[int]] = {}
        for i in rows:
            by_ex.setdefault(int(ex_of[i]), []).append(i)
        for t, issued in enumerate(by_ex.values()):  # one response's rows, in k order
            for i in issued:
                b = finalize_bound(float(raw[i]) * cal.factor(None, gen, int(ks[i]), spread=float(spread[i])),
                                   int(ks[i]), None)
                out[i], counted[i] = b, t >= warmup
            cal.observe(None, gen, [(int(ks[i]), out[i]) for i in issued], int(y[issued[0]]))
    return {"bound": out, "counted": counted}


def run_eval(train_files: list[Path], test_files: list[Path], quantile: float, out: Path, *, folds: int = 2,
             warmup: int = 100, step: float = 0.05, seed: int = 0, stages: Path | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the evaluation (module docstring); write ``out/length_eval.{json,md,png}`` and return the dict.

    Raises ``ValueError`` for an empty train or test set.
    """
    from jitflow_server.analyzer.length import LengthPredictor
    from jitflow_server.analyzer.length_calibration import finalize_bound
    from jitflow_server.analyzer.length_data import build_rows, load_examples
    from jitflow_server.analyzer.tokens import get_token_counter

    def tick(msg: str) -> None:
        if progress is not None:
            progress(msg)

    counter = get_token_counter()
    files = list(dict.fromkeys([p.resolve() for p in train_files + test_files]))
    by_file = {}
    for f in files:
        tick(f"loading {f.name}")
        by_file[f] = load_examples([f], counter)
    train_ex = [e for f in dict.fromkeys(p.resolve() for p in train_files) for e in by_file[f]]
    test_ex = [e for f in dict.fromkeys(p.resolve() for p in test_files) for e in by_file[f]]
    if not train_ex or not test_ex:
        raise ValueError("empty train or test set")
    all_ex = list({id(e): e for e in train_ex + test_ex}.values())
    pos = {id(e): i for i, e in enumerate(all_ex)}
    tick(f"featurising {len(all_ex)} responses")
    ref = LengthPredictor(quantile, random_state=seed, counter=counter)
    P, G, y, C, idx = build_rows(all_ex, ref.refine_grid, counter)
    ks = G[:, 1].astype(np.int64)
    row_key = [all_ex[i].key for i in idx]
    train_set = {pos[id(e)] for e in train_ex}
    train_gens = sorted({e.model for e in train_ex if e.model})
    test_gens = list(dict.fromkeys(e.model for e in test_ex))
    held_out = [g for g in test_gens if g not in train_gens]
    fold_of = {k: prompt_fold(k, seed, folds) for k in set(row_key)}
    test_set = {pos[id(e)] for e in test_ex}
    is_test = np.asarray([idx[i] in test_set and ks[i] in EVAL_KS for i in range(len(y))])

    def fit_pair(tr: np.ndarray, previous: bool = True) -> dict[str, LengthPredictor]:
        ex_tr = sorted({int(idx[i]) for i in tr})
        m_new = LengthPredictor(quantile, random_state=seed, counter=counter)
        mem = m_new.fit_memory([all_ex[i] for i in ex_tr])
        mrow = {e: j for j, e in enumerate(ex_tr)}
        M = m_new.memory_rows([all_ex[i] for i in ex_tr], mem)[[mrow[int(idx[i])] for i in tr]]
        m_new.fit_rows(P[tr], G[tr], y[tr], [C[i] for i in tr], [row_key[i] for i in tr], M=M, memory=mem)
        if not previous:
            return {"qrf": m_new}
        m_old = LengthPredictor(quantile, random_state=seed, counter=counter, text_memory=False, spread_scaled=False)
        m_old.fit_rows(P[tr], G[tr], y[tr], [C[i] for i in tr], [row_key[i] for i in tr])
        return {"qrf": m_new, "qrf_v1": m_old}

    def bound_rows(models: dict[str, LengthPredictor], tr: np.ndarray, te: np.ndarray,
                   raw: dict[str, np.ndarray], spread: dict[str, np.ndarray], empirical: bool = True) -> None:
        prompts = [all_ex[int(idx[i])].prompt or "" for i in te]
        for name, m in models.items():
            X = m._assemble(P[te], G[te], [C[i] for i in te], m.memory_features(prompts))
            raw[name][te], spread[name][te] = m.predict_bounds(X)
        if not empirical:
            return
        y0 = y[tr][ks[tr] == 0]
        for k in EVAL_KS:
            pool = y0[y0 > k]
            raw["empirical"][te[ks[te] == k]] = float(np.quantile(pool if len(pool) else y0, quantile))

    splits: dict[str, dict[str, Any]] = {}
    fit_s = 0.0
    latency_model: LengthPredictor | None = None
    # ---- new prompts: instruction-disjoint cross-fitting ----
    raw = {m: np.full(len(y), np.nan) for m in METHODS}
    spread = {m: np.ones(len(y)) for m in METHODS}
    for f in range(folds):
        tr = np.asarray([i for i in range(len(y)) if idx[i] in train_set and fold_of[row_key[i]] != f])
        te = np.asarray([i for i in np.nonzero(is_test)[0] if fold_of[row_key[i]] == f])
        if len(tr) == 0 or len(te) == 0:
            continue
        tick(f"new prompts, fold {f + 1}/{folds}: training on {len(tr)} rows")
        t0 = time.perf_counter()
        models = fit_pair(tr)
        fit_s += time.perf_counter() - t0
        bound_rows(models, tr, te, raw, spread)
        latency_model = models["qrf"]
    splits["new_prompts"] = {"raw": raw, "spread": spread, "rows": np.nonzero(is_test & ~np.isnan(raw["qrf"]))[0]}
    # ---- known prompts: held-out generators, trained on every training response ----
    if held_out:
        tick("known prompts: training on every training response")
        tr = np.asarray([i for i in range(len(y)) if idx[i] in train_set])
        te = np.asarray([i for i in np.nonzero(is_test)[0] if all_ex[int(idx[i])].model in held_out])
        raw = {m: np.full(len(y), np.nan) for m in METHODS}
        spread = {m: np.ones(len(y)) for m in METHODS}
        models = fit_pair(tr)
        bound_rows(models, tr, te, raw, spread)
        latency_model = models["qrf"]
        # reference: the same predictor with the held-out model's responses to the other fold's prompts
        # in training (prompt-disjoint 2-fold cross-fitting over the held-out rows)
        raw[SEEN_MODEL], spread[SEEN_MODEL] = np.full(len(y), np.nan), np.ones(len(y))
        held_rows = np.asarray([i for i in range(len(y)) if all_ex[int(idx[i])].model in held_out])
        for f in range(2):
            other = held_rows[[prompt_fold(row_key[i], seed + 1, 2) != f for i in held_rows]]
            te_f = te[[prompt_fold(row_key[i], seed + 1, 2) == f for i in te]]
            if len(other) == 0 or len(te_f) == 0:
                continue
            tick(f"known prompts, the held-out model seen on other prompts: fold {f + 1}/2")
            m_seen = fit_pair(np.concatenate([tr, other]), previous=False)["qrf"]
            bound_rows({SEEN_MODEL: m_seen}, tr, te_f, raw, spread, empirical=False)
        splits["known_prompts"] = {"raw": raw, "spread": spread, "rows": te}

    def group_of(i: int) -> str:
        return "in_distribution" if all_ex[int(idx[i])].model in train_gens else "held_out_model"

    results: dict[str, Any] = {}
    for split, sp in splits.items():
        rows = sp["rows"]
        gens: dict[str, list[int]] = {}
        for i in rows:
            gens.setdefault(str(all_ex[int(idx[i])].model), []).append(int(i))
        for g in gens.values():
            g.sort(key=lambda i: (int(idx[i]), ks[i]))
        res_split: dict[str, Any] = {}
        for name in sp["raw"]:
            unc = np.asarray([finalize_bound(float(v), int(k), None) if np.isfinite(v) else np.nan
                              for v, k in zip(sp["raw"][name], ks, strict=True)])
            cal = _stream(gens, sp["raw"][name], sp["spread"][name], ks, y, idx, quantile, step, warmup)
            for grp in sorted({group_of(i) for i in rows}):
                rg = np.asarray([i for i in rows if group_of(i) == grp])
                entry = res_split.setdefault(grp, {}).setdefault(name, {"uncalibrated": {}, "calibrated": {}})
                for k in EVAL_KS:
                    sel = rg[ks[rg] == k]
                    entry["uncalibrated"][str(k)] = summarize(y[sel], unc[sel])
                    selc = sel[cal["counted"][sel]]
                    entry["calibrated"][str(k)] = summarize(y[selc], cal["bound"][selc])
        results[split] = res_split

    tick("text representations")
    text_repr = _text_representations(all_ex, train_ex, test_ex, held_out, quantile, seed, folds, counter)
    tick("latency")
    latency = _latency(latency_model, [e.prompt or "" for e in test_ex], seed) if latency_model else {}
    stage_res = None
    if stages is not None:
        from jitflow_server.analyzer.patterns import load_deepresearch
        from jitflow_server.analyzer.stage_length import evaluate_stage_bounds

        tick("deep-research stages")
        stage_res = evaluate_stage_bounds(load_deepresearch(stages), quantile=quantile, folds=folds, seed=seed)
    result = {
        "quantile": quantile, "tokenizer": counter.name, "train_files": [str(p) for p in train_files],
        "test_files": [str(p) for p in test_files], "train_generators": train_gens, "test_generators": test_gens,
        "held_out_generators": held_out, "folds": folds, "n_train_responses": len(train_ex),
        "n_test_responses": len(test_ex), "warmup": warmup, "calibration_step": step, "fit_seconds": round(fit_s, 1),
        "results": results, "text_representations": text_repr, "latency_ms": latency,
        "stages": stage_res, "stages_file": str(stages) if stages else None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "length_eval.json").write_text(json.dumps(result, indent=1))
    (out / "length_eval.md").write_text(render_markdown(result))
    _plot(result, out / "length_eval.png")
    return result


def _text_representations(all_ex: list[Any], train_ex: list[Any], test_ex: list[Any], held_out: list[str],
                          quantile: float, seed: int, folds: int, counter: Any) -> dict[str, Any]:
    """k = 0 bounds of held-out-model responses with candidate prompt representations (no calibration):
    the 32-bucket hashed bag of words (v1), TF-IDF + 64-d SVD in its place, and the prompt memory."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    from jitflow_server.analyzer.length import LengthPredictor
    from jitflow_server.analyzer.length_features import N_HASH, PREFIX_FEATURE_NAMES, prompt_features
    from jitflow_server.analyzer.length_memory import PromptMemory

    test = [e for e in test_ex if e.model in held_out] or test_ex
    base = len(prompt_features([""])[0]) - N_HASH
    out: dict[str, Any] = {}

    def fold_of(e: Any) -> int:
        return prompt_fold(e.key, seed, folds)

    for split in ("new_prompts", "known_prompts"):
        if split == "known_prompts" and not held_out:
            continue
        parts = range(folds) if split == "new_prompts" else [None]
        ys: list[float] = []
        bounds: dict[str, list[float]] = {"hashed_bow_32": [], "tfidf_svd_64": [], "prompt_memory": []}
        for f in parts:
            tr = [e for e in train_ex if f is None or fold_of(e) != f]
            te = [e for e in test if f is None or fold_of(e) == f]
            if not tr or not te:
                continue
            Ptr = prompt_features([e.prompt or "" for e in tr], counter.count([e.prompt or "" for e in tr]))
            Pte = prompt_features([e.prompt or "" for e in te], counter.count([e.prompt or "" for e in te]))
            vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True).fit([e.prompt or "" for e in tr])
            V = vec.transform([e.prompt or "" for e in tr])
            svd = TruncatedSVD(max(1, min(64, V.shape[1] - 1)), random_state=seed).fit(V)
            Str = svd.transform(vec.transform([e.prompt or "" for e in tr]))
            Ste = svd.transform(vec.transform([e.prompt or "" for e in te]))
            mem = PromptMemory().fit([e.prompt or "" for e in tr], [e.output_len for e in tr])
            Mtr = LengthPredictor(quantile).memory_rows(tr, mem)
            Mte = mem.features([e.prompt or "" for e in te])
            ytr = np.asarray([e.output_len for e in tr], dtype=np.float64)
            Gtr, Gte = np.zeros((len(tr), len(PREFIX_FEATURE_NAMES))), np.zeros((len(te), len(PREFIX_FEATURE_NAMES)))
            cands = {"hashed_bow_32": (Ptr, Pte, None, None),
                     "tfidf_svd_64": (np.hstack([Ptr[:, :base], Str]), np.hstack([Pte[:, :base], Ste]), None, None),
                     "prompt_memory": (Ptr, Pte, Mtr, Mte)}
            for name, (A, B, MA, MB) in cands.items():
                m = LengthPredictor(quantile, random_state=seed, counter=counter, cv_folds=0, spread_scaled=False)
                m.fit_rows(A, Gtr, ytr, [None] * len(tr), M=MA, memory=mem if MA is not None else None)
                bounds[name] += list(m.predict_matrix(m._assemble(B, Gte, [None] * len(te), MB)))
            ys += [e.output_len for e in te]
        yy = np.asarray(ys)
        res = {}
        for name, b in bounds.items():
            bb = np.asarray(b)
            s = float(np.quantile(np.maximum(yy, 1.0) / bb, quantile, method="higher"))
            res[name] = {"raw": summarize(yy, bb), "at_coverage_q": summarize(yy, bb * s)}
        out[split] = res
    return out


def _latency(m: Any, prompts: list[str], seed: int) -> dict[str, dict[str, float]]:
    """P50/P99 ms: one request from text, and a batch of 256 from text and on the serving path (prompt
    and memory features cached at arrival, as the length service does)."""
    from jitflow_server.analyzer.length_features import prompt_features

    rng = np.random.default_rng(seed)
    pick = [prompts[j] for j in rng.integers(0, len(prompts), 256)]

    def timed(fn: Callable[[], Any], n: int) -> dict[str, float]:
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return {"p50_ms": float(np.percentile(ts, 50)), "p99_ms": float(np.percentile(ts, 99)), "n": n}

    pf = prompt_features(pick, m.counter.count(pick))
    mf = m.memory_features(pick)
    it = iter(range(10**9))
    return {
        "single_from_text": timed(lambda: m.predict([pick[next(it) % 256]]), 200),
        "batch256_from_text": timed(lambda: m.predict(pick), 20),
        "batch256_serving_path": timed(lambda: m.predict_bounds(m.features(pick, prompt_feats=pf, memory_feats=mf)[0]),
                                       20),
    }


def _fmt(s: dict[str, float]) -> str:
    if not s.get("n"):
        return "| – | – | – | – | – |"
    return (f"| {s['n']} | {s['coverage']:.3f} | {s['median_ratio']:.2f} | {s['p90_ratio']:.2f} | "
            f"{s['over_reservation']:.2f} |")


def render_markdown(res: dict[str, Any]) -> str:
    """Markdown report of a :func:`run_eval` result."""
    q = res["quantile"]
    lines = [f"# Length upper bound evaluation (q = {q})", "",
             f"Tokenizer `{res['tokenizer']}`. Train generators: {', '.join(res['train_generators'])}; test "
             f"generators: {', '.join(res['test_generators'])}. {res['n_train_responses']} train / "
             f"{res['n_test_responses']} test responses; {res['folds']}-fold prompt-disjoint cross-fitting for "
             f"`new_prompts`. Calibrated = online calibrator per generator stream, counted after "
             f"{res['warmup']} responses. Over-reservation = Σ(bound − true)⁺ / Σ true.", ""]
    for split, groups in res["results"].items():
        for grp, by_m in groups.items():
            lines += [f"## {split.replace('_', ' ')}: {grp.replace('_', ' ')}", "",
                      "| method | calibration | k | n | coverage | median bound/true | P90 bound/true | "
                      "over-reservation |", "|---|---|---:|---:|---:|---:|---:|---:|"]
            for name, modes in by_m.items():
                for mode, by_k in modes.items():
                    for k, s in by_k.items():
                        lines.append(f"| {NAMES[name]} | {mode} | {k} {_fmt(s)}")
            lines.append("")
    lines += ["## Text representations (k = 0, held-out model, uncalibrated and scaled to coverage q)", "",
              "| split | representation | coverage | median | P90 | median at q | P90 at q |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for split, by_r in res["text_representations"].items():
        for name, v in by_r.items():
            a, b = v["raw"], v["at_coverage_q"]
            lines.append(f"| {split} | {name} | {a['coverage']:.3f} | {a['median_ratio']:.2f} | {a['p90_ratio']:.2f} | "
                         f"{b['median_ratio']:.2f} | {b['p90_ratio']:.2f} |")
    if res.get("stages"):
        from jitflow_server.analyzer.stage_length import render_stage_markdown

        lines += ["", f"## Deep-research stages ({res['stages_file']})", "", render_stage_markdown(res["stages"])]
    lines += ["", "## Latency (ms, this machine)", "", "| what | P50 | P99 |", "|---|---:|---:|"]
    for k, v in res["latency_ms"].items():
        lines.append(f"| {k} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} |")
    lines += ["", f"Fit time of the new-prompt folds: {res['fit_seconds']} s.", ""]
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for split, groups in res["results"].items():
        for grp, by_m in groups.items():
            if grp != "held_out_model":
                continue
            for name in by_m:
                by_k = by_m[name]["calibrated"]
                ks = [int(k) for k, s in by_k.items() if s.get("n")]
                lab = f"{name} ({split})"
                ls = "-" if split == "known_prompts" else "--"
                axes[0].plot(ks, [by_k[str(k)]["coverage"] for k in ks], ls, marker="o", label=lab)
                axes[1].plot(ks, [by_k[str(k)]["median_ratio"] for k in ks], ls, marker="o", label=lab)
                axes[2].plot(ks, [by_k[str(k)]["p90_ratio"] for k in ks], ls, marker="o", label=lab)
    q = res["quantile"]
    axes[0].axhline(q, color="k", lw=0.8)
    axes[0].axhline(q - 0.03, color="k", lw=0.5, ls=":")
    axes[0].set(xlabel="generated tokens k", ylabel="coverage", title="held-out model, calibrated: coverage")
    axes[1].set(xlabel="generated tokens k", ylabel="median bound / true", title="median bound/true")
    axes[2].set(xlabel="generated tokens k", ylabel="P90 bound / true", title="P90 bound/true")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
