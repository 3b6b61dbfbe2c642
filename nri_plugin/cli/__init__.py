"""The ``nri-qos`` and ``nri-qos-hook`` commands, one module per command.

:mod:`nri_plugin.cli.nri_qos` parses ``nri-qos``'s arguments and hands each subcommand to its
module (:mod:`~nri_plugin.cli.daemon` for ``run``, :mod:`~nri_plugin.cli.simulate`,
:mod:`~nri_plugin.cli.probe`, :mod:`~nri_plugin.cli.status`, :mod:`~nri_plugin.cli.reset`,
:mod:`~nri_plugin.cli.check_config`); :mod:`nri_plugin.cli.hook` is the OCI hook binary.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nri-qos`` command (:func:`nri_plugin.cli.nri_qos.main`)."""
    # Imported on call, not with the package: the OCI hook binary lives here too, and it runs in
    # every container's prestart, where loading the configuration and logging modules that the
    # parser needs would more than double its start-up time.
    from nri_plugin.cli.nri_qos import main as nri_qos

    return nri_qos(argv)
