"""Errors meant for the user: the CLI prints them as one line, the server as an OpenAI error body."""


class HotstartError(Exception):
    """A problem the user can fix (bad file, bad flag, missing model). Printed as one line."""


class ModelConfigError(HotstartError):
    pass


class WeightsError(HotstartError):
    pass


class ModelNotFoundError(HotstartError):
    pass
