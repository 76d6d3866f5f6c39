"""Which ``attnpool`` backend class serves a model runner (importing this module imports SGLang).

SGLang's registry calls :func:`backend_for` for every runner (the plugin's factory:
:func:`attnpool.integrations.sglang.register`): a speculative runner gets
:class:`.spec.AttnpoolSpecBackend`, an encoder-decoder model's runner (cross-attention
layers) :class:`.cross.AttnpoolCrossBackend`, any other runner the base :class:`.backend.
AttnpoolAttnBackend`. The class is picked from the runner, once; each refuses at construction
what it does not serve, with every reason (a speculative encoder-decoder runner: the
speculative class, which refuses cross attention).
"""

from __future__ import annotations

from typing import Any

from .backend import AttnpoolAttnBackend, kept, speculative
from .cross import AttnpoolCrossBackend, encoder_decoder
from .spec import AttnpoolSpecBackend

__all__ = ["backend_class", "backend_for"]


def backend_class(model_runner: Any) -> type[AttnpoolAttnBackend]:
    """The class that serves this runner (see the module doc)."""
    if speculative(model_runner):
        return AttnpoolSpecBackend
    if encoder_decoder(AttnpoolAttnBackend.served_layers(model_runner)):
        return AttnpoolCrossBackend
    return AttnpoolAttnBackend


def backend_for(model_runner: Any) -> AttnpoolAttnBackend:
    """The runner's one backend, built on first use by its class (:func:`backend_class`),
    then kept on the runner (:func:`.backend.kept`: SGLang builds a draft runner's backends
    in several places, and they all share one pool)."""
    return kept(model_runner, lambda runner: backend_class(runner)(runner))
