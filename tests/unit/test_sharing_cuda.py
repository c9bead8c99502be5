"""CUDA IPC sharing, the parts that run without a GPU: allocator refusal and UUID addressing."""

from __future__ import annotations

import pytest
import torch

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.mapping.regions import (
    BufferLayout,
    SharedHandle,
    map_region,
    normalize_uuid,
    ordinal_for_uuid,
)
from kvpoold.sharing import CudaIpcBackingFactory, check_allocator_conf
from kvpoold.sharing.cuda_ipc import check_ipc_handle_kind

A = "5a1b2c3d-0000-1111-2222-333344445555"
B = "6f00aa11-9999-8888-7777-666655554444"


@pytest.mark.parametrize(
    "env",
    [
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments: true ,garbage_collection_threshold:0.6"},
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        {"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    ],
)
def test_expandable_segments_are_refused_saying_why_and_what_to_do(env):
    with pytest.raises(FailedPrecondition) as err:
        check_allocator_conf(env)
    msg = str(err.value)
    assert "expandable_segments" in msg and "pytorch#165685" in msg
    assert "another process" in msg and "Unset" in msg
    assert err.value.field in env


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
        {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2],expandable_segments:False"},
        {"OTHER": "expandable_segments:True"},
    ],
)
def test_other_allocator_settings_are_accepted(env):
    check_allocator_conf(env)


def test_cuda_malloc_async_is_refused():
    with pytest.raises(FailedPrecondition, match="cudaMallocAsync"):
        check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})


def test_the_factory_checks_the_environment_before_anything_else():
    """Refused with a clear reason even on a machine without CUDA."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(FailedPrecondition, match="expandable_segments"):
        CudaIpcBackingFactory("cuda:0", env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_the_factory_without_cuda_says_to_use_shared_memory():
    with pytest.raises(FailedPrecondition, match="--device cpu"):
        CudaIpcBackingFactory("cuda:0", env={})


def test_handles_of_expandable_segments_are_refused():
    """torch's handle header is a version byte then 'c' (cudaMalloc) or 'e' (expandable)."""
    check_ipc_handle_kind(b"\x02c" + bytes(64))
    with pytest.raises(FailedPrecondition, match="expandable segment"):
        check_ipc_handle_kind(b"\x02e" + bytes(16))


def test_uuids_compare_without_prefix_or_case():
    assert normalize_uuid(f"GPU-{A.upper()}") == A
    assert normalize_uuid(f"  {A} ") == A
    assert normalize_uuid(f"MIG-{B}") == B


def test_the_ordinal_follows_the_uuid_not_the_exporters_numbering():
    """The daemon's GPU A is this process's cuda:1 when CUDA_VISIBLE_DEVICES lists B first."""
    assert ordinal_for_uuid(A, [B, A]) == 1
    assert ordinal_for_uuid(f"GPU-{A}", [A]) == 0


def test_a_device_uuid_mismatch_lists_the_visible_devices():
    with pytest.raises(FailedPrecondition) as err:
        ordinal_for_uuid(A, [B])
    msg = str(err.value)
    assert "device UUID mismatch" in msg and A in msg and f"cuda:0={B}" in msg
    assert "CUDA_VISIBLE_DEVICES" in msg
    with pytest.raises(FailedPrecondition, match="visible: none"):
        ordinal_for_uuid(A, [])
    with pytest.raises(InvalidArgument):
        ordinal_for_uuid("", [A])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_mapping_a_cuda_handle_without_cuda_is_refused():
    h = SharedHandle(sharing="cuda_ipc", size=4096, device_uuid=A, storage_size=4096)
    with pytest.raises(FailedPrecondition, match="CUDA is not available"):
        map_region(h, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_a_failed_import_gives_the_export_back_without_masking_the_error():
    """Giving back the ref-counter slot is best effort: on a CPU build it cannot, and the
    caller still gets the real reason (no CUDA; a bad layout)."""
    h = SharedHandle(sharing="cuda_ipc", size=4096, device_uuid=A, storage_size=4096,
                     ref_counter_handle=b"/torch_0_0_0", ref_counter_offset=3)
    with pytest.raises(FailedPrecondition, match="CUDA is not available"):
        map_region(h, [])
    with pytest.raises(InvalidArgument):
        map_region(h, [BufferLayout("b", "uint8", (8192,), 0, 8192)])
