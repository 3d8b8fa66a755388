"""docs/configuration.md lists every variable the settings read, and bin/run's: a setting added
without a line there fails here."""

import re

from django.conf import settings

from tests.processes import ROOT

DOC = (ROOT / "docs/configuration.md").read_text()


def documented(name: str) -> bool:
    return f"`{name}`" in DOC


def test_every_variable_the_settings_read_is_documented():
    read = {setting.name for setting in settings.ENVIRONMENT_READ}
    # Read conditionally or in a helper: found in the source too, so none escapes by a branch.
    source = (ROOT / "telemachus/settings.py").read_text()
    read |= set(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]+)"', source))
    assert len(read) > 60
    assert [name for name in sorted(read) if not documented(name)] == []


def test_every_variable_bin_run_reads_is_documented():
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]+):-", (ROOT / "bin/run").read_text()))
    assert {"PORT", "TELEMACHUS_SHUTDOWN_GRACE"} <= read
    assert [name for name in sorted(read) if not documented(name)] == []


def test_the_settings_read_the_environment_only_through_the_recording_readers():
    """So `telemachus_check` lists them all with their source."""
    assert "os.environ" not in (ROOT / "telemachus/settings.py").read_text()
