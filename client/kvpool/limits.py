"""Wire constants both sides use: message size, the field-at-fault metadata key, the id dtype.

One place for each; the daemon's listeners and the clients' channels read the same values.
"""

from __future__ import annotations

import numpy as np

# The largest gRPC message either side sends or accepts (a Free of 16M ids is 64 MiB of int32).
MAX_MESSAGE_BYTES = 64 << 20
# gRPC channel/server options that apply MAX_MESSAGE_BYTES in both directions.
MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
# Trailing metadata key of a failed call: the input field at fault (``items[1].count``).
FIELD_METADATA_KEY = "kvpool-field"
# Ids cross the wire as little-endian int32 bytes.
ID_DTYPE = np.dtype("<i4")
