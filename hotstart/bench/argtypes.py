"""argparse actions shared by the bench verbs (argparse only: imported by `hotstart --help`)."""

from __future__ import annotations

import argparse


class TargetAction(argparse.Action):
    """Options that name a target (--config / --peer / --peers / --hotstart / --url) append (kind, value,
    name) to one list, so their command-line order is kept."""

    def __call__(self, parser, namespace, values, option_string=None):
        targets = list(getattr(namespace, "targets", None) or [])
        targets.append((self.const, values, None))
        namespace.targets = targets


class NameAction(argparse.Action):
    """--peer-name / --url-name NAME: the table label of the target just before it (of the kind in const)."""

    def __call__(self, parser, namespace, values, option_string=None):
        targets = list(getattr(namespace, "targets", None) or [])
        kinds = self.const if isinstance(self.const, tuple) else ("peer",)
        if not targets or targets[-1][0] not in kinds or targets[-1][2] is not None:
            names = " / ".join("--" + k for k in kinds)
            parser.error(f"{option_string} {values!r}: must follow the {names} it names")
        targets[-1] = (targets[-1][0], targets[-1][1], values)
        namespace.targets = targets
