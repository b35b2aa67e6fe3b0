"""``python -m dcp_compile.lowering interpret JOB OUT``: the child process of
dcp_compile.lowering.interpreter's run_interpreter_spmd (see _run_isolated)."""

import sys

from .interpreter import main

sys.exit(main(sys.argv[1:]))
