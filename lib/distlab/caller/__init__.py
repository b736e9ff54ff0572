"""The caller's side: what runs in the notebook (or the command line) that starts a run, never
in a rank. launch() checks a config (preflight.py), starts the ranks on 127.0.0.1 with
timeouts and teardown (launch.py; fork_server.py replaces a fork server that died) and hands
back a Run (run.py): the event log as it grows, wait(), stop(), history. resume.py launches
again from a checkpoint; progress.py prints a run's progress lines; retention.py keeps the
runs folder small.

May import: the foundation, data/, models/, parallel/, config, checkpoint/, theory/ and the
rank's side (the worker function it starts). Never the studies or the workbook layer.
"""
