"""CLI: `python -m data.prepare key=value ...` (see `data.pipeline` for the settings and conventions)."""
from data.pipeline import main

if __name__ == "__main__":
    raise SystemExit(main())
