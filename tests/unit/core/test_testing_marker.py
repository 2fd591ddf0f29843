"""The orchestra plugin's ``orc_backend`` marker check, without a cluster."""

from __future__ import annotations

import pytest


def test_a_marker_naming_no_backend_is_a_usage_error(request):
    """(Checked before any fixture starts: the plugin's ``pytest_runtest_setup`` calls this for every test.)"""
    from orchestra.testing import _plugin

    request.node.add_marker(pytest.mark.orc_backend("gpu"))
    with pytest.raises(pytest.UsageError, match="orc_backend\\('local'\\)"):
        _plugin.marked_backend(request.node, request.config)
