"""`check` runs every validation `serve` runs before the port opens, and both refuse with one line
and exit 2: plugin paths that escape the model store, bad MODEL_ROUTER_* values, key settings that
hold no key. No error echoes a long value, or any value under a key that may hold a secret."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.cli import main
from tests.conftest import HANG_S, REPO, free_port

RESNET = "models:\n  clf:\n    plugin: resnet\n    options: {{weights: {weights}{extra}}}\n"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MODEL_ROUTER_"):
            monkeypatch.delenv(name)


def store_fleet(tmp_path: Path, weights: str, extra: str = "") -> Path:
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    (store / "resnet18.pt").write_bytes(b"not loaded by check")
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"secret")
    if not (store / "link.pt").exists():
        (store / "link.pt").symlink_to(outside)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"model_store: {store}\n" + RESNET.format(weights=weights, extra=extra), encoding="utf-8")
    return fleet


def check(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["check", "--config", str(config)])
    return code, capsys.readouterr().err.strip()


def serve_refusal(config: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `serve`; it must exit on its own, before opening the port."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MODEL_ROUTER_")}
    child_env.update({"MODEL_ROUTER_CONFIG": str(config), "MODEL_ROUTER_PORT": str(free_port()), **(env or {})})
    done = subprocess.run([sys.executable, "-m", "router", "serve"], cwd=REPO, env=child_env, capture_output=True,
                          text=True, timeout=120, check=False)
    return done.returncode, done.stderr.strip()


@pytest.mark.parametrize(("weights", "extra", "words"), [
    ("../../etc/passwd", "", "resolves outside the model store"),
    ("/etc/passwd", "", "absolute path '/etc/passwd' is not allowed"),
    ("link.pt", "", "resolves outside the model store"),
    ("resnet18.pt", ", labels_file: link.pt", "path 'link.pt' resolves outside the model store"),
])
def test_check_refuses_paths_that_escape_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: str, extra: str, words: str
) -> None:
    code, err = check(store_fleet(tmp_path, weights, extra), capsys)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"model-router: {tmp_path / 'fleet.yaml'}: models.clf.options: ") and words in err


def test_serve_refuses_an_escaping_path_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = store_fleet(tmp_path, "../../etc/passwd")
    code, err = serve_refusal(fleet)
    assert (code, err) == check(fleet, capsys)


def test_a_valid_store_path_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = check(store_fleet(tmp_path, "resnet18.pt"), capsys)
    assert code == 0 and "is valid" in err


def test_check_names_each_missing_model_file_by_model_key_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = store_fleet(tmp_path, "resnet50.pt", ", labels_file: labels.txt")
    code = main(["check", "--config", str(fleet)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # no plan printed: the fleet cannot serve as written
    store = (tmp_path / "store").resolve()
    assert f"{fleet}: models.clf.options.weights: 'resnet50.pt': no such file ({store / 'resnet50.pt'})" in err
    assert f"{fleet}: models.clf.options.labels_file: 'labels.txt': no such file ({store / 'labels.txt'})" in err
    assert "model-router store init-demo" in err  # and how to get the demo weights
    (store / "resnet50.pt").write_bytes(b"not loaded by check")
    (store / "labels.txt").write_text("cat\n", encoding="utf-8")
    assert check(fleet, capsys)[0] == 0


@pytest.mark.parametrize(("env", "words"), [
    ({"MODEL_ROUTER_PORT": "abc"}, "environment: MODEL_ROUTER_PORT: Input should be a valid integer"),
    ({"MODEL_ROUTER_API_KEY": "k" * 20}, "environment: MODEL_ROUTER_API_KEY: not a setting; did you mean MODEL_ROUTER_API_KEYS?"),
    ({"MODEL_ROUTER_API_KEYS": " , "}, "MODEL_ROUTER_API_KEYS is set but holds no key"),
    ({"MODEL_ROUTER_API_KEYS": "clé-de-seize-caractères"}, "MODEL_ROUTER_API_KEYS: key 1 has a character that is not printable ASCII"),
    ({"MODEL_ROUTER_PROTECT_HEALTH": "true"}, "MODEL_ROUTER_PROTECT_HEALTH is set but no API or admin key is configured"),
])
def test_bad_settings_are_one_line_and_exit_2_in_check_and_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str], words: str
) -> None:
    fleet = store_fleet(tmp_path, "resnet18.pt")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = check(fleet, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert "k" * 20 not in err and "clé" not in err  # keys are never shown


def test_serve_refuses_bad_settings_before_the_port_opens(tmp_path: Path) -> None:
    fleet = store_fleet(tmp_path, "resnet18.pt")
    empty = tmp_path / "admin-keys"
    empty.write_text("# rotated, and left empty by mistake\n", encoding="utf-8")
    for env, words in [({"MODEL_ROUTER_PORT": "abc"}, "MODEL_ROUTER_PORT: Input should be a valid integer"),
                       ({"MODEL_ROUTER_API_KEYS": " , ", "MODEL_ROUTER_ADMIN_KEYS_FILE": str(empty)},
                        "MODEL_ROUTER_API_KEYS is set but holds no key"),
                       ({"MODEL_ROUTER_ADMIN_KEYS_FILE": str(empty)}, "holds no key (empty, or only comments)")]:
        started = time.monotonic()
        code, err = serve_refusal(fleet, env)
        assert code == 2 and len(err.splitlines()) == 1 and words in err, err
        assert time.monotonic() - started < 60


def test_secret_looking_values_are_never_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = "s3cr3t-value-that-must-not-leak"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"api_key: {secret}\nmodels:\n  m: {{plugin: scripted}}\n", encoding="utf-8")
    code, err = check(fleet, capsys)
    assert code == 2 and secret not in err and "API keys never go in the fleet file" in err
    fleet.write_text(f"models:\n  m:\n    plugin: scripted\n    options: {{auth_token: {secret}}}\n", encoding="utf-8")
    code, err = check(fleet, capsys)
    assert code == 2 and secret not in err and "models.m.options.auth_token" in err and "not shown" in err


def test_long_values_and_alias_bombs_give_short_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("models:\n  m:\n    plugin: scripted\n    options: {hang_on: [" + "x" * 100_000 + "]}\n",
                     encoding="utf-8")
    code, err = check(fleet, capsys)
    assert code == 2 and len(err) < 500
    bomb = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in "bcdefghi":
        previous = chr(ord(level) - 1)
        bomb.append(f"{level}: &{level} [{', '.join(['*' + previous] * 9)}]")
    options = "\n".join("      " + line for line in [*bomb, "hang_on: *i"])
    fleet.write_text(f"models:\n  m:\n    plugin: scripted\n    options:\n{options}\n", encoding="utf-8")
    started = time.monotonic()
    code, err = check(fleet, capsys)
    assert code == 2 and "models.m.options.hang_on: Input should be a valid string" in err
    assert len(err) < 5000 and time.monotonic() - started < HANG_S, err[:500]  # expanded, it would not end


def test_serve_takes_the_grpc_port_from_its_flag(tmp_path: Path) -> None:
    from router.cli import parser, prepare

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("models:\n  m: {plugin: scripted}\n", encoding="utf-8")
    settings, _, _ = prepare(parser().parse_args(["serve", "--config", str(fleet), "--grpc-port", "0"]))
    assert settings.grpc_port == 0
    settings, _, _ = prepare(parser().parse_args(["serve", "--config", str(fleet), "--port", "9100", "--grpc-port", "9101"]))
    assert (settings.port, settings.grpc_port) == (9100, 9101)
