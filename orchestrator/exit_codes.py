"""The exit codes of every command (``python -m orchestrator``, ``.plan``, ``.best``, ``.report``,
``.compare``, ``.data``): one set, so a script can tell bad input from a failure everywhere."""

from __future__ import annotations

OK = 0
FAILED = 1  # the traceback says what
BAD_INPUT = 2  # one error: line names the flag, argument or override, and why; nothing launched
NO_MATCH = 3  # nothing matched: no run, sweep or trial fits the (sound) input

HELP = f"""exit codes:
  {OK}  done
  {FAILED}  failed (the traceback says what)
  {BAD_INPUT}  bad input: one error: line names the flag, argument or override, and why
  {NO_MATCH}  nothing matched: no run, sweep or trial fits the (sound) input"""
