"""Update paths: ``reference`` (plain torch, any device) and ``triton`` (fused, CUDA).

Both take plain tensors and write the same bytes in every read region; phases choose between them.
Nothing here imports triton at module import time.
"""
