"""The fast phases of benchmarks/serve_faults.py against an in-process server on the tiny chat
model: bad input never answered 5xx, odd sampling beside a greedy row, an archive truncated,
overwritten and deleted under the server, a one-address flood. (The script runs them all, and
the log and process checks, against a real `structkv serve` with a real model.)"""
import importlib.util
from pathlib import Path

import pytest

from structkv.serve import app_for
from structkv.serve.engine import Settings
from structkv.serve.launch import Background

pytest.importorskip("httpx")
spec = importlib.util.spec_from_file_location("serve_faults", Path(__file__).parents[1] / "benchmarks/serve_faults.py")
serve_faults = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_faults)

NAME = "tiny-chat"


def _settings(**kw):
    return Settings(**{**dict(model_name=NAME, method="snapkv", context_method="snapkv", kv_budget=0.3, compile=False,
                              max_tokens=64, default_max_tokens=8, room=64, min_context_tokens=32, max_queue=16), **kw})


def test_bad_input_and_sampling_beside_a_greedy_row(chat_model):
    with Background(app_for(chat_model, _settings()), max_connections=16) as srv:
        bad = serve_faults.bad_input(srv.url, NAME, {})
        assert bad["5xx"] == [], bad["statuses"]
        assert all(isinstance(v, int) and 400 <= v < 500 for v in bad["statuses"].values()), bad["statuses"]
        iso = serve_faults.isolation(srv.url, NAME, {})
        assert iso["failed"] == [] and not iso["greedy_changed"], iso


def test_archive_changed_under_the_server_is_never_read(chat_model, tmp_path):
    settings = _settings(archive="int4", archive_dir=str(tmp_path))
    with Background(app_for(chat_model, settings), max_connections=16) as srv:
        got = serve_faults.archive_faults(srv.url, NAME, {}, tmp_path, facts=12)
    assert got["archive_files"] >= 1 and got["wrong_answers"] == 0 and got["5xx"] == 0, got


def test_health_answered_while_one_address_floods(chat_model):
    with Background(app_for(chat_model, _settings()), max_connections=4, head_timeout_s=10.0) as srv:
        got = serve_faults.flood(srv.url, seconds=3.0, sockets=30)
    assert got["share"] >= 0.95, got
