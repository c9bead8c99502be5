"""Import-only stand-in for ``triton.runtime.jit`` (see the ``triton`` stub)."""


class JITFunction:
    """Wraps a would-be kernel; calling or launching it is an error."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, _grid):
        return self

    def __call__(self, *_args, **_kwargs):
        raise RuntimeError(f"triton stub: kernel {self.__name__} cannot run on CPU")
