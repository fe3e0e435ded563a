"""The losses' options as the integrations take them: each value goes unchanged to the check the losses run
(transducer/options.py), so that what the losses refuse (a float duration, a bool clamp, a string) is refused
here too, and the error names the argument as the integration's user spells it."""

import contextlib

from ..options import BY_NAME

__all__ = ["checked", "spelled"]


@contextlib.contextmanager
def spelled(name, as_spelled):
    """Within the block, a TypeError or ValueError about the argument ``name`` (its message begins ``name:``, as
    every check's does) names it ``as_spelled`` instead."""
    try:
        yield
    except (TypeError, ValueError) as e:
        message = str(e)
        if not message.startswith(f"{name}:"):
            raise
        raise type(e)(as_spelled + message[len(name) :]) from None


def checked(name, value, as_spelled=None):
    """``value`` of the loss option ``name`` as the losses take it, by that option's own check; its errors name
    the argument ``as_spelled`` (default: ``name``)."""
    with spelled(name, as_spelled or name):
        return BY_NAME[name].check(value)
