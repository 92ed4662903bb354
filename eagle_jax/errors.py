"""User-facing errors: one line that names the problem and the fix."""


class EagleError(Exception):
    """An error caused by user input (files, configs, flags); printed as one line by the CLIs."""
