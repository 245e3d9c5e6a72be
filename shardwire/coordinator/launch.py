"""From command-line options to a running pipeline: in this process, or split across workers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..devices import (
    check_device,
    default_devices,
    free_memory,
    parse_dtype,
    stored_precision_dtype,
    torch_device,
)
from ..engine.draft_model import DraftModel, check_vocabularies
from ..formats import ModelFile, open_model
from ..pipeline import LocalPipeline, Pipeline
from ..pipeline.loading import load_stage
from ..pipeline.plan import PlanDevice, make_plan, parse_overrides
from ..tokenizer import load_tokenizer
from ..weights.in_use import compute_line, missing_kernels_warning
from ..weights.kernels import kernels_on
from ..weights.measure import fastest_formats, prompt_products, provenance, row_products
from ..weights.policy import default_dtype
from ..wire.options import add_client_tls_args, client_tls, resolve_token
from .cluster import Cluster

log = logging.getLogger("shardwire.launch")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("splitting across workers (llama.cpp's RPC flags)")
    g.add_argument(
        "--rpc",
        default=os.environ.get("SHARDWIRE_RPC"),
        help="comma-separated worker addresses host:port (env SHARDWIRE_RPC)",
    )
    g.add_argument(
        "-ts",
        "--tensor-split",
        default=None,
        help="share of blocks per device in plan order, e.g. 3,1,1 (default: by free memory)",
    )
    g.add_argument(
        "-ngl",
        "--n-gpu-layers",
        type=int,
        default=None,
        help="blocks placed on devices; the first n_layers - N stay on this machine's CPU (default: all)",
    )
    g.add_argument(
        "-ot",
        "--override-tensor",
        action="append",
        default=[],
        metavar="REGEX=DEVICE",
        help="keep the block matrices whose names match REGEX on DEVICE of the same worker (e.g. "
        "'ffn_.*_exps=cpu': a mixture of experts' experts in a GPU worker's CPU memory); that device "
        "holds no blocks of its own (repeatable, or comma-separated)",
    )
    g.add_argument(
        "-sm", "--split-mode", default="layer", choices=["layer"], help="how to split the model (default: %(default)s)"
    )
    add_client_tls_args(g)
    g.add_argument("--cache-dir", default=None, help="where tensor hashes are remembered (default: ~/.cache/shardwire)")
    g = p.add_argument_group("surviving a worker that drops out")
    g.add_argument(
        "--dead-after",
        type=float,
        default=5.0,
        help="seconds without a heartbeat before a worker counts as gone (default: %(default)s)",
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds without any step result, while steps are in flight, before the links "
        "between workers count as broken (default: %(default)s)",
    )
    g.add_argument(
        "--recovery-timeout",
        type=float,
        default=60.0,
        help="how long a request waits for lost capacity to come back when what is left cannot "
        "hold the model (default: %(default)s)",
    )


def parse_split(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--tensor-split '{text}' is not a comma-separated list of numbers") from None


def local_pipeline(
    model: ModelFile,
    device: str,
    dtype: str,
    weights: str,
    n_slots: int,
    ctx: int,
    prefill_chunk: int = 512,
    kv_tokens: int | None = None,
    swa_full: bool = False,
) -> LocalPipeline:
    """Every block in this process on one device, its weights held as the plan resolves `weights`
    for that device (auto: the first mode that fits its free memory), as a worker's would be."""
    kernels, fastest = kernels_on(torch_device(device)), fastest_formats(device, dtype)
    warning = missing_kernels_warning()
    if device.startswith("cpu") and warning:
        log.warning("%s", warning)
    products = prompt_products(device, dtype), row_products(device, dtype)
    planned = PlanDevice("local", device, free_memory(device), dtype, kernels, fastest, *products, compute_line(device))
    plan = make_plan(
        model,
        [planned],
        n_slots=n_slots,
        ctx=ctx,
        prefill_chunk=prefill_chunk,
        weights=weights,
        kv_tokens=kv_tokens,
        swa_full=swa_full,
    )
    stage = plan.stages[0]
    return LocalPipeline(
        [
            load_stage(
                model,
                0,
                model.config.n_layers,
                device=torch_device(device),
                dtype=parse_dtype(dtype),
                weights=stage.weights,
                fastest=fastest,
            )
        ],
        n_slots=n_slots,
        ctx=plan.ctx,
        kv_pages=plan.kv_pages,
        window_step=plan.window_step,
    )


def _cluster(
    model: ModelFile, args: argparse.Namespace, workers: list[str], local: list[str], show_progress: bool
) -> Cluster:
    ngl = args.n_gpu_layers
    return Cluster(
        workers,
        token=resolve_token(args),
        tls=client_tls(args),
        local_devices=local,
        local_cpu=ngl is not None and ngl < model.config.n_layers,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        show_progress=show_progress,
    )


def _local_devices(args: argparse.Namespace, accelerators: list[str], overrides: list[tuple[str, str]]) -> list[str]:
    """This machine's devices that take stages (--device, else `accelerators`), plus the devices
    -ot names, which hold what it keeps apart."""
    local = [check_device(d) for d in args.device.split(",")] if args.device else accelerators
    if not local:
        return []
    return local + [check_device(name) for _, name in overrides if name not in local]


def _workers(args: argparse.Namespace) -> list[str]:
    return [a for a in (args.rpc or "").split(",") if a.strip()]


def load_draft(args: argparse.Namespace, tokenizer, n_slots: int, ctx: int) -> DraftModel | None:
    """The draft model -md names, whole on --device-draft (this machine's CPU unless given),
    its cache sized for the pipeline's slots; a ValueError where its vocabulary is not the model's."""
    if not getattr(args, "model_draft", None):
        return None
    model = open_model(args.model_draft)
    check_vocabularies(tokenizer, load_tokenizer(model))
    device = check_device(args.device_draft or "cpu")
    dtype = stored_precision_dtype(default_dtype(device), device, model.matrix_type)
    ctx = min(ctx, model.config.context_length)
    return DraftModel(local_pipeline(model, device, dtype, args.weights, n_slots, ctx).stages[0], n_slots, ctx)


def build_pipeline(
    model: ModelFile, args: argparse.Namespace, n_slots: int = 1, quiet: bool = False
) -> tuple[Pipeline, Cluster | None]:
    """A LocalPipeline, or a loaded cluster's pipeline when --rpc or -ngl asks for one, with its
    cluster."""
    ctx = min(args.ctx_size, model.config.context_length)
    workers = _workers(args)
    ngl = args.n_gpu_layers
    overrides = parse_overrides(args.override_tensor)
    if not workers and (ngl is None or ngl >= model.config.n_layers) and not overrides:
        device = check_device(args.device or default_devices()[0])
        dtype = args.dtype or stored_precision_dtype(default_dtype(device), device, model.matrix_type)
        pipeline = local_pipeline(
            model, device, dtype, args.weights, n_slots, ctx, kv_tokens=args.kv_budget, swa_full=args.swa_full
        )
        if not quiet:
            measured = provenance(device, dtype)
            print(f"kernels on {device}: {compute_line(device)}", file=sys.stderr, flush=True)
            if measured:
                print(f"{device}: {measured}", file=sys.stderr, flush=True)
        return pipeline, None
    accelerators = [d for d in default_devices() if d != "cpu"]
    # one process with -ot: its device takes the blocks, the -ot devices what the patterns name
    local = _local_devices(args, accelerators or ([] if workers or not overrides else ["cpu"]), overrides)
    cluster = _cluster(model, args, workers, local, show_progress=not quiet)
    cluster.heartbeat.dead_after, cluster.heartbeat.stall_timeout = args.dead_after, args.stall_timeout
    cluster.recovery_timeout = args.recovery_timeout
    try:
        cluster.connect(model)
        plan = cluster.make_plan(
            tensor_split=parse_split(args.tensor_split),
            n_gpu_layers=ngl,
            n_slots=n_slots,
            ctx=ctx,
            dtype=args.dtype,
            weights=args.weights,
            overrides=overrides,
            kv_tokens=args.kv_budget,
            swa_full=args.swa_full,
        )
        if not quiet:
            print(plan.table(), file=sys.stderr)
        return cluster.load(plan), cluster
    except BaseException:
        cluster.close()
        raise


def plan_only(model: ModelFile, args: argparse.Namespace) -> str:
    """The plan table for `shardwire plan`: workers are asked for their devices, nothing is loaded."""
    ctx = min(args.ctx_size, model.config.context_length)
    workers = _workers(args)
    overrides = parse_overrides(args.override_tensor)
    accelerators = [d for d in default_devices() if d != "cpu"]
    local = _local_devices(args, accelerators if workers else ["cpu"], overrides)
    cluster = _cluster(model, args, workers, local, show_progress=False)
    try:
        cluster.connect(model)
        plan = cluster.make_plan(
            tensor_split=parse_split(args.tensor_split),
            n_gpu_layers=args.n_gpu_layers,
            n_slots=args.parallel,
            ctx=ctx,
            dtype=args.dtype,
            weights=args.weights,
            overrides=overrides,
            kv_tokens=args.kv_budget,
            swa_full=args.swa_full,
        )
    finally:
        cluster.close()
    table = plan.table()
    plan.check_fits()
    return table
