"""The `shardwire` command: worker, generate, serve, plan, bench, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import __version__
from ..coordinator.launch import add_cluster_args
from ..enums import COMPUTE_DTYPES, WEIGHT_MODES
from ..pipeline import PipelineError
from ..serving.cors import CorsPolicy
from ..serving.openai_api import SPEC_TYPES
from ..wire.options import add_worker_tls_args, resolve_token, server_tls
from ..worker.ring import SPIN_S


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, help="0 = off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="1.0 = off (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, help="0.0 = off (default: %(default)s)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1.0 = off (default: %(default)s)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks back (default: %(default)s)")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: a random one)")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (llama-server's flags)")
    g.add_argument(
        "--spec-type",
        choices=SPEC_TYPES,
        default=None,
        help="ngram-simple: each decode step proposes the tokens that followed the sequence's last "
        "n-gram earlier in its context (prompt lookup); draft-simple: what the draft model (-md) "
        "writes; all checked in that one step, as many as measured to pay (default: draft-simple "
        "with -md, else none)",
    )
    g.add_argument(
        "-md",
        "--model-draft",
        "--spec-draft-model",
        default=None,
        metavar="FILE",
        help="a draft model of the same vocabulary (a .gguf file or a Hugging Face folder), run whole "
        "on --device-draft",
    )
    g.add_argument(
        "-devd", "--device-draft", "--spec-draft-device", default=None, help="the draft model's device (default: cpu)"
    )
    g.add_argument(
        "--draft-p-min",
        "--spec-draft-p-min",
        type=float,
        default=0.0,
        help="the draft model stops proposing where its most likely token is less likely (default: 0.0)",
    )
    # llama-server's current names and those it had before (both are in users' commands)
    g.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        "--draft",
        "--draft-n",
        dest="draft_max",
        type=int,
        default=16,
        help="most proposals a step carries (default: 16)",
    )
    g.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        "--draft-n-min",
        dest="draft_min",
        type=int,
        default=0,
        help="fewest proposals worth a step (default: 0)",
    )
    g.add_argument(
        "--spec-ngram-simple-size-n",
        "--spec-ngram-size-n",
        dest="spec_ngram_size_n",
        type=int,
        default=3,
        help="longest n-gram looked up (default: %(default)s)",
    )
    g.add_argument(
        "--spec-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on workers, send a sequence's next step while the one before is in flight, on what it "
        "is expected to give, where its proposals are kept often enough to pay (default: on)",
    )


def _add_server_defaults_args(p: argparse.ArgumentParser) -> None:
    """llama-server's flags for what a request leaves out; a flag not given leaves each endpoint
    its own default (OpenAI's on /v1, llama.cpp's on /completion)."""
    g = p.add_argument_group("request defaults (llama-server's flags)")
    g.add_argument("--temp", "--temperature", type=float, default=None, help="temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="1.0 = off")
    g.add_argument("--min-p", type=float, default=None, help="0.0 = off")
    g.add_argument("--repeat-penalty", type=float, default=None, help="1.0 = off")
    g.add_argument("--repeat-last-n", type=int, default=None, help="tokens the penalty looks back")
    g.add_argument("-s", "--seed", type=int, default=None, help="seed of requests without one (-1: random each)")
    g.add_argument(
        "-n",
        "--n-predict",
        "--predict",
        type=int,
        default=-1,
        help="tokens per completion for requests without max_tokens/n_predict; a request's own wins, as "
        "in llama-server (default: %(default)s = up to the end of the context)",
    )
    g.add_argument(
        "--reasoning",
        choices=["on", "off", "auto"],
        default="auto",
        help="thinking models (a chat template with <think>): templates see enable_thinking true, "
        "or false with off (a block the template opens is then closed); the reasoning comes back "
        "apart, as reasoning_content (default: %(default)s)",
    )
    g.add_argument(
        "--reasoning-format",
        choices=["auto", "deepseek", "none"],
        default="auto",
        help="none: the reasoning stays in content, as the model wrote it; auto, deepseek: apart, as "
        "reasoning_content (a request's reasoning_format wins) (default: %(default)s)",
    )
    g.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="variables for the chat template, e.g. '{\"enable_thinking\": false}'; a request's own "
        "chat_template_kwargs add to them",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template instead of the model's: a built-in name (chatml, llama3, gemma, phi3, zephyr) "
        "or Jinja text",
    )
    g.add_argument("--chat-template-file", default=None, help="chat template instead of the model's, from a file")
    g.add_argument(
        "--jinja", action="store_true", help="accepted for llama-server's command lines: templates are Jinja"
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file (first part of a split model) or a Hugging Face folder")
    p.add_argument(
        "-d",
        "--device",
        default=None,
        help="device for local stages: cpu, cuda:N or mps (default: the first accelerator, else cpu)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=COMPUTE_DTYPES,
        help="compute dtype (default: each device's own, as its worker reports it: float32 on CPUs with "
        "ggml's kernels, as llama.cpp's CPU backend; bfloat16 on cuda and, without ggml, on CPUs with "
        "native bf16; float16 on mps; else float32; raised where it would round the file's weights: an "
        "F32 file computes in float32, F16 weights never in bfloat16)",
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="quantized GGUF weights on the devices: dequant (to the compute dtype), packed (int4/int8 "
        "kernels), compact (packed only where that costs no more than ~1.1x the file; the rest "
        "dequantized just before use; through ggml's kernels where those measured fastest), fast (each "
        "type in the format its device measured fastest to decode: dense, PyTorch's packed kernel or "
        "ggml's); auto = the first of fast, packed, compact that fits (default: %(default)s)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=4096,
        help="context size per sequence, capped at the model's (default: %(default)s)",
    )
    p.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the most positions the KV caches of all sequences hold together, in pages of 16 that "
        "sequences take as they grow; a full pool makes the newest sequence wait (default: every "
        "slot's whole --ctx-size; never less than one)",
    )
    p.add_argument(
        "--swa-full",
        action="store_true",
        help="blocks on a sliding window (gpt-oss, Gemma 3) keep every position, as the others do, so that "
        "any cached prompt prefix is reused; by default they keep their window and a prefill chunk's worth "
        "per sequence, and a prefix is reused only in the slot that computed it",
    )
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwire", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardwire {__version__}")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="(default: %(default)s)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="continue a prompt, printing tokens as they come")
    _add_model_args(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_sampling_args(p)
    _add_speculative_args(p)
    add_cluster_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("worker", help="serve stages of a model to a coordinator")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=50052, help="(default: %(default)s)")
    p.add_argument(
        "-d",
        "--device",
        default=None,
        help="devices to serve, comma-separated: cuda:N, mps, cpu (CPU devices may be named "
        "cpu:0,cpu:1) (default: every accelerator, else cpu)",
    )
    p.add_argument("--mem", default=None, help="memory budget per device, e.g. 20G or 512M (default: free memory)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    p.add_argument("--cache-dir", default=None, help="weight cache folder (default: ~/.cache/shardwire)")
    p.add_argument("--cache-size", default=None, help="evict least recently used weights beyond this, e.g. 100G")
    p.add_argument(
        "--model-dir", action="append", default=[], help="folder of this machine's own model files (repeatable)"
    )
    p.add_argument("--max-connections", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--max-frame", default="256M", help="largest frame accepted (default: %(default)s)")
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure this CPU's kernels again at start instead of using the choices kept in the cache",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=SPIN_S * 1000,
        help="after a decode step, poll the link this long for the next one before sleeping: a sleeping CPU "
        "takes tens to hundreds of microseconds to wake each token; 0 sleeps at once, which saves power "
        "(default: %(default)g)",
    )
    add_worker_tls_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("certs", help="make a self-signed TLS certificate and print its fingerprint")
    p.add_argument("--out", default=".", help="folder for NAME.crt and NAME.key (default: %(default)s)")
    p.add_argument("--name", default="shardwire", help="(default: %(default)s)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="host name or IP address the certificate is for (repeatable; default: localhost, 127.0.0.1)",
    )
    p.add_argument("--days", type=int, default=3650, help="(default: %(default)s)")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("plan", help="print how a model would be split, without loading weights")
    _add_model_args(p)
    add_cluster_args(p)
    p.add_argument("-np", "--parallel", type=int, default=1, help="sequence slots (default: %(default)s)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llama-server's counterpart)")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="0 = any free port (default: %(default)s)")
    api_key_help = (
        "clients must send Authorization: Bearer KEY or X-Api-Key: KEY (env SHARDWIRE_API_KEY; default: none)"
    )
    p.add_argument("--api-key", default=os.environ.get("SHARDWIRE_API_KEY"), help=api_key_help)
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=4,
        help="sequences decoded together, each with its own KV cache of --ctx-size (default: %(default)s)",
    )
    p.add_argument("-a", "--alias", default=None, help="model name in the API (default: the file name)")
    p.add_argument(
        "--cors-origins",
        default="*",
        help="comma-separated origins whose browser pages may call the API; '*' = any, 'localhost' = "
        "pages served from this machine, '' = no CORS (default: %(default)s)",
    )
    p.add_argument(
        "--cors-methods",
        default=CorsPolicy.methods,
        help="what a CORS preflight says the pages may send (default: %(default)s)",
    )
    p.add_argument("--cors-headers", default=CorsPolicy.headers, help="request headers pages may send (default: *)")
    p.add_argument(
        "--cors-credentials",
        action=argparse.BooleanOptionalAction,
        default=CorsPolicy.credentials,
        help="pages may send cookies and credentials (default: on, as llama-server)",
    )
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at GET /metrics")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="answers carry llama-server's __verbose (the prompt as text, ...) unless a request sends "
        '"verbose": false',
    )
    p.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GET /slots: what each sequence slot runs (--no-slots: 501, as llama-server's) (default: on)",
    )
    p.add_argument(
        "--webui",
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the web page at /: chat with the model and watch the cluster (--no-webui or --no-ui, "
        "llama-server's names: / answers 404) (default: on)",
    )
    _add_server_defaults_args(p)
    _add_speculative_args(p)
    add_cluster_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="split a small trained model across two local workers and generate")
    p.add_argument(
        "-p",
        "--prompt",
        default="Alice was beginning to get very tired",
        help="text to continue (default: %(default)s)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=96,
        help="tokens to generate; the model's context is 128 (default: %(default)s)",
    )
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default: %(default)s)")
    p.add_argument("-d", "--device", default="cpu", help="device each worker serves (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=1, help="CPU threads per worker (default: %(default)s)")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_demo)

    from .bench import add_bench_args

    p = sub.add_parser(
        "bench", help="prompt and decode tokens/s, alone or across --rpc workers (llama-bench's counterpart)"
    )
    _add_model_args(p)
    add_bench_args(p)
    add_cluster_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def parse_size(text: str | None) -> int | None:
    """'20G', '512M', '1.5T' or a plain number of bytes."""
    if not text:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"bad size '{text}' (use e.g. 20G or 512M)") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, PipelineError) as e:
        logging.debug("failed", exc_info=True)
        print(f"shardwire: error: {e}", file=sys.stderr)
        return 1


def cmd_generate(args: argparse.Namespace) -> int:
    from .generate import run_generate

    return run_generate(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..weights.in_use import missing_kernels_warning
    from ..weights.measure import forget_measurements, provenance
    from ..weights.policy import default_dtype
    from ..wire.frames import Limits
    from ..worker import Worker

    tls = server_tls(args)
    if args.remeasure:
        print(f"shardwire worker: {forget_measurements()} kept kernel measurement(s) of this CPU dropped", flush=True)
    worker = Worker(
        host=args.host,
        port=args.port,
        devices=args.device.split(",") if args.device else None,
        mem=parse_size(args.mem),
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        cache_max_bytes=parse_size(args.cache_size),
        model_dirs=[Path(d) for d in args.model_dir],
        token=resolve_token(args),
        threads=args.threads,
        tls=tls,
        insecure=args.insecure,
        max_connections=args.max_connections,
        limits=Limits(max_payload=parse_size(args.max_frame)),
        poll=args.poll_ms / 1000,
    )
    port = worker.bind()
    desc = worker.describe()
    print(
        f"shardwire worker {desc.worker_id} listening on {args.host}:{port}"
        f" ({'TLS ' + tls.fingerprint() if tls else 'plain TCP'}, "
        f"{'token required' if worker.token else 'no token'})",
        flush=True,
    )
    for d in desc.devices:
        print(f"  {d.name}: {d.free / 2**30:.1f} GiB available; {d.compute}", flush=True)
        measured = provenance(d.name, default_dtype(d.name))
        if measured:
            print(f"  {d.name}: {measured}", flush=True)
    warning = missing_kernels_warning()
    if warning and any(d.name.startswith("cpu") for d in desc.devices):
        print(f"  warning: {warning}", flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.close()
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..wire.tls import generate_certificate

    cert, key, fingerprint = generate_certificate(Path(args.out), args.host, args.days, args.name)
    print(f"certificate: {cert}\nprivate key: {key}\nfingerprint: {fingerprint}")
    print(f"start a worker with --tls-cert {cert} --tls-key {key}; give coordinators --tls-pin {fingerprint}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import run_serve

    return run_serve(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from ..coordinator.launch import plan_only
    from ..formats import open_model

    print(plan_only(open_model(args.model), args))
    return 0
