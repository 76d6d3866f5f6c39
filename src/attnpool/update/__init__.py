"""How a phase's bytes are written. The contract both update paths share sits here (``parts``:
what a phase asks a path to write; ``paths``: the path protocol and its choice; ``buffers``,
``launch``, ``launch_cache``); one folder per way of writing: ``reference`` (plain torch, any
device: the general path and the oracle), ``triton`` (fused, CUDA), ``host`` (a CPU pool's
host route: one C call, built at install time).

Both paths take plain tensors and write the same bytes in every read region; phases choose
between them. Nothing here imports triton at module import time.
"""
