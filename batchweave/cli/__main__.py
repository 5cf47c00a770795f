"""``python -m batchweave.cli``: the same as the ``batchweave`` console script."""

from batchweave.cli import main

if __name__ == "__main__":
    main()
