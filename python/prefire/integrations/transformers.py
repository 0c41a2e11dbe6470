"""prefire as the activation checkpoint of a Hugging Face transformers model.

``enable(model)`` turns on the model's own activation checkpointing (the
layers transformers marks for it, ``every_n_layers`` as transformers counts
them) with :func:`prefire.checkpoint` as the checkpoint function, and keeps
prefire there when the model's checkpointing is enabled again later:
``Trainer(args=TrainingArguments(gradient_checkpointing=True))`` does that at
the start of ``train()``. The layers stay plain modules (``state_dict``,
``save_pretrained`` and ``from_pretrained`` unchanged). Checkpoints made by
the layers are prefire's: ``prefire.collect()``, ``prefire()`` and sessions
apply to them.

Note [Where prefire hooks into transformers]
transformers has no public option for the checkpoint function. Its layers
call ``self._gradient_checkpointing_func(...)``, which
``_set_gradient_checkpointing`` sets from ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` before 5.0). ``enable`` calls that public
method, with ``use_reentrant=False`` (4.x defaults to the reentrant variant),
so that transformers does everything else it does there (which layers, the
input embeddings' ``requires_grad``), and then replaces that attribute on
every module that has it. It fails loudly, naming what it looked for, when no
module has it (a transformers version that changed the mechanism): never
training without prefire while the user believes it on.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from .. import _checkpoint
from .._options import check_options

_ATTRIBUTE = "_gradient_checkpointing_func"
_MARK = "_prefire_checkpoint"


def _install(model, function) -> int:
    installed = 0
    for module in model.modules():
        if hasattr(module, _ATTRIBUTE):
            setattr(module, _ATTRIBUTE, function)
            installed += 1
    if installed == 0:
        import transformers

        raise RuntimeError(
            f"prefire.integrations.transformers: no module of {type(model).__name__} has {_ATTRIBUTE!r} after "
            f"enabling activation checkpointing (transformers {transformers.__version__}); this transformers "
            "version checkpoints its layers another way, and prefire is not in use. Wrap the layers with "
            "prefire.checkpoint_wrapper instead")
    return installed


def enable(model, every_n_layers: int = 1, **checkpoint_kwargs: Any):
    """Turns on ``model``'s activation checkpointing with prefire's checkpoint.

    Args:
        model: a transformers ``PreTrainedModel`` that supports gradient
            checkpointing.
        every_n_layers: checkpoint every n-th layer (transformers' own
            argument; 5.0 and later).
        checkpoint_kwargs: passed to every :func:`prefire.checkpoint` call
            (``early_stop``, ``determinism_check``, ``preserve_rng_state``,
            ``context_fn``, ``offload_to``, ``offload_inputs_only``); a name
            that is not one of its options raises TypeError. Enabling again
            with transformers' own options (the Trainer's
            ``gradient_checkpointing_kwargs``) adds them to these;
            transformers' ``offload=True`` raises, naming ``offload_to``.

    Returns:
        ``model``.

    Raises:
        ValueError: the model does not support gradient checkpointing,
            ``every_n_layers`` is not an int >= 1, or is not 1 on a
            transformers without it.
        TypeError: a checkpoint option prefire.checkpoint does not have, or
            of the wrong kind.
        RuntimeError: transformers did not set up checkpointing the way
            prefire hooks into (see Note [Where prefire hooks into
            transformers]).
    """
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"prefire.integrations.transformers.enable: every_n_layers must be an int >= 1 (1: every "
                         f"layer), got {every_n_layers!r}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"prefire.integrations.transformers.enable: {type(model).__name__} does not support "
                         "gradient checkpointing")
    check_options("prefire.integrations.transformers.enable", checkpoint_kwargs)
    function = functools.partial(_checkpoint.checkpoint, **checkpoint_kwargs)
    cls = type(model)
    if hasattr(cls, "activation_checkpointing_enable"):
        cls.activation_checkpointing_enable(model, activation_checkpointing_kwargs={"use_reentrant": False},
                                            every_n_layers=every_n_layers)
        names = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    else:
        if every_n_layers != 1:
            raise ValueError("prefire.integrations.transformers.enable: every_n_layers needs transformers 5.0 or "
                             "later")
        cls.gradient_checkpointing_enable(model, gradient_checkpointing_kwargs={"use_reentrant": False})
        names = ("gradient_checkpointing_enable",)
    _install(model, function)

    # Enabling again (the Trainer does) must not put torch's checkpoint back.
    # Bound methods of the instance, so that a deepcopy of the model gets its own.
    for name in names:
        setattr(model, name, types.MethodType(
            functools.partial(_enable_again, original=getattr(cls, name), function=function), model))
    setattr(model, _MARK, True)
    return model


def _enable_again(model, *args, original, function, **kwargs):
    # What transformers would do with its own options is replaced by prefire's
    # checkpoint: each of them is consumed or refused (Note [Options that
    # cannot be ignored]), never dropped.
    if kwargs.get("offload"):
        raise ValueError(
            f"prefire.integrations.transformers: {original.__name__}(offload=True) would offload with torch's "
            "save_on_cpu, which prefire's checkpoint replaces on this model; pass offload_to=prefire.OffloadTier"
            "(...) (with offload_inputs_only=True for what offload=True does) to "
            "prefire.integrations.transformers.enable instead")
    given = kwargs.get("activation_checkpointing_kwargs", kwargs.get("gradient_checkpointing_kwargs"))
    if given is None and args and isinstance(args[0], dict):
        given = args[0]
    if given:
        options = {name: value for name, value in given.items() if name != "use_reentrant"}
        check_options(f"prefire.integrations.transformers: {original.__name__}", options)
        function = functools.partial(function.func, **dict(function.keywords, **options))
    result = original(model, *args, **kwargs)
    _install(model, function)
    return result


def is_enabled(model) -> bool:
    """Whether :func:`enable` turned prefire on for ``model`` and its layers
    still checkpoint with it."""
    if not getattr(model, _MARK, False):
        return False
    functions = [getattr(m, _ATTRIBUTE) for m in model.modules() if hasattr(m, _ATTRIBUTE)]
    return bool(functions) and all(
        isinstance(f, functools.partial) and f.func is _checkpoint.checkpoint for f in functions)
