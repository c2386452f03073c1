"""Batch jobs: JSONL requests in, one JSONL result per line out (the `nv generate` machinery).

- requests.py   parse each input shape into a request or a per-line error
- reader.py     the reader thread: parse, render chat, add_request, bounded read-ahead
- writer.py     ordered (bounded reorder buffer) or unordered output, one flush per line
- formatting.py native and OpenAI Batch output lines, error lines
- resume.py     --resume: answered ids, torn-line repair
- runner.py     the job loop on the main thread: step the engine, drain, Ctrl-C handling
- command.py    `nv generate` end to end (argument checks, engine, dashboard, exit code)
"""

from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import JobOptions, JobProgress, JobResult, run_job

__all__ = ["Defaults", "JobOptions", "JobProgress", "JobResult", "run_job"]
