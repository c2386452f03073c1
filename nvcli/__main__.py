"""`python -m nvcli ...` runs the `nv` command line."""

from nvcli.cli import app

if __name__ == "__main__":
    app(prog_name="nv")
