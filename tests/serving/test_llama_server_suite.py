"""A few of llama.cpp's own server tests, run against `shardwire serve` through
benchmarks/llama_server_shim.py: ones known to pass, so that a regression shows. Skipped where
the suite is not on this machine (benchmarks/build_llama_cpp.sh unpacks it);
`python -m benchmarks.llama_server_suite` runs the wider selection and explains its failures."""

from __future__ import annotations

import pytest

from benchmarks import llama_server_suite as suite

pytestmark = pytest.mark.slow  # a server process per test

KNOWN_TO_PASS = [
    "unit/test_tokenize.py",
    "unit/test_basic.py::test_server_props",
    "unit/test_basic.py::test_server_slots",
    "unit/test_basic.py::test_no_ui",
    "unit/test_completion.py::test_completion_with_tokens_input",
    "unit/test_completion.py::test_completion_response_fields",
    "unit/test_ignore_eos.py::test_ignore_eos_false_no_logit_bias",
    "unit/test_chat_completion.py::test_context_size_exceeded",
    "unit/test_security.py::test_incorrect_api_key",
    "unit/test_security.py::test_correct_api_key",
    "unit/test_metrics.py::test_metrics_generation_rate_excludes_first_token",
    "unit/test_metrics.py::test_metrics_prometheus_format",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
    "unit/test_completion.py::test_completion_unified",
]


def test_known_passing_llama_server_tests_pass():
    folder = suite.tests_dir()
    if not (folder / "utils.py").is_file():
        pytest.skip(f"llama.cpp's server tests are not at {folder} (benchmarks/build_llama_cpp.sh)")
    pytest.importorskip("requests")
    results, output = suite.run(KNOWN_TO_PASS, folder=folder, time_limit=240, test_timeout=60)
    assert results, output[-3000:]
    failed = [r for r in results if r.outcome != "passed"]
    assert not failed, suite.summary(results) + "\n" + output[-3000:]
    assert len(results) >= 21  # every file and id above ran (test_tokenize has 3, the parametrized ones 2 or 4 each)
