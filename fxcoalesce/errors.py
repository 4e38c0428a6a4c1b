"""The error fxcoalesce raises where ranks would pair different collectives."""


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group would issue, or issued, different collective sequences. A plain
    exception: raised in the thread that found the difference, nothing else happens."""
