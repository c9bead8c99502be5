"""vLLM 0.32's KV-cache groups: which layers share one block table, and each group's spec.

The rules, in vLLM's order (``get_kv_cache_groups``):

1. The hybrid manager off (``disable_hybrid_kv_cache_manager``, or a KV connector without
   HMA): sliding-window layers next to full-attention ones are sized as full attention
   (block size of the full layers, the window kept for compute only).
2. Every spec equal (or full-attention specs that differ only in their window): one group.
3. One spec type and one block size, other sizes differing (vLLM's
   ``UniformTypeKVCacheSpecs``): one group whose page is the sum of its layers' pages.
4. Otherwise (hybrid): pages are unified to the largest (a smaller page that divides it gets
   a proportionally larger block size, else it is padded), layers are bucketed by spec, and
   each bucket is cut into groups of ``group_size`` layers, the smallest bucket's size
   (the largest when no bucket is 1.5 times the smallest), layer ``i`` of a bucket going to
   group ``i mod num_groups``. Gemma-3-1B (22 sliding + 4 full layers): six sliding groups
   (4, 4, 4, 4, 3, 3 layers) and one full group of 4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import VllmSpecType
from kvpoold.sizing.vllm_specs import LayerSpec, NamedSpec

# a bucket this many times the smallest one sets the group size instead (vLLM's heuristic)
LARGEST_BUCKET_RATIO = 1.5


@dataclass(frozen=True)
class Group:
    """Layers sharing a block table; ``specs`` holds each layer's own spec (one per layer)."""

    layers: tuple[NamedSpec, ...]
    spec: LayerSpec  # the group's spec (its first layer's, merged)
    uniform_type: bool = False

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def page_size_bytes(self) -> int:
        if self.uniform_type:
            return sum(layer.spec.page_size_bytes for layer in self.layers)
        return self.spec.page_size_bytes


def _merge(specs: list[LayerSpec]) -> LayerSpec | None:
    """vLLM's ``merge`` of the specs of one group, or None when they cannot share one.

    Full attention merges specs that differ only in their window (at most one window among
    them); sliding-window and MLA specs merge only when equal.
    """
    first = specs[0]
    if first.type is VllmSpecType.full_attention:
        if any(s.type is not VllmSpecType.full_attention for s in specs):
            return None
        if any(replace(s, sliding_window=None) != replace(first, sliding_window=None)
               for s in specs):
            return None
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}
        if len(windows) > 1:
            return None
        return replace(first, sliding_window=windows.pop() if windows else None)
    return first if all(s == first for s in specs) else None


def _uniform_type(specs: list[LayerSpec]) -> bool:
    """One block size and one spec type (sliding windows: one window)."""
    first = specs[0]
    if any(s.block_size != first.block_size for s in specs):
        return False
    if first.type is VllmSpecType.mamba:
        return all(s.type is VllmSpecType.mamba and s.page_size_bytes == first.page_size_bytes
                   for s in specs)
    if any(s.type is VllmSpecType.mamba for s in specs):
        return False
    if first.type is VllmSpecType.sliding_window:
        return all(s.type is VllmSpecType.sliding_window
                   and s.sliding_window == first.sliding_window for s in specs)
    # MLA is a kind of full attention to vLLM's registry of spec types
    return all(s.type is not VllmSpecType.sliding_window for s in specs)


def _promote_local(layers: list[NamedSpec]) -> list[NamedSpec]:
    """The hybrid manager off: sliding-window layers become full attention next to full
    attention layers (``unify_hybrid_kv_cache_specs``).

    Raises:
        InvalidArgument: the promoted specs still differ in type.
    """
    specs = [n.spec for n in layers]
    if _merge(specs) is not None or _uniform_type(specs):
        return layers
    has_full = any(s.type in (VllmSpecType.full_attention, VllmSpecType.mla) for s in specs)
    has_sliding = any(s.type is VllmSpecType.sliding_window for s in specs)
    if not (has_full and has_sliding):
        raise InvalidArgument(
            "vLLM cannot size this model without its hybrid KV-cache manager (its layers' "
            "specs are of different types); drop --disable-hybrid-kv-cache-manager",
            field="disable_hybrid_kv_cache_manager")
    full_sizes = {s.block_size for s in specs if s.type is VllmSpecType.full_attention}
    full_block = next(iter(full_sizes)) if len(full_sizes) == 1 else None
    out = []
    for n in layers:
        s = n.spec
        if s.type is VllmSpecType.sliding_window:
            block = full_block or s.block_size
            padded = None
            if s.page_size_padded is not None:
                padded = max(s.page_size_padded,
                             s.unpadded_page_size_bytes * block // s.block_size)
            s = replace(s, type=VllmSpecType.full_attention, block_size=block,
                        page_size_padded=padded)
        out.append(NamedSpec(n.index, n.name, s))
    promoted = [n.spec for n in out]
    if not (_merge(promoted) is not None or _uniform_type(promoted)):
        raise InvalidArgument(
            "vLLM cannot size this model without its hybrid KV-cache manager (the layers' "
            "specs stay of different types); drop --disable-hybrid-kv-cache-manager",
            field="disable_hybrid_kv_cache_manager")
    return out


def _unify_pages(layers: list[NamedSpec]) -> list[NamedSpec]:
    """Every page at the largest page size (``unify_kv_cache_spec_page_size``).

    Raises:
        InvalidArgument: an MLA page that neither divides nor can be padded to the largest.
    """
    largest = max(n.spec.page_size_bytes for n in layers)
    out = []
    for n in layers:
        s = n.spec
        page = s.page_size_bytes
        if page != largest:
            if s.type is VllmSpecType.mamba:
                s = replace(s, page_size_padded=largest)
            elif largest % page == 0:
                s = s.with_block_size(s.block_size * (largest // page))
            elif s.type is not VllmSpecType.mla:
                s = replace(s, page_size_padded=largest)
            else:
                raise InvalidArgument(
                    f"layer {n.name}: its page of {page:,} B neither divides nor pads to the "
                    f"largest page of {largest:,} B (vLLM pads only non-MLA attention)",
                    field="model_config")
        out.append(NamedSpec(n.index, n.name, s))
    return out


def _hybrid_groups(layers: list[NamedSpec]) -> list[Group]:
    by_spec: dict[LayerSpec, list[NamedSpec]] = {}
    for n in layers:
        by_spec.setdefault(n.spec, []).append(n)
    buckets: list[list[NamedSpec]] = []
    bucket_specs: list[list[LayerSpec]] = []
    for spec, members in by_spec.items():
        for names, specs in zip(buckets, bucket_specs, strict=True):
            if _merge([*specs, spec]) is not None:
                names.extend(members)
                specs.append(spec)
                break
        else:
            buckets.append(list(members))
            bucket_specs.append([spec])
    smallest = min(len(b) for b in buckets)
    largest = max(len(b) for b in buckets)
    group_size = largest if largest < smallest * LARGEST_BUCKET_RATIO else smallest
    groups = []
    for bucket in buckets:
        num_groups = -(-len(bucket) // group_size)
        for i in range(num_groups):
            members = tuple(bucket[i::num_groups])
            merged = _merge([m.spec for m in members])
            assert merged is not None  # a bucket holds mergeable specs only
            groups.append(Group(members, merged))
    return groups


def kv_cache_groups(layers: list[NamedSpec], *, hybrid: bool) -> list[Group]:
    """The KV-cache groups of the whole model (every pipeline stage's layers).

    Args:
        layers: every layer's spec, in layer order.
        hybrid: the hybrid KV-cache manager is on.

    Raises:
        InvalidArgument: a model vLLM cannot group (see :func:`_promote_local`,
            :func:`_unify_pages`).
    """
    if not layers:
        return []
    if not hybrid:
        layers = _promote_local(layers)
    specs = [n.spec for n in layers]
    merged = _merge(specs)
    if merged is not None:
        return [Group(tuple(layers), merged)]
    if _uniform_type(specs):
        return [Group(tuple(layers), specs[0], uniform_type=True)]
    return _hybrid_groups(_unify_pages(layers))


def project(groups: list[Group], indices: range) -> list[Group]:
    """The groups as one pipeline stage holds them: only its layers (a group may be left
    with none, and still counts as a group)."""
    out = []
    for g in groups:
        kept = tuple(n for n in g.layers if n.index in indices)
        out.append(Group(kept, g.spec, g.uniform_type))
    return out
