"""Moving KV pages between daemons (disaggregated prefill/decode) with NIXL; see
docs/pd-transfer.md.

By role: ``nixl_module`` loads the optional NIXL package, ``nixl_agent`` owns the daemon's agent
and ``progress`` the thread that progresses it; ``page_layout`` decides which pools can
exchange pages and ``descriptors`` where their pages are; ``pages`` checks and pins the pages a
transfer moves; ``grants`` keeps the receive grants and ``receives`` runs the receiving side,
``sends`` the sending side; ``peers`` owns the outbound peer clients and messages
(``messages`` their typed form); ``transfers`` is the facade the daemon calls. Nothing here
imports the daemon's server room."""

from kvpoold.transfer.nixl_agent import NixlAgent, make_agent
from kvpoold.transfer.nixl_module import NIXL_MISSING, load_nixl, nixl_installed
from kvpoold.transfer.transfers import Outgoing, Transfers

__all__ = ["NIXL_MISSING", "NixlAgent", "Outgoing", "Transfers", "load_nixl",
           "make_agent", "nixl_installed"]
