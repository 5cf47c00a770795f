"""``python -m batchweave``: the same as the ``batchweave`` console script (and ``python -m
batchweave.cli``)."""

from batchweave.cli import main

if __name__ == "__main__":
    main()
