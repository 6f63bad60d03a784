"""``python -m flashspec.training --out DIR ...``: see flashspec.training.cli."""
from flashspec.training.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
