"""The tools around the library: the command line, the demos, the benchmarks' cases and the
classic baseline they compare against.

Nothing in the library imports this package: an engine that only builds pools never loads it.
"""
