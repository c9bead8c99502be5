"""The plan record: pool sizes plus the buffer layout, a frozen Struct that round-trips JSON.

This is kvpool's answer to SGLang's ``_PoolSizes``: plain values only (dtypes by name), so it can
be printed by ``kvpoold plan --json``, returned by ``Configure`` and hashed into a fingerprint.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated, Literal

import msgspec

from kvpool.contract.dtypes import DType
from kvpool.contract.spec import Base
from kvpool.contract.vllm_plan import VllmPlan


class BufferKind(enum.StrEnum):
    """What a buffer's rows are indexed by, which tells a transfer engine how to move it."""

    kv = "kv"  # token-major KV rows of the full (or only) token space: row r = token slot r
    swa_kv = "swa_kv"  # token-major rows of the SWA token space (hybrid SWA)
    index = "index"  # DSA indexer, page-major rows of the full token space
    state = "state"  # per request-state slot (mamba conv/ssm, DSV4 compress state)
    spec_state = "spec_state"  # per request row: speculative intermediate conv/ssm states
    compressed = "compressed"  # DSV4 compressed KV token spaces (c4 / c128)
    req_to_token = "req_to_token"  # request row -> token slots (aux, outside the budget)
    map = "map"  # full -> swa slot mapping (aux, outside the budget)
    # vLLM's KV-cache backing (a vLLM-layout pool): one int8 region that vLLM's KV-cache
    # tensors view per layer; the plan's ``vllm.tensors`` say where block b of layer l lies
    vllm_kv = "vllm_kv"


class BufferFill(enum.StrEnum):
    """What a buffer holds before anything is written into it (the pool builder writes it over
    the zero-filled backing; a client's fresh pool reads the same)."""

    zeros = "zeros"
    # Rows of [kv | score], two equal halves of the last dim: the score half is -inf, so a row
    # nobody has written weighs nothing in a softmax over scores (DSV4 compress states).
    kv_score = "kv_score"


class BufferSpec(Base):
    """One named, typed view carved out of the pool's single backing region.

    ``page_bytes`` is the size of one allocation unit of this buffer (a KV page: page_size
    rows; a state slot: one row), what a transfer engine registers as the item length.
    ``in_budget`` is False for the aux buffers that live outside ``budget_bytes``.
    ``id_space`` names the plan's id space whose id ``u`` addresses unit ``u`` of dim 0 (rows
    ``u * page_bytes / row_bytes`` onward); "" when no allocatable id does. ``fill`` is what
    the buffer holds when the pool is built.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    kind: BufferKind
    page_bytes: int
    in_budget: bool = True
    id_space: str = ""
    fill: BufferFill = BufferFill.zeros


# The aux full->SWA page map of hybrid SWA and DSV4 pools: int64, indexed by full page id.
FULL_TO_SWA = "full_to_swa"

SpaceName = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]


class IdSpaceSpec(Base):
    """One allocatable id space of a pool: ids ``1..capacity`` (0 is the padding unit, never
    handed out), each standing for ``bytes_per_unit`` bytes over the buffers it indexes.

    ``follows`` names the space this one is paired with: every id handed out in that space
    brings one id of this space, written into the ``mapping`` buffer at the leader's index
    (full -> SWA pages of a hybrid sliding-window pool). A following space is never allocated
    on its own; freeing in it takes leader ids and returns only their paired ids.
    """

    name: SpaceName  # kv, swa, req, state, c4_state, c128_state
    capacity: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 2)]
    unit: str  # pages, rows, slots: what one id is, for messages
    bytes_per_unit: int
    knob: str  # the option that makes the space larger, for "not enough free" messages
    follows: SpaceName | None = None
    mapping: str | None = None

# The unit of an elastic pool's memory: each view's share of a group is whole chunks (a huge
# page on CPU, CUDA VMM's allocation granularity on GPU).
CHUNK_BYTES = 2 << 20


def group_ranges(views: list[tuple[int, int]], group: int) -> list[tuple[int, int]]:
    """Group ``group`` of views given as ``(offset, share)`` (a view's bytes of one group):
    ``(offset + group * share, share)`` each. The one definition of where a group lies."""
    return [(offset + group * share, share) for offset, share in views]


class ElasticPlan(Base):
    """The groups of an elastic pool: the unit the daemon grants, backs and takes back.

    A group is the same run of ``pages_per_group`` KV pages (``tokens_per_group`` tokens) in
    every view named in ``views``; each view's share of a group is whole ``chunk_bytes``
    chunks, so group ``g`` of view ``v`` is the bytes ``[offset_v + g * share_v, offset_v +
    (g + 1) * share_v)`` with ``share_v = pages_per_group * page_bytes_v``. Page ``p`` lies in
    group ``p // pages_per_group``; group 0 holds the padding page 0, so it is always granted.
    ``fixed_bytes`` (the aux buffers, from ``fixed_offset`` to the end) are backed for the
    pool's life. Floor, cap and weight are in groups and say how the arbiter treats the pool.
    """

    tokens_per_group: int
    pages_per_group: int
    group_bytes: int
    groups: int
    chunk_bytes: int
    views: tuple[str, ...]
    fixed_offset: int
    fixed_bytes: int
    floor_groups: int
    cap_groups: int
    weight: float

    def group_of(self, page: int) -> int:
        """The group page ``page`` lies in."""
        return page // self.pages_per_group


# hf_config: read by the architecture table's loader; assumed: an unknown class read as the
# family given with --assume-architecture; spec: a hand-written spec.
ArchitectureSource = Literal["hf_config", "assumed", "spec"]
# Families an unknown HF class may be read as (`--assume-architecture`, Configure's
# assume_architecture): the ones a HF config alone can be read as.
ASSUMABLE_FAMILIES: tuple[str, ...] = ("mha", "mla", "dsa", "hybrid_swa", "hybrid_gdn",
                                       "hybrid_mamba")


class PoolPlan(Base):
    """Sizes and layout of one pool; ``None`` where a field does not apply to the architecture.

    ``total_bytes`` is what the budget pays for (KV + state buffers); ``aux_bytes`` the
    request->token table and SWA mapping; ``backing_bytes`` the one region actually allocated
    (total + aux + alignment padding, < 256 B per buffer).
    """

    architecture: str
    architecture_source: ArchitectureSource
    model_architecture: str
    kv_cache_dtype: str
    page_size: int
    context_length: int
    cell_size_bytes: int
    max_total_num_tokens: int
    max_running_requests: int
    full_max_total_num_tokens: int | None
    swa_max_total_num_tokens: int | None
    mamba_cache_size: int | None
    c4_max_total_num_tokens: int | None
    c128_max_total_num_tokens: int | None
    c4_state_pool_size: int | None
    c128_state_pool_size: int | None
    total_bytes: int
    aux_bytes: int
    backing_bytes: int
    budget_bytes: int | None
    num_pages: int
    swa_num_pages: int | None
    tp_size: int
    pp_size: int
    pp_rank: int
    layer_start: int
    layer_end: int
    num_draft_layers: int
    req_to_token_columns: int
    notes: tuple[str, ...]
    buffers: tuple[BufferSpec, ...]
    # What Allocate/Free hand out, in this order; Stats, metrics and `kvpool top` follow it.
    id_spaces: tuple[IdSpaceSpec, ...] = ()
    # The device profile planned for (``--gpu``), as "h100-80g (80 GiB, SM90)".
    gpu: str = ""
    # Elastic pools only: their groups (None: a fixed pool, backed whole at Configure).
    elastic: ElasticPlan | None = None
    # vLLM-layout pools only (engine vllm): vLLM's own plan, which the backing follows (its
    # KV-cache tensors over the one int8 region, its block ids = the ``kv`` page ids).
    vllm: VllmPlan | None = None

    @property
    def engine(self) -> str:
        """The engine whose layout the pool has: ``vllm`` or ``sglang``."""
        return "sglang" if self.vllm is None else "vllm"

    @property
    def charged_bytes(self) -> int:
        """What the pool takes of the device budget at Configure: the whole region of a fixed
        pool; the fixed part and the floor of an elastic one (its grants add to it)."""
        e = self.elastic
        if e is None:
            return self.backing_bytes
        return e.fixed_bytes + e.floor_groups * e.group_bytes

    def group_ranges(self, group: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of an elastic pool's group ``group`` in each of its views, in
        the region (whole chunks): what the daemon backs and a client maps.

        Raises:
            ValueError: a fixed pool, or a group outside the range.
        """
        e = self.elastic
        if e is None or not 0 <= group < e.groups:
            raise ValueError(f"no group {group} in this plan"
                             + ("" if e is None else f" (groups 0..{e.groups - 1})"))
        return group_ranges(self.group_shares(), group)

    def group_shares(self) -> list[tuple[int, int]]:
        """``(offset, share)`` of each view an elastic pool's groups cut: where the view starts
        and its bytes of one group (:func:`group_ranges` places group ``g`` from them).

        Raises:
            ValueError: a fixed pool.
        """
        e = self.elastic
        if e is None:
            raise ValueError("a fixed pool has no groups")
        return [(b.offset_bytes, e.pages_per_group * b.page_bytes)
                for b in (self.buffer(name) for name in e.views)]

    def id_space(self, name: str) -> IdSpaceSpec:
        """The id space called ``name``; KeyError lists the plan's spaces."""
        for s in self.id_spaces:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in self.id_spaces) or "none"
        raise KeyError(f"no id space {name!r} in this plan (id spaces: {known})")

    def buffer(self, name: str) -> BufferSpec:
        """The buffer called ``name``; KeyError lists a few known names."""
        for b in self.buffers:
            if b.name == name:
                return b
        known = ", ".join(b.name for b in self.buffers[:6])
        raise KeyError(f"no buffer {name!r} in this plan (buffers: {known}, ...)")

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> PoolPlan:
        return msgspec.json.decode(data, type=cls)

    def fingerprint(self) -> str:
        """Hash of everything that decides the memory layout (the buffers and the id spaces)."""
        layout = (
            self.architecture,
            self.page_size,
            self.num_pages,
            self.swa_num_pages,
            self.max_running_requests,
            self.mamba_cache_size,
            self.backing_bytes,
            self.buffers,
            self.id_spaces,
        )
        if self.elastic is not None:  # a fixed pool's fingerprint is what it always was
            layout = (*layout, self.elastic)
        if self.vllm is not None:  # so is an SGLang-layout pool's
            layout = (*layout, self.vllm)
        return hashlib.sha256(msgspec.json.encode(layout)).hexdigest()[:32]
