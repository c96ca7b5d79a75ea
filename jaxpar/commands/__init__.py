"""The command-line programs, one module each with `main(argv=None) -> int` (the exit code).

Installed, each is a console script: jaxpar-train, jaxpar-plan, jaxpar-launch, jaxpar-export,
jaxpar-generate, jaxpar-dataset; `python -m jaxpar COMMAND ...` runs the same
(jaxpar/__main__.py); a checkout's scripts/*.py call them too. They sit above every other jaxpar
module: nothing in the library imports them.
"""

NAMES = ("train", "plan", "launch", "export", "generate", "dataset")
