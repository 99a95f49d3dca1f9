"""Compile ahead, in parallel: every Triton kernel and launch config a run's cases will autotune over.

A sweep of many shapes on a fresh machine spends most of its time compiling: each new specialization (head
dim, mask, dtype, size bucket) compiles every candidate config of each autotuned kernel, one after another in
the timing process (the random set: 19 of 128 forward shapes in a 10-minute call). ``attnbench warm`` runs
each of the cases' Triton variants once per mode in ``procs`` worker processes side by side, which fills
Triton's disk cache; the timing run that follows loads the compiled kernels and only times the candidates.
The workers' own autotuning picks are thrown away (they share the GPU, so their timings mean nothing).
"""
import os
import subprocess
import sys
import tempfile
import time

import torch

from .cases import shard
from .registry import Unsupported, first_line


def warm_cases(op, cases, device, variants, modes, seed=0, progress=print) -> dict:
    """Run each variant once per case and mode on ``device`` (the compile is the point, not the result);
    returns {"ran": n, "declined": n, "failed": [reason, ...]}. A case whose inputs or run exhaust memory
    is a failure with its reason: its kernels compile in the timing run instead."""
    from .runner import is_out_of_memory

    counts = {"ran": 0, "declined": 0, "failed": []}

    def failed(where, error):
        what = "out of memory" if is_out_of_memory(error) else f"{type(error).__name__}: {first_line(str(error), 160)}"
        counts["failed"].append(f"{where}: {what}")

    for case in cases:
        x = None
        try:
            x = op.make_inputs(case, device, seed)
        except Exception as error:  # noqa: BLE001 - a worker reports and goes on to its next case
            failed(case.label, error)
        for name in variants if x is not None else ():
            for mode in modes:
                if mode not in op.variant(name).modes:
                    continue
                try:  # each variant and mode apart: one that fails leaves the others' kernels to compile
                    op.variant(name).prepare(case, x, mode)()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    counts["ran"] += 1
                except Unsupported:
                    counts["declined"] += 1
                except Exception as error:  # noqa: BLE001
                    failed(f"{case.label} {name} {mode}", error)
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress(f"warm {op.name} {case.label}")
    return counts


def worker_command(op_name, case_set, pattern, variants, modes, seed, index, count, device, part=None) -> list:
    """The command line of one worker process (``python -m attnbench.bench.warm``); ``part``: the run's
    ``--shard`` (K, N), taken from the set before the worker's own share."""
    command = [sys.executable, "-m", "attnbench.bench.warm", op_name, case_set, f"{index}/{count}", str(device),
               str(seed)]
    if pattern:
        command.append(f"--match={pattern}")  # one word: a pattern may start with "-"
    if part:
        command.append(f"--shard={part[0]}/{part[1]}")
    command += [f"--variant={name}" for name in variants] + [f"--mode={mode}" for mode in modes]
    return command


def warm(op, case_set, cases, pattern, variants, modes, device, procs, seed=0, progress=print, part=None) -> tuple:
    """Compile ahead for ``cases`` (op's ``case_set``, filtered by ``pattern``, then ``part`` of it: --shard's
    (K, N)) in ``procs`` worker processes;
    returns (each worker's last line: its counts and failures, in worker order; whether every worker
    exited cleanly)."""
    procs = max(1, min(procs, len(cases)))
    started = time.monotonic()
    # The workers' autotuning picks come from a shared GPU: never written to Triton's disk cache, where the
    # timing run would take them. Each worker writes to a file of its own (pipes read one after another
    # would stall a worker whose compiler warnings fill its pipe).
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING="0")
    with tempfile.TemporaryDirectory(prefix="attnbench-warm-") as logs:
        workers = []
        for i in range(procs):
            with open(os.path.join(logs, f"{i}.log"), "w") as log:
                workers.append(subprocess.Popen(worker_command(op.name, case_set, pattern, variants, modes, seed, i,
                                                               procs, device, part),
                                                stdout=log, stderr=subprocess.STDOUT, text=True, env=env))
        summaries, clean = [], True
        for i, w in enumerate(workers):
            w.wait()
            with open(os.path.join(logs, f"{i}.log")) as log:
                lines = [line for line in log.read().splitlines() if line.strip()]
            last = lines[-1] if lines else "(no output)"
            if w.returncode:
                clean = False
                last = f"exit {w.returncode}: {last}"
            summaries.append(f"worker {i}/{procs}: {last}")
            progress(summaries[-1])
    progress(f"warm {op.name}: {len(cases)} cases in {procs} processes, {time.monotonic() - started:.0f} s")
    return summaries, clean


def _main(argv):
    import argparse
    import re

    import attnbench

    parser = argparse.ArgumentParser(prog="python -m attnbench.bench.warm", description="one worker of attnbench warm")
    parser.add_argument("op")
    parser.add_argument("case_set")
    parser.add_argument("part", help="INDEX/COUNT")
    parser.add_argument("device")
    parser.add_argument("seed", type=int)
    parser.add_argument("--match")
    parser.add_argument("--shard", help="K/N: the run's part of the set, before this worker's share")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--mode", action="append", default=[])
    args = parser.parse_args(argv)
    index, count = (int(n) for n in args.part.split("/"))
    op = attnbench.get(args.op)
    cases = [c for c in op.cases(args.case_set) if not args.match or re.search(args.match, c.label)]
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        cases = shard(cases, k - 1, n)
    counts = warm_cases(op, shard(cases, index, count), torch.device(args.device), args.variant, args.mode,
                        args.seed, progress=lambda line: None)
    failed = "; ".join(counts["failed"]) or "none"
    print(f"{counts['ran']} runs, {counts['declined']} declined, failed: {failed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
