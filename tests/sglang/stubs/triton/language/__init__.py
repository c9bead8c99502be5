"""Import-only stand-in for ``triton.language`` (see the ``triton`` stub).

Kernel signatures annotate parameters with ``tl.constexpr`` and module-level
constants use dtype names; any other attribute resolves to an inert placeholder.
"""


class constexpr:
    def __init__(self, value=None):
        self.value = value


class _Placeholder:
    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return _Placeholder(f"{self.name}.{name}")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)
