"""Run README jobs one after the other in this one interpreter (tests/e2e/test_readme.py).

    python3 tests/support/readme_runner.py JOBS.json RESULTS.jsonl

Each job of JOBS.json is ``{"id", "cwd", "script": PATH}`` (a ```python block, run as
``python3 PATH`` would run it: ``runpy.run_path`` as ``__main__``, a fresh namespace) or
``{"id", "cwd", "module": M, "args": [...]}`` (a command, run as ``python3 -m M ARGS`` would:
``runpy.run_module`` as ``__main__`` with that ``sys.argv``). Starting Python and importing
torch, transformers and dcp_compile costs ~3 CPU-s per process, more than most jobs' own
work, so the README's jobs share one process; what a fresh process gives a job is restored
before each: its own working directory, the environment, ``sys.argv``/``sys.path``, a
random torch seed, grad mode and default dtype, an empty Dynamo cache, empty ``lru_cache``
memos in dcp_compile's modules (:func:`clear_project_caches`). Each job's exit code
(an exception is 1, ``SystemExit`` its code), output and CPU seconds go to RESULTS.jsonl,
one line per job as it ends; a job still running after ``--timeout`` seconds ends the
process with every thread's stack on stderr (the results so far are kept).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import runpy
import sys
import time
import traceback

OUTPUT_TAIL = 6000   # characters of a job's output kept in its result


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)    # sys.exit("message") prints it and exits 1
    return 1


def clear_project_caches() -> int:
    """Empty every memo (``functools.lru_cache``/``cache``) of a dcp_compile module, so that
    a job proves and renders from scratch as in a fresh process (the prover's certificates
    are cached per (dcp, interleave, block)). What stays warm is Python's, torch's and
    sympy's own state, and the two op-call tables (``passes.propagation._CALL_RESULTS``,
    ``lowering.decompose._TRACES``): keyed on an op call's full metadata, they give a job
    the results it would compute, sooner. Returns the number of memos emptied."""
    emptied = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("dcp_compile") or module is None:
            continue
        for obj in list(vars(module).values()):
            if callable(getattr(obj, "cache_clear", None)) and hasattr(obj, "cache_info"):
                obj.cache_clear()
                emptied += 1
    return emptied


def run_job(job: dict) -> dict:
    """Run one job as its own process would; its exit code, output and CPU seconds."""
    import torch

    env, argv, path = dict(os.environ), list(sys.argv), list(sys.path)
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    torch.seed()             # a fresh interpreter's torch starts from a random seed too
    torch._dynamo.reset()
    clear_project_caches()
    out = io.StringIO()
    start = time.process_time()
    os.chdir(job["cwd"])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if "script" in job:
                    sys.argv = [job["script"]]
                    sys.path.insert(0, os.path.dirname(os.path.abspath(job["script"])))
                    runpy.run_path(job["script"], run_name="__main__")
                else:
                    sys.argv = [job["module"], *job["args"]]
                    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException:  # noqa: BLE001 - the job's failure, reported as python's
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.argv[:], sys.path[:] = argv, path
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
        os.chdir(HOME)
    text = out.getvalue()
    return {"id": job["id"], "returncode": code, "output": text[-OUTPUT_TAIL:],
            "cpu_seconds": round(time.process_time() - start, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jobs", help="JSON list of jobs")
    ap.add_argument("results", help="JSON lines: one result per job, written as it ends")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    args = ap.parse_args(argv)
    with open(args.jobs) as f:
        jobs = json.load(f)
    import torch  # noqa: F401 - every job's first import: out of the collector's scans
    from dcp_compile.runtime.distributed.launch import freeze_gc
    freeze_gc()
    for job in jobs:
        print(f"readme job {job['id']}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(args.timeout, exit=True)
        result = run_job(job)
        faulthandler.cancel_dump_traceback_later()
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


HOME = os.getcwd()

if __name__ == "__main__":
    sys.exit(main())
