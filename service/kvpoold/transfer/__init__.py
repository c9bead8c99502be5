"""Moving KV pages between daemons (disaggregated prefill/decode) with NIXL; see
docs/pd-transfer.md. ``nixl_agent`` wraps the optional NIXL package, ``layout`` decides which
pools can exchange pages, ``grants`` keeps the receive grants, ``transfers`` runs both sides."""

from kvpoold.transfer.nixl_agent import (
    NIXL_MISSING,
    NixlAgent,
    load_nixl,
    make_agent,
    nixl_installed,
)
from kvpoold.transfer.transfers import Outgoing, Transfers

__all__ = ["NIXL_MISSING", "NixlAgent", "Outgoing", "Transfers", "load_nixl",
           "make_agent", "nixl_installed"]
