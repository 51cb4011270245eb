"""Start-up hook, run from `lm_eval_spot.pth` in site-packages (lm-eval 0.4.13 has no plugin discovery).

It installs one tiny `sys.meta_path` finder and imports nothing else (no torch, no lm_eval): only when a program
itself imports `lm_eval.api.registry` or `lm_eval.tasks.manager` does it register `spot-dlm` and the plugin's
task folder, and when the `lm_eval` console script imports `lm_eval.__main__` it wraps the entry point so that
the plugin's own input errors end the run with one line (see `lm_eval_spot.harness.registration`). Standard-library `sys` only, to keep interpreter start-up cheap.
"""

import sys

_TARGETS = ("lm_eval.api.registry", "lm_eval.tasks.manager", "lm_eval.__main__")


class _AfterExec:
    """Wraps a module's real loader; runs the plugin's registration right after the module body."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from lm_eval_spot.harness import registration

        registration.on_import(self._name, module)

    def get_code(self, fullname):
        # `python -m lm_eval` (accelerate launch, torchrun) runs lm_eval/__main__.py through runpy, which reads the
        # code and runs it without exec_module: the one-line error handling is installed here instead.
        if fullname == "lm_eval.__main__":
            from lm_eval_spot.harness import registration

            registration.install_excepthook()
        return self._loader.get_code(fullname)

    def __getattr__(self, item):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, item)


class SpotFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is SpotFinder:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _AfterExec(spec.loader, fullname)
                return spec
        return None


def install():
    if SpotFinder not in sys.meta_path and not any(type(f).__name__ == "SpotFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, SpotFinder)
