"""Wire constants both sides use: message size, the field-at-fault metadata key, the id dtype.

One place for each; the daemon's listeners and the clients' channels read the same values.
"""

from __future__ import annotations

import re

import numpy as np

from kvpool.contract.errors import InvalidArgument, echo

# The largest gRPC message a client sends or accepts, and the daemon sends (a Stats reply of
# thousands of leases is larger than gRPC's 4 MiB default).
MAX_MESSAGE_BYTES = 64 << 20
# gRPC channel options that apply MAX_MESSAGE_BYTES in both directions (the daemon's own:
# SERVER_MESSAGE_OPTIONS, below the request bounds).
MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
# Trailing metadata key of a failed call: the input field at fault (``items[1].count``).
FIELD_METADATA_KEY = "kvpool-field"
# Ids cross the wire as little-endian int32 bytes.
ID_DTYPE = np.dtype("<i4")
# A sealed page's key and parent key: the engine's block hash (SHA-256 size).
KEY_BYTES = 32

# -- bounds on what one request may carry (docs/api.md, "Limits") ------------------------------
# Checked at the daemon's edge before any work, so a hostile or broken request costs O(its
# bytes) at most and is refused with INVALID_ARGUMENT naming the bound.

# Layers of a model spec (num_layers, num_hidden_layers): real models have < 200.
MAX_LAYERS = 1024
# Items of one Allocate or Free: an engine's batch call has one per request of the batch.
MAX_ITEMS_PER_CALL = 4096
# Ids of one Free (all items together): 4M int32 = 16 MiB. Every byte of a request under the
# daemon's receive limit is copied once more on its event loop by gRPC before any check can see
# it (~3 ms a MB on a busy 2-core host, bench/hostile_free.py), so this is what one hostile
# Free can cost everyone else at most. The client refuses a larger Free before sending it
# (kvpool.contract.wire.free_request): split it into several calls.
MAX_IDS_PER_CALL = 1 << 22
# Characters of a name a request gives that the daemon keeps or logs: a lease's name, a model's
# architecture (``ModelSpec.architecture``, a HF config's class name).
MAX_NAME_CHARS = 128
# Characters of ``hf_config_json`` (real config.json files are < 100 KB).
MAX_CONFIG_CHARS = 1 << 20
# A Free names each id it returns once, and a lease holds at most every id of a pool: a Free
# larger than the largest live pool's ids (4 B each) plus the rest of the message cannot be
# honest. The rest: the lease (id, secret), the pool name and per item (MAX_ITEMS_PER_CALL) a
# space name of MAX_NAME_CHARS and the tags and lengths (16 B).
FREE_OVERHEAD_BYTES = (4 << 10) + MAX_ITEMS_PER_CALL * (MAX_NAME_CHARS + 16)
# Bytes of one request message, per method, checked before the message is parsed. Every method
# has its bound, sized for the bounds above with room to spare; Free's is the largest
# (MAX_IDS_PER_CALL ids), and the daemon bounds it further by its live pools
# (free_request_bytes).
MAX_REQUEST_BYTES: dict[str, int] = {
    "Configure": MAX_CONFIG_CHARS + (64 << 10),
    "OpenLease": 4 << 10,
    "KeepAlive": 256 << 10,
    "CloseLease": 1 << 10,
    "Allocate": 128 << 10,  # 4,096 items of a short space name and a count
    "Free": MAX_IDS_PER_CALL * ID_DTYPE.itemsize + FREE_OVERHEAD_BYTES,
    "Stats": 1 << 10,
    "WatchStats": 1 << 10,
    "Drop": 1 << 10,
    "Attach": 4 << 10,
    "Detach": 1 << 10,
    # A transfer's pages: at most 65,536 int32 ids (256 KiB); with a pool name, a peer address
    # (512 characters) and a token (64 bytes) besides.
    "GrantReceive": (256 + 8) << 10,
    "Send": (256 + 8) << 10,
    "WaitTransfer": 1 << 10,
    # A page layout lists every buffer of the kv and swa spaces: up to 4 per layer (K, V and
    # their fp4 scales) of MAX_LAYERS layers and as many draft layers, 33 B each on the wire
    # (284 KB for 2,048 fp4 layers); a SWA mask of one byte per page (64 KiB) besides.
    "PeerReceive": 1 << 20,
    # A token and a failure's text (a status message: 2,048 characters, 8 KiB of UTF-8 at most).
    "PeerDone": 16 << 10,
    "CancelGrant": 1 << 10,
    # Sealed pages: an id, a key and a parent key (32 B each) and page_size token ids per page:
    # 8 MiB holds 16,384 pages of 16 tokens; an engine seals a step's pages at a time.
    "Seal": 8 << 20,
    # Pages to unseal: at most MAX_IDS_PER_CALL int32 ids, with a pool name and a lease.
    "Unseal": (256 + 8) << 10,
    "Adopt": 4 << 10,
    "Sealed": 1 << 10,
}
# Pages one Adopt hands over at most (its reply: about 16 MiB with 256-token pages); the
# engine asks again until none is left.
MAX_ADOPT_PAGES = 16_384
# The daemon's gRPC receive limit: the largest request bound. gRPC refuses a larger message
# itself (RESOURCE_EXHAUSTED, "Received message larger than max") as it arrives, off the event
# loop and before any byte of it reaches Python; a smaller one over its method's bound is
# refused by the daemon's intake (INVALID_ARGUMENT) after gRPC copied it onto the loop.
MAX_REQUEST_MESSAGE_BYTES = max(MAX_REQUEST_BYTES.values())
# The daemon's gRPC server options: replies up to MAX_MESSAGE_BYTES, requests up to
# MAX_REQUEST_MESSAGE_BYTES.
SERVER_MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_MESSAGE_BYTES),
)


def free_request_bytes(most_ids: int) -> int:
    """The bound of one Free's message when the largest live pool has ``most_ids`` ids (all its
    spaces together): 4 B per id plus FREE_OVERHEAD_BYTES, at most MAX_REQUEST_BYTES["Free"].

    Args:
        most_ids: ids of the live pool with the most (0: no pool).

    Returns:
        Bytes.
    """
    return min(MAX_REQUEST_BYTES["Free"], most_ids * ID_DTYPE.itemsize + FREE_OVERHEAD_BYTES)


# Characters of user input an error message quotes (the rest is elided, with its length).
MAX_ECHO_CHARS = 80

# -- names --------------------------------------------------------------------------------------

# A pool's name: it becomes part of shared-memory file names and metric labels, so no "/", no
# capitals, at most 63 characters. The one rule: the daemon's edge and its backings both call
# check_pool_name.
POOL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def check_pool_name(name: object, field: str = "pool") -> str:
    """``name`` if it is a pool name (``[a-z0-9][a-z0-9._-]{0,62}``).

    Raises:
        InvalidArgument: anything else (the message quotes at most MAX_ECHO_CHARS of it).
    """
    if (not isinstance(name, str) or len(name) > MAX_ECHO_CHARS
            or not POOL_NAME.fullmatch(name)):
        raise InvalidArgument(
            f"pool name {echo(name, MAX_ECHO_CHARS)} must match [a-z0-9][a-z0-9._-]{{0,62}} "
            "(lower case, digits, '.', '_', '-'; 1 to 63 characters)",
            field=field,
        )
    return name
