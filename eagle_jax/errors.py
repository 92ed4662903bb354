"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations


class EagleError(Exception):
    """An error caused by user input (files, configs, flags); printed as one line by the CLIs.

    `setting` names the configuration field the error is about (e.g. "out", "steps"): the library states
    the wrong value, and a command names the flag that set it (`cli.command.run`).
    """

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting
