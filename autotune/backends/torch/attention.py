"""Swapping a module's attention implementation (eager / SDPA), where the model allows it.

Hugging Face transformers models choose their attention kernel through ``config._attn_implementation`` and switch
it with ``set_attn_implementation``. The ONNX export that gives the layer table needs the factory's own
implementation (eager attention exports op by op); a build may swap it on its copy of the module, as a knob.
Other modules have nothing to swap: they get no knob. Where a model can run SDPA, SDPA comes first: it is what
``from_pretrained`` picks by default, so what the model's users run, and the knob's default (the one-liner
references and the plans' starting point) must be the same module they have.
"""

from __future__ import annotations

from typing import Any

from autotune.backends.base import BuildError

SWAPPABLE = ("eager", "sdpa")
USERS_DEFAULT = "sdpa"
"""transformers' default ``attn_implementation`` where the model supports it (``_supports_sdpa``); else eager."""
"""The implementations offered: eager (matmul, softmax, matmul) and ``torch.nn.functional.scaled_dot_product_attention``
(fused kernels). Others (flash-attention packages, hub kernels) need installs the backend does not assume."""


def _models(module: Any) -> list[Any]:
    """The transformers models inside ``module`` (any depth, ``module`` itself included)."""
    return [
        sub
        for sub in module.modules()
        if callable(getattr(sub, "set_attn_implementation", None))
        and hasattr(getattr(sub, "config", None), "_attn_implementation")
    ]


def attention_implementations(module: Any) -> tuple[str, ...]:
    """The attention implementations ``module`` can run, its users' default first; ``()`` when it cannot swap.

    The users' default is what transformers picks when a model is loaded without ``attn_implementation``: SDPA
    where every model inside supports it, else the module's current one (a factory may set eager for the ONNX
    export). Every transformers model inside must be able to switch at run time (``_can_set_attn_implementation``)
    and must run on the implementation offered (``_supports_sdpa`` for SDPA).
    """
    models = _models(module)
    if not models:
        return ()
    current = {str(model.config._attn_implementation) for model in models}
    if len(current) != 1 or next(iter(current)) not in SWAPPABLE:
        return ()  # mixed or custom implementations: leave them alone
    own = current.pop()
    for model in models:
        can_set = getattr(model, "_can_set_attn_implementation", None)
        if callable(can_set) and not can_set():
            return ()
    offered = [own]
    for name in SWAPPABLE:
        if name != own and (name == "eager" or all(getattr(model, "_supports_sdpa", False) for model in models)):
            offered.append(name)
    if USERS_DEFAULT in offered:
        offered.remove(USERS_DEFAULT)
        offered.insert(0, USERS_DEFAULT)
    return tuple(offered) if len(offered) > 1 else ()


def set_attention(module: Any, implementation: str) -> None:
    """Switches every transformers model inside ``module`` to ``implementation``, in place.

    Raises:
        BuildError: ``module`` has no swappable attention, or the switch did not take.
    """
    models = _models(module)
    if not models:
        raise BuildError(f"attention={implementation!r}: the module has no transformers model to switch")
    for model in models:
        if model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)
    wrong = sorted({str(m.config._attn_implementation) for m in models} - {implementation})
    if wrong:
        # transformers warns and keeps the old implementation when a model cannot switch: a silent no-op here would
        # measure the old kernel under the new name.
        raise BuildError(f"attention={implementation!r} did not take: the module still runs {wrong}")
