"""Debugging: training bugs switched on by RunConfig.bug (bugs.py), what a rank measures to
find them (probe.py), naming the first module that made inf/NaN (nan.py), and the checks that
find a bug in a finished run's events (diagnose.py).

May import: the foundation, data/, models/, parallel/ and config. The rank's loop imports it,
never the reverse.
"""
