"""Tests of the analyzer's token counter seam: counters built from the engine's Hugging Face tokenizer and
from the raw ``tokenizers.Tokenizer`` count alike and carry the same name; models remember the name."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jitflow_server.analyzer.length import LengthPredictor, load_predictor_or_none
from jitflow_server.analyzer.length_service import LengthService
from jitflow_server.analyzer.tokens import REGEX_COUNTER_NAME, TokenCounter

CORPUS = [
    "Write a short poem about the sea and the wind.",
    "List five tips for writing clean Python code, with examples.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog; 12345 times!",
] * 20
TEXTS = ["Hello world, this is a test.\n ok", 'x = {"a": 1}', "", "tips for the sea"]


def bpe(vocab_size: int) -> Tokenizer:
    """A small byte-level BPE trained here (deterministic, no network)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def test_hf_fast_tokenizer_counts_like_its_backend_and_shares_its_name() -> None:
    raw = bpe(300)
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw.to_str()))
    a, b = TokenCounter(raw), TokenCounter(hf)
    assert a.name == b.name and a.name.startswith("bpe")
    assert a.count(TEXTS) == b.count(TEXTS) == [len(hf(t, add_special_tokens=False).input_ids) for t in TEXTS]
    assert a.prefixes(TEXTS[0], [0, 3, 1000]) == b.prefixes(TEXTS[0], [0, 3, 1000])
    assert TokenCounter(bpe(280)).name != a.name  # another vocabulary counts differently: another name


def test_counter_is_not_affected_by_truncation_left_on_the_engine_tokenizer() -> None:
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe(300))
    counter = TokenCounter(hf)
    before = counter.count(TEXTS)
    hf(TEXTS, truncation=True, max_length=2)  # may leave truncation set on the shared backend
    assert counter.count(TEXTS) == before and max(before) > 2


def test_regex_fallback_and_unsupported_tokenizers() -> None:
    assert TokenCounter(None).name == REGEX_COUNTER_NAME
    assert TokenCounter(None).count(["a, b\n"]) == [4]
    with pytest.raises(TypeError, match="fast Hugging Face tokenizer"):
        TokenCounter(object())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple:
    """A small forest trained with the regex counter, saved to disk."""
    rng = np.random.default_rng(0)
    prompts = [f"a {('short', 'long')[i % 2]} question {i}" for i in range(200)]
    lengths = [max(1, int((30 if i % 2 == 0 else 200) * np.exp(0.3 * rng.normal()))) for i in range(200)]
    pred = LengthPredictor(0.9, n_estimators=10, counter=TokenCounter(None), refine_grid=(50,), cv_folds=0).fit(
        prompts, lengths)
    return pred, pred.save(tmp_path_factory.mktemp("m") / "m.pkl"), prompts


def test_loading_with_another_tokenizer_warns(saved, caplog) -> None:
    pred, path, _ = saved
    other = TokenCounter(bpe(300))
    with caplog.at_level(logging.WARNING, logger="jitflow_server.analyzer.length"):
        same = LengthPredictor.load(path, counter=TokenCounter(None))
    assert not [r for r in caplog.records if "tokenizer" in r.message]
    with caplog.at_level(logging.WARNING, logger="jitflow_server.analyzer.length"):
        loaded = load_predictor_or_none(path, counter=other)
    assert loaded is not None and loaded.counter is other and same.tokenizer_name == REGEX_COUNTER_NAME
    assert any(REGEX_COUNTER_NAME in r.message and other.name in r.message for r in caplog.records)


def test_service_counts_and_logs_with_the_injected_counter(saved, tmp_path) -> None:
    _, path, prompts = saved
    counter = TokenCounter(bpe(300))
    tel = tmp_path / "tel.jsonl"
    with LengthService(path, counter=counter, telemetry_path=tel) as svc:
        assert svc.predictor is not None and svc.predictor.counter is counter and svc.counter is counter
        svc.submit("r", prompts[0], app="chat")
        assert svc.flush(5)
        svc.observe("r", 12)
    line = tel.read_text().splitlines()[0]
    assert f'"tokenizer":"{counter.name}"' in line
    assert f'"prompt_tokens":{counter.count([prompts[0]])[0]}' in line


def test_saved_model_names_only_the_compiled_forest_by_its_module_path(saved) -> None:
    """Saved models must keep loading: the pickle references jitflow code only through
    ``jitflow_server.analyzer.length_forest.CompiledForest``."""
    _, path, _ = saved
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as fh:
        Recorder(fh).load()
    assert {c for c in seen if c[0].startswith("jitflow")} == {("jitflow_server.analyzer.length_forest", "CompiledForest")}
