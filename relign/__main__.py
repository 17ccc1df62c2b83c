# The import sits under the guard: spawned worker processes (reward pools) re-import the
# main module as __mp_main__ and must not pay for, or run, the CLI.
if __name__ == "__main__":
    from relign.cli import main

    raise SystemExit(main())
