"""``python -m minidist serve``: a trained GPT behind an HTTP endpoint with OpenAI's completions API
(:mod:`minidist.serving.server`)."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from minidist import launch, workloads
from minidist.checkpoint_io import CheckpointError
from minidist.cli.values import fail, nonnegative_int, positive_int
from minidist.p2p import get_timeout
from minidist.serving.scheduler import Scheduler
from minidist.serving.server import CompletionServer, follow
from minidist.serving.tp_decode import TensorParallelDecoder


def serve_parser() -> argparse.ArgumentParser:
    """The ``serve`` command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m minidist serve",
        description="Serve a GPT trained with `train --model gpt` over HTTP: POST /v1/completions (OpenAI's fields: "
                    "prompt, max_tokens, temperature, top_k, seed, stream) and GET /health. Requests are batched "
                    "continuously: each joins the running batch at the next step and leaves it when done.")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="the GPT: a `train --model gpt --save-model PATH` file (.npz), a --checkpoint-dir folder "
                        "(its newest valid checkpoint) or one of its ckpt-<step>.npz files")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=nonnegative_int, default=8000, help="the port (default: 8000; 0: any free port)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel decode over N ranks, under `mpiexec -n N` (default: 1)")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="B",
                   help="requests decoded together at most; more wait their turn (default: 8)")
    p.add_argument("--kv-block-size", type=positive_int, default=16, metavar="T",
                   help="positions per block of the paged KV cache (default: 16)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None, metavar="N",
                   help="KV blocks in all, the cache's memory budget (default: enough for --max-batch requests of "
                        "the model's block size)")
    return p


def serve_command(argv: list[str]) -> int:
    """``python -m minidist serve --checkpoint PATH [--host H --port P --tp N --max-batch B
    --kv-block-size T --num-kv-blocks N]``: loads the GPT (``workloads.load_language_model``, as
    ``generate``), prints ``minidist serve: listening on http://H:P ...`` and serves until Ctrl-C,
    after which it prints one line and returns 0. ``--tp N`` runs under ``mpiexec -n N``: every
    rank holds its shard of the model (``serving.TensorParallelDecoder``), rank 0 serves HTTP and
    the others follow its scheduler (``serving.server.follow``); Ctrl-C (which mpiexec passes to
    every rank) stops rank 0, which stops the others. Exit status 1 when PATH is missing,
    unreadable or corrupt, mpi4py is missing, or the port cannot be bound (taken: the fix named);
    2 for a usage error (bad flags, a PATH that holds no GPT, --tp N on a job of another size or
    a model whose heads N does not divide)."""
    parser = serve_parser()
    args = parser.parse_args(argv)
    rank, size = launch.world_from_env() or (0, 1)  # from mpiexec's environment: MPI not started yet
    if size != args.tp:
        if rank == 0:
            parser.error(f"--tp {args.tp} needs {args.tp} ranks, this job has {size}: run `mpiexec -n {args.tp} "
                         f"python -m mpi4py -m minidist serve ... --tp {args.tp}`")
        return 2
    try:
        model, tokenizer = workloads.load_language_model(args.checkpoint)
    except workloads.NotALanguageModelError as error:
        parser.error(f"--checkpoint {error}")
    except CheckpointError as error:
        return fail("serve", str(error))
    if args.tp == 1:
        return _serve(args, parser, model, tokenizer)
    try:
        comm = launch.require_mpi4py("serve --tp", load=True).COMM_WORLD
    except launch.LaunchError as error:
        return fail("serve", str(error))
    try:
        decoder = TensorParallelDecoder(model, comm)
    except ValueError as error:  # the same on every rank: printed once
        if comm.Get_rank() == 0:
            print(f"{parser.prog}: error: --tp {args.tp}: {error}", file=sys.stderr)
        return launch.finish(comm, 2, get_timeout(), command="serve")
    if comm.Get_rank() == 0:
        status = _serve(args, parser, decoder, tokenizer, comm)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 takes Ctrl-C and stops this rank in step with it
        follow(comm, Scheduler(decoder, **_scheduler_options(args)))
        status = 0
    return launch.finish(comm, status, get_timeout(), command="serve")


def _scheduler_options(args: argparse.Namespace) -> dict:
    return dict(max_batch=args.max_batch, kv_block_size=args.kv_block_size, num_kv_blocks=args.num_kv_blocks)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser, model, tokenizer, comm=None) -> int:
    """Serve ``model`` (a GPT, or rank 0's TensorParallelDecoder of ``comm``) until Ctrl-C; the
    exit status."""
    name = os.path.splitext(os.path.basename(os.path.normpath(args.checkpoint)))[0]
    try:
        server = CompletionServer(model, tokenizer, host=args.host, port=args.port, model_name=name, comm=comm,
                                  **_scheduler_options(args))
    except OSError as error:
        return fail("serve", f"cannot listen on {args.host}:{args.port} ({error.strerror or error}); "
                             "another program holds the port? give another --port (0: any free port)")
    tp = f", tensor-parallel over {comm.Get_size()} ranks" if comm is not None else ""
    print(f"minidist serve: listening on {server.url} (POST /v1/completions, GET /health; model {name}, "
          f"block size {model.config.block_size}, vocabulary {tokenizer.vocab_size}{tp}); Ctrl-C stops it",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("minidist serve: stopped (Ctrl-C)", file=sys.stderr, flush=True)
    return 0
