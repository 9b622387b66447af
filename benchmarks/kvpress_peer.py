"""kvpress's own presses on exactly the prompts of a structkv eval folder, query-agnostic.

The peer check of issue 29: the same model (transformers' own, from the same GGUF), the same
token ids (the folder's prompts rebuilt from its config.json with structkv's tokenizer), the
context compressed once by a press as kvpress's pipeline does it (`press(model)` around the
context's prefill, then its `generate_answer` for the question, greedy, stopping at EOS), and
scored with structkv's metric. The result is a folder with the source's config.json and a
predictions.jsonl whose labels are `kvpress:<press>@<R_KV>`, so benchmarks/paired_ruler.py and
common_subset.py pair it with the source folder's runs prompt by prompt.

kvpress pins transformers < 5.3, structkv's tests use 5.x above it, so it runs in its own venv
(the optional `peers` extra names the packages; never a test dependency):

    python -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.13.0 'structkv[peers]'
    /tmp/peers/bin/python benchmarks/kvpress_peer.py research/results/ruler_2k_question_after_smollm2 \
        --presses kvzip,snapkv,expected_attention,keydiff --kv-budget 0.1,0.2

kvpress supports Llama-family models (SmolLM2); it refuses KVzip on Gemma 3 and its Expected
Attention fails on Gemma 3's rotary embedding (research/results/README.md).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

PRESSES = ("kvzip", "snapkv", "expected_attention", "keydiff")


def make_press(name: str, kv_budget: float):
    """kvpress's press keeping `kv_budget` of the entries (its compression_ratio is what it drops)."""
    import kvpress

    cls = {"kvzip": kvpress.KVzipPress, "snapkv": kvpress.SnapKVPress,
           "expected_attention": kvpress.ExpectedAttentionPress, "keydiff": kvpress.KeyDiffPress}[name]
    return cls(compression_ratio=1.0 - kv_budget)


def gguf_of(name: str) -> Path:
    """The GGUF file structkv loads for `name` (the smollm2 alias or a .gguf path)."""
    from structkv.models.loading import SMOLLM2_GGUF
    from structkv.util.fetch import fetch

    if name in ("smollm2", "smollm2-135m-instruct"):
        return Path(fetch(SMOLLM2_GGUF)[0])
    if name.endswith(".gguf"):
        return Path(name)
    raise SystemExit(f"{name}: this script loads transformers' model from a GGUF (the smollm2 alias or a .gguf path); "
                     "kvpress supports Llama-family models")


def hf_model(gguf: Path, eos_ids):
    """transformers' model from the GGUF structkv loads, stopping at the same end tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = list(eos_ids)
    # KVzipPress tokenizes its repeat prompt with AutoTokenizer(model.config.name_or_path): a folder
    # holding the GGUF's tokenizer as transformers reads it
    folder = Path(tempfile.mkdtemp(prefix="kvpress-tokenizer-"))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    _plain_fast_tokenizer(folder)
    model.config.name_or_path = str(folder)
    _same_ids(AutoTokenizer.from_pretrained(folder), gguf)
    return model


def _plain_fast_tokenizer(folder: Path) -> None:
    """transformers' GGUF reader labels a llama-architecture GGUF's tokenizer `CodeLlamaTokenizer`
    even for a byte-level BPE vocabulary (SmolLM2's); reloaded under that class from the saved
    folder it turns newlines and spaces into token 0 (`<|endoftext|>`), so KVzipPress's repeat
    prompt and chat markup came out corrupted (research/results/README.md, "kvzip against kvpress").
    The saved tokenizer.json is the GGUF's own: load it as the plain fast tokenizer it is."""
    config = folder / "tokenizer_config.json"
    d = json.loads(config.read_text())
    d["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(d, indent=2))


def _same_ids(tokenizer, gguf: Path) -> None:
    """Refuse a peer tokenizer that does not give structkv's ids for chat markup and prose."""
    import structkv

    ours = structkv.load(str(gguf)).tokenizer
    for text in ("<|im_end|>\n<|im_start|>assistant\n", "\n\nRepeat the previous context exactly.", " A b\n c"):
        if tokenizer.encode(text, add_special_tokens=False) != ours.encode(text, add_bos=False):
            raise SystemExit(f"the peer's tokenizer ({type(tokenizer).__name__}) encodes {text!r} unlike structkv's: "
                             "its prompts would not be the same tokens")


class _Text:
    """The decoding kvpress's `generate_answer` asks of a tokenizer, by structkv's tokenizer (the
    same text for the same ids as structkv's own runs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        eos = set(self.tokenizer.eos_ids)
        return self.tokenizer.decode([int(i) for i in ids if not (skip_special_tokens and int(i) in eos)])


_LIBC = ctypes.CDLL("libc.so.6")


class PeakRSS:
    """The most resident memory the process added while inside the block, above its level on
    entry, sampled every `every` seconds by a thread. Why this and not ru_maxrss: the process's
    all-time peak is the GGUF load's, not an answer's; measured this way each answer's figure is
    what its prefill, cache and decode added on top of the loaded model (a spike shorter than
    `every` can be missed)."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, every: float = 0.002):
        self.every, self.peak = every, 0

    @classmethod
    def rss(cls) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * cls.PAGE

    def __enter__(self):
        _LIBC.malloc_trim(0)  # hand freed heap pages back first, or an earlier answer's hide this one's peak
        self.base, self._stop = self.rss(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss() - self.base)
            time.sleep(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss() - self.base)


@torch.inference_mode()
def answer(model, text: _Text, press, context: list[int], question: list[int], max_new_tokens: int):
    """kvpress's compress-once answer to one question (its pipeline's prefill under the press, then
    its `generate_answer`), and the K+V bytes the press kept."""
    from types import SimpleNamespace

    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model):
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    prefill_s = time.perf_counter() - t0
    kept = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    pipe = SimpleNamespace(model=model, tokenizer=text)  # what generate_answer reads of its pipeline
    out = KVPressTextGenerationPipeline.generate_answer(pipe, question_ids=torch.tensor([question]), cache=cache,
                                                        context_length=len(context), max_new_tokens=max_new_tokens)
    return out, kept, prefill_s


def run_peer(source: Path, out: Path | None, samples: int | None, prefix: str, runs: list[tuple[str, float]],
             setup, why: str = "") -> None:
    """Answer every prompt of the structkv eval folder `source` (made with
    --question-after-compression) once per (name, R_KV) of `runs`, into `out`/predictions.jsonl
    (default SOURCE_<prefix>) with labels `<prefix>:<name>@<R_KV>`, so the folders pair prompt by
    prompt; resumes. Each record has the answer's peak resident memory above the loaded model
    (`PeakRSS`). `setup(ours, cfg)` returns `answer(name, budget, sample, cap) -> (prediction,
    extra record fields)`, `ours` being structkv's model of the folder."""
    import structkv
    from structkv.harness.eval.result_folder import read_predictions, sample_key
    from structkv.harness.eval.runner import EvalConfig, build_samples, score

    stored = json.loads((source / "config.json").read_text())["config"]
    if not stored.get("question_after"):
        raise SystemExit(f"{source} was not made with --question-after-compression: {why}make the folder in that mode")
    cfg = EvalConfig(**{k: v for k, v in stored.items() if k in EvalConfig.__dataclass_fields__})
    cfg.samples = samples or cfg.samples
    ours = structkv.load(cfg.model)
    answer = setup(ours, cfg)
    out = Path(out or f"{source}_{prefix}")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "config.json", out / "config.json")  # the same identity settings: the folders pair
    done = read_predictions(out / "predictions.jsonl") if (out / "predictions.jsonl").exists() else {}
    with (out / "predictions.jsonl").open("a") as sink:
        for sample in build_samples(cfg, ours.tokenizer):
            for name, budget in runs:
                label = f"{prefix}:{name}@{budget:g}"
                key = sample_key(label, sample)
                if key in done:
                    continue
                cap = sample["max_new_tokens"] if cfg.max_new_tokens is None else min(cfg.max_new_tokens,
                                                                                     sample["max_new_tokens"])
                with PeakRSS() as memory:
                    said, extra = answer(name, budget, sample, cap)
                record = {"key": key, "label": label, "method": f"{prefix}:{name}", "kv_budget": budget,
                          "task": sample["task"], "index": sample["index"], "length_budget": sample["length_budget"],
                          "prompt_tokens": len(sample["input_ids"]) + len(sample["question_ids"]), "prediction": said,
                          "outputs": sample["outputs"], "score": score(sample, said),
                          "peak_rss_mib": memory.peak / 2**20, **extra}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                print(f"{label} {sample['task']} #{sample['index']}: {record['score']:.0f}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a structkv eval folder made with --question-after-compression")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--kv-budget", default="0.1,0.2")
    ap.add_argument("--out", help="default: SOURCE_kvpress")
    ap.add_argument("--samples", type=int, help="per task, fewer than the source's (a partial run; resumable)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvpress  # noqa: F401  (registers the pipeline)

    def setup(ours, cfg):
        model = hf_model(gguf_of(cfg.model), ours.config.eos_token_ids or ours.tokenizer.eos_ids)
        text = _Text(ours.tokenizer)

        def one(name, budget, sample, cap):
            said, kept, prefill_s = answer(model, text, make_press(name, budget), sample["input_ids"],
                                           sample["question_ids"], cap)
            return said, {"kv_bytes_kept": kept, "prefill_s": prefill_s}
        return one

    runs = [(p, float(b)) for p in args.presses.split(",") for b in args.kv_budget.split(",")]
    run_peer(Path(args.source), args.out, args.samples, "kvpress", runs, setup,
             why="kvpress compresses the context without the question; ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
