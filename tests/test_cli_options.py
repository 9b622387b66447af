"""Each setting is declared once: the config dataclasses (EvalConfig, BenchConfig, serve's Settings)
hold what a run means, and the command line's flags must cover exactly their fields, apart from the
renames and the flags about the process (where to write, threads, the network) listed here. A
field added without its flag, or a flag without its field, fails here."""
import argparse
import dataclasses

import pytest

from structkv.cli import bench, evaluate, serve
from structkv.harness.bench import BenchConfig
from structkv.harness.eval.config import EvalConfig
from structkv.serve.engine import Settings

# command -> (module, config, {flag dest: field}, flags about the process, fields set by the command itself)
COMMANDS = {
    "eval": (evaluate, EvalConfig,
             {"kv_budget": "kv_budgets", "data": "data_dir", "question_after_compression": "question_after",
              "eager": "compile", "separate": "shared"},
             {"no_write", "out", "quiet", "r_struct", "report", "threads"}, set()),
    "bench": (bench, BenchConfig, {"eager": "compile", "no_hf": "hf"}, {"eval", "out", "r_struct", "threads"}, set()),
    "serve": (serve, Settings, {"served_name": "model_name"},
              {"allow_origin", "allowed_host", "api_key", "body_timeout", "dtype", "head_timeout", "host", "kv_dtype",
               "log_level", "max_connections", "max_request_bytes", "model", "no_auth", "port", "r_struct",
               "shutdown_grace", "threads", "weights"}, {"default_max_tokens"}),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_flags_cover_the_config_fields_once(name):
    module, config, renames, process, own = COMMANDS[name]
    sub = argparse.ArgumentParser().add_subparsers()
    module.add_parser(sub)
    flags = {a.dest for a in sub.choices[name]._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(config)}
    mapped = {renames.get(f, f) for f in flags - process}
    assert mapped - fields == set(), f"flags of {name} with no field in {config.__name__}"
    assert fields - mapped == own, f"fields of {config.__name__} with no flag of {name}"
