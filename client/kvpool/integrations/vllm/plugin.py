"""kvpool's ``vllm.general_plugins`` entry point: registers :data:`CONNECTOR_NAME`
(``KVPoolConnector``) with vLLM's ``KVConnectorFactory``, lazily (the connector's module is
imported only when a ``kv_transfer_config`` selects it).

vLLM calls every general plugin in each of its processes (``load_general_plugins``), so
:func:`register` is idempotent. pyproject.toml names it::

    [project.entry-points."vllm.general_plugins"]
    kvpool = "kvpool.integrations.vllm.plugin:register"
"""

from __future__ import annotations

CONNECTOR_NAME = "KVPoolConnector"
CONNECTOR_MODULE = "kvpool.integrations.vllm.connector"


def register() -> None:
    """Register ``KVPoolConnector`` with vLLM's connector factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered already (this process loaded the plugins before)
        KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
