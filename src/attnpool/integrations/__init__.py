"""Integrations of attnpool with model libraries.

* :mod:`attnpool.integrations.transformers`: Hugging Face transformers (>= 5) models generate
  through a pool (:class:`~attnpool.integrations.transformers.PagedGenerator`), with an attention
  function registered under the name ``"attnpool"``. Needs the optional extra ``hf``.
* :mod:`attnpool.integrations.vllm`: a vLLM attention backend (a vLLM plugin, on with
  ``ATTNPOOL_VLLM=1``).
* :mod:`attnpool.integrations.sglang`: an SGLang attention backend named ``attnpool`` (an SGLang
  plugin; ``attention_backend="attnpool"``).
* :mod:`attnpool.integrations.engine`: what the vLLM and SGLang integrations share (a pool's
  sizes and config, the layers' shared facts, the per-step filler's skeleton); plain torch.

Nothing here is imported by ``import attnpool``; importing this package imports no model library
either (each integration module imports its library itself).
"""
