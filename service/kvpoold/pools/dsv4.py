"""DeepSeek-V4 pool builder: carve the plan's views, then mark every compress-state score as -inf.

A compress state row is ``[kv | score]`` (two equal halves of the last dim). The compressor
softmaxes over the scores, so a row nobody has written must score -inf to weigh nothing, and the
last row of each state buffer is the sentinel that position -1 reads (kv 0, score -inf). The
backing arrives zero-filled, so only the score halves need writing.
"""

from __future__ import annotations

import torch

from kvpool.plan import BufferKind, PoolPlan

# The module, not the name: builder.py registers build_dsv4 and imports this file, so carve is
# looked up at call time to keep that circular import safe.
from kvpoold.pools import builder


def build_dsv4(plan: PoolPlan, backing: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of every buffer of a ``dsv4`` plan over ``backing``, compress states initialized.

    Args:
        plan: a plan whose architecture is ``dsv4``.
        backing: the zero-filled flat uint8 region of at least ``plan.backing_bytes``.

    Returns:
        Buffer name -> typed view; the score half of every ``kind == state`` buffer holds -inf,
        everything else is left as allocated (zeros).

    Raises:
        InvalidArgument: from :func:`~kvpoold.pools.builder.carve` for a too-small or
            malformed backing.
    """
    views = builder.carve(plan, backing)
    for spec in plan.buffers:
        if spec.kind == BufferKind.state:
            state = views[spec.name]
            # SGLang clears only the sentinel row and leaves the rest uninitialized; writing
            # every score keeps a never-written slot harmless too.
            state[..., state.shape[-1] // 2 :].fill_(float("-inf"))
    return views
