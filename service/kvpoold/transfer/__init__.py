"""Moving KV pages between daemons (disaggregated prefill/decode) with NIXL; see
docs/pd-transfer.md.

By role: ``nixl_agent`` wraps the optional NIXL package; ``page_layout`` decides which pools can
exchange pages and ``descriptors`` where their pages are; ``pages`` checks and pins the pages a
transfer moves; ``grants`` keeps the receive grants and ``receives`` runs the receiving side,
``sends`` the sending side; ``peers`` owns the outbound peer clients and messages
(``messages`` their typed form); ``transfers`` is the facade the daemon calls. Nothing here
imports the daemon's server room."""

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
