"""Why a test of llama.cpp's server suite fails against shardwire: a short cause per test, from
what the failures of the default selection were found to come from (test id patterns first, then
the failure's message)."""

from __future__ import annotations

import re

MODEL = (
    "model differs: the stand-in (Llama 2's vocabulary, random weights) is not the suite's stories260K, "
    "so token counts and generated text differ"
)

BY_TEST = [  # the first match wins
    (r"::test_server_multiple_addresses", "missing feature: several listen addresses (--host a,b)"),
    (r"::test_no_ui|::test_access_static_assets_without_api_key", "missing feature: the web UI"),
    (r"::test_server_model_aliases_and_tags", "missing feature: several aliases and --tags for one model"),
    (r"::test_metrics_prompt_processed_and_cached",
     "prefix reuse is by whole pages of 16 tokens (as vLLM's blocks); this prompt is shorter than one"),
    (r"::test_cors_origins_defaults_to_localhost_with_tools_enabled",
     "missing feature: llama-server's built-in tools (--tools), with which its CORS default becomes localhost"),
    (r"::test_chat_template$|::test_chat_template_assistant_prefill|::test_chat_template_continue_final|"
     r"::test_verbose_debug", "missing feature: verbose (__verbose), assistant prefill, continue_final_message"),
    (r"::test_apply_chat_template$|This is not a chat template",
     "chat templates: llama.cpp's other built-in names (command-r) and text without Jinja tags are refused"),
    (r"::test_invalid_chat_completion_req", "two assistant turns in a row are accepted (llama-server refuses)"),
    (r"test_ctx_shift\.py::test_ctx_shift_enabled", "missing feature: context shift (--context-shift)"),
    (r"::test_cors_options\[.*Allow-Headers",
     "CORS: a preflight's asked headers are named, not \"*\" (browsers never let \"*\" cover Authorization)"),
    (r"::test_cors_proxy", "missing feature: /cors-proxy (the web UI's MCP proxy)"),
    (r"::test_local_media_file", "missing feature: images (multimodal)"),
    (r"::test_metrics_prometheus_format",
     "metrics: llama-server's newer series (prompt_tokens_cached_total, n_decode_total, n_tokens_max, ...)"),
    (r"::test_metrics_embedding", "missing feature: embeddings"),
    (r"test_template\.py::test_reasoning",
     "reasoning: Command R7B's thinking tags (<|START_THINKING|>) are not among those shardwire knows"),
    (r"test_basic\.py::test_load_split_model|::test_completion\[|::test_completion_stream\[", MODEL),
    (r"::test_completion(_stream)?_with_openai_library$|::test_chat_completion_with_openai_library$", MODEL),
    (r"::test_chat_completion\[|::test_nocache_long_input_prompt|test_ctx_shift\.py::test_ctx_shift_disabled", MODEL),
    (r"::test_chat_completion_stream\[|::test_completion_prompt_cache|::test_chat_completion_cached_tokens", MODEL),
    (r"::test_return_progress\[", MODEL),  # the count of prompt chunks follows the prompt's token count
]  # fmt: skip

BY_MESSAGE = [
    (r"internal error|generation failed", "the engine failed (see the server log)"),
    (r"Server process died", "shardwire serve refused its command line"),
    (r"TestTimeout|ReadTimeout", "timed out"),
]


def cause_of(test: str, message: str) -> str:
    for pattern, cause in BY_TEST:
        if re.search(pattern, test):
            return cause
    for pattern, cause in BY_MESSAGE:
        if re.search(pattern, message):
            return cause
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return f"unclassified: {first[:160]}"
