"""The one exception type that means "the user can fix this"."""


class UserInputError(ValueError):
    """Bad data, flag or file. The scripts print it as one line, without a traceback.

    Anything else that goes wrong is our bug and keeps its traceback.
    """
