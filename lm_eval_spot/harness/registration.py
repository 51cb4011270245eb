"""Registration of `spot-dlm` and of the plugin's tasks with lm-eval (called by the start-up hook or by hand)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

MODEL_NAME = "spot-dlm"
MODEL_TARGET = "lm_eval_spot.harness.model:SpotDLM"


def tasks_dir() -> Path:
    """The plugin's task folder: inside the installed package, or the repo's `tasks/` in a source checkout."""
    here = Path(__file__).resolve().parents[1]  # the package
    for cand in (here / "tasks", here.parent / "tasks"):
        if cand.is_dir():
            return cand
    return here / "tasks"


def register_model() -> None:
    """Register `spot-dlm` lazily, after the built-ins (get_model fills them only into an EMPTY registry)."""
    import lm_eval.models  # noqa: F401  (registers the built-in table)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def _with_plugin_tasks(include_path):
    ours = str(tasks_dir())
    if include_path is None:
        return [ours]
    paths = list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
    # Ours first: lm-eval lets later paths override earlier ones, so a user's --include_path still wins.
    return [ours] + [p for p in paths if str(p) != ours]


def patch_task_manager(manager_module: ModuleType) -> None:
    cls = manager_module.TaskManager
    if getattr(cls.__init__, "_spot_patched", False):
        return
    original = cls.__init__

    def __init__(self, verbosity=None, include_path=None, *args, **kwargs):
        original(self, verbosity, _with_plugin_tasks(include_path), *args, **kwargs)

    __init__._spot_patched = True  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__


# Set (to anything but 0 or empty) to keep the full traceback of the plugin's input errors.
DEBUG_ENV = "SPOT_DEBUG"
USER_ERROR_EXIT = 2  # argparse's status for bad command-line input


def wrap_cli(main_module: ModuleType) -> None:
    """The `lm_eval` console script: a bad model argument or request (SpotUserError) ends the run with its
    one-line message on stderr and exit status 2 instead of a traceback through lm-eval's internals."""
    original = getattr(main_module, "cli_evaluate", None)
    if original is None or getattr(original, "_spot_wrapped", False):
        return

    def cli_evaluate(*args, **kwargs):
        from lm_eval_spot.settings.args import SpotUserError

        try:
            return original(*args, **kwargs)
        except SpotUserError as err:
            if _debug():
                raise
            sys.stderr.write(f"error: {err} (set {DEBUG_ENV}=1 for the traceback)\n")
            return USER_ERROR_EXIT

    cli_evaluate._spot_wrapped = True  # type: ignore[attr-defined]
    cli_evaluate.__doc__ = original.__doc__
    main_module.cli_evaluate = cli_evaluate


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def install_excepthook() -> None:
    """`python -m lm_eval`: a SpotUserError that ends the program prints its one line and exits 2 (the process is
    ending anyway; any other exception goes to the previous hook unchanged)."""
    previous = sys.excepthook
    if getattr(previous, "_spot_hook", False):
        return

    def hook(kind, value, tb):
        from lm_eval_spot.settings.args import SpotUserError

        if isinstance(value, SpotUserError) and not _debug():
            sys.stderr.write(f"error: {value} (set {DEBUG_ENV}=1 for the traceback)\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(USER_ERROR_EXIT)  # an excepthook cannot choose the exit status otherwise
        previous(kind, value, tb)

    hook._spot_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def on_import(name: str, module: ModuleType) -> None:
    if name == "lm_eval.api.registry":
        register_model()
    elif name == "lm_eval.tasks.manager":
        patch_task_manager(module)
    elif name == "lm_eval.__main__":
        wrap_cli(module)
