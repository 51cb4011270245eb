"""Plain `lm_eval --model spot-dlm` registration: cheap start-up hook, built-ins intact, tasks found."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def py(code: str, *flags: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, cwd="/",
                         env=env or os.environ.copy(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_startup_hook_installed_and_cheap():
    site = Path(sysconfig.get_paths()["purelib"])
    assert (site / "lm_eval_spot.pth").is_file(), "install the package first (pip install -e . or .)"
    out = py("import sys; print(sorted(m for m in ('torch','lm_eval','transformers','lm_eval_spot.harness.model') "
             "if m in sys.modules))")
    assert out.strip().endswith("[]"), out  # the hook imports none of them
    # Cumulative import time of the hook, as CPython measures it (microseconds), best of 5 starts.
    costs = []
    for _ in range(5):
        report = py("pass", "-X", "importtime")
        m = re.search(r"\|\s*(\d+)\s*\|\s*lm_eval_spot\._boot\s*$", report, re.M)
        assert m, report[-2000:]
        costs.append(int(m.group(1)))
    assert min(costs) < 10_000, f"start-up hook costs {min(costs)} us"


def test_builtin_models_still_resolve_and_spot_dlm_registered():
    out = py("from lm_eval.api.registry import get_model; print(get_model('hf').__name__, "
             "get_model('dummy').__name__, get_model('spot-dlm').__name__)")
    assert "HFLM DummyLM SpotDLM" in out


def test_registry_order_does_not_matter():
    # A program that imports the model table first must still get spot-dlm.
    out = py("import lm_eval.models; from lm_eval.api.registry import get_model; print(get_model('spot-dlm'))")
    assert "SpotDLM" in out


def test_plugin_tasks_found_without_include_path():
    out = py("from lm_eval.tasks import TaskManager; tm = TaskManager(include_defaults=False); "
             "print('spot_arith' in tm.all_tasks, 'spot_arith_mini' in tm.all_tasks)")
    assert "True True" in out


def test_user_include_path_still_used(tmp_path):
    (tmp_path / "mytask.yaml").write_text("task: my_extra_task\ndataset_path: x\noutput_type: generate_until\n")
    out = py(f"from lm_eval.tasks import TaskManager; tm = TaskManager(include_defaults=False, "
             f"include_path={str(tmp_path)!r}); print('my_extra_task' in tm.all_tasks, 'spot_arith' in tm.all_tasks)")
    assert "True True" in out


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="lm_eval.models")}
    assert eps.get("spot-dlm") == "lm_eval_spot.harness.model:SpotDLM"


def test_non_editable_wheel_works(tmp_path):
    """Build the wheel, install it into a folder, and use it as a site dir ahead of the test venv's."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "hatchling" in build.stderr:
        pytest.skip("hatchling could not be fetched to build the wheel")
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("lm_eval_spot-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lm_eval_spot.pth" in names
    assert "lm_eval_spot/tasks/spot_arith/spot_arith.yaml" in names
    assert "lm_eval_spot/model_cards/sdar-4b-chat.md" in names and "lm_eval_spot/model_cards/llada2.0-mini.md" in names
    # The wheel holds the product: no research or benchmark module, and a package root of at most 10 modules.
    modules = [n for n in names if n.endswith(".py")]
    assert not [n for n in modules if "research" in n or "bench" in n.rsplit("/", 1)[-1]], modules
    root = [n for n in modules if n.count("/") == 1 and n.startswith("lm_eval_spot/")]
    assert len(root) <= 10, root
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    # Every site dir of this interpreter (a venv with system site-packages has two), after the wheel's.
    sites = [str(target)] + [p for p in sys.path if p.endswith("site-packages")]
    code = (f"import site; [site.addsitedir(p) for p in {sites!r}]; "
            "import lm_eval_spot, json; from lm_eval_spot.harness.registration import tasks_dir; "
            "from lm_eval.api.registry import get_model; from lm_eval.tasks import TaskManager; "
            "tm = TaskManager(include_defaults=False); "
            "from lm_eval_spot.settings.cards import cards_dir, load_card; "
            "print(json.dumps([lm_eval_spot.__file__, str(tasks_dir()), get_model('spot-dlm').__name__, "
            "get_model('hf').__name__, 'spot_arith' in tm.all_tasks, str(cards_dir()), "
            "load_card('sdar-4b-chat-b32')['block_len']]))")
    out = py(code, "-S")
    file_, tdir, name, hf, found, cdir, block = json.loads(out.strip().splitlines()[-1])
    assert file_.startswith(str(target)) and tdir.startswith(str(target))
    assert cdir.startswith(str(target)) and block == 32
    assert (name, hf, found) == ("SpotDLM", "HFLM", True)
