"""The checkpoint options every entry point takes, checked in one place.

Note [Options that cannot be ignored]
``prefire.checkpoint(function, *args, **kwargs)`` passes the keyword
arguments it does not know to ``function``, as torch's checkpoint does. The
entry points that take *checkpoint options* (``checkpoint_wrapper``,
``plan_checkpoints``, ``integrations.transformers.enable``,
``checkpoint_sequential``) must not: a misspelled or foreign option
(``offload=True``, transformers' name for offloading) would fall through to
the block, which ignores it when it takes ``**kwargs`` (transformers layers
do), and the user would train without what they asked for. So those entry
points check their options here, once, when they are made: a name that is
not one of ``prefire.checkpoint``'s options raises ``TypeError`` naming it
and the options there are, and a value of the wrong kind (a directory for
``offload_to``) raises ``TypeError`` saying what it should be, in one line.
``prefire.checkpoint`` itself checks the values of its own options the same
way (cheap ``isinstance`` checks, before anything runs).
"""

from __future__ import annotations

from typing import Any, Dict

from . import _C

#: prefire.checkpoint's options and what each must be.
_KINDS = {
    "use_reentrant": ("None or a bool", lambda v: v is None or isinstance(v, bool)),
    "context_fn": ("None or a function returning two context managers", lambda v: v is None or callable(v)),
    "determinism_check": ('"default", "none", "metadata" or "checksum"',
                          lambda v: v in ("default", "none", "metadata", "checksum")),
    "debug": ("a bool", lambda v: isinstance(v, bool)),
    "early_stop": ("a bool", lambda v: isinstance(v, bool)),
    "preserve_rng_state": ("a bool", lambda v: isinstance(v, bool)),
    "offload_to": ("None or a prefire.OffloadTier (OffloadTier.host_file(directory, capacity_bytes) or "
                   "OffloadTier.pinned_host(capacity_bytes))", lambda v: v is None or isinstance(v, _C.OffloadTier)),
    "offload_inputs_only": ("a bool", lambda v: isinstance(v, bool)),
}

OPTIONS = tuple(_KINDS)

_HINTS = {
    "offload": "to offload, pass offload_to=prefire.OffloadTier.host_file(directory, capacity_bytes) (CPU) or "
               "prefire.OffloadTier.pinned_host(capacity_bytes) (CUDA); offload_inputs_only=True for what "
               "transformers' offload=True does",
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 and "\n" not in text else f"a {type(value).__name__}"


def check_value(where: str, name: str, value: Any) -> None:
    """TypeError, in one line, when ``value`` is not what option ``name`` takes."""
    kind, ok = _KINDS[name]
    if not ok(value):
        raise TypeError(f"{where}: {name} must be {kind}, got {_shown(value)}")


def check_values(where: str, **values: Any) -> None:
    """check_value for each option given."""
    for name, value in values.items():
        check_value(where, name, value)


def check_options(where: str, options: Dict[str, Any]) -> None:
    """Raises TypeError for a name that is not one of prefire.checkpoint's
    options (it would reach the block) or a value of the wrong kind (Note
    [Options that cannot be ignored])."""
    for name, value in options.items():
        if name not in _KINDS:
            hint = _HINTS.get(name)
            raise TypeError(f"{where}: {name}= is not an option of prefire.checkpoint (its options: "
                            f"{', '.join(OPTIONS)}); it would reach the block and be ignored there"
                            + (f"; {hint}" if hint else ""))
        check_value(where, name, value)
    if options.get("offload_inputs_only") and options.get("offload_to") is None:
        raise ValueError(f"{where}: offload_inputs_only=True needs offload_to= (the tier the inputs go to)")
