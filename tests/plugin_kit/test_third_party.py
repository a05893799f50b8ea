"""A third-party plugin installed beside the router: the router's own contract test does not
change, and its author checks it with one command (`model-router plugins check NAME`) or from
their own tests (the `plugin_contract` fixture, `check_plugin`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.plugin_kit.third_party import ENTRY_POINTS, run_with, third_party_distribution
from tests.plugins.test_contract import SHIPPED


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return third_party_distribution(tmp_path_factory.mktemp("third_party"))


def collected(done_stdout: str) -> set[str]:
    return set(re.findall(r"test_plugin_keeps_the_contract\[([^\]]+)\]", done_stdout))


def test_the_router_contract_test_ignores_a_third_party_plugin(third_party: Path) -> None:
    listed = run_with(third_party, "-m", "router", "plugins")
    assert {"brightness", "short", "nan", "shy"} <= {line.split("\t")[0] for line in listed.stdout.splitlines()}, \
        listed.stdout + listed.stderr  # the subprocess does see the third-party distribution

    done = run_with(third_party, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                    "tests/plugins/test_contract.py")

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert collected(done.stdout) == set(SHIPPED)
    assert not set(ENTRY_POINTS) & collected(done.stdout)


def test_plugins_check_passes_a_third_party_plugin_that_keeps_the_contract(third_party: Path) -> None:
    done = run_with(third_party, "-m", "router", "plugins", "check", "brightness", "--options", '{"scale": 2}')

    assert done.returncode == 0, done.stdout + done.stderr
    assert "model-router: plugin 'brightness' on cpu: keeps the contract (9 checks)" in done.stderr
    steps = [line.split("\t", 1)[1] for line in done.stdout.splitlines()]
    assert steps[0].startswith("entry point: brightness_plugin.BrightnessPlugin from third-party-brightness")
    assert "inputs: 3 (image/jpeg, image/jpeg, image/jpeg), each within accepts" in steps
    assert any(step.startswith("round trip: a batch of 3 gives 3 JSON answers") for step in steps)


@pytest.mark.parametrize(("name", "args", "message"), [
    ("short", (), "plugin 'short' breaks the contract at predict_batch: 2 outputs for a batch of 3"),
    ("nan", (), "plugin 'nan' breaks the contract at postprocess: returns what is not plain JSON without NaN"),
    ("shy", (), ("plugin 'shy' breaks the contract at load('cpu'): RuntimeError: no device for me (a load error "
                "must name the model")),
    ("brightness", ("--refuses",), "at load('cpu'): loaded, but the plugin was expected to refuse this device"),
    ("brightness", ("--options", '{"scale": -1}'), "breaks the contract at the options: {'scale': -1} are refused"),
    ("nope", (), "plugin 'nope' breaks the contract at the entry point: no plugin of that name"),
])
def test_plugins_check_fails_a_broken_plugin_naming_the_step(third_party: Path, name: str, args: tuple[str, ...],
                                                              message: str) -> None:
    done = run_with(third_party, "-m", "router", "plugins", "check", name, *args)

    assert done.returncode == 1, done.stdout + done.stderr
    assert message in done.stderr, done.stderr


def test_plugins_check_reports_a_refusal_it_was_told_to_expect(third_party: Path) -> None:
    done = run_with(third_party, "-m", "router", "plugins", "check", "brightness", "--device", "cuda:0", "--refuses")

    assert done.returncode == 0, done.stdout + done.stderr
    assert "refuses it as expected, naming the model (3 checks)" in done.stderr
    assert "model 'contract': brightness runs on the CPU only, got 'cuda:0'" in done.stdout


def test_plugins_check_takes_input_files_and_refuses_bad_arguments(third_party: Path, tmp_path: Path) -> None:
    given = run_with(third_party, "-m", "router", "plugins", "check", "brightness",
                     "--input", str(REPO / "examples" / "street.jpg"), "--input", str(REPO / "examples" / "square.png"))
    assert given.returncode == 0, given.stdout + given.stderr
    assert "ok\tinputs: 2 (image/jpeg, image/png), each within accepts" in given.stdout

    not_json = run_with(third_party, "-m", "router", "plugins", "check", "brightness", "--options", "scale=2")
    assert not_json.returncode == 2 and "--options is a JSON object, got 'scale=2'" in not_json.stderr
    missing = run_with(third_party, "-m", "router", "plugins", "check", "brightness", "--input", str(tmp_path / "no.jpg"))
    assert missing.returncode == 2 and f"--input names no file: {tmp_path / 'no.jpg'}" in missing.stderr


PLUGIN_TESTS = '''
from router.plugin_kit import check_plugin


def test_brightness_keeps_the_contract(plugin_contract):
    report = plugin_contract("brightness", options={"scale": 0.5})
    assert report.distribution == "third-party-brightness"


def test_short_breaks_it(plugin_contract):
    plugin_contract("short")


def test_check_plugin_called_directly(tmp_path):
    assert check_plugin("brightness", store=tmp_path).steps[-1] == "unload"
'''


def test_a_plugin_authors_own_tests_run_the_contract_with_the_pytest_helper(third_party: Path, tmp_path: Path) -> None:
    (tmp_path / "test_my_plugin.py").write_text(PLUGIN_TESTS, encoding="utf-8")

    # The fixture's module named explicitly, whether or not this environment's router declares it yet.
    done = run_with(third_party, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:model-router-plugin-contract",
                    "-p", "router.plugin_kit.pytest_plugin", "test_my_plugin.py", cwd=tmp_path)

    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"1 failed, 2 passed", done.stdout), done.stdout
    assert "FAILED test_my_plugin.py::test_short_breaks_it" in done.stdout
    assert "plugin 'short' breaks the contract at predict_batch: 2 outputs for a batch of 3" in done.stdout


def test_the_router_installs_the_pytest_helper_as_a_pytest_plugin() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["entry-points"]["pytest11"] == {"model-router-plugin-contract": "router.plugin_kit.pytest_plugin"}
    from router.plugin_kit import pytest_plugin

    assert callable(pytest_plugin.plugin_contract)
