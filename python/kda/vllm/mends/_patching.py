"""How a mend changes one of vLLM's functions (:func:`install`, :func:`replace`) and how its probe reads
vLLM's code (:func:`code_shows`). A mend marks its wrapper with its name and the function it wraps, so
that applying it again finds it (idempotence) and a probe reads vLLM's own function under any mends (a
probe answers for vLLM as installed, mended or not)."""

import inspect

_MARK = "_kda_mend"


def wrapping(wrapper, wrapped, mend):
    """Marks ``wrapper`` as mend ``mend``'s (a module name) wrapping of ``wrapped``; returns it."""
    setattr(wrapper, _MARK, mend)
    wrapper.__wrapped__ = wrapped
    return wrapper


def applied(function, mend):
    """Whether mend ``mend`` wraps ``function`` (or a mend that ``function`` is a wrapping of)."""
    while getattr(function, _MARK, None):
        if getattr(function, _MARK) == mend:
            return True
        function = function.__wrapped__
    return False


def original(function):
    """vLLM's function under the mends that wrap it."""
    while getattr(function, _MARK, None):
        function = function.__wrapped__
    return function


def source(obj):
    """The source text of vLLM's ``obj`` (under any mends), or None where Python has none (a probe
    then answers "needed": the pinned release is known to need every mend)."""
    try:
        return inspect.getsource(original(obj))
    except (OSError, TypeError):
        return None


def install(owner, attribute, mend, make):
    """Sets ``owner.attribute`` (a function or a classmethod) to ``make(current)``, marked as mend
    ``mend``'s wrapping of the current function, unless that mend wraps it already."""
    current = inspect.getattr_static(owner, attribute)
    bound = isinstance(current, classmethod)
    function = current.__func__ if bound else current
    if applied(function, mend):
        return
    wrapper = wrapping(make(function), function, mend)
    setattr(owner, attribute, classmethod(wrapper) if bound else wrapper)


def code_shows(obj, *present, absent=()):
    """Whether the source of vLLM's ``obj`` (under any mends) holds every string of ``present`` and none
    of ``absent``: a probe's reading of the defect's code path. True where Python has no source (the
    pinned release is known to need every mend)."""
    code = source(obj)
    if code is None:
        return True
    return all(s in code for s in present) and not any(s in code for s in absent)


def replace(owner, attribute, mend, function):
    """:func:`install` of a replacement that does not call vLLM's function."""
    install(owner, attribute, mend, lambda vllm_function: function)
