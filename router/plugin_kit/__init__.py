"""The plugin author's kit: the router's plugin contract, run against one installed plugin.

    from router.plugin_kit import check_plugin

    def test_my_plugin_keeps_the_contract():
        check_plugin("my-model", options={"threshold": 0.5})

The same checks run from `model-router plugins check NAME` and, as the `plugin_contract`
fixture, from the pytest plugin the router installs (docs/plugins.md, "Check your plugin").
"""

from router.plugin_kit.contract import MODEL, ContractFailure, ContractReport, check_plugin, sample_inputs

__all__ = ["MODEL", "ContractFailure", "ContractReport", "check_plugin", "sample_inputs"]
